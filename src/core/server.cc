// AFTensorServer: the registrations, the per-frame checks of arriving pushes,
// and worker loss and rejoin, tying the batch assembler (what arrived, which
// batch is ready) to the reply path (what goes back).

#include "stepmesh/server.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "src/base/logging.h"
#include "src/base/rate_limit.h"
#include "src/core/batch_assembler.h"
#include "src/core/chrome_trace.h"
#include "src/core/mesh.h"
#include "src/core/mesh_node.h"
#include "src/core/participant_node.h"
#include "src/core/reply_path.h"
#include "src/core/server_tensors.h"
#include "src/core/worker_rejoins.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

constexpr uint32_t kSendReplies = 1;
constexpr uint32_t kSendError = 2;

// What a worker may keep parked on one server (pushes whose key, or pull key,
// is not registered there yet): frames and payload bytes. Beyond either, its
// next such push is refused at once.
constexpr size_t kMaxParkedPerWorker = 16;
constexpr size_t kMaxParkedBytesPerWorker = size_t{64} << 20;
// How often the receive thread looks at parked pushes when nothing else
// happened (their deadlines, their senders' losses).
constexpr absl::Duration kParkedCheck = absl::Milliseconds(10);

// The frame context of a worker's push: the worker, and the receive region
// Resolve checked the push against and reserved its slot in (null when the
// push was refused or parked). One per worker: a transport resolves a peer's
// frames one at a time (see TransportSink).
struct PushNote {
  int worker = 0;
  RecvRegistration* reg = nullptr;
  bool duplicate = false;  // a copy of a push already accepted: dropped, nobody answered
  // Parked: the payload lands in `park` (the key is not registered yet).
  std::unique_ptr<std::byte[]> park;
  bool parking = false;
};

// A push that arrived before its key (or its pull key) was registered here,
// set aside by the receive thread -- which moves on to other frames -- until
// the registration comes (then it is delivered as if it arrived then) or its
// deadline passes (then its request is refused, naming the key).
struct ParkedPush {
  FrameHeader header;
  std::unique_ptr<std::byte[]> payload;  // its key was not registered
  // Its key was, its pull key not: the payload is in the worker's slot of
  // this receive region, reserved for it (busy) until the push is delivered.
  RecvRegistration* reg = nullptr;
  absl::Time deadline;
  uint32_t epoch = 0;  // the sender's process (WorkerRejoins::epoch) when it arrived
};

class Server final : public ParticipantNode<AFTensorServer> {
 public:
  Server(const MeshOptions& options, std::shared_ptr<Backend> backend)
      : ParticipantNode(options, std::move(backend)),
        assembler_(options_.num_workers, lost_, options.trace.enabled),
        replies_(options_, io_, lost_, stats_, trace_ring_),
        notes_(options_.num_workers),
        parked_(options_.num_workers),
        parked_bytes_(options_.num_workers, 0),
        rejoins_(options_.num_workers),
        fenced_(new std::atomic<bool>[options_.num_workers]) {
    for (int w = 0; w < options_.num_workers; ++w) {
      notes_[w].worker = w;
      fenced_[w].store(false);
    }
  }
  ~Server() override { Stop(); }

  absl::Status Init(const TransportFactory& factory) {
    // Made now: making a flag later pins memory, which waits for the whole device.
    STEPMESH_ASSIGN_OR_RETURN(batches_ready_, backend_->CreateHostFlag());
    STEPMESH_ASSIGN_OR_RETURN(batch_cursor_, backend_->CreateHostFlag());
    assembler_.CountReadyBatches(batches_ready_.get());
    return Start(factory);
  }

  int num_workers() const override { return options_.num_workers; }

  absl::Status RegisterRecvTensor(Key key, TensorView region) override {
    base::MutexLock lock(&reg_mu_);
    STEPMESH_RETURN_IF_ERROR(CheckNewKey(key, recv_regs_.contains(key), "receive"));
    STEPMESH_ASSIGN_OR_RETURN(size_t slot_bytes, SlotBytes(region, "receive"));
    std::vector<NodeId> writers;
    for (int w = 0; w < options_.num_workers; ++w) writers.push_back(PeerId(w));
    STEPMESH_ASSIGN_OR_RETURN(
        WireTensor wire, RegisterTensor(key, region, options_.num_workers, std::move(writers)));
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

  absl::Status RegisterReplyTensor(Key key, TensorView region) override {
    base::MutexLock lock(&reg_mu_);
    STEPMESH_RETURN_IF_ERROR(CheckNewKey(key, reply_regs_.contains(key), "reply"));
    STEPMESH_ASSIGN_OR_RETURN(size_t slot_bytes, SlotBytes(region, "reply"));
    STEPMESH_ASSIGN_OR_RETURN(WireTensor wire,
                              RegisterTensor(key, region, options_.num_workers, {}));
    reply_regs_[key] =
        std::make_unique<ReplyRegistration>(ReplyRegistration{region, wire, slot_bytes});
    ReleaseParked();
    return absl::OkStatus();
  }

  absl::Status Unregister(Key key) override {
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
          UnregisterTensor(recv->second->wire.region, recv->second->view.data, key));
      recv_regs_.erase(recv);
    }
    if (reply != reply_regs_.end()) {
      STEPMESH_RETURN_IF_ERROR(
          UnregisterTensor(reply->second->wire.region, reply->second->view.data, key));
      reply_regs_.erase(reply);
      // Pushes pulling it must be checked again (PullRegistered).
      for (auto& [k, r] : recv_regs_)
        std::fill_n(r->pull_checked.get(), options_.num_workers, kNoPull);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Batch> GetBatch(absl::Duration timeout, BatchPolicy policy) override {
    if (stopped()) return absl::FailedPreconditionError("server is shut down");
    const absl::Time deadline = absl::Now() + timeout;
    // Also wakes when the last worker is gone: nothing can arrive any more.
    AwaitUntil(
        [this] { return assembler_.HasReady() || stopped() || lost_.live() == 0 || DrainedOut(); },
        deadline);
    if (std::optional<Batch> batch = assembler_.TakeReady()) return *batch;
    if (stopped()) return absl::CancelledError("server shut down while waiting for a batch");
    if (DrainedOut()) {
      return absl::UnavailableError(
          absl::StrCat("server ", rank_,
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

  absl::Status StreamWaitNextBatch(Stream& stream) override {
    if (stopped()) return absl::FailedPreconditionError("server is shut down");
    return stream.WaitHostFlagNext(*batches_ready_, *batch_cursor_);
  }

  absl::Status Respond(const Batch& batch, absl::Span<const Reply> replies,
                       const SendOptions& send_options) override {
    if (stopped()) return absl::FailedPreconditionError("server is shut down");
    base::ReaderMutexLock reg_lock(&reg_mu_);
    const ReplyTensors& reply_tensors = reply_regs_;
    const uint64_t respond_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    absl::Status responded = assembler_.Respond(batch.handle, [&](BatchSlot& slot, uint32_t index) {
      STEPMESH_RETURN_IF_ERROR(replies_.Prepare(slot, replies, reply_tensors));
      slot.respond_ns = respond_ns;
      return EnqueueSend({kSendReplies, index, batch.handle.generation(), send_options.ready});
    });
    if (responded.ok()) stats_.Request(absl::StatusCode::kOk);
    return responded;
  }

 private:
  uint64_t InFlight() override {
    return static_cast<uint64_t>(std::max(assembler_.ready_count(), 0));
  }

  // --- draining (Participant::Leave) ---
  // Every worker sent its fence (or is gone): nothing more can arrive.
  bool AllFenced() const {
    for (int w = 0; w < options_.num_workers; ++w) {
      if (!lost_.lost(w) && !fenced_[w].load(std::memory_order_acquire)) return false;
    }
    return !parked_any_.load(std::memory_order_acquire);
  }
  // Draining, nothing more arrives and nothing is left to hand out (GetBatch).
  bool DrainedOut() {
    return draining_.load(std::memory_order_acquire) && AllFenced() &&
           assembler_.NothingToHandOut();
  }
  // Counted out now; answers what arrived (the application keeps serving);
  // done once every reply went out.
  absl::Status Drain(absl::Time deadline) override {
    const absl::Time start = absl::Now();
    draining_.store(true, std::memory_order_release);
    STEPMESH_RETURN_IF_ERROR(rendezvous_->AnnounceLeaving());
    NotifyWaiters();
    if (AwaitUntil([this] { return AllFenced() && assembler_.Idle(); }, deadline)) {
      return absl::OkStatus();
    }
    int unfenced = 0;
    for (int w = 0; w < options_.num_workers; ++w) {
      unfenced += !lost_.lost(w) && !fenced_[w].load(std::memory_order_acquire);
    }
    return absl::DeadlineExceededError(absl::StrCat(
        "server ", rank_, " left after ", absl::FormatDuration(absl::Now() - start),
        " without draining: ", unfenced, " worker(s) had not confirmed their last push, and ",
        assembler_.Idle() ? "no batch" : "batches", " were still unanswered"));
  }

  // --- send thread ---
  void ExecuteSend(const SendItem& item, const absl::Status& ready) override {
    if (item.kind == kSendError) {
      replies_.SendError(*transport_, self_, item.index);
      return;
    }
    replies_.SendReplies(*transport_, self_, rank_, assembler_.responding(item.index), ready);
    assembler_.Release(item.index);
  }

  // --- receive thread ---
  // Checks a push once: its sender, its key, dtype and size, and that the
  // worker's slot is free (then reserves it). The result travels to OnFrame
  // as the frame's context.
  absl::Status Resolve(NodeId peer, const FrameHeader& h, Destination& out,
                       FrameContext* context) override {
    const uint32_t w = NodeRank(peer);
    if (!IsWorker(peer) || w >= static_cast<uint32_t>(options_.num_workers)) {
      return absl::PermissionDeniedError(
          absl::StrCat("a frame from node 0x", absl::Hex(peer), ", which is not one of the ",
                       options_.num_workers, " workers of this mesh"));
    }
    if (h.type != FrameType::kPush) {
      // Refused before anything is reserved; OnFrame answers it.
      return absl::InvalidArgumentError(
          absl::StrCat("a server receives pushes, not frame type ", static_cast<int>(h.type)));
    }
    ForgetPreviousProcess(static_cast<int>(w));
    if (fenced_[w].load(std::memory_order_relaxed)) {
      return absl::UnavailableError(absl::StrCat("server ", rank_,
                                                 " left the mesh (it drains) and takes nothing "
                                                 "after worker ",
                                                 w, "'s last push"));
    }
    PushNote& note = notes_[w];
    note.reg = nullptr;
    note.duplicate = false;
    note.parking = false;
    *context = &note;
    base::ReaderMutexLock lock(&reg_mu_);
    auto it = recv_regs_.find(h.key);
    // Why not refuse a push whose key (or pull key) is not registered at
    // once: a worker may push as soon as the mesh is up, before this server's
    // application registered the key (no barrier is required of integrators).
    // Why not wait here: this thread reads every worker's frames. So the push
    // is parked, bounded per worker, and the receive thread moves on (see
    // ParkedPush).
    if (it == recv_regs_.end()) return Park(static_cast<int>(w), h, out, note);
    STEPMESH_RETURN_IF_ERROR(Admit(static_cast<int>(w), h, *it->second, out, note));
    // Only the reply tensor is missing: the payload lands in its slot, now
    // reserved, and only its delivery is parked.
    if (!PullRegistered(h, *it->second, static_cast<int>(w))) note.parking = true;
    return absl::OkStatus();
  }

  // Whether the reply tensor a push pulls (if it pulls) is registered.
  bool PullRegistered(const FrameHeader& h) const ABSL_SHARED_LOCKS_REQUIRED(reg_mu_) {
    return (h.flags & kFlagHasPull) == 0 || reply_regs_.contains(h.pull_key);
  }
  // The same for a push of worker `w` into `reg`, remembering the answer: a
  // worker pulls the same key request after request, so the lookup is paid
  // once (receive thread; a reply key's Unregister forgets every answer).
  bool PullRegistered(const FrameHeader& h, RecvRegistration& reg, int w) const
      ABSL_SHARED_LOCKS_REQUIRED(reg_mu_) {
    if ((h.flags & kFlagHasPull) == 0) return true;
    if (h.pull_key != kNoPull && reg.pull_checked[w] == h.pull_key) return true;
    if (!reply_regs_.contains(h.pull_key)) return false;
    reg.pull_checked[w] = h.pull_key;
    return true;
  }

  // The checks of a push whose key is registered here as `reg`: dtype, size,
  // a copy of an accepted push, the worker's slot free (then reserved).
  absl::Status Admit(int w, const FrameHeader& h, RecvRegistration& reg, Destination& out,
                     PushNote& note) ABSL_SHARED_LOCKS_REQUIRED(reg_mu_) {
    if (h.dtype != reg.view.dtype) {
      return absl::InvalidArgumentError(absl::StrCat("push dtype ", DTypeName(h.dtype),
                                                     " under key ", h.key, " but server ", rank_,
                                                     " registered ", DTypeName(reg.view.dtype)));
    }
    if (h.payload_bytes > reg.slot_bytes) {
      return absl::OutOfRangeError(absl::StrCat("push of ", h.payload_bytes, " bytes under key ",
                                                h.key, " exceeds server ", rank_, "'s ",
                                                reg.slot_bytes, "-byte slot"));
    }
    if (h.request_id == reg.last_request[w]) {
      // The same request's push again. Refusing it with an error would fail
      // that request while this server still serves its original -- the
      // worker would reuse the key's tensors, and its next push would meet a
      // busy slot (and, over RDMA, the original's late reply would land in
      // the next request's pull tensor). Answering it again would hold the
      // slot for a batch nobody waits for. The original's reply answers it.
      note.duplicate = true;
      return absl::AlreadyExistsError(absl::StrCat("push under key ", h.key, " of request 0x",
                                                   absl::Hex(h.request_id),
                                                   " arrived twice; the copy is dropped"));
    }
    if (reg.busy[w].exchange(true)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "push under key ", h.key, " while the previous one is still being processed"));
    }
    reg.last_request[w] = h.request_id;
    note.reg = &reg;  // its slot stays reserved (and the key registered) until the push is done
    out = Destination{reg.wire.wire + w * reg.slot_bytes, reg.slot_bytes, reg.wire.region};
    return absl::OkStatus();
  }

  // A push of worker `w` whose key or pull key is not registered: its payload
  // goes to a buffer of its own, kept (OnFrame) until the registration or the
  // deadline; refused at once when `w` already has its share parked.
  absl::Status Park(int w, const FrameHeader& h, Destination& out, PushNote& note)
      ABSL_SHARED_LOCKS_REQUIRED(reg_mu_) {
    if (parked_[w].size() >= kMaxParkedPerWorker ||
        parked_bytes_[w] + h.payload_bytes > kMaxParkedBytesPerWorker) {
      return absl::NotFoundError(absl::StrCat(MissingRegistration(w, h), " (", parked_[w].size(),
                                              " of worker ", w, "'s pushes, ", parked_bytes_[w],
                                              " bytes, already wait for registrations here)"));
    }
    note.park.reset(h.payload_bytes > 0 ? new std::byte[h.payload_bytes] : nullptr);
    note.parking = true;
    out = Destination{note.park.get(), h.payload_bytes, 0};
    return absl::OkStatus();
  }

  // What is not registered for worker `w`'s push `h`, for its error.
  std::string MissingRegistration(int w, const FrameHeader& h) const
      ABSL_SHARED_LOCKS_REQUIRED(reg_mu_) {
    if (!recv_regs_.contains(h.key)) {
      return absl::StrCat("push key ", h.key, " of worker ", w, " is not registered on server ",
                          rank_);
    }
    return absl::StrCat("worker ", w, " pulls key ", h.pull_key,
                        ", which has no reply tensor on server ", rank_);
  }

  void OnFrame(NodeId peer, const FrameHeader& h, FrameContext context,
               absl::Status status) override {
    MarkActivity();
    if (IsWorker(peer)) stats_.Received(static_cast<int>(NodeRank(peer)), h.payload_bytes);
    if (context == nullptr) {
      // Refused by Resolve before it claimed anything (a frame of another
      // type, a sender outside the mesh), or an error frame from a worker.
      if (h.type == FrameType::kError && h.key == kFenceKey && absl::IsCancelled(status) &&
          IsWorker(peer) && NodeRank(peer) < static_cast<uint32_t>(options_.num_workers)) {
        return Fenced(static_cast<int>(NodeRank(peer)));
      }
      if (h.type == FrameType::kError) {
        STEPMESH_LOG_LIMITED(violations_, kWarning, "server ", rank_, ": ", PeerName(peer),
                             " sent an error frame: ", status.ToString());
        return;
      }
      STEPMESH_LOG_LIMITED(violations_, kWarning, "server ", rank_, ": refused a frame from ",
                           PeerName(peer), ": ", status.message());
      QueueError(peer, h.request_id, status);
      return;
    }
    PushNote& note = *static_cast<PushNote*>(context);
    if (std::exchange(note.duplicate, false)) {
      STEPMESH_LOG_LIMITED(violations_, kWarning, "server ", rank_, ": ", PeerName(peer), ": ",
                           status.message());
      return;
    }
    RecvRegistration* reg = std::exchange(note.reg, nullptr);
    const int w = note.worker;
    if (std::exchange(note.parking, false) && status.ok()) {
      if (reg == nullptr) parked_bytes_[w] += h.payload_bytes;  // else it sits in its slot
      parked_[w].push_back(
          ParkedPush{h, std::move(note.park), reg, absl::Now() + ParkWait(), rejoins_.epoch(w)});
      ++parked_total_;
      parked_any_.store(true, std::memory_order_release);
      STEPMESH_LOG(kInfo, "server ", rank_, ": worker ", w, "'s push under key ", h.key,
                   " waits for its registration here");
      // A registration between Resolve and here found nothing parked yet.
      registered_.store(true, std::memory_order_release);
      return;
    }
    note.park.reset();
    Deliver(peer, w, h, reg, std::move(status));
  }

  // Receive thread: worker `w` pushes nothing more here (its fence, after its
  // last push, sent once it heard this server drains).
  void Fenced(int w) {
    if (!draining_.load(std::memory_order_acquire)) return;  // a previous drain's, late
    fenced_[w].store(true, std::memory_order_release);
    assembler_.StopAwaiting(w);
    NotifyWaiters();
  }

  // A push of worker `w` resolved (`reg`, its slot reserved) or refused
  // (`status`): checks its bytes, adds it to its request and the request to
  // its batch; a refusal goes back to the worker.
  void Deliver(NodeId peer, int w, const FrameHeader& h, RecvRegistration* reg,
               absl::Status status) {
    if (status.ok()) {
      status = reg == nullptr ? absl::InternalError("push delivered without a resolved destination")
                              : io_.Check(h, reg->wire, reg->wire.wire + w * reg->slot_bytes);
    }
    BatchAssembler::Arrival arrival = assembler_.AddPart(w, h, reg, status);
    if (!arrival.report.ok()) QueueError(peer, h.request_id, arrival.report);
    if (arrival.ready) NotifyWaiters();
    if (arrival.complete == nullptr) return;
    Assembly& a = *arrival.complete;
    for (int i = 0; i < a.num_keys; ++i) {
      // Staged regions: move the worker's bytes from the wire copy to the tensor.
      const RecvRegistration& part = *a.regs[i];
      if (absl::Status s = io_.StageIn(part.wire, part.view.data, w * part.slot_bytes, a.bytes[i]);
          !s.ok()) {
        QueueError(peer, h.request_id, s);
        if (assembler_.Abandon(w, a)) NotifyWaiters();
        return;
      }
    }
    bool ready = false;
    if (absl::Status added = assembler_.Commit(w, a, &ready); !added.ok()) {
      QueueError(peer, h.request_id, added);
    }
    if (ready) NotifyWaiters();
  }

  // Receive thread, before any frame of worker `w`: once a restarted `w`
  // rejoined, drops what its previous process left half-received (request ids
  // restart with the process) and frees the receive slots those pushes held.
  // Slots held by batches the application has not answered stay held.
  void ForgetPreviousProcess(int w) {
    if (!rejoins_.NewProcessSeen(w)) return;
    const std::vector<const RecvRegistration*> held = assembler_.ForgetWorker(w);
    // Only this thread sets busy flags, so none can become held meanwhile.
    base::ReaderMutexLock lock(&reg_mu_);
    for (auto& [key, reg] : recv_regs_) {
      // The new process numbers its requests afresh.
      reg->last_request[w] = 0;
      if (std::find(held.begin(), held.end(), reg.get()) == held.end()) reg->busy[w].store(false);
    }
  }

  // How long a push may stay parked: half the timeout, so that its worker,
  // whose request has the whole timeout, hears this server's NOT_FOUND (naming
  // the key) rather than its own deadline, and a batch it shares with other
  // workers waits at most that long for it.
  absl::Duration ParkWait() const { return options_.timeout / 2; }

  // Any thread: a registration happened; the receive thread looks at what is parked.
  void ReleaseParked() {
    registered_.store(true, std::memory_order_release);
    if (parked_any_.load(std::memory_order_acquire)) transport_->Wake();
  }

  // Receive thread, after every poll: delivers parked pushes whose
  // registrations came, refuses those past their deadline, and drops those of
  // workers that are gone (or restarted). Nothing to do costs a compare.
  void AfterPoll() override {
    if (parked_total_ == 0) return;
    const absl::Time now = absl::Now();
    if (!registered_.exchange(false, std::memory_order_acq_rel) && now < next_parked_check_) {
      return;
    }
    next_parked_check_ = now + kParkedCheck;
    for (int w = 0; w < options_.num_workers; ++w) {
      std::deque<ParkedPush>& queue = parked_[w];
      const uint32_t epoch = rejoins_.epoch(w);
      for (size_t i = 0; i < queue.size();) {
        ParkedPush& p = queue[i];
        if (lost_.lost(w) || p.epoch != epoch) {  // its sender is gone: nothing is owed
          if (p.reg != nullptr) p.reg->busy[w].store(false);
          Unpark(w, i);
          continue;
        }
        RecvRegistration* reg = p.reg;
        Destination out;
        absl::Status status;
        bool keep = false;
        {
          base::ReaderMutexLock lock(&reg_mu_);
          auto it = recv_regs_.find(p.header.key);
          if (reg != nullptr) {
            if (PullRegistered(p.header, *reg, w)) {
              // Delivered as it is: its payload is in its slot.
            } else if (now >= p.deadline) {
              status = absl::NotFoundError(
                  absl::StrCat(MissingRegistration(w, p.header), " (waited ",
                               absl::FormatDuration(ParkWait()), " for its registration)"));
            } else {
              keep = true;
            }
          } else if (it != recv_regs_.end() && PullRegistered(p.header)) {
            PushNote note;  // not notes_[w]: a frame of `w` may be half-received
            note.worker = w;
            status = Admit(w, p.header, *it->second, out, note);
            reg = std::exchange(note.reg, nullptr);
            if (std::exchange(note.duplicate, false)) {
              Unpark(w, i);
              continue;
            }
          } else if (now >= p.deadline) {
            status = absl::NotFoundError(absl::StrCat(MissingRegistration(w, p.header), " (waited ",
                                                      absl::FormatDuration(ParkWait()),
                                                      " for its registration)"));
          } else {
            keep = true;
          }
        }
        if (keep) {
          ++i;
          continue;
        }
        if (status.ok() && p.reg == nullptr && p.header.payload_bytes > 0) {
          std::memcpy(out.data, p.payload.get(), p.header.payload_bytes);
        }
        const FrameHeader h = p.header;
        Unpark(w, i);
        Deliver(PeerId(w), w, h, reg, std::move(status));
      }
    }
  }

  void Unpark(int w, size_t i) {
    if (parked_[w][i].reg == nullptr) parked_bytes_[w] -= parked_[w][i].header.payload_bytes;
    parked_[w].erase(parked_[w].begin() + static_cast<std::ptrdiff_t>(i));
    if (--parked_total_ == 0) parked_any_.store(false, std::memory_order_release);
  }

  void QueueError(NodeId worker, uint64_t request_id, const absl::Status& status) {
    const uint32_t index = replies_.RecordError(worker, request_id, status);
    STEPMESH_LOG(kInfo, "server ", rank_, ": rejecting request from worker ", NodeRank(worker),
                 ": ", status.ToString());
    if (absl::Status s = EnqueueSend({kSendError, index, 0, nullptr}); !s.ok()) {
      STEPMESH_LOG(kWarning, "cannot report an error to worker ", NodeRank(worker), ": ",
                   s.ToString());
    }
  }

  // --- peer events (receive or rendezvous thread) ---
  void HandlePeerLost(NodeId peer, const absl::Status& why) override {
    if (!IsWorker(peer)) return;
    const int w = static_cast<int>(NodeRank(peer));
    if (w >= options_.num_workers || !lost_.MarkLost(w)) return;
    stats_.Lost(w);
    STEPMESH_LOG(kInfo, "server ", rank_, ": ", PeerLossMessage(peer, why.message()));
    assembler_.DropWorker(w);
    NotifyWaiters();
  }

  // A connection loss while the worker rejoins may be its previous
  // process's: set aside, settled by the scheduler (src/core/worker_rejoins.h).
  void HandleConnectionLost(NodeId peer, const absl::Status& why) override {
    if (IsWorker(peer) && rejoins_.SetAsideLoss(static_cast<int>(NodeRank(peer)))) {
      STEPMESH_LOG(kInfo, "server ", rank_, ": worker ", NodeRank(peer),
                   "'s connection ended while it rejoined (its previous process's, or a new "
                   "one that left: the scheduler tells): ",
                   why.ToString());
      return;
    }
    HandlePeerLost(peer, why);
  }

  // The scheduler saw worker `peer` leave in order. Its data connection's
  // goodbye says the same after its last pushes, except when that goodbye
  // was set aside while the worker rejoined: only then this counts it out.
  void HandlePeerLeft(NodeId peer) override {
    if (!IsWorker(peer)) return;
    if (!rejoins_.TakeSetAsideLoss(static_cast<int>(NodeRank(peer)))) return;
    HandlePeerLost(peer, absl::CancelledError("left"));
  }

  // A restarted attention process rejoined under the same rank: accept its
  // connection and count it in batches again. Requests of its previous process
  // were dropped when that was lost; its registrations are the new process's own.
  void HandlePeerJoined(NodeId peer, const std::string& endpoint) override {
    if (!IsWorker(peer) || stopped()) return;
    const int w = static_cast<int>(NodeRank(peer));
    if (w >= options_.num_workers) return;
    // Draining: the newcomer's roster does not hold this server.
    if (draining_.load(std::memory_order_acquire)) return;
    // A worker that never looked lost (its old connection still open) is superseded.
    HandlePeerLost(peer, absl::UnavailableError("worker restarted"));
    rejoins_.BeginRejoin(w);
    // Batches wait for it once its first request arrived (docs/elastic.md).
    assembler_.AwaitAfterFirstRequest(w);
    // Counted before its connection exists, so no batch forms without it meanwhile.
    lost_.MarkBack(w);
    absl::Status connected =
        transport_->Connect(self_, {PeerInfo{peer, endpoint}}, absl::Now() + options_.timeout);
    rejoins_.EndRejoin(w);
    if (!connected.ok()) {
      HandlePeerLost(peer, connected);
      STEPMESH_LOG(kWarning, "server ", rank_, ": rejoined worker ", w,
                   " never connected: ", connected.ToString());
      return;
    }
    stats_.Rejoined(w);
    STEPMESH_LOG(kInfo, "server ", rank_, ": worker ", w, " rejoined at ", endpoint);
  }

  // Joining a running mesh: every worker is new to this server, so none is
  // awaited before its first request here.
  void OnRoster(bool joined_running) override {
    if (!joined_running) return;
    for (int w = 0; w < options_.num_workers; ++w) assembler_.AwaitAfterFirstRequest(w);
  }

  void CancelAll(const absl::Status&) override { assembler_.ClearReady(); }

  // --- registration rules ---
  absl::StatusOr<size_t> SlotBytes(const TensorView& region, absl::string_view what) const {
    if (region.data == nullptr || region.bytes() == 0) {
      return absl::InvalidArgumentError(absl::StrCat("cannot register an empty ", what, " tensor"));
    }
    const int64_t rows = region.shape.rank() > 0 ? region.shape[0] : 1;
    if (rows % options_.num_workers != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " tensor's first dimension ", rows, " is not a multiple of num_workers ",
          options_.num_workers, " (one equal slot per worker)"));
    }
    return region.bytes() / options_.num_workers;
  }

  absl::Status CheckNewKey(Key key, bool exists, absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_) {
    if (exists) {
      return absl::AlreadyExistsError(absl::StrCat(what, " key ", key, " already registered"));
    }
    return CheckRegistrationLimit(recv_regs_.size() + reply_regs_.size());
  }

  base::Mutex reg_mu_;
  absl::flat_hash_map<Key, std::unique_ptr<RecvRegistration>> recv_regs_ ABSL_GUARDED_BY(reg_mu_);
  ReplyTensors reply_regs_ ABSL_GUARDED_BY(reg_mu_);

  // StreamWaitNextBatch: the ready batches the assembler counts, and the
  // device-side cursor of the waiting stream. Declared before the assembler,
  // which points at the first.
  std::unique_ptr<HostFlag> batches_ready_;
  std::unique_ptr<HostFlag> batch_cursor_;
  BatchAssembler assembler_;
  ReplyPath replies_;
  std::vector<PushNote> notes_;  // receive thread only
  // Parked pushes per worker, oldest first, and their payload bytes (receive thread only).
  std::vector<std::deque<ParkedPush>> parked_;
  std::vector<size_t> parked_bytes_;
  size_t parked_total_ = 0;
  absl::Time next_parked_check_ = absl::InfinitePast();
  std::atomic<bool> parked_any_{false};  // whether a registration should wake the receive thread
  std::atomic<bool> registered_{false};  // a registration since the receive thread last looked
  WorkerRejoins rejoins_;              // which process of each worker is served; the rejoin window
  std::atomic<bool> draining_{false};  // Leave began: counted out, answering what arrived
  // Per worker: its fence arrived (receive thread sets, any thread reads).
  std::unique_ptr<std::atomic<bool>[]> fenced_;
  base::RateLimiter violations_{10, absl::Seconds(10)};
};

}  // namespace

absl::StatusOr<std::unique_ptr<AFTensorServer>> CreateServer(const MeshOptions& options,
                                                             std::shared_ptr<Backend> backend,
                                                             const TransportFactory& transport,
                                                             RendezvousFactory rendezvous) {
  STEPMESH_ASSIGN_OR_RETURN(MeshOptions server_options, OptionsForRole(options, Role::kServer));
  if (backend == nullptr) return absl::InvalidArgumentError("CreateServer: no backend");
  auto server = std::make_unique<Server>(server_options, std::move(backend));
  server->SetRendezvousFactory(std::move(rendezvous));
  STEPMESH_RETURN_IF_ERROR(server->Init(transport));
  return server;
}

}  // namespace stepmesh::core
