// ServerLogic's application side: registrations, batches handed out
// (GetBatch) and answered (Respond), and the send thread's replies and error
// reports (src/core/server_logic.h).

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/base/logging.h"
#include "src/core/chrome_trace.h"
#include "src/core/mesh.h"
#include "src/core/server_logic.h"
#include "stepmesh/status.h"

namespace stepmesh::core {

ServerLogic::ServerLogic(MeshNode& node)
    : node_(node),
      options_(node.options()),
      io_(node.io()),
      lost_(node.lost()),
      stats_(node.stats()),
      assembler_(options_.num_workers, lost_, options_.trace.enabled),
      replies_(options_, io_, lost_, stats_, node.trace_ring()),
      notes_(options_.num_workers),
      parked_(options_.num_workers),
      parked_bytes_(options_.num_workers, 0),
      rejoins_(options_.num_workers),
      fences_(options_.num_workers) {
  for (int w = 0; w < options_.num_workers; ++w) notes_[w].worker = w;
}

absl::Status ServerLogic::Init() {
  // Made now: making a flag later pins memory, which waits for the whole device.
  STEPMESH_ASSIGN_OR_RETURN(batches_ready_, node_.backend().CreateHostFlag());
  STEPMESH_ASSIGN_OR_RETURN(batch_cursor_, node_.backend().CreateHostFlag());
  assembler_.CountReadyBatches(batches_ready_.get());
  return absl::OkStatus();
}

int ServerLogic::num_workers() const { return options_.num_workers; }

absl::Status ServerLogic::RegisterRecvTensor(Key key, TensorView region) {
  base::MutexLock lock(&reg_mu_);
  STEPMESH_RETURN_IF_ERROR(CheckNewKey(key, recv_regs_.contains(key), "receive"));
  STEPMESH_ASSIGN_OR_RETURN(size_t slot_bytes, SlotBytes(region, "receive"));
  std::vector<NodeId> writers;
  for (int w = 0; w < options_.num_workers; ++w) writers.push_back(node_.PeerId(w));
  STEPMESH_ASSIGN_OR_RETURN(
      WireTensor wire, node_.RegisterTensor(key, region, options_.num_workers, std::move(writers)));
  auto reg = std::make_unique<RecvRegistration>();
  reg->view = region;
  reg->wire = wire;
  reg->slot_bytes = slot_bytes;
  reg->busy.reset(new std::atomic<bool>[options_.num_workers]);
  reg->last_request.reset(new uint64_t[options_.num_workers]());
  reg->pull_checked.reset(new Key[options_.num_workers]);
  std::fill_n(reg->pull_checked.get(), options_.num_workers, kNoPull);
  for (int w = 0; w < options_.num_workers; ++w) reg->busy[w] = false;
  recv_regs_[key] = std::move(reg);
  ReleaseParked();
  return absl::OkStatus();
}

absl::Status ServerLogic::RegisterReplyTensor(Key key, TensorView region) {
  base::MutexLock lock(&reg_mu_);
  STEPMESH_RETURN_IF_ERROR(CheckNewKey(key, reply_regs_.contains(key), "reply"));
  STEPMESH_ASSIGN_OR_RETURN(size_t slot_bytes, SlotBytes(region, "reply"));
  STEPMESH_ASSIGN_OR_RETURN(WireTensor wire,
                            node_.RegisterTensor(key, region, options_.num_workers, {}));
  reply_regs_[key] =
      std::make_unique<ReplyRegistration>(ReplyRegistration{region, wire, slot_bytes});
  ReleaseParked();
  return absl::OkStatus();
}

absl::Status ServerLogic::Unregister(Key key) {
  base::MutexLock lock(&reg_mu_);
  auto recv = recv_regs_.find(key);
  auto reply = reply_regs_.find(key);
  if (recv == recv_regs_.end() && reply == reply_regs_.end()) {
    return absl::NotFoundError(absl::StrCat("key ", key, " is not registered"));
  }
  if (recv != recv_regs_.end()) {
    for (int w = 0; w < options_.num_workers; ++w) {
      if (recv->second->busy[w].load()) {
        return absl::FailedPreconditionError(
            absl::StrCat("key ", key, " holds data of an unanswered batch"));
      }
    }
  }
  if (reply != reply_regs_.end() && assembler_.ReplySourceInUse(reply->second.get())) {
    return absl::FailedPreconditionError(
        absl::StrCat("key ", key, " is the source of a reply being sent"));
  }
  if (reply != reply_regs_.end() && assembler_.PullKeyAwaited(key)) {
    // Requests were admitted for pulling it (Resolve checked): they are owed a reply.
    return absl::FailedPreconditionError(
        absl::StrCat("key ", key, " is pulled by a request not yet answered"));
  }
  if (recv != recv_regs_.end()) {
    STEPMESH_RETURN_IF_ERROR(
        node_.UnregisterTensor(recv->second->wire.region, recv->second->view.data, key));
    recv_regs_.erase(recv);
  }
  if (reply != reply_regs_.end()) {
    STEPMESH_RETURN_IF_ERROR(
        node_.UnregisterTensor(reply->second->wire.region, reply->second->view.data, key));
    reply_regs_.erase(reply);
    // Pushes pulling it must be checked again (PullRegistered).
    for (auto& [k, r] : recv_regs_)
      std::fill_n(r->pull_checked.get(), options_.num_workers, kNoPull);
  }
  return absl::OkStatus();
}

absl::StatusOr<Batch> ServerLogic::GetBatch(absl::Duration timeout, BatchPolicy policy) {
  if (node_.stopped()) return absl::FailedPreconditionError("server is shut down");
  const absl::Time deadline = absl::Now() + timeout;
  // Also wakes when the last worker is gone: nothing can arrive any more.
  node_.AwaitDriving(
      [this] {
        return assembler_.HasReady() || node_.stopped() || lost_.live() == 0 || DrainedOut();
      },
      deadline, [this] { return assembler_.MoreThanOneToHandOut(); });
  if (std::optional<Batch> batch = assembler_.TakeReady()) return *batch;
  if (node_.stopped()) return absl::CancelledError("server shut down while waiting for a batch");
  if (DrainedOut()) {
    return absl::UnavailableError(
        absl::StrCat("server ", node_.rank(),
                     " drained: it left the mesh (Leave) and every request that reached "
                     "it was handed out"));
  }
  if (lost_.live() == 0) return absl::UnavailableError("every worker is gone");
  if (policy == BatchPolicy::kReadyByDeadline) {
    // The oldest partial batch, if any worker arrived.
    if (std::optional<Batch> batch = assembler_.TakeOldestPartial()) return *batch;
  }
  return absl::DeadlineExceededError(
      absl::StrCat("no batch within ", absl::FormatDuration(timeout)));
}

absl::Status ServerLogic::StreamWaitNextBatch(Stream& stream) {
  if (node_.stopped()) return absl::FailedPreconditionError("server is shut down");
  node_.ResumeReceiver();  // the device waits: the receive thread assembles
  return stream.WaitHostFlagNext(*batches_ready_, *batch_cursor_);
}

absl::Status ServerLogic::Respond(const Batch& batch, absl::Span<const Reply> replies,
                                  const SendOptions& send_options) {
  if (node_.stopped()) return absl::FailedPreconditionError("server is shut down");
  SendItem item{SendKind::kReplies, 0, batch.handle.generation(), send_options.ready};
  // Owned: this thread sends the replies itself (the send thread is idle and
  // nothing waits before them), once the locks Execute takes are let go.
  std::unique_lock<std::mutex> inline_send;
  absl::Status responded;
  {
    base::ReaderMutexLock reg_lock(&reg_mu_);
    const ReplyTensors& reply_tensors = reply_regs_;
    const uint64_t respond_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    responded = assembler_.Respond(batch.handle, [&](BatchSlot& slot, uint32_t index) {
      STEPMESH_RETURN_IF_ERROR(replies_.Prepare(slot, replies, reply_tensors));
      slot.respond_ns = respond_ns;
      item.index = index;
      inline_send = node_.ClaimInlineSend(item);
      if (inline_send.owns_lock()) return absl::OkStatus();
      return node_.EnqueueSend(item);
    });
  }
  if (!responded.ok()) return responded;
  stats_.Request(absl::StatusCode::kOk);
  if (inline_send.owns_lock()) Execute(item, absl::OkStatus());
  return absl::OkStatus();
}

uint64_t ServerLogic::InFlight() {
  return static_cast<uint64_t>(std::max(assembler_.ready_count(), 0));
}

void ServerLogic::Execute(const SendItem& item, const absl::Status& ready) {
  if (item.kind == SendKind::kError) {
    replies_.SendError(node_.transport(), node_.self(), item.index);
    return;
  }
  replies_.SendReplies(node_.transport(), node_.self(), node_.rank(),
                       assembler_.responding(item.index), ready);
  assembler_.Release(item.index);
}

void ServerLogic::ReleaseParked() {
  registered_.store(true, std::memory_order_release);
  if (parked_any_.load(std::memory_order_acquire)) node_.transport().Wake();
}

void ServerLogic::QueueError(NodeId worker, uint64_t request_id, const absl::Status& status) {
  const uint32_t index = replies_.RecordError(worker, request_id, status);
  STEPMESH_LOG(kInfo, "server ", node_.rank(), ": rejecting request from worker ", NodeRank(worker),
               ": ", status.ToString());
  if (absl::Status s = node_.EnqueueSend({SendKind::kError, index, 0, nullptr}); !s.ok()) {
    STEPMESH_LOG(kWarning, "cannot report an error to worker ", NodeRank(worker), ": ",
                 s.ToString());
  }
}

absl::StatusOr<size_t> ServerLogic::SlotBytes(const TensorView& region,
                                              absl::string_view what) const {
  if (region.data == nullptr || region.bytes() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("cannot register an empty ", what, " tensor"));
  }
  const int64_t rows = region.shape.rank() > 0 ? region.shape[0] : 1;
  if (rows % options_.num_workers != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " tensor's first dimension ", rows, " is not a multiple of num_workers ",
                     options_.num_workers, " (one equal slot per worker)"));
  }
  return region.bytes() / options_.num_workers;
}

absl::Status ServerLogic::CheckNewKey(Key key, bool exists, absl::string_view what) const {
  if (exists) {
    return absl::AlreadyExistsError(absl::StrCat(what, " key ", key, " already registered"));
  }
  return node_.CheckRegistrationLimit(recv_regs_.size() + reply_regs_.size());
}

}  // namespace stepmesh::core
