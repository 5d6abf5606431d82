// Send: the prepared route and source of a frame, and the work requests that
// post it (payload pieces, the striped chunk, the frame into the peer's ring).

#include "src/transport/rdma/rdma_transport_impl.h"

namespace stepmesh::rdma::impl {
namespace {

// Builds a chain of RDMA writes of [src, src + bytes) to [remote, ...) in
// pieces of at most `max_piece` bytes; returns how many it filled (<= room).
int FillPieces(const std::byte* src, uint64_t remote, uint32_t rkey, uint32_t lkey, size_t bytes,
               size_t max_piece, ibv_sge* sges, ibv_send_wr* wrs, int room) {
  int n = 0;
  for (size_t done = 0; done < bytes && n < room; ++n) {
    const size_t piece = std::min(bytes - done, max_piece);
    sges[n] = {reinterpret_cast<uintptr_t>(src + done), static_cast<uint32_t>(piece), lkey};
    wrs[n] = ibv_send_wr{};
    wrs[n].opcode = IBV_WR_RDMA_WRITE;
    wrs[n].wr.rdma.remote_addr = remote + done;
    wrs[n].wr.rdma.rkey = rkey;
    done += piece;
  }
  return n;
}

void Link(ibv_sge* sges, ibv_send_wr* wrs, int n) {
  for (int i = 0; i < n; ++i) {
    wrs[i].sg_list = &sges[i];
    wrs[i].num_sge = 1;
    wrs[i].next = i + 1 < n ? &wrs[i + 1] : nullptr;
  }
}

}  // namespace

absl::Status RdmaTransport::Send(NodeId peer_id, const FrameHeader& header, const void* src,
                                 RegionId src_region, size_t bytes) {
  const auto* source = static_cast<const std::byte*>(src);
  QueuedFrame& frame = scratch_;
  frame.header = header;
  frame.src = source;
  frame.route = nullptr;
  frame.region = src_region;
  frame.lkey = 0;
  frame.started = false;
  if (!IsDataFrame(header.type)) {
    STEPMESH_ASSIGN_OR_RETURN(Peer * peer, PeerFor(peer_id));
    frame.bytes = std::min(bytes, kSmallPayloadMax);  // error text beyond this is cut
    frame.header.payload_bytes = frame.bytes;
    return Submit(*peer, frame, std::nullopt);
  }
  if (header.payload_bytes != bytes) {
    return absl::InvalidArgumentError("rdma: header.payload_bytes differs from the payload");
  }
  frame.bytes = bytes;
  if (bytes == 0) {  // an acknowledgement: no advert, no payload write
    STEPMESH_ASSIGN_OR_RETURN(Peer * peer, PeerFor(peer_id));
    return Submit(*peer, frame, std::nullopt);
  }
  // A source that changes between the lookup and the post (a
  // deregistration) aborts the post; look once more.
  for (int attempt = 0;; ++attempt) {
    STEPMESH_ASSIGN_OR_RETURN(const CachedRoute* cached, RouteFor(peer_id, header.key));
    Peer& peer = *cached->peer;
    if (!peer.usable()) return Gone(peer);
    const RouteView view = ReadRoute(*cached->route);
    if (view.live && bytes > view.bytes) {
      return absl::OutOfRangeError(absl::StrCat("rdma: ", bytes, " bytes for key ", header.key,
                                                " exceed the peer's slot of ", view.bytes));
    }
    STEPMESH_ASSIGN_OR_RETURN(const CachedSource source_info, SourceFor(src_region, source, bytes));
    frame.route = cached->route;
    frame.lkey = source_info.lkey;
    absl::Status sent = Submit(peer, frame, source_info.version);
    if (!absl::IsAborted(sent) || attempt == 2) return sent;
  }
}

absl::Status RdmaTransport::Gone(Peer& peer) {
  if (peer.failure.failed()) {
    return absl::UnavailableError(
        absl::StrCat("rdma: ", PeerName(peer.id), " is gone: ", peer.failure.status().message()));
  }
  return absl::UnavailableError(absl::StrCat("rdma: ", PeerName(peer.id), " is gone"));
}

absl::StatusOr<Peer*> RdmaTransport::PeerFor(NodeId id) {
  const uint64_t version = peers_version_.load(std::memory_order_acquire);
  if (auto it = peer_cache_.find(id); it != peer_cache_.end() && it->second.second == version) {
    Peer* peer = it->second.first;
    if (!peer->usable()) return Gone(*peer);
    return peer;
  }
  Peer* peer = FindPeer(id);
  if (peer == nullptr) {
    return absl::NotFoundError(absl::StrCat("rdma: no connection to node 0x", absl::Hex(id)));
  }
  peer_cache_[id] = {peer, version};
  if (!peer->usable()) return Gone(*peer);
  return peer;
}

absl::StatusOr<const CachedRoute*> RdmaTransport::RouteFor(NodeId peer_id, uint64_t key) {
  const uint64_t version = peers_version_.load(std::memory_order_acquire);
  auto it = route_cache_.find({peer_id, key});
  if (it != route_cache_.end() && it->second.peers_version == version) return &it->second;
  Peer* peer = FindPeer(peer_id);
  if (peer == nullptr) {
    return absl::NotFoundError(absl::StrCat("rdma: no connection to node 0x", absl::Hex(peer_id)));
  }
  Route* route;
  {
    MutexLock lock(&peer->route_mu);
    std::unique_ptr<Route>& slot = peer->routes[key];
    if (slot == nullptr) slot = std::make_unique<Route>();  // live once advertised
    route = slot.get();
  }
  CachedRoute& entry = route_cache_[{peer_id, key}];
  entry = {peer, route, version};
  return &entry;
}

absl::StatusOr<CachedSource> RdmaTransport::SourceFor(RegionId id, const std::byte* src,
                                                      size_t bytes) {
  const uint64_t version = regions_version_.load(std::memory_order_acquire);
  auto it = source_cache_.find(id);
  if (it == source_cache_.end() || it->second.version != version) {
    MutexLock lock(&regions_mu_);
    auto region = regions_.find(id);
    if (region == regions_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rdma: source region ", id, " is not registered"));
    }
    const RegionInfo& info = region->second->info;
    if (!region->second->local_mr) {
      // A receive region: the slot holding [src, src + bytes), by its own MR.
      const auto* base = static_cast<const std::byte*>(info.base);
      const size_t slot = src >= base ? static_cast<size_t>(src - base) / info.slot_bytes : 0;
      if (src < base || slot >= info.num_slots ||
          src + bytes > base + (slot + 1) * info.slot_bytes) {
        return absl::OutOfRangeError(
            absl::StrCat("rdma: a send from receive region ", id, " must lie inside one slot"));
      }
      return CachedSource{base + slot * info.slot_bytes, info.slot_bytes,
                          region->second->slot_mrs[slot]->lkey, version};
    }
    it = source_cache_
             .insert_or_assign(id,
                               CachedSource{static_cast<const std::byte*>(info.base), info.bytes(),
                                            region->second->local_mr->lkey, version})
             .first;
  }
  const CachedSource& source = it->second;
  if (src < source.base || src + bytes > source.base + source.bytes) {
    return absl::OutOfRangeError(absl::StrCat("rdma: source outside region ", id));
  }
  return source;
}

absl::StatusOr<Blocked> RdmaTransport::Advance(Peer& peer, QueuedFrame& frame) {
  for (int attempt = 0; attempt < 3; ++attempt) {
    if (!peer.usable()) return Gone(peer);
    if (!frame.started) {
      frame.dst = RouteView{};
      if (frame.route != nullptr) {
        frame.dst = ReadRoute(*frame.route);
        if (!frame.dst.live) return Blocked::kAdvert;
        if (frame.bytes > frame.dst.bytes) {
          return absl::OutOfRangeError(absl::StrCat("rdma: ", frame.bytes, " bytes for key ",
                                                    frame.header.key, " exceed the peer's slot of ",
                                                    frame.dst.bytes, "; the frame was not sent"));
        }
      }
      frame.chunk = 0;
      if (frame.route != nullptr && peer.num_qps > 1 &&
          frame.bytes >= static_cast<size_t>(rdma_.stripe_min_bytes)) {
        frame.chunk = (frame.bytes / 2) & ~(kPageBytes - 1);
      }
      if (!HasCredit(peer, peer.qps[0]) || (frame.chunk > 0 && !HasCredit(peer, peer.qps[1]))) {
        return Blocked::kCredit;
      }
      frame.started = true;
      frame.chunk_posted = 0;
      frame.chunk_sent = false;
      frame.payload_posted = 0;
    }
    absl::StatusOr<bool> posted = PostStarted(peer, frame);
    if (posted.ok()) return *posted ? Blocked::kNothing : Blocked::kSendQueue;
    if (!absl::IsAborted(posted.status())) return posted.status();
    frame.started = false;  // the route changed under it: again, at the new place
  }
  return Blocked::kSendQueue;  // the route keeps changing: try again later
}

absl::StatusOr<bool> RdmaTransport::PostStarted(Peer& peer, QueuedFrame& frame) {
  const Route* route = frame.route;
  const uint32_t seq = frame.dst.seq;
  auto valid = [route, seq] {
    return route == nullptr || route->seq.load(std::memory_order_acquire) == seq;
  };
  const RouteView& dst = frame.dst;
  if (frame.chunk > 0 && !frame.chunk_sent) {
    QueuePair& qp = peer.qps[1];
    const size_t chunk = frame.chunk;
    // The chunk's last piece carries the immediate that counts it.
    const size_t head = chunk > max_wr_bytes_ ? chunk - (chunk - 1) % max_wr_bytes_ - 1 : 0;
    const std::byte* chunk_src = frame.src + frame.bytes - chunk;
    const uint64_t chunk_remote = dst.addr + frame.bytes - chunk;
    ibv_sge sge{reinterpret_cast<uintptr_t>(chunk_src + head), static_cast<uint32_t>(chunk - head),
                frame.lkey};
    ibv_send_wr wr{};
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.imm_data = htonl(rdma::ChunkImm(peer.stripes_sent));
    wr.wr.rdma.remote_addr = chunk_remote + head;
    wr.wr.rdma.rkey = dst.rkey;
    STEPMESH_ASSIGN_OR_RETURN(
        const bool all, PostPieces(peer, qp, chunk_src, chunk_remote, dst.rkey, frame.lkey, head,
                                   &frame.chunk_posted, &wr, &sge, valid));
    if (!all) return false;
    ++qp.frames_sent;
    ++peer.stripes_sent;
    frame.chunk_sent = true;
  }
  QueuePair& qp = peer.qps[0];
  const bool small = frame.route == nullptr;  // error text (or nothing) rides in the ring
  const std::byte* small_src =
      frame.src != nullptr ? frame.src : reinterpret_cast<const std::byte*>(frame.copy.data());
  const size_t small_bytes = small ? frame.bytes : 0;
  const uint32_t ring_slot = static_cast<uint32_t>(qp.frames_sent % peer.depth);
  std::byte* staged = qp.send_ring + ring_slot * kRingStride;
  EncodeFrame(frame.header, staged);
  if (small_bytes > 0) std::memcpy(staged + kFrameBytes, small_src, small_bytes);
  const uint32_t frame_len = static_cast<uint32_t>(kFrameBytes + small_bytes);
  ibv_sge sge{reinterpret_cast<uintptr_t>(staged), frame_len, peer.local_mr->lkey};
  ibv_send_wr wr{};
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.imm_data = htonl(rdma::FrameImm(ring_slot, peer.stripes_sent));
  wr.wr.rdma.remote_addr = qp.remote_ring + ring_slot * kRingStride;
  wr.wr.rdma.rkey = peer.remote_rkey;
  if (frame_len <= qp.max_inline) wr.send_flags = IBV_SEND_INLINE;
  const size_t payload = small ? 0 : frame.bytes - frame.chunk;
  STEPMESH_ASSIGN_OR_RETURN(const bool all,
                            PostPieces(peer, qp, frame.src, dst.addr, dst.rkey, frame.lkey, payload,
                                       &frame.payload_posted, &wr, &sge, valid));
  if (!all) return false;
  ++qp.frames_sent;
  return true;
}

template <typename Valid>
absl::StatusOr<bool> RdmaTransport::PostPieces(Peer& peer, QueuePair& qp, const std::byte* src,
                                               uint64_t remote, uint32_t rkey, uint32_t lkey,
                                               size_t bytes, size_t* done, ibv_send_wr* tail,
                                               ibv_sge* tail_sge, Valid& valid) {
  ibv_sge sges[kMaxChain];
  ibv_send_wr wrs[kMaxChain];
  const int room =
      static_cast<int>(std::min<uint32_t>(kMaxChain, std::max(qp.sq.data_slots(), 2u))) - 1;
  for (;;) {
    const int n = FillPieces(src + *done, remote + *done, rkey, lkey, bytes - *done, max_wr_bytes_,
                             sges, wrs, room);
    size_t filled = 0;
    for (int i = 0; i < n; ++i) filled += sges[i].length;
    int count = n;
    const bool last = *done + filled == bytes;
    if (last) {
      wrs[count] = *tail;
      sges[count] = *tail_sge;
      ++count;
    }
    Link(sges, wrs, count);
    absl::StatusOr<bool> posted = qp.sq.TryPost(wrs, count, peer.failure, valid);
    if (!posted.ok() && peer.failure.failed()) {
      Wake();  // the receive thread reports the loss now
      return Gone(peer);
    }
    if (!posted.ok() || !*posted) return posted;
    *done += filled;
    if (last) return true;
  }
}

}  // namespace stepmesh::rdma::impl
