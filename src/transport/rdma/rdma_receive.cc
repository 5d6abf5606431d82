// The receive path: completions, in-order delivery to the sink (stripes
// first), re-posted receives and credit returns, the landing check.

#include "src/transport/rdma/rdma_transport_impl.h"

namespace stepmesh::rdma::impl {

absl::Status RdmaTransport::PostReceive(QueuePair& qp, uint32_t q) {
  ibv_recv_wr wr{};
  wr.wr_id = q;
  ibv_recv_wr* bad = nullptr;
  if (const int rc = verbs_->PostRecv(qp.qp.get(), &wr, &bad); rc != 0) {
    return absl::InternalError(ErrnoMessage("rdma: ibv_post_recv", rc));
  }
  return absl::OkStatus();
}

void RdmaTransport::ArmAll() {
  const size_t count = peer_count_.load(std::memory_order_acquire);
  for (size_t i = 0; i < count; ++i) {
    Peer& peer = *peers_[i];
    if (!peer.lost) verbs_->ReqNotifyCq(peer.recv_cq.get(), 0);
  }
}

void RdmaTransport::ConsumeCqEvents() {
  if (!channel_) return;
  ibv_cq* cq;
  void* context;
  while (verbs_->GetCqEvent(channel_.get(), &cq, &context) == 0) verbs_->AckCqEvents(cq, 1);
}

void RdmaTransport::Housekeep(TransportSink& sink) {
  const size_t count = peer_count_.load(std::memory_order_acquire);
  for (size_t i = 0; i < count; ++i) {
    Peer& peer = *peers_[i];
    if (peer.lost) continue;
    for (uint32_t q = 0; q < peer.num_qps; ++q) {
      peer.qps[q].sq.Reap(peer.failure);
      if (!peer.failure.failed()) MaybeReturnCredits(peer, peer.qps[q], /*any=*/false);
    }
    if (!peer.pending_acks.empty()) ServiceAcks(peer);
  }
  ReportFailures(sink);
}

void RdmaTransport::ServiceAcks(Peer& peer) {
  auto& acks = peer.pending_acks;
  for (size_t i = 0; i < acks.size();) {
    bool drained = true;
    for (uint32_t q = 0; q < peer.num_qps; ++q) {
      drained = drained && peer.qps[q].sq.Drained(acks[i].watermarks[q]);
    }
    if (!drained && peer.usable()) {
      ++i;
      continue;
    }
    if (peer.usable()) {
      std::byte msg[rdma::kBootHeaderBytes + rdma::kMaxBootBody];
      WriteControl(peer, msg, rdma::EncodeWithdrawAck(acks[i].key, msg));
    }
    acks.erase(acks.begin() + static_cast<ptrdiff_t>(i));
    pending_acks_.fetch_sub(1, std::memory_order_relaxed);
  }
}

void RdmaTransport::ReportFailures(TransportSink& sink) {
  const size_t count = peer_count_.load(std::memory_order_acquire);
  for (size_t i = 0; i < count; ++i) {
    Peer& peer = *peers_[i];
    if (peer.lost || !peer.failure.failed()) continue;
    // A flush or an event says little: the request that failed first may
    // wait in a send CQ.
    if (peer.failure.rank() < FailureRecord::kCause) {
      for (uint32_t q = 0; q < peer.num_qps; ++q) peer.qps[q].sq.Reap(peer.failure);
    }
    Lose(peer, sink, peer.failure.status());
  }
}

int RdmaTransport::DrainCompletions(TransportSink& sink) {
  int work = 0;
  bool failed = false;
  const size_t count = peer_count_.load(std::memory_order_acquire);
  for (size_t i = 0; i < count; ++i) {
    Peer& peer = *peers_[i];
    if (peer.lost || peer.failure.failed()) continue;
    work += DrainPeer(peer, sink);
    failed = failed || peer.failure.failed();
  }
  if (failed) ReportFailures(sink);
  return work;
}

int RdmaTransport::DrainPeer(Peer& peer, TransportSink& sink) {
  ibv_wc wc[kPollBatch];
  const int n = verbs_->PollCq(peer.recv_cq.get(), kPollBatch, wc);
  if (n < 0) {
    peer.failure.Record(absl::InternalError("rdma: receive CQ overrun"), FailureRecord::kEvent);
    return 0;
  }
  for (int k = 0; k < n && !peer.failure.failed(); ++k) OnReceive(peer, wc[k], sink);
  return n;
}

void RdmaTransport::OnReceive(Peer& peer, const ibv_wc& wc, TransportSink& sink) {
  if (wc.status != IBV_WC_SUCCESS) {
    return peer.failure.Record(CompletionError(wc, "receive"), wc.status == IBV_WC_WR_FLUSH_ERR
                                                                   ? FailureRecord::kFlush
                                                                   : FailureRecord::kCause);
  }
  const uint32_t q = static_cast<uint32_t>(wc.wr_id);
  if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc.wc_flags & IBV_WC_WITH_IMM) ||
      q >= peer.num_qps) {
    return Fail(peer, absl::DataLossError("rdma: unexpected receive completion"));
  }
  QueuePair& qp = peer.qps[q];
  const uint32_t imm = ntohl(wc.imm_data);
  if (rdma::ImmIsChunk(imm)) {
    if (q == 0 || (imm & rdma::kImmChunkMask) != (peer.stripes_seen & rdma::kImmChunkMask)) {
      return Fail(peer, absl::DataLossError("rdma: stripe chunk out of order"));
    }
    // A chunk is consumed on arrival (its bytes are in the slot already):
    // its receive and credit go back at once.
    ++peer.stripes_seen;
    ++qp.frames_received;
    Consumed(peer, qp, q);
    return DeliverReady(peer, sink);
  }
  const uint32_t slot = static_cast<uint32_t>(qp.frames_received % peer.depth);
  if (q != 0 || rdma::ImmRingSlot(imm) != slot || wc.byte_len < kFrameBytes) {
    return Fail(peer, absl::DataLossError("rdma: frame outside the header ring order"));
  }
  peer.arrivals[slot] = Arrival{rdma::ImmStripes(imm), wc.byte_len};
  ++qp.frames_received;
  DeliverReady(peer, sink);
}

void RdmaTransport::DeliverReady(Peer& peer, TransportSink& sink) {
  QueuePair& qp = peer.qps[0];
  while (qp.delivered < qp.frames_received && !peer.failure.failed()) {
    const uint32_t slot = static_cast<uint32_t>(qp.delivered % peer.depth);
    const Arrival& arrival = peer.arrivals[slot];
    if (!rdma::StripesArrived(peer.stripes_seen, arrival.stripes_needed)) return;
    const std::byte* ring = qp.recv_ring + slot * kRingStride;
    absl::StatusOr<FrameHeader> header = DecodeFrame(absl::MakeConstSpan(ring, kFrameBytes));
    if (!header.ok()) {
      return Fail(peer,
                  absl::DataLossError(absl::StrCat("rdma: malformed frame from ", PeerName(peer.id),
                                                   ": ", header.status().message())));
    }
    const size_t small = IsDataFrame(header->type) ? 0 : header->payload_bytes;
    if (small > kSmallPayloadMax || arrival.byte_len != kFrameBytes + small) {
      return Fail(peer, absl::DataLossError("rdma: frame length disagrees with its header"));
    }
    if (header->src != peer.id) {
      return Fail(peer, absl::PermissionDeniedError("rdma: frame claims another sender"));
    }
    Deliver(peer, *header, absl::MakeConstSpan(ring + kFrameBytes, small), sink);
    Consumed(peer, qp, 0);
  }
}

void RdmaTransport::MaybeReturnCredits(Peer& peer, QueuePair& qp, bool any) {
  const uint64_t owed = qp.delivered - qp.credits_returned;
  if (owed == 0 || (!any && owed < std::max<uint32_t>(1, peer.depth / 4))) return;
  std::atomic_ref<uint64_t>(*qp.credit_word).store(qp.delivered, std::memory_order_release);
  ibv_sge sge{reinterpret_cast<uintptr_t>(qp.credit_word), sizeof(uint64_t), peer.local_mr->lkey};
  ibv_send_wr wr{};
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.wr.rdma.remote_addr = qp.remote_mailbox;
  wr.wr.rdma.rkey = peer.remote_rkey;
  if (sizeof(uint64_t) <= qp.max_inline) wr.send_flags = IBV_SEND_INLINE;
  // A full credit share is retried by Housekeep; the value is cumulative.
  if (qp.sq.PostCredit(wr, peer.failure)) qp.credits_returned = qp.delivered;
}

void RdmaTransport::Deliver(Peer& peer, const FrameHeader& header,
                            absl::Span<const std::byte> small, TransportSink& sink) {
  switch (header.type) {
    case FrameType::kPush:
    case FrameType::kReply: {
      Destination dest;
      core::FrameContext context = nullptr;
      absl::Status status = sink.Resolve(peer.id, header, dest, &context);
      if (status.ok() && header.payload_bytes > 0) status = CheckLanding(peer.id, header, dest);
      sink.OnFrame(peer.id, header, context, status);
      return;
    }
    case FrameType::kError:
      sink.OnFrame(
          peer.id, header, nullptr,
          absl::Status(static_cast<absl::StatusCode>(header.status_code),
                       std::string(reinterpret_cast<const char*>(small.data()), small.size())));
      return;
    default:
      return;  // heartbeats, goodbyes, credits, control: nothing to deliver
  }
}

absl::Status RdmaTransport::CheckLanding(NodeId writer, const FrameHeader& header,
                                         const Destination& dest) {
  if (dest.capacity < header.payload_bytes) {
    return absl::OutOfRangeError("destination smaller than payload");
  }
  MutexLock lock(&recv_mu_);
  auto it = receive_slots_.find({header.key, writer});
  if (it == receive_slots_.end()) {
    return absl::NotFoundError(
        absl::StrCat("rdma: no receive slot for key ", header.key, " from ", PeerName(writer)));
  }
  if (dest.data != it->second.data || header.payload_bytes > it->second.bytes) {
    return absl::FailedPreconditionError(absl::StrCat("rdma: the destination for key ", header.key,
                                                      " is not ", PeerName(writer),
                                                      "'s advertised slot"));
  }
  return absl::OkStatus();
}

}  // namespace stepmesh::rdma::impl
