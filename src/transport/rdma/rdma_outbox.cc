// The per-peer outbox: frames that could not be posted when sent wait there
// and are posted as the peer returns credits; stalls are reported.

#include "src/base/ring.h"
#include "src/transport/rdma/rdma_transport_impl.h"

namespace stepmesh::rdma::impl {

absl::Status RdmaTransport::Submit(Peer& peer, QueuedFrame& frame,
                                   std::optional<uint64_t> version) {
  Outbox& box = peer.outbox;
  MutexLock lock(&peer.outbox.mu);
  // UnregisterRegion bumps the version before it looks for queued frames
  // under this lock: a frame checked here is either seen there or aborted.
  if (version.has_value() && regions_version_.load(std::memory_order_acquire) != *version) {
    return absl::AbortedError("rdma: the source region changed");
  }
  if (!peer.usable()) return Gone(peer);
  if (box.size == 0) {
    STEPMESH_ASSIGN_OR_RETURN(const Blocked blocked, Advance(peer, frame));
    if (blocked == Blocked::kNothing) return absl::OkStatus();
    box.blocked = blocked;
  }
  if (box.size == kMaxQueuedFrames) {
    return absl::ResourceExhaustedError(
        absl::StrCat("rdma: the send queue to ", PeerName(peer.id), " is full (", kMaxQueuedFrames,
                     " frames waiting for ", BlockedOn(box.blocked, box.at(0).header.key), " for ",
                     absl::FormatDuration(absl::Trunc(
                         absl::Nanoseconds(absl::GetCurrentTimeNanos() - box.head_since_ns),
                         absl::Milliseconds(1))),
                     ")"));
  }
  if (box.size == box.ring.size()) {
    base::GrowRing(box.ring, box.head, box.size, kInitialQueuedFrames, kMaxQueuedFrames);
  }
  QueuedFrame& queued = box.at(box.size);
  queued = frame;
  if (frame.route == nullptr && frame.bytes > 0) {
    // An error frame's text (small, rare): the caller's buffer is not kept.
    queued.copy.assign(reinterpret_cast<const char*>(frame.src), frame.bytes);
    queued.src = nullptr;
  }
  queued.queued_ns = absl::GetCurrentTimeNanos();
  if (box.size++ == 0) {
    box.head_since_ns = queued.queued_ns;
    box.backlogged.store(true, std::memory_order_release);
    backlogged_.fetch_add(1, std::memory_order_acq_rel);
    Wake();  // its Poll now looks at the peer's credits every millisecond
  }
  return absl::OkStatus();
}

void RdmaTransport::Pop(Outbox& box) {
  QueuedFrame& done = box.at(0);
  done.copy.clear();
  done.src = nullptr;
  box.head = (box.head + 1) % box.ring.size();
  --box.size;
  box.head_since_ns = absl::GetCurrentTimeNanos();
  box.blocked = Blocked::kNothing;
}

std::string RdmaTransport::BlockedOn(Blocked blocked, uint64_t key) {
  switch (blocked) {
    case Blocked::kAdvert:
      return absl::StrCat("its advert of a receive region for key ", key);
    case Blocked::kCredit:
      return "its receive credits";
    case Blocked::kSendQueue:
      return "room in the send queue";
    default:
      return "the head frame";
  }
}

void RdmaTransport::DrainOutbox(Peer& peer) {
  Outbox& box = peer.outbox;
  while (box.size > 0 && box.blocked != Blocked::kFailed) {
    absl::StatusOr<Blocked> blocked = Advance(peer, box.at(0));
    if (!blocked.ok()) {
      box.blocked = Blocked::kFailed;
      box.failed = blocked.status();
      return;
    }
    if (*blocked != Blocked::kNothing) {
      box.blocked = *blocked;
      return;
    }
    Pop(box);
  }
  if (box.size == 0 && box.backlogged.exchange(false, std::memory_order_acq_rel)) {
    backlogged_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void RdmaTransport::ServiceOutboxes(TransportSink& sink) {
  const size_t count = peer_count_.load(std::memory_order_acquire);
  const int64_t timeout_ns = absl::ToInt64Nanoseconds(options_.timeout);
  for (size_t i = 0; i < count; ++i) {
    Peer& peer = *peers_[i];
    if (!peer.outbox.backlogged.load(std::memory_order_acquire) || peer.lost) continue;
    for (;;) {
      FrameHeader dropped;
      absl::Status why;
      {
        Outbox& box = peer.outbox;
        MutexLock lock(&peer.outbox.mu);
        DrainOutbox(peer);
        if (box.size == 0) break;
        const int64_t waited = absl::GetCurrentTimeNanos() - box.head_since_ns;
        if (box.blocked == Blocked::kFailed) {
          why = box.failed;
        } else if (waited <= timeout_ns) {
          break;
        } else if (box.blocked == Blocked::kAdvert) {
          why = absl::DeadlineExceededError(absl::StrCat(
              "rdma: ", PeerName(peer.id), " never advertised a receive region for key ",
              box.at(0).header.key, " (waited ", absl::FormatDuration(options_.timeout),
              "); the frame was not sent"));
        } else {
          peer.failure.Record(
              absl::DeadlineExceededError(
                  absl::StrCat("rdma: ", PeerName(peer.id), " returned no receive credits within ",
                               absl::FormatDuration(options_.timeout), " (", box.size,
                               " frames queued, waiting for ", BlockedOn(box.blocked, 0), ")")),
              FailureRecord::kCause);
          break;
        }
        if (!peer.usable()) break;
        dropped = box.at(0).header;
        box.failed = absl::OkStatus();
        Pop(box);
      }
      // Outside the lock: the sink may queue work of its own.
      dropped.type = FrameType::kError;
      dropped.src = peer.id;
      dropped.dst = self_;
      dropped.payload_bytes = 0;
      dropped.status_code = static_cast<uint32_t>(why.code());
      sink.OnFrame(peer.id, dropped, nullptr, std::move(why));
    }
  }
  ReportFailures(sink);
}

void RdmaTransport::ClearOutbox(Peer& peer) {
  Outbox& box = peer.outbox;
  MutexLock lock(&box.mu);
  while (box.size > 0) Pop(box);
  box.failed = absl::OkStatus();
  if (box.backlogged.exchange(false, std::memory_order_acq_rel)) {
    backlogged_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void RdmaTransport::FlushOutboxes(absl::Time deadline) {
  while (backlogged_.load(std::memory_order_acquire) > 0 && absl::Now() < deadline) {
    const size_t count = peer_count_.load(std::memory_order_acquire);
    for (size_t i = 0; i < count; ++i) {
      Peer& peer = *peers_[i];
      if (!peer.outbox.backlogged.load(std::memory_order_acquire)) continue;
      if (!peer.usable()) {
        ClearOutbox(peer);
        continue;
      }
      for (uint32_t q = 0; q < peer.num_qps; ++q) peer.qps[q].sq.Reap(peer.failure);
      MutexLock lock(&peer.outbox.mu);
      DrainOutbox(peer);
    }
    absl::SleepFor(absl::Microseconds(50));
  }
}

}  // namespace stepmesh::rdma::impl
