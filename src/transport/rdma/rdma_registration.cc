// Registering regions, and releasing them only once nothing can touch them:
// fences behind this node's sends, withdrawals acknowledged by the writers.

#include "src/transport/rdma/rdma_transport_impl.h"

namespace stepmesh::rdma::impl {

absl::Status RdmaTransport::RegisterRegion(const RegionInfo& info) {
  if (info.base == nullptr || info.bytes() == 0) {
    return absl::InvalidArgumentError("rdma: empty region");
  }
  if (info.remote_writable && info.slot_peers.size() != info.num_slots) {
    return absl::InvalidArgumentError("rdma: slot_peers must name every slot's writer");
  }
  auto region = std::make_unique<LocalRegion>();
  region->info = info;
  // Local access only for sending; receive slots get REMOTE_WRITE, one MR each,
  // so a peer's rkey reaches only the slot it owns.
  const std::string what =
      absl::StrCat("rdma: registering region ", info.id, " (", DeviceName(info.device),
                   info.dmabuf_fd >= 0 ? " memory by dma-buf)" : " memory)");
  const int ordering = DataAccessFlags();
  // A receive region gets only its per-slot MRs: a whole-region MR as well
  // would pin every page twice against RLIMIT_MEMLOCK (the kernel charges
  // each MR on its own). Local access (a send from it) goes by the slot's MR.
  if (!info.remote_writable) {
    absl::StatusOr<MrHandle> local =
        RegisterPart(info, info.base, info.bytes(), IBV_ACCESS_LOCAL_WRITE | ordering);
    if (!local.ok()) {
      return absl::InternalError(absl::StrCat(what, ": ", local.status().message()));
    }
    region->local_mr = *std::move(local);
  } else {
    for (uint32_t slot = 0; slot < info.num_slots; ++slot) {
      absl::StatusOr<MrHandle> mr = RegisterPart(
          info, static_cast<std::byte*>(info.base) + slot * info.slot_bytes, info.slot_bytes,
          IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | ordering);
      if (!mr.ok()) {
        return absl::InternalError(
            absl::StrCat(what, ", slot ", slot, ": ", mr.status().message()));
      }
      region->slot_mrs.push_back(*std::move(mr));
    }
  }
  MutexLock lock(&regions_mu_);
  if (regions_.contains(info.id)) {
    return absl::AlreadyExistsError(absl::StrCat("rdma: region ", info.id, " registered twice"));
  }
  {
    MutexLock slots(&recv_mu_);
    for (NodeId writer : info.slot_peers) {
      if (receive_slots_.contains({info.key, writer})) {
        return absl::AlreadyExistsError(absl::StrCat(
            "rdma: ", PeerName(writer), " already has a receive slot for key ", info.key));
      }
    }
    for (uint32_t slot = 0; info.remote_writable && slot < info.num_slots; ++slot) {
      receive_slots_[{info.key, info.slot_peers[slot]}] =
          ReceiveSlot{static_cast<std::byte*>(info.base) + slot * info.slot_bytes, info.slot_bytes};
    }
  }
  LocalRegion* raw = region.get();
  regions_.emplace(info.id, std::move(region));
  for (uint32_t slot = 0; info.remote_writable && slot < info.num_slots; ++slot) {
    if (Peer* peer = FindPeer(info.slot_peers[slot]); peer != nullptr && peer->usable()) {
      SendAdvert(*peer, *raw, slot);
    }
  }
  return absl::OkStatus();
}

absl::Status RdmaTransport::UnregisterRegion(RegionId id) {
  std::unique_ptr<LocalRegion> region;
  {
    MutexLock lock(&regions_mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return absl::NotFoundError(absl::StrCat("rdma: no region ", id));
    // Sends that looked the source up before this abort at their post (or
    // are queued, and seen below).
    regions_version_.fetch_add(1, std::memory_order_acq_rel);
    // Frames still queued read their payload from the region when their
    // peer returns credits: it must stay until they are out.
    const size_t count = peer_count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < count; ++i) {
      Peer& peer = *peers_[i];
      MutexLock box(&peer.outbox.mu);
      for (size_t f = 0; f < peer.outbox.size; ++f) {
        if (peer.outbox.at(f).region == id) {
          return absl::FailedPreconditionError(
              absl::StrCat("rdma: region ", id, " still has frames queued to ", PeerName(peer.id),
                           " (slow to return credits); try again"));
        }
      }
    }
    region = std::move(it->second);
    regions_.erase(it);
    MutexLock slots(&recv_mu_);
    for (NodeId writer : region->info.slot_peers) receive_slots_.erase({region->info.key, writer});
  }
  const absl::Time deadline = absl::Now() + options_.timeout;
  DrainSends(deadline, /*why=*/absl::StrCat("deregistering region ", id));
  if (region->info.remote_writable) WithdrawSlots(region->info, deadline);
  return absl::OkStatus();  // the MRs are deregistered as `region` goes
}

absl::StatusOr<MrHandle> RdmaTransport::RegisterPart(const RegionInfo& region, void* addr,
                                                     size_t bytes, int access) {
  std::string dmabuf_error;
  if (region.dmabuf_fd >= 0 && !dmabuf_refused_.load(std::memory_order_relaxed)) {
    const uint64_t offset =
        region.dmabuf_offset +
        static_cast<uint64_t>(static_cast<std::byte*>(addr) - static_cast<std::byte*>(region.base));
    MrHandle mr(verbs_.get(),
                verbs_->RegDmabufMr(pd_.get(), offset, bytes, reinterpret_cast<uintptr_t>(addr),
                                    region.dmabuf_fd, access));
    if (mr) return mr;
    const int error = errno;
    dmabuf_error = ErrnoMessage("ibv_reg_dmabuf_mr", error);
    if (error != EOPNOTSUPP && error != EPROTONOSUPPORT) {
      return absl::InternalError(dmabuf_error);
    }
    if (!dmabuf_refused_.exchange(true)) {
      STEPMESH_LOG(kWarning, "rdma: ", port_.device_name, " refuses dma-buf memory regions (",
                   dmabuf_error,
                   "); registering device memory by address (peer memory, nvidia-peermem) "
                   "instead");
    }
  }
  MrHandle mr(verbs_.get(), verbs_->RegMr(pd_.get(), addr, bytes, access));
  if (mr) return mr;
  const int error = errno;
  std::string message = ErrnoMessage(
      region.device.kind == DeviceKind::kCpu ? "ibv_reg_mr" : "ibv_reg_mr (peer memory)", error);
  if (!dmabuf_error.empty()) message = absl::StrCat(dmabuf_error, ", then ", message);
  if (region.dmabuf_fd >= 0 && dmabuf_error.empty()) {
    absl::StrAppend(&message, " (dma-buf refused earlier)");
  }
  if (error == ENOMEM) absl::StrAppend(&message, MemlockHint(bytes));
  return absl::InternalError(message);
}

std::array<uint64_t, rdma::kMaxQpsPerPeer> RdmaTransport::FencePeer(Peer& peer,
                                                                    absl::Time deadline) {
  std::array<uint64_t, rdma::kMaxQpsPerPeer> marks{};
  for (uint32_t q = 0; q < peer.num_qps; ++q) {
    absl::StatusOr<uint64_t> mark = peer.qps[q].sq.Fence(deadline, peer.failure);
    marks[q] = mark.ok() ? *mark : 0;  // a failed fence failed the peer
  }
  return marks;
}

std::vector<RdmaTransport::Drain> RdmaTransport::DrainAll(absl::Time deadline) {
  const size_t count = peer_count_.load(std::memory_order_acquire);
  std::vector<std::array<uint64_t, rdma::kMaxQpsPerPeer>> marks(count);
  for (size_t i = 0; i < count; ++i) {
    if (peers_[i]->usable()) marks[i] = FencePeer(*peers_[i], deadline);
  }
  std::vector<Drain> drained(count, Drain::kDone);
  for (size_t i = 0; i < count; ++i) {
    if (peers_[i]->usable()) drained[i] = AwaitDrained(*peers_[i], marks[i], deadline);
  }
  return drained;
}

void RdmaTransport::DrainSends(absl::Time deadline, const std::string& why) {
  const std::vector<Drain> drained = DrainAll(deadline);
  for (size_t i = 0; i < drained.size(); ++i) {
    Peer& peer = *peers_[i];
    if (drained[i] == Drain::kDone) continue;
    if (drained[i] == Drain::kPeerGone) {
      ErrorQps(peer);  // nobody acknowledges; the receive thread reports the loss
      continue;
    }
    peer.failure.Record(absl::DeadlineExceededError(absl::StrCat(
                            "rdma: sends to ", PeerName(peer.id), " did not complete within ",
                            absl::FormatDuration(options_.timeout), " (", why, ")")),
                        FailureRecord::kCause);
    ErrorQps(peer);  // flushed: the NIC stops reading our memory
    Wake();
  }
}

RdmaTransport::Drain RdmaTransport::AwaitDrained(
    Peer& peer, const std::array<uint64_t, rdma::kMaxQpsPerPeer>& marks, absl::Time deadline) {
  for (int round = 0;; ++round) {
    bool done = true;
    for (uint32_t q = 0; q < peer.num_qps; ++q) {
      peer.qps[q].sq.Reap(peer.failure);
      done = done && peer.qps[q].sq.Drained(marks[q]);
    }
    if (done) return Drain::kDone;
    if (peer.lost.load() && !shut_down_.load()) return Drain::kDone;  // QPs in ERR: flushed
    if ((round & 15) == 0 && HungUp(peer)) return Drain::kPeerGone;
    if (absl::Now() > deadline) return Drain::kTimedOut;
    absl::SleepFor(absl::Microseconds(20));
  }
}

void RdmaTransport::WithdrawSlots(const RegionInfo& info, absl::Time deadline) {
  std::vector<Peer*> writers;
  {
    MutexLock lock(&acks_mu_);
    for (NodeId owner : info.slot_peers) {
      Peer* peer = FindPeer(owner);
      if (peer == nullptr || !peer->usable()) continue;
      ++awaited_acks_[{peer->token, info.key}];
      writers.push_back(peer);
    }
  }
  std::byte msg[rdma::kBootHeaderBytes + rdma::kMaxBootBody];
  const size_t n = rdma::EncodeWithdraw(info.key, msg);
  for (Peer* peer : writers) WriteControl(*peer, msg, n);
  MutexLock lock(&acks_mu_);
  auto settled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(acks_mu_) {
    for (Peer* peer : writers) {
      if (awaited_acks_.contains({peer->token, info.key}) && peer->usable() && !shut_down_.load()) {
        return false;
      }
    }
    return true;
  };
  acks_mu_.AwaitWithDeadline(settled, deadline);
  for (Peer* peer : writers) {
    auto it = awaited_acks_.find({peer->token, info.key});
    if (it == awaited_acks_.end()) continue;
    if (--it->second == 0) awaited_acks_.erase(it);
    if (!peer->usable() || shut_down_.load()) continue;
    // It may still write with the old rkey: cut it off before the MR goes.
    peer->failure.Record(
        absl::DeadlineExceededError(
            absl::StrCat("rdma: ", PeerName(peer->id), " did not acknowledge the withdrawal ",
                         "of key ", info.key, " within ", absl::FormatDuration(options_.timeout))),
        FailureRecord::kCause);
    ErrorQps(*peer);
    Wake();
  }
}

}  // namespace stepmesh::rdma::impl
