// WorkerLogic's request path: registrations, prepared requests and their
// posts, waiting for and collecting a request (src/core/worker_logic.h).

#include <atomic>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "src/base/logging.h"
#include "src/core/chrome_trace.h"
#include "src/core/mesh.h"
#include "src/core/worker_logic.h"
#include "stepmesh/status.h"

namespace stepmesh::core {

WorkerLogic::WorkerLogic(MeshNode& node)
    : node_(node),
      options_(node.options()),
      io_(node.io()),
      lost_(node.lost()),
      membership_(node.membership()),
      stats_(node.stats()),
      trace_ring_(node.trace_ring()),
      // Generations start at a random point per process: a reply addressed to
      // a previous process under this rank (a server answering a batch from
      // before a restart) then matches no request of this one.
      requests_(options_.max_inflight_requests, options_.num_servers, std::random_device{}() | 1),
      draining_(new std::atomic<bool>[options_.num_servers]),
      fence_sent_(options_.num_servers, 0) {
  ReservePlan(scratch_, options_.num_servers);
  scratch_.owner = this;
  for (int s = 0; s < options_.num_servers; ++s) draining_[s].store(false);
}

absl::Status WorkerLogic::Init() { return requests_.CreateDoneFlags(node_.backend()); }

int WorkerLogic::num_servers() const { return options_.num_servers; }

absl::Status WorkerLogic::RegisterPushTensor(Key key, TensorView tensor) {
  base::MutexLock lock(&reg_mu_);
  STEPMESH_RETURN_IF_ERROR(node_.CheckRegistrationLimit(push_regs_.size() + pull_regs_.size()));
  if (push_regs_.contains(key)) {
    return absl::AlreadyExistsError(absl::StrCat("push key ", key, " already registered"));
  }
  absl::StatusOr<WireTensor> wire = node_.RegisterTensor(key, tensor, 1, {});
  if (!wire.ok()) return wire.status();
  TensorRegistration* reg = NewRegistration();
  reg->view = tensor;
  reg->wire = *wire;
  push_regs_[key] = reg;
  return absl::OkStatus();
}

absl::Status WorkerLogic::RegisterPullTensor(Key key, int server, TensorView tensor) {
  if (server < 0 || server >= options_.num_servers) {
    return absl::InvalidArgumentError(
        absl::StrCat("server ", server, " out of range [0, ", options_.num_servers, ")"));
  }
  base::MutexLock lock(&reg_mu_);
  STEPMESH_RETURN_IF_ERROR(node_.CheckRegistrationLimit(push_regs_.size() + pull_regs_.size()));
  if (pull_regs_.contains({key, server})) {
    return absl::AlreadyExistsError(
        absl::StrCat("pull key ", key, " from server ", server, " already registered"));
  }
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<HostFlag> arrivals, node_.backend().CreateHostFlag());
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<HostFlag> cursor, node_.backend().CreateHostFlag());
  STEPMESH_ASSIGN_OR_RETURN(const WireTensor wire,
                            node_.RegisterTensor(key, tensor, 1, {node_.PeerId(server)}));
  TensorRegistration* reg = NewRegistration();
  reg->view = tensor;
  reg->wire = wire;
  reg->arrivals = std::move(arrivals);
  reg->cursor = std::move(cursor);
  pull_regs_[{key, server}] = reg;
  return absl::OkStatus();
}

absl::Status WorkerLogic::Unregister(Key key) {
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
    STEPMESH_RETURN_IF_ERROR(node_.UnregisterTensor(reg->wire.region, reg->view.data, key));
    push_regs_.erase(push);
    FreeRegistration(reg);
  }
  for (const auto& id : pulls) {
    TensorRegistration* reg = pull_regs_[id];
    STEPMESH_RETURN_IF_ERROR(node_.UnregisterTensor(reg->wire.region, reg->view.data, key));
    pull_regs_.erase(id);
    FreeRegistration(reg);
  }
  return absl::OkStatus();
}

absl::StatusOr<PreparedRequest> WorkerLogic::Prepare(absl::Span<const Push> pushes,
                                                     absl::Span<const Pull> pulls) {
  if (node_.stopped()) return absl::FailedPreconditionError("worker is shut down");
  auto plan = std::make_unique<PreparedPlan>();
  plan->owner = this;
  base::MutexLock lock(&reg_mu_);
  STEPMESH_RETURN_IF_ERROR(BuildLocked(pushes, pulls, *plan));
  return PreparedPlan::Wrap(std::move(plan));
}

absl::StatusOr<RequestHandle> WorkerLogic::Post(const PreparedRequest& prepared,
                                                const SendOptions& send_options) {
  const uint64_t enqueue_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
  const PreparedPlan* plan = PreparedPlan::Of(prepared);
  if (plan == nullptr) return absl::InvalidArgumentError("an empty PreparedRequest");
  if (plan->owner != this) {
    return absl::InvalidArgumentError("a PreparedRequest of another worker");
  }
  if (node_.stopped()) return absl::FailedPreconditionError("worker is shut down");
  if (node_.leaving()) return LeavingError();
  RequestHandle handle;
  bool staged = false;
  {
    base::MutexLock lock(&reg_mu_);
    STEPMESH_ASSIGN_OR_RETURN(handle, CommitLocked(*plan, send_options, enqueue_ns, &staged));
  }
  return Enqueue(handle, send_options, staged);
}

absl::StatusOr<RequestHandle> WorkerLogic::PushPull(absl::Span<const Push> pushes,
                                                    absl::Span<const Pull> pulls,
                                                    const SendOptions& send_options) {
  const uint64_t enqueue_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
  if (node_.stopped()) return absl::FailedPreconditionError("worker is shut down");
  if (node_.leaving()) return LeavingError();
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

absl::Status WorkerLogic::Wait(RequestHandle handle, absl::Duration timeout) {
  STEPMESH_ASSIGN_OR_RETURN(Request * r, requests_.Lookup(handle));
  const absl::Time deadline = absl::Now() + timeout;
  if (!node_.AwaitDriving(
          [r] { return r->state.load(std::memory_order_acquire) != RequestState::kPending; },
          deadline, [this] { return requests_.pending() > 0; })) {
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

absl::StatusOr<bool> WorkerLogic::Test(RequestHandle handle) {
  STEPMESH_ASSIGN_OR_RETURN(Request * r, requests_.Lookup(handle));
  node_.ResumeReceiver();  // a caller that polls with Test reads nothing itself
  return r->state.load(std::memory_order_acquire) == RequestState::kDone;
}

absl::Status WorkerLogic::StreamWaitReply(RequestHandle handle, Stream& stream) {
  STEPMESH_ASSIGN_OR_RETURN(Request * r, requests_.Lookup(handle));
  node_.ResumeReceiver();  // the device waits: the receive thread delivers
  return stream.WaitHostFlag(*r->done_flag, handle.generation());
}

absl::Status WorkerLogic::StreamWaitNextPull(Key key, int server, Stream& stream) {
  node_.ResumeReceiver();
  base::MutexLock lock(&reg_mu_);  // Unregister must not free the flags meanwhile
  auto it = pull_regs_.find({key, server});
  if (it == pull_regs_.end()) {
    return absl::NotFoundError(
        absl::StrCat("pull key ", key, " from server ", server, " is not registered"));
  }
  return stream.WaitHostFlagNext(*it->second->arrivals, *it->second->cursor);
}

absl::StatusOr<TraceRecord> WorkerLogic::FetchTrace(RequestHandle handle) {
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

uint64_t WorkerLogic::InFlight() {
  base::MutexLock lock(&reg_mu_);
  return requests_.in_use();
}

TensorRegistration* WorkerLogic::NewRegistration() {
  if (!free_regs_.empty()) {
    TensorRegistration* reg = free_regs_.back();
    free_regs_.pop_back();
    return reg;
  }
  reg_slots_.push_back(std::make_unique<TensorRegistration>());
  return reg_slots_.back().get();
}

void WorkerLogic::FreeRegistration(TensorRegistration* reg) {
  const uint32_t generation = reg->generation == UINT32_MAX ? 1 : reg->generation + 1;
  *reg = TensorRegistration();
  reg->generation = generation;
  free_regs_.push_back(reg);
}

absl::Status WorkerLogic::BuildLocked(absl::Span<const Push> pushes, absl::Span<const Pull> pulls,
                                      PreparedPlan& plan) {
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

absl::StatusOr<RequestHandle> WorkerLogic::CommitLocked(const PreparedPlan& plan,
                                                        const SendOptions& send_options,
                                                        uint64_t enqueue_ns, bool* staged) {
  Request* r = requests_.NextFree();
  if (r == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("all ", requests_.size(), " request slots in flight (max_inflight_requests)"));
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

absl::StatusOr<RequestHandle> WorkerLogic::Enqueue(RequestHandle handle,
                                                   const SendOptions& send_options, bool staged) {
  const SendItem item{SendKind::kRequest, handle.index(), handle.generation(), send_options.ready};
  if (!staged && node_.TrySendInline(item)) return handle;
  absl::Status queued = node_.EnqueueSend(item);
  if (!queued.ok()) {
    Fail(handle.index(), queued);
    return queued;
  }
  return handle;
}

absl::StatusOr<int> WorkerLogic::CountLiveAddressed(const PreparedPlan& plan, Request& r) const {
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

absl::Status WorkerLogic::GoneError(int s) const {
  return absl::UnavailableError(absl::StrCat(
      "server ", s,
      draining_[s].load(std::memory_order_relaxed) ? " left the mesh (it drains)" : " is gone",
      " (membership epoch ", membership_.epoch(), ")"));
}

void WorkerLogic::Fail(uint32_t index, const absl::Status& why) {
  Request& r = requests_.at(index);
  requests_.FailIfOk(r, why);
  Complete(r);
  absl::Status ignored;
  (void)requests_.Collect(r, &ignored);
  base::MutexLock lock(&reg_mu_);
  requests_.Free(index);
}

}  // namespace stepmesh::core
