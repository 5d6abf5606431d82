// AFTensorWorker: registrations, prepared requests and their posts, and the
// worker's send and receive paths around the request table
// (src/core/request_table.h, src/core/prepared_request.h).

#include "stepmesh/worker.h"

#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "src/base/logging.h"
#include "src/base/rate_limit.h"
#include "src/core/chrome_trace.h"
#include "src/core/mesh.h"
#include "src/core/mesh_node.h"
#include "src/core/participant_node.h"
#include "src/core/prepared_request.h"
#include "src/core/request_table.h"
#include "stepmesh/status.h"

namespace stepmesh::core {
namespace {

constexpr uint32_t kSendRequest = 1;
// The marker after a worker's last push to a draining server (SendItem.index:
// the server): a kError frame under kFenceKey, status CANCELLED, no text.
constexpr uint32_t kSendFence = 2;

class Worker final : public ParticipantNode<AFTensorWorker> {
 public:
  Worker(const MeshOptions& options, std::shared_ptr<Backend> backend)
      : ParticipantNode(options, std::move(backend)),
        // Generations start at a random point per process: a reply addressed to
        // a previous process under this rank (a server answering a batch from
        // before a restart) then matches no request of this one.
        requests_(options.max_inflight_requests, options_.num_servers, std::random_device{}() | 1),
        draining_(new std::atomic<bool>[options_.num_servers]),
        fence_sent_(options_.num_servers, 0) {
    ReservePlan(scratch_, options_.num_servers);
    scratch_.owner = this;
    for (int s = 0; s < options_.num_servers; ++s) draining_[s].store(false);
  }
  ~Worker() override { Stop(); }

  absl::Status Init(const TransportFactory& factory) {
    STEPMESH_RETURN_IF_ERROR(requests_.CreateDoneFlags(*backend_));
    return Start(factory);
  }

  int num_servers() const override { return options_.num_servers; }

  absl::Status RegisterPushTensor(Key key, TensorView tensor) override {
    base::MutexLock lock(&reg_mu_);
    STEPMESH_RETURN_IF_ERROR(CheckRegistrationLimit(push_regs_.size() + pull_regs_.size()));
    if (push_regs_.contains(key)) {
      return absl::AlreadyExistsError(absl::StrCat("push key ", key, " already registered"));
    }
    absl::StatusOr<WireTensor> wire = RegisterTensor(key, tensor, 1, {});
    if (!wire.ok()) return wire.status();
    TensorRegistration* reg = NewRegistration();
    reg->view = tensor;
    reg->wire = *wire;
    push_regs_[key] = reg;
    return absl::OkStatus();
  }

  absl::Status RegisterPullTensor(Key key, int server, TensorView tensor) override {
    if (server < 0 || server >= options_.num_servers) {
      return absl::InvalidArgumentError(
          absl::StrCat("server ", server, " out of range [0, ", options_.num_servers, ")"));
    }
    base::MutexLock lock(&reg_mu_);
    STEPMESH_RETURN_IF_ERROR(CheckRegistrationLimit(push_regs_.size() + pull_regs_.size()));
    if (pull_regs_.contains({key, server})) {
      return absl::AlreadyExistsError(
          absl::StrCat("pull key ", key, " from server ", server, " already registered"));
    }
    STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<HostFlag> arrivals, backend_->CreateHostFlag());
    STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<HostFlag> cursor, backend_->CreateHostFlag());
    STEPMESH_ASSIGN_OR_RETURN(const WireTensor wire,
                              RegisterTensor(key, tensor, 1, {PeerId(server)}));
    TensorRegistration* reg = NewRegistration();
    reg->view = tensor;
    reg->wire = wire;
    reg->arrivals = std::move(arrivals);
    reg->cursor = std::move(cursor);
    pull_regs_[{key, server}] = reg;
    return absl::OkStatus();
  }

  absl::Status Unregister(Key key) override {
    base::MutexLock lock(&reg_mu_);
    std::vector<std::pair<Key, int>> pulls;
    for (const auto& [id, reg] : pull_regs_) {
      if (id.first != key) continue;
      if (reg->in_flight) {
        return absl::FailedPreconditionError(absl::StrCat("key ", key, " is in flight"));
      }
      pulls.push_back(id);
    }
    auto push = push_regs_.find(key);
    if (push != push_regs_.end() && push->second->in_flight) {
      return absl::FailedPreconditionError(absl::StrCat("key ", key, " is in flight"));
    }
    if (push == push_regs_.end() && pulls.empty()) {
      return absl::NotFoundError(absl::StrCat("key ", key, " is not registered"));
    }
    if (push != push_regs_.end()) {
      TensorRegistration* reg = push->second;
      STEPMESH_RETURN_IF_ERROR(UnregisterTensor(reg->wire.region, reg->view.data, key));
      push_regs_.erase(push);
      FreeRegistration(reg);
    }
    for (const auto& id : pulls) {
      TensorRegistration* reg = pull_regs_[id];
      STEPMESH_RETURN_IF_ERROR(UnregisterTensor(reg->wire.region, reg->view.data, key));
      pull_regs_.erase(id);
      FreeRegistration(reg);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<PreparedRequest> Prepare(absl::Span<const Push> pushes,
                                          absl::Span<const Pull> pulls) override {
    if (stopped()) return absl::FailedPreconditionError("worker is shut down");
    auto plan = std::make_unique<PreparedPlan>();
    plan->owner = this;
    base::MutexLock lock(&reg_mu_);
    STEPMESH_RETURN_IF_ERROR(BuildLocked(pushes, pulls, *plan));
    return PreparedPlan::Wrap(std::move(plan));
  }

  absl::StatusOr<RequestHandle> Post(const PreparedRequest& prepared,
                                     const SendOptions& send_options) override {
    const uint64_t enqueue_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    const PreparedPlan* plan = PreparedPlan::Of(prepared);
    if (plan == nullptr) return absl::InvalidArgumentError("an empty PreparedRequest");
    if (plan->owner != this) {
      return absl::InvalidArgumentError("a PreparedRequest of another worker");
    }
    if (stopped()) return absl::FailedPreconditionError("worker is shut down");
    if (leaving()) return LeavingError();
    RequestHandle handle;
    bool staged = false;
    {
      base::MutexLock lock(&reg_mu_);
      STEPMESH_ASSIGN_OR_RETURN(handle, CommitLocked(*plan, send_options, enqueue_ns, &staged));
    }
    return Enqueue(handle, send_options, staged);
  }

  absl::StatusOr<RequestHandle> PushPull(absl::Span<const Push> pushes,
                                         absl::Span<const Pull> pulls,
                                         const SendOptions& send_options) override {
    const uint64_t enqueue_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    if (stopped()) return absl::FailedPreconditionError("worker is shut down");
    if (leaving()) return LeavingError();
    RequestHandle handle;
    bool staged = false;
    {
      // Prepared into the worker's own plan (reserved: no allocation) and
      // posted from it before the lock is let go.
      base::MutexLock lock(&reg_mu_);
      STEPMESH_RETURN_IF_ERROR(BuildLocked(pushes, pulls, scratch_));
      STEPMESH_ASSIGN_OR_RETURN(handle, CommitLocked(scratch_, send_options, enqueue_ns, &staged));
    }
    return Enqueue(handle, send_options, staged);
  }

  absl::Status Wait(RequestHandle handle, absl::Duration timeout) override {
    STEPMESH_ASSIGN_OR_RETURN(Request * r, requests_.Lookup(handle));
    const absl::Time deadline = absl::Now() + timeout;
    if (!AwaitUntil(
            [r] { return r->state.load(std::memory_order_acquire) != RequestState::kPending; },
            deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "request not complete after ", absl::FormatDuration(timeout), " (still pending)"));
    }
    if (kStatsOn && options_.trace.enabled) {
      stats_.stage(Stage::kWake).RecordSpan(r->complete_ns, MonotonicNowNs());
    }
    absl::Status result;
    STEPMESH_RETURN_IF_ERROR(requests_.Collect(*r, &result));
    stats_.Request(result.code());
    base::MutexLock lock(&reg_mu_);
    requests_.Free(handle.index());
    return result;
  }

  absl::StatusOr<bool> Test(RequestHandle handle) override {
    STEPMESH_ASSIGN_OR_RETURN(Request * r, requests_.Lookup(handle));
    return r->state.load(std::memory_order_acquire) == RequestState::kDone;
  }

  absl::Status StreamWaitReply(RequestHandle handle, Stream& stream) override {
    STEPMESH_ASSIGN_OR_RETURN(Request * r, requests_.Lookup(handle));
    return stream.WaitHostFlag(*r->done_flag, handle.generation());
  }

  absl::Status StreamWaitNextPull(Key key, int server, Stream& stream) override {
    base::MutexLock lock(&reg_mu_);  // Unregister must not free the flags meanwhile
    auto it = pull_regs_.find({key, server});
    if (it == pull_regs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("pull key ", key, " from server ", server, " is not registered"));
    }
    return stream.WaitHostFlagNext(*it->second->arrivals, *it->second->cursor);
  }

  absl::StatusOr<TraceRecord> FetchTrace(RequestHandle handle) override {
    if (handle.index() >= requests_.size()) return absl::InvalidArgumentError("invalid handle");
    const Request& r = requests_.at(handle.index());
    const RequestState state = r.state.load(std::memory_order_acquire);
    if (r.generation != handle.generation() ||
        (state != RequestState::kDone && state != RequestState::kReleased)) {
      return absl::FailedPreconditionError("no trace: request pending or its slot was reused");
    }
    TraceRecord record;
    for (int s = 0; s < options_.num_servers; ++s) {  // the capacity
      if (r.addressed[s]) record.servers.push_back({s, r.stamps[s]});
    }
    record.complete_ns = r.complete_ns;
    return record;
  }

 private:
  uint64_t InFlight() override {
    base::MutexLock lock(&reg_mu_);
    return requests_.in_use();
  }

  // --- leaving (Participant::Leave) ---
  absl::Status LeavingError() const {
    return absl::FailedPreconditionError(
        absl::StrCat("worker ", rank_, " is leaving the mesh (Leave): it takes no new requests"));
  }
  // Requests posted and not complete (any thread; reads each slot's state).
  size_t Pending() const {
    size_t n = 0;
    for (uint32_t i = 0; i < requests_.size(); ++i) {
      n += requests_.at(i).state.load(std::memory_order_acquire) == RequestState::kPending;
    }
    return n;
  }
  // No new requests (leaving() is set); every posted one completes first.
  absl::Status Drain(absl::Time deadline) override {
    const absl::Time start = absl::Now();
    if (AwaitUntil([this] { return Pending() == 0; }, deadline)) return absl::OkStatus();
    return absl::DeadlineExceededError(
        absl::StrCat("worker ", rank_, " left with ", Pending(), " request(s) still pending after ",
                     absl::FormatDuration(absl::Now() - start), " (they fail CANCELLED)"));
  }

  // --- registrations and posts ---
  // A slot for a new registration: reused when one is free (its generation
  // already bumped past every plan that named it), else a new one.
  TensorRegistration* NewRegistration() ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_) {
    if (!free_regs_.empty()) {
      TensorRegistration* reg = free_regs_.back();
      free_regs_.pop_back();
      return reg;
    }
    reg_slots_.push_back(std::make_unique<TensorRegistration>());
    return reg_slots_.back().get();
  }
  // The slot of a registration just gone: emptied, and stale to every plan
  // that named it. Not freed: a plan may still hold its address.
  void FreeRegistration(TensorRegistration* reg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_) {
    const uint32_t generation = reg->generation == UINT32_MAX ? 1 : reg->generation + 1;
    *reg = TensorRegistration();
    reg->generation = generation;
    free_regs_.push_back(reg);
  }

  absl::Status BuildLocked(absl::Span<const Push> pushes, absl::Span<const Pull> pulls,
                           PreparedPlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_) {
    return BuildPlan(
        pushes, pulls, options_.num_servers,
        [this](Key key) ABSL_NO_THREAD_SAFETY_ANALYSIS -> TensorRegistration* {
          auto it = push_regs_.find(key);
          return it == push_regs_.end() ? nullptr : it->second;
        },
        [this](Key key, int server) ABSL_NO_THREAD_SAFETY_ANALYSIS -> TensorRegistration* {
          auto it = pull_regs_.find({key, server});
          return it == pull_regs_.end() ? nullptr : it->second;
        },
        plan);
  }

  // Takes a free slot for `plan`: everything checked before any state
  // changes. `staged`: whether a push is staged through host memory.
  absl::StatusOr<RequestHandle> CommitLocked(const PreparedPlan& plan,
                                             const SendOptions& send_options, uint64_t enqueue_ns,
                                             bool* staged) ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_) {
    Request* r = requests_.NextFree();
    if (r == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "all ", requests_.size(), " request slots in flight (max_inflight_requests)"));
    }
    STEPMESH_RETURN_IF_ERROR(CheckPlanPostable(plan));
    FillRequest(plan, *r);
    STEPMESH_ASSIGN_OR_RETURN(const int addressed, CountLiveAddressed(plan, *r));
    for (const PreparedPlan::PushPart& p : plan.pushes) {
      p.reg->in_flight = true;
      *staged |= p.reg->wire.staged;
    }
    for (const PreparedPlan::PullPart& p : plan.pulls) p.reg->in_flight = true;
    r->stage = send_options.stage;
    return requests_.Commit(addressed, enqueue_ns);
  }

  // Hands the request to the send thread, or, when the send thread is idle
  // and there is nothing to wait for (no ready event, no staging copy, a
  // transport whose Send never waits), sends it on this thread: one
  // hand-off fewer per round trip.
  absl::StatusOr<RequestHandle> Enqueue(RequestHandle handle, const SendOptions& send_options,
                                        bool staged) {
    const SendItem item{kSendRequest, handle.index(), handle.generation(), send_options.ready};
    if (!staged && TrySendInline(item)) return handle;
    absl::Status queued = EnqueueSend(item);
    if (!queued.ok()) {
      Fail(handle.index(), queued);
      return queued;
    }
    return handle;
  }

  // How many servers `r` addresses; UNAVAILABLE when one it names is not a
  // member. Pushes to every server (Push::servers empty) skip the servers
  // that are not: the membership current at this post. A flag per server,
  // no lookup; the masking runs only while some rank is not a member.
  absl::StatusOr<int> CountLiveAddressed(const PreparedPlan& plan, Request& r) const {
    int addressed = 0;
    const int num_servers = options_.num_servers;
    for (int s = 0; s < num_servers; ++s) {
      if (!r.addressed[s]) continue;
      if (lost_.lost(s)) {
        if (plan.named[s]) return GoneError(s);
        r.addressed[s] = 0;
        for (int i = 0; i < r.num_pushes; ++i) r.targets[i * num_servers + s] = 0;
        continue;
      }
      ++addressed;
    }
    if (addressed == 0) {
      return absl::UnavailableError(
          "no server is a member of the mesh now (every one left or was lost)");
    }
    return addressed;
  }
  absl::Status GoneError(int s) const {
    return absl::UnavailableError(absl::StrCat(
        "server ", s,
        draining_[s].load(std::memory_order_relaxed) ? " left the mesh (it drains)" : " is gone",
        " (membership epoch ", membership_.epoch(), ")"));
  }

  // --- send thread ---
  void ExecuteSend(const SendItem& item, const absl::Status& ready) override {
    if (item.kind == kSendFence) return SendFence(static_cast<int>(item.index));
    Request& r = requests_.at(item.index);
    absl::Status failed =
        ready.ok()
            ? absl::OkStatus()
            : absl::Status(ready.code(), absl::StrCat("ready event failed: ", ready.message()));
    for (int i = 0; i < r.num_pushes && failed.ok(); ++i) {
      const PlannedPush& p = r.pushes[i];
      failed = io_.StageOut(p.reg->wire, p.reg->view.data, 0, p.bytes);
    }
    // Worker w starts with server w (a rotation; see ReplyPath::SendReplies).
    const int num_servers = options_.num_servers;
    for (int i = 0; i < num_servers; ++i) {
      const int s = (i + rank_) % num_servers;
      if (!r.addressed[s]) continue;
      if (!failed.ok()) {
        Settle(r, s, failed);
      } else if (lost_.lost(s) && !(draining_[s].load() && !fence_sent_[s])) {
        // Gone; or draining with its fence already sent (a post that raced
        // the drain notice): it takes nothing after the fence.
        Settle(r, s, GoneError(s));
      } else {
        SendPushes(r, RequestId(item.index, item.generation), s);
      }
    }
    Release(r);  // the send thread's reference
  }

  // Send thread (or inline, under the send lock): the fence after the last
  // push to draining server `s`; every item queued before it went first.
  void SendFence(int s) {
    fence_sent_[s] = 1;
    FrameHeader h;
    h.type = FrameType::kError;
    h.src = self_;
    h.dst = PeerId(s);
    h.key = kFenceKey;
    h.status_code = static_cast<uint32_t>(absl::StatusCode::kCancelled);
    h.payload_bytes = 0;
    if (absl::Status sent = transport_->Send(h.dst, h, nullptr, 0, 0); !sent.ok()) {
      // Its connection is gone already (a server that simply shut down).
      STEPMESH_LOG(kInfo, "worker ", rank_, ": no fence to departing server ", s, ": ",
                   sent.message());
    }
  }

  // Every push of `r` addressed to server `s`, as one multi-part request.
  void SendPushes(Request& r, uint64_t request_id, int s) {
    const int num_servers = options_.num_servers;
    uint16_t parts = 0;
    for (int i = 0; i < r.num_pushes; ++i) parts += r.targets[i * num_servers + s];
    FrameHeader h;
    h.type = FrameType::kPush;
    h.src = self_;
    h.dst = PeerId(s);
    h.request_id = request_id;
    h.part_count = parts;
    if (r.pull_key[s] != kNoPull) {
      h.flags = kFlagHasPull;
      h.pull_key = r.pull_key[s];
    }
    if (r.stage.has_value()) {
      h.flags |= kFlagStage;
      h.status_code = *r.stage;
    }
    h.stamps.enqueue_ns = r.enqueue_ns;
    h.stamps.post_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    r.stamps[s].enqueue_ns = r.enqueue_ns;
    r.stamps[s].post_ns = h.stamps.post_ns;
    uint16_t part = 0;
    for (int i = 0; i < r.num_pushes; ++i) {
      if (!r.targets[i * num_servers + s]) continue;
      const PlannedPush& p = r.pushes[i];
      h.key = p.key;
      h.dtype = p.dtype;
      h.payload_bytes = p.bytes;
      h.part_index = part++;
      io_.Seal(h, p.reg->wire, p.data);
      absl::Status sent = transport_->Send(h.dst, h, p.data, p.region, p.bytes);
      if (!sent.ok()) {
        Settle(
            r, s,
            absl::Status(sent.code(), absl::StrCat("sending to server ", s, ": ", sent.message())));
        return;
      }
      stats_.Sent(s, p.bytes);
    }
  }

  // --- receive thread ---
  // Validates a reply once: its sender, its request, and where it lands. The
  // request travels to OnFrame as the frame's context.
  absl::Status Resolve(NodeId peer, const FrameHeader& h, Destination& out,
                       FrameContext* context) override {
    if (h.type != FrameType::kReply) {
      return absl::InvalidArgumentError(
          absl::StrCat("a worker receives replies, not frame type ", static_cast<int>(h.type)));
    }
    STEPMESH_ASSIGN_OR_RETURN(Request * r, AwaitingReply(peer, h));
    *context = r;
    const int s = static_cast<int>(NodeRank(peer));
    if (r->pull_key[s] == kNoPull) {
      if (h.payload_bytes != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("server ", s, " replied with data to a push-only request"));
      }
      return absl::OkStatus();
    }
    if (h.key != r->pull_key[s]) {
      return absl::InvalidArgumentError(absl::StrCat("server ", s, " replied under key ", h.key,
                                                     ", the request pulls key ", r->pull_key[s]));
    }
    const TensorRegistration& reg = *r->pull_reg[s];
    if (h.dtype != reg.view.dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("reply dtype ", DTypeName(h.dtype), " under key ", h.key,
                       " but the pull tensor is ", DTypeName(reg.view.dtype)));
    }
    if (h.payload_bytes > reg.view.bytes()) {
      return absl::OutOfRangeError(absl::StrCat("reply of ", h.payload_bytes, " bytes under key ",
                                                h.key, " exceeds the pull tensor's ",
                                                reg.view.bytes()));
    }
    out = Destination{reg.wire.wire, reg.view.bytes(), reg.wire.region};
    return absl::OkStatus();
  }

  void OnFrame(NodeId peer, const FrameHeader& h, FrameContext context,
               absl::Status status) override {
    MarkActivity();
    Request* r = static_cast<Request*>(context);
    const int s = static_cast<int>(NodeRank(peer));
    if (IsServer(peer)) stats_.Received(s, h.payload_bytes);
    if (h.type == FrameType::kError) {
      // Error frames carry no payload and are not resolved: validated here, once.
      absl::StatusOr<Request*> pending = AwaitingReply(peer, h);
      if (!pending.ok()) {
        STEPMESH_LOG(kWarning, "dropped a frame from server ", s, ": ", pending.status().ToString(),
                     " (frame status: ", status.ToString(), ")");
        return;
      }
      r = *pending;
    } else if (h.type != FrameType::kReply) {
      // Nothing was claimed for it; a server has no request to fail, so the
      // log is the answer.
      STEPMESH_LOG_LIMITED(violations_, kWarning, "worker ", rank_, ": dropped a frame from ",
                           PeerName(peer), ": ", status.message());
      return;
    } else if (r == nullptr) {  // Resolve found no request awaiting it: `status` says why
      STEPMESH_LOG(kWarning, "dropped a frame from server ", s, ": ", status.ToString());
      return;
    } else if (!requests_.IsCurrent(*r, h.request_id)) {
      // Failed (the server was lost) and reused while the payload was landing.
      STEPMESH_LOG(kWarning, "dropped a frame from server ", s,
                   ": its request finished while it arrived (frame status: ", status.ToString(),
                   ")");
      return;
    }
    if (h.type == FrameType::kReply && status.ok() && r->pull_key[s] != kNoPull) {
      const TensorRegistration& reg = *r->pull_reg[s];
      status = io_.Check(h, reg.wire, reg.wire.wire);
      if (status.ok()) status = io_.StageIn(reg.wire, reg.view.data, 0, h.payload_bytes);
    }
    if (h.type == FrameType::kReply && status.ok()) {
      TraceStamps& t = r->stamps[s];
      t.server_arrival_ns = h.stamps.server_arrival_ns;
      t.server_handler_ns = h.stamps.server_handler_ns;
      t.server_reply_ns = h.stamps.server_reply_ns;
      t.server_respond_ns = t.server_reply_ns != 0 ? t.server_reply_ns - h.status_code : 0;
      t.reply_arrival_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
      RecordStages(t);
    }
    if (!status.ok()) {
      status = absl::Status(status.code(), absl::StrCat("server ", s, ": ", status.message()));
    }
    Settle(*r, s, status);
  }

  // The pending request a frame from `peer` answers.
  absl::StatusOr<Request*> AwaitingReply(NodeId peer, const FrameHeader& h) const {
    const uint32_t s = NodeRank(peer);
    if (!IsServer(peer) || s >= static_cast<uint32_t>(options_.num_servers)) {
      return absl::PermissionDeniedError("frame from a node that is not a server");
    }
    return requests_.PendingFor(h.request_id, static_cast<int>(s));
  }

  // --- peer events (receive or rendezvous thread) ---
  void HandlePeerLost(NodeId peer, const absl::Status& why) override {
    if (!IsServer(peer)) return;
    const int s = static_cast<int>(NodeRank(peer));
    if (s >= options_.num_servers) return;
    // A draining server was counted out already (HandlePeerLeft); its
    // connection ending now fails what it did not answer.
    const bool newly = lost_.MarkLost(s);
    if (!newly && !draining_[s].exchange(false)) return;
    if (newly) stats_.Lost(s);
    const absl::Status failure = absl::UnavailableError(PeerLossMessage(peer, why.message()));
    std::vector<RequestHandle> pending;
    {
      base::MutexLock lock(&reg_mu_);
      pending = requests_.PendingAddressing(s);
    }
    // A server that said goodbye with nothing of ours pending left in order:
    // info. Anything else is a loss the operator should see.
    const bool orderly = absl::IsCancelled(why) && pending.empty();
    if (orderly) {
      STEPMESH_LOG(kInfo, "worker ", rank_, ": ", PeerName(peer), " left (orderly shutdown)");
    } else if (!pending.empty() || !stopped()) {
      STEPMESH_LOG(kWarning, "worker ", rank_, ": ", failure.message(), " (", pending.size(),
                   " request(s) pending)");
    }
    for (RequestHandle handle : pending) {
      Request& r = requests_.at(handle.index());
      if (r.generation == handle.generation() && r.state.load() == RequestState::kPending) {
        Settle(r, s, failure);
      }
    }
  }

  // Server `peer` left in order or began to drain (the scheduler's notice):
  // new posts to it fail at once; what was posted before goes out, then a
  // fence telling it nothing more comes; requests it holds complete with its
  // replies (or fail when its connection ends first).
  void HandlePeerLeft(NodeId peer) override {
    if (!IsServer(peer) || stopped()) return;
    const int s = static_cast<int>(NodeRank(peer));
    if (s >= options_.num_servers || lost_.lost(s)) return;
    {
      std::lock_guard<std::mutex> lock(send_lock());
      fence_sent_[s] = 0;
    }
    draining_[s].store(true);
    if (lost_.MarkLost(s)) stats_.Lost(s);
    STEPMESH_LOG(kInfo, "worker ", rank_, ": server ", s, " left the mesh (epoch ",
                 membership_.epoch() + 1, "); requests it holds complete first");
    SendItem fence{kSendFence, static_cast<uint32_t>(s), 0, nullptr};
    fence.ordered = true;
    if (absl::Status queued = EnqueueSend(fence); !queued.ok()) {
      STEPMESH_LOG(kWarning, "worker ", rank_, ": cannot queue the fence to server ", s, ": ",
                   queued.ToString());
    }
  }

  // A restarted server rejoined: dial it again and let requests address it.
  // Requests that were in flight when it was lost already failed (UNAVAILABLE);
  // the new process starts empty, so its registrations are the app's to redo.
  void HandlePeerJoined(NodeId peer, const std::string& endpoint) override {
    if (!IsServer(peer) || stopped()) return;
    const int s = static_cast<int>(NodeRank(peer));
    if (s >= options_.num_servers) return;
    // A server that never looked lost to this worker (its connection is still
    // open) is still superseded: the old connection belongs to a dead process.
    HandlePeerLost(peer, absl::UnavailableError("server restarted"));
    absl::Status connected =
        transport_->Connect(self_, {PeerInfo{peer, endpoint}}, absl::Now() + options_.timeout);
    if (!connected.ok()) {
      STEPMESH_LOG(kWarning, "worker ", rank_, ": cannot reconnect to rejoined server ", s, ": ",
                   connected.ToString());
      return;
    }
    draining_[s].store(false);
    lost_.MarkBack(s);
    stats_.Rejoined(s);
    STEPMESH_LOG(kInfo, "worker ", rank_, ": server ", s, " rejoined at ", endpoint);
  }

  void CancelAll(const absl::Status& why) override {
    // Threads are stopped: nothing else touches the requests now.
    for (uint32_t i = 0; i < requests_.size(); ++i) {
      Request& r = requests_.at(i);
      if (r.state.load() != RequestState::kPending) continue;
      requests_.FailIfOk(r, why);
      Complete(r);
    }
    // No reply comes any more: streams waiting on the GPU timeline must not
    // wait forever.
    base::MutexLock lock(&reg_mu_);
    for (auto& [id, reg] : pull_regs_) reg->arrivals->ReleaseWaiters();
  }

  // --- request life ---
  void Settle(Request& r, int server, const absl::Status& status) {
    bool first = false;
    const bool last = requests_.Settle(r, server, status, &first);
    if (first) stats_.Outcome(server, status.code());
    if (last) Complete(r);
  }

  // The worker-side stages of one server's reply (each a difference of two
  // stamps of one host; see Stage).
  void RecordStages(const TraceStamps& t) {
    stats_.stage(Stage::kSubmit).RecordSpan(t.enqueue_ns, t.post_ns);
    const uint64_t server_ns = t.server_reply_ns - t.server_arrival_ns;
    if (t.post_ns != 0 && t.server_arrival_ns != 0 && t.server_reply_ns >= t.server_arrival_ns &&
        t.reply_arrival_ns >= t.post_ns + server_ns) {
      stats_.stage(Stage::kNetwork).Record(t.reply_arrival_ns - t.post_ns - server_ns);
    }
  }
  void Release(Request& r) {
    if (requests_.Release(r)) Complete(r);
  }

  // Frees the request's tensors for new requests, then reports it done.
  void Complete(Request& r) {
    {
      base::MutexLock lock(&reg_mu_);
      for (int i = 0; i < r.num_pushes; ++i) r.pushes[i].reg->in_flight = false;
      for (int s = 0; s < options_.num_servers; ++s) {
        if (r.pull_key[s] != kNoPull) r.pull_reg[s]->in_flight = false;
      }
    }
    const uint64_t complete_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    stats_.stage(Stage::kTotal).RecordSpan(r.enqueue_ns, complete_ns);
    if (trace_ring_.on()) RecordTrace(r, complete_ns);
    requests_.MarkDone(r, complete_ns);
    NotifyWaiters();
  }

  // Before MarkDone: the slot (and its stamps) is the application's to reuse after.
  void RecordTrace(const Request& r, uint64_t complete_ns) {
    using W = WorkerTraceWords;
    trace_ring_.Record([&](const TraceRing::Writer& out) {
      out.Put(W::kRequestId, RequestId(r.index, r.generation.load(std::memory_order_relaxed)));
      out.Put(W::kEnqueue, r.enqueue_ns);
      out.Put(W::kComplete, complete_ns);
      for (int s = 0; s < options_.num_servers; ++s) {
        const size_t at = W::kFirstServer + W::kPerServer * s;
        out.Put(at + W::kPost, r.stamps[s].post_ns);
        out.Put(at + W::kReplyArrival, r.stamps[s].reply_arrival_ns);
        out.Put(at + W::kAddressed, r.addressed[s]);
      }
    });
  }

  // A request that could not even be queued: undone as if it never happened.
  void Fail(uint32_t index, const absl::Status& why) {
    Request& r = requests_.at(index);
    requests_.FailIfOk(r, why);
    Complete(r);
    absl::Status ignored;
    (void)requests_.Collect(r, &ignored);
    base::MutexLock lock(&reg_mu_);
    requests_.Free(index);
  }

  base::Mutex reg_mu_;  // the registrations, their in_flight flags, the free request slots
  // Registration slots: never freed while the worker lives (prepared
  // requests hold their addresses), reused through free_regs_.
  std::vector<std::unique_ptr<TensorRegistration>> reg_slots_ ABSL_GUARDED_BY(reg_mu_);
  std::vector<TensorRegistration*> free_regs_ ABSL_GUARDED_BY(reg_mu_);
  absl::flat_hash_map<Key, TensorRegistration*> push_regs_ ABSL_GUARDED_BY(reg_mu_);
  absl::flat_hash_map<std::pair<Key, int>, TensorRegistration*> pull_regs_ ABSL_GUARDED_BY(reg_mu_);
  PreparedPlan scratch_ ABSL_GUARDED_BY(reg_mu_);  // PushPull's
  RequestTable requests_;
  // Per server: it left by draining (set by the rendezvous thread): new posts
  // to it fail, the ones queued before go out ahead of its fence.
  std::unique_ptr<std::atomic<bool>[]> draining_;
  // Per server: the fence went (send lock held: send thread or inline send).
  std::vector<uint8_t> fence_sent_;
  base::RateLimiter violations_{10, absl::Seconds(10)};
};

}  // namespace

absl::StatusOr<std::unique_ptr<AFTensorWorker>> CreateWorker(const MeshOptions& options,
                                                             std::shared_ptr<Backend> backend,
                                                             const TransportFactory& transport,
                                                             RendezvousFactory rendezvous) {
  STEPMESH_ASSIGN_OR_RETURN(MeshOptions worker_options, OptionsForRole(options, Role::kWorker));
  if (backend == nullptr) return absl::InvalidArgumentError("CreateWorker: no backend");
  auto worker = std::make_unique<Worker>(worker_options, std::move(backend));
  worker->SetRendezvousFactory(std::move(rendezvous));
  STEPMESH_RETURN_IF_ERROR(worker->Init(transport));
  return worker;
}

}  // namespace stepmesh::core
