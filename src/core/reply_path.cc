#include "src/core/reply_path.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "src/base/logging.h"
#include "src/core/chrome_trace.h"

namespace stepmesh::core {
namespace {

// Error records waiting for the send thread, reused round-robin.
constexpr size_t kErrorRing = 256;

}  // namespace

ReplyPath::ReplyPath(const MeshOptions& options, const PayloadIo& io, const LostPeers& lost,
                     StatsRecorder& stats, TraceRing& trace)
    : options_(options), io_(io), lost_(lost), stats_(stats), trace_(trace), errors_(kErrorRing) {}

absl::Status ReplyPath::Prepare(BatchSlot& slot, absl::Span<const Reply> replies,
                                const ReplyTensors& reply_tensors) const {
  // Validate everything first: a failed Respond sends nothing.
  for (size_t i = 0; i < replies.size(); ++i) {
    const Reply& reply = replies[i];
    if (reply.worker < 0 || reply.worker >= options_.num_workers ||
        !slot.entries[reply.worker].present) {
      return absl::InvalidArgumentError(
          absl::StrCat("reply to worker ", reply.worker, " which is not in this batch"));
    }
    for (size_t j = 0; j < i; ++j) {
      if (replies[j].worker == reply.worker) {
        return absl::InvalidArgumentError(absl::StrCat("two replies to worker ", reply.worker));
      }
    }
    const WorkerEntry& e = slot.entries[reply.worker];
    if (e.pull_key == kNoPull) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker ", reply.worker, " pulled nothing from this server"));
    }
    auto it = reply_tensors.find(e.pull_key);
    if (it == reply_tensors.end()) continue;  // answered with an error frame (below)
    const size_t bytes = reply.bytes == kWholeTensor ? it->second->slot_bytes : reply.bytes;
    if (reply.offset == Reply::kSlot) {
      if (bytes > it->second->slot_bytes) {
        return absl::OutOfRangeError(absl::StrCat("reply of ", bytes, " bytes exceeds the ",
                                                  it->second->slot_bytes, "-byte slot of key ",
                                                  e.pull_key));
      }
    } else {
      const size_t region = it->second->view.bytes();
      if (reply.offset > region || bytes > region - reply.offset) {
        return absl::OutOfRangeError(
            absl::StrCat("reply to worker ", reply.worker, ": offset ", reply.offset, " + ", bytes,
                         " bytes exceeds the ", region, "-byte reply region of key ", e.pull_key));
      }
    }
  }
  for (int w : slot.workers) {
    const Key pull = slot.entries[w].pull_key;
    // A pull checked when the request arrived whose tensor is gone since
    // (Unregister refuses that while the batch is known; a race remains): that
    // worker hears NOT_FOUND, the others of the batch their replies.
    if (pull == kNoPull || !reply_tensors.contains(pull)) continue;
    bool answered = false;
    for (const Reply& reply : replies) answered = answered || reply.worker == w;
    if (!answered) {
      return absl::InvalidArgumentError(
          absl::StrCat("worker ", w, " pulls key ", slot.entries[w].pull_key, " but got no reply"));
    }
  }
  for (int w : slot.workers) {
    WorkerEntry& e = slot.entries[w];
    e.reply = nullptr;
    e.reply_missing = e.pull_key != kNoPull && !reply_tensors.contains(e.pull_key);
  }
  for (const Reply& reply : replies) {
    WorkerEntry& e = slot.entries[reply.worker];
    if (e.reply_missing) continue;
    e.reply = reply_tensors.find(e.pull_key)->second.get();
    e.reply_bytes = reply.bytes == kWholeTensor ? e.reply->slot_bytes : reply.bytes;
    e.reply_offset = reply.offset == Reply::kSlot
                         ? static_cast<size_t>(reply.worker) * e.reply->slot_bytes
                         : reply.offset;
  }
  return absl::OkStatus();
}

void ReplyPath::SendReplies(Transport& transport, NodeId self, int rank, BatchSlot& slot,
                            const absl::Status& ready) const {
  const uint64_t reply_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
  // Server s starts with the s-th worker (a rotation), so that no worker is
  // every server's last: with every server starting at worker 0, the last
  // worker always waits for all the others' replies, and its next push
  // holds up every server's next batch.
  const size_t n = slot.workers.size();
  for (size_t i = 0; i < n; ++i) {
    const int w = slot.workers[(i + static_cast<size_t>(rank)) % n];
    const WorkerEntry& e = slot.entries[w];
    // Free the worker's receive slots first: its next push may follow our reply at once.
    slot.ReleaseReceiveSlots(w);
    if (lost_.lost(w)) continue;
    FrameHeader h;
    h.src = self;
    h.dst = WorkerId(w);
    h.request_id = e.request_id;
    h.stamps = e.stamps;
    h.stamps.server_handler_ns = slot.handler_ns;
    h.stamps.server_reply_ns = reply_ns;
    if (reply_ns != 0 && slot.respond_ns != 0 && reply_ns >= slot.respond_ns) {
      h.status_code = static_cast<uint32_t>(
          std::min<uint64_t>(reply_ns - slot.respond_ns, std::numeric_limits<uint32_t>::max()));
    }
    absl::Status sent;
    if (!ready.ok() || e.reply_missing) {
      const absl::Status why =
          !ready.ok() ? absl::Status(ready.code(),
                                     absl::StrCat("reply's ready event failed: ", ready.message()))
                      : absl::NotFoundError(absl::StrCat("worker ", w, " pulls key ", e.pull_key,
                                                         ", which has no reply tensor on server ",
                                                         rank, " any more"));
      h.type = FrameType::kError;
      h.status_code = static_cast<uint32_t>(why.code());
      h.payload_bytes = std::min<size_t>(why.message().size(), kMaxErrorTextBytes);
      sent = transport.Send(h.dst, h, why.message().data(), 0, h.payload_bytes);
    } else {
      h.type = FrameType::kReply;
      const std::byte* src = nullptr;
      RegionId region = 0;
      if (e.reply != nullptr) {
        h.key = e.pull_key;
        h.dtype = e.reply->view.dtype;
        h.payload_bytes = e.reply_bytes;
        const size_t offset = e.reply_offset;
        src = e.reply->wire.wire + offset;
        region = e.reply->wire.region;
        sent = io_.StageOut(e.reply->wire, e.reply->view.data, offset, e.reply_bytes);
        io_.Seal(h, e.reply->wire, src);
      }
      if (sent.ok()) sent = transport.Send(h.dst, h, src, region, h.payload_bytes);
    }
    if (!sent.ok()) {
      STEPMESH_LOG(kWarning, "server ", rank, ": reply to worker ", w,
                   " failed: ", sent.ToString());
      continue;
    }
    stats_.Sent(w, h.payload_bytes);
    if (h.type == FrameType::kError)
      stats_.Outcome(w, static_cast<absl::StatusCode>(h.status_code));
    stats_.stage(Stage::kDispatch).RecordSpan(e.stamps.server_arrival_ns, slot.handler_ns);
    stats_.stage(Stage::kRespond).RecordSpan(slot.handler_ns, reply_ns);
    if (trace_.on()) {
      using S = ServerTraceWords;
      trace_.Record([&](const TraceRing::Writer& out) {
        out.Put(S::kRequestId, e.request_id);
        out.Put(S::kWorker, static_cast<uint64_t>(w));
        out.Put(S::kArrival, e.stamps.server_arrival_ns);
        out.Put(S::kHandler, slot.handler_ns);
        out.Put(S::kReply, reply_ns);
        out.Put(S::kCode, h.type == FrameType::kError ? uint64_t{h.status_code} : 0);
      });
    }
  }
}

uint32_t ReplyPath::RecordError(NodeId worker, uint64_t request_id, const absl::Status& status) {
  base::MutexLock lock(&error_mu_);
  const uint32_t index = static_cast<uint32_t>(next_error_++ % errors_.size());
  errors_[index] = {worker, request_id, status.code(), std::string(status.message())};
  return index;
}

void ReplyPath::SendError(Transport& transport, NodeId self, uint32_t index) {
  ErrorRecord record;
  {
    base::MutexLock lock(&error_mu_);
    record = std::move(errors_[index]);
  }
  FrameHeader h;
  h.type = FrameType::kError;
  h.src = self;
  h.dst = record.worker;
  h.request_id = record.request_id;
  h.status_code = static_cast<uint32_t>(record.code);
  h.payload_bytes = std::min<size_t>(record.message.size(), kMaxErrorTextBytes);
  absl::Status sent = transport.Send(h.dst, h, record.message.data(), 0, h.payload_bytes);
  if (!sent.ok()) {
    STEPMESH_LOG(kWarning, "error frame not delivered: ", sent.ToString());
    return;
  }
  stats_.Sent(static_cast<int>(NodeRank(h.dst)), h.payload_bytes);
  stats_.Outcome(static_cast<int>(NodeRank(h.dst)), record.code);
}

}  // namespace stepmesh::core
