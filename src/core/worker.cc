// AFTensorWorker: request slots, validation, and the worker's send/receive paths.

#include <array>
#include <memory>
#include <random>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "src/core/logging.h"
#include "src/core/mesh.h"
#include "src/core/mesh_node.h"
#include "stepmesh/status.h"
#include "stepmesh/worker.h"

namespace stepmesh::core {
namespace {

constexpr int kMaxPushesPerRequest = 16;
constexpr uint32_t kSendRequest = 1;
constexpr Key kNoPull = ~Key{0};

struct Registration {
  TensorView view;
  WireTensor wire;
  bool in_flight = false;  // guarded by the worker's reg_mu_
  // Pull registrations: replies settled so far, and the device-side cursor of
  // StreamWaitNextPull. `arrived` changes once per request that pulls here,
  // and one such request is in flight at a time.
  std::unique_ptr<HostFlag> arrivals;
  std::unique_ptr<HostFlag> cursor;
  uint32_t arrived = 0;
};

enum class RequestState : uint8_t { kFree, kPending, kDone, kReleased };

struct PlannedPush {
  Key key = 0;
  const std::byte* data = nullptr;
  size_t bytes = 0;
  DType dtype = DType::kUInt8;
  RegionId region = 0;
  Registration* reg = nullptr;
};

// One PushPull in flight. Sized once at Create so requests never allocate.
struct Request {
  explicit Request(int num_servers)
      : targets(kMaxPushesPerRequest * num_servers, 0),
        pull_key(num_servers, kNoPull),
        pull_reg(num_servers, nullptr),
        addressed(num_servers, 0),
        settled(new std::atomic<bool>[num_servers]),
        stamps(num_servers) {}

  uint32_t index = 0;  // of its slot
  // Read by the receive thread to reject stale frames while a new request fills the slot.
  std::atomic<uint32_t> generation{0};
  std::atomic<RequestState> state{RequestState::kFree};
  int num_pushes = 0;
  std::array<PlannedPush, kMaxPushesPerRequest> pushes;
  std::vector<uint8_t> targets;  // [push][server]: push goes to server
  std::vector<Key> pull_key;     // per server
  std::vector<Registration*> pull_reg;
  std::vector<uint8_t> addressed;
  std::unique_ptr<std::atomic<bool>[]> settled;
  std::atomic<int> outstanding{0};  // unsettled servers + the send thread's reference
  std::vector<TraceStamps> stamps;
  uint64_t enqueue_ns = 0;
  uint64_t complete_ns = 0;
  ::stepmesh::core::Mutex status_mu;
  absl::Status status ABSL_GUARDED_BY(status_mu);
};

uint64_t RequestId(uint32_t index, uint32_t generation) {
  return (uint64_t{index} << 32) | generation;
}

class Worker final : public AFTensorWorker, public MeshNode {
 public:
  Worker(const MeshOptions& options, std::shared_ptr<Backend> backend)
      : MeshNode(options, std::move(backend)),
        lost_servers_(new std::atomic<bool>[options.num_servers]) {
    for (int s = 0; s < options.num_servers; ++s) lost_servers_[s] = false;
    requests_.reserve(options.max_inflight_requests);
    // Generations start at a random point per process: a reply addressed to a
    // previous process under this rank (a server answering a batch from before
    // a restart) then matches no request of this one.
    const uint32_t first_generation = std::random_device{}() | 1;
    for (int i = 0; i < options.max_inflight_requests; ++i) {
      requests_.push_back(std::make_unique<Request>(options.num_servers));
      requests_.back()->index = static_cast<uint32_t>(i);
      requests_.back()->generation.store(first_generation, std::memory_order_relaxed);
      free_.push_back(options.max_inflight_requests - 1 - i);
    }
  }
  ~Worker() override { Stop(); }

  absl::Status Init(const TransportFactory& factory) {
    // A flag per request slot holds the generation of the slot's latest
    // finished request (StreamWaitReply). Made now: making one later pins
    // memory, which waits for the whole device.
    for (const auto& r : requests_) {
      STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<HostFlag> flag, backend_->CreateHostFlag());
      flag->Store(r->generation.load(std::memory_order_relaxed));
      done_flags_.push_back(std::move(flag));
    }
    return Start(factory);
  }

  int rank() const override { return rank_; }
  int num_servers() const override { return options_.num_servers; }
  Backend& backend() override { return *backend_; }

  absl::Status RegisterPushTensor(Key key, TensorView tensor) override {
    ::stepmesh::core::MutexLock lock(&reg_mu_);
    STEPMESH_RETURN_IF_ERROR(CheckCapacity());
    if (push_regs_.contains(key)) {
      return absl::AlreadyExistsError(absl::StrCat("push key ", key, " already registered"));
    }
    STEPMESH_ASSIGN_OR_RETURN(WireTensor wire, RegisterTensor(key, tensor, 1, {}));
    push_regs_[key] = std::make_unique<Registration>(Registration{tensor, wire, false});
    return absl::OkStatus();
  }

  absl::Status RegisterPullTensor(Key key, int server, TensorView tensor) override {
    if (server < 0 || server >= options_.num_servers) {
      return absl::InvalidArgumentError(absl::StrCat("server ", server, " out of range [0, ",
                                                     options_.num_servers, ")"));
    }
    ::stepmesh::core::MutexLock lock(&reg_mu_);
    STEPMESH_RETURN_IF_ERROR(CheckCapacity());
    if (pull_regs_.contains({key, server})) {
      return absl::AlreadyExistsError(
          absl::StrCat("pull key ", key, " from server ", server, " already registered"));
    }
    auto reg = std::make_unique<Registration>(Registration{tensor, {}, false});
    STEPMESH_ASSIGN_OR_RETURN(reg->arrivals, backend_->CreateHostFlag());
    STEPMESH_ASSIGN_OR_RETURN(reg->cursor, backend_->CreateHostFlag());
    STEPMESH_ASSIGN_OR_RETURN(reg->wire, RegisterTensor(key, tensor, 1, {PeerId(server)}));
    pull_regs_[{key, server}] = std::move(reg);
    return absl::OkStatus();
  }

  absl::Status Unregister(Key key) override {
    ::stepmesh::core::MutexLock lock(&reg_mu_);
    std::vector<std::pair<Key, int>> pulls;
    for (const auto& [id, reg] : pull_regs_) {
      if (id.first != key) continue;
      if (reg->in_flight) return absl::FailedPreconditionError(absl::StrCat("key ", key, " is in flight"));
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
      STEPMESH_RETURN_IF_ERROR(
          UnregisterTensor(push->second->wire.region, push->second->view.data, key));
      push_regs_.erase(push);
    }
    for (const auto& id : pulls) {
      const Registration& reg = *pull_regs_[id];
      STEPMESH_RETURN_IF_ERROR(UnregisterTensor(reg.wire.region, reg.view.data, key));
      pull_regs_.erase(id);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<RequestHandle> PushPull(absl::Span<const Push> pushes,
                                         absl::Span<const Pull> pulls,
                                         const SendOptions& send_options) override {
    const uint64_t enqueue_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    if (stopped()) return absl::FailedPreconditionError("worker is shut down");
    if (pushes.empty()) return absl::InvalidArgumentError("a request needs at least one push");
    if (pushes.size() > kMaxPushesPerRequest) {
      return absl::InvalidArgumentError(
          absl::StrCat(pushes.size(), " pushes; at most ", kMaxPushesPerRequest, " per request"));
    }
    const int num_servers = options_.num_servers;
    uint32_t index;
    Request* r;
    {
      ::stepmesh::core::MutexLock lock(&reg_mu_);
      if (free_.empty()) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "all ", requests_.size(), " request slots in flight (max_inflight_requests)"));
      }
      r = requests_[free_.back()].get();
      // Validate everything before touching any state.
      std::fill(r->targets.begin(), r->targets.end(), 0);
      std::fill(r->addressed.begin(), r->addressed.end(), 0);
      std::fill(r->pull_key.begin(), r->pull_key.end(), kNoPull);
      for (size_t i = 0; i < pushes.size(); ++i) {
        const Push& push = pushes[i];
        auto it = push_regs_.find(push.key);
        if (it == push_regs_.end()) {
          return absl::NotFoundError(absl::StrCat("push key ", push.key, " is not registered"));
        }
        Registration& reg = *it->second;
        const size_t registered = reg.view.bytes();
        const size_t bytes = push.bytes == kWholeTensor ? registered : push.bytes;
        if (bytes > registered) {
          return absl::OutOfRangeError(absl::StrCat("push of ", bytes, " bytes under key ",
                                                    push.key, " exceeds the registered ",
                                                    registered));
        }
        if (reg.in_flight) {
          return absl::FailedPreconditionError(
              absl::StrCat("push key ", push.key, " is still in flight in another request"));
        }
        for (size_t j = 0; j < i; ++j) {
          if (pushes[j].key == push.key) {
            return absl::InvalidArgumentError(absl::StrCat("push key ", push.key, " repeated"));
          }
        }
        if (push.servers.empty()) {
          for (int s = 0; s < num_servers; ++s) r->targets[i * num_servers + s] = 1;
        }
        for (int s : push.servers) {
          if (s < 0 || s >= num_servers) {
            return absl::InvalidArgumentError(absl::StrCat("push to unknown server ", s));
          }
          r->targets[i * num_servers + s] = 1;
        }
        for (int s = 0; s < num_servers; ++s) r->addressed[s] |= r->targets[i * num_servers + s];
        r->pushes[i] = {push.key, reg.wire.wire, bytes, reg.view.dtype, reg.wire.region, &reg};
      }
      for (const Pull& pull : pulls) {
        if (pull.server < 0 || pull.server >= num_servers) {
          return absl::InvalidArgumentError(absl::StrCat("pull from unknown server ", pull.server));
        }
        auto it = pull_regs_.find({pull.key, pull.server});
        if (it == pull_regs_.end()) {
          return absl::NotFoundError(absl::StrCat("pull key ", pull.key, " from server ",
                                                  pull.server, " is not registered"));
        }
        if (it->second->in_flight) {
          return absl::FailedPreconditionError(
              absl::StrCat("pull key ", pull.key, " is still in flight in another request"));
        }
        if (r->pull_key[pull.server] != kNoPull) {
          return absl::InvalidArgumentError(
              absl::StrCat("two pulls from server ", pull.server, " in one request"));
        }
        if (!r->addressed[pull.server]) {
          return absl::InvalidArgumentError(absl::StrCat(
              "pull from server ", pull.server, " without a push to it in the same request"));
        }
        r->pull_key[pull.server] = pull.key;
        r->pull_reg[pull.server] = it->second.get();
      }
      int addressed = 0;
      for (int s = 0; s < num_servers; ++s) {
        if (!r->addressed[s]) continue;
        if (lost_servers_[s].load()) {
          return absl::UnavailableError(absl::StrCat("server ", s, " is gone"));
        }
        ++addressed;
      }
      // Commit.
      index = free_.back();
      free_.pop_back();
      for (size_t i = 0; i < pushes.size(); ++i) r->pushes[i].reg->in_flight = true;
      for (const Pull& pull : pulls) r->pull_reg[pull.server]->in_flight = true;
      r->num_pushes = static_cast<int>(pushes.size());
      const uint32_t previous = r->generation.load(std::memory_order_relaxed);
      r->generation.store(previous == UINT32_MAX ? 1 : previous + 1, std::memory_order_relaxed);
      for (int s = 0; s < num_servers; ++s) {
        r->settled[s].store(!r->addressed[s], std::memory_order_relaxed);
        r->stamps[s] = TraceStamps{};
      }
      r->outstanding.store(addressed + 1, std::memory_order_relaxed);
      r->enqueue_ns = enqueue_ns;
      r->complete_ns = 0;
      {
        ::stepmesh::core::MutexLock status_lock(&r->status_mu);
        r->status = absl::OkStatus();
      }
      r->state.store(RequestState::kPending, std::memory_order_release);
    }
    const uint32_t generation = r->generation.load(std::memory_order_relaxed);
    const RequestHandle handle(index, generation);
    absl::Status queued = EnqueueSend({kSendRequest, index, generation, send_options.ready});
    if (!queued.ok()) {
      Fail(*r, queued);
      return queued;
    }
    return handle;
  }

  absl::Status Wait(RequestHandle handle, absl::Duration timeout) override {
    STEPMESH_ASSIGN_OR_RETURN(Request * r, Lookup(handle));
    const absl::Time deadline = absl::Now() + timeout;
    if (!AwaitUntil([r] { return r->state.load(std::memory_order_acquire) != RequestState::kPending; },
                    deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "request not complete after ", absl::FormatDuration(timeout), " (still pending)"));
    }
    RequestState expected = RequestState::kDone;
    if (!r->state.compare_exchange_strong(expected, RequestState::kReleased)) {
      return absl::FailedPreconditionError("handle already waited on");
    }
    absl::Status result;
    {
      ::stepmesh::core::MutexLock lock(&r->status_mu);
      result = r->status;
    }
    ::stepmesh::core::MutexLock lock(&reg_mu_);
    free_.push_back(handle.index());
    return result;
  }

  absl::StatusOr<bool> Test(RequestHandle handle) override {
    STEPMESH_ASSIGN_OR_RETURN(Request * r, Lookup(handle));
    return r->state.load(std::memory_order_acquire) == RequestState::kDone;
  }

  absl::Status StreamWaitReply(RequestHandle handle, Stream& stream) override {
    STEPMESH_ASSIGN_OR_RETURN(Request * r, Lookup(handle));
    return stream.WaitHostFlag(*done_flags_[r->index], handle.generation());
  }

  absl::Status StreamWaitNextPull(Key key, int server, Stream& stream) override {
    ::stepmesh::core::MutexLock lock(&reg_mu_);  // Unregister must not free the flags meanwhile
    auto it = pull_regs_.find({key, server});
    if (it == pull_regs_.end()) {
      return absl::NotFoundError(
          absl::StrCat("pull key ", key, " from server ", server, " is not registered"));
    }
    return stream.WaitHostFlagNext(*it->second->arrivals, *it->second->cursor);
  }

  absl::StatusOr<TraceRecord> FetchTrace(RequestHandle handle) override {
    if (handle.index() >= requests_.size()) return absl::InvalidArgumentError("invalid handle");
    Request& r = *requests_[handle.index()];
    const RequestState state = r.state.load(std::memory_order_acquire);
    if (r.generation != handle.generation() ||
        (state != RequestState::kDone && state != RequestState::kReleased)) {
      return absl::FailedPreconditionError("no trace: request pending or its slot was reused");
    }
    TraceRecord record;
    for (int s = 0; s < options_.num_servers; ++s) {
      if (r.addressed[s]) record.servers.push_back({s, r.stamps[s]});
    }
    record.complete_ns = r.complete_ns;
    return record;
  }

  absl::Status Barrier() override { return rendezvous_->Barrier(options_.timeout); }

  absl::Status Shutdown() override {
    Stop();
    return absl::OkStatus();
  }

 private:
  // --- send thread ---
  void ExecuteSend(const SendItem& item, const absl::Status& ready) override {
    Request& r = *requests_[item.index];
    const int num_servers = options_.num_servers;
    absl::Status failed =
        ready.ok() ? absl::OkStatus()
                   : absl::Status(ready.code(), absl::StrCat("ready event failed: ", ready.message()));
    for (int i = 0; i < r.num_pushes && failed.ok(); ++i) {
      const PlannedPush& p = r.pushes[i];
      failed = StageOut(p.reg->wire, p.reg->view.data, 0, p.bytes);
    }
    // Worker w starts with server w (a rotation; see the server's ExecuteSend).
    for (int i = 0; i < num_servers; ++i) {
      const int s = (i + rank_) % num_servers;
      if (!r.addressed[s]) continue;
      if (!failed.ok()) {
        Settle(r, s, failed);
        continue;
      }
      if (lost_servers_[s].load(std::memory_order_acquire)) {
        Settle(r, s, absl::UnavailableError(absl::StrCat("server ", s, " is gone")));
        continue;
      }
      uint16_t parts = 0;
      for (int i = 0; i < r.num_pushes; ++i) parts += r.targets[i * num_servers + s];
      FrameHeader h;
      h.type = FrameType::kPush;
      h.src = self_;
      h.dst = PeerId(s);
      h.request_id = RequestId(item.index, item.generation);
      h.part_count = parts;
      if (r.pull_key[s] != kNoPull) {
        h.flags = kFlagHasPull;
        h.pull_key = r.pull_key[s];
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
        SealPayload(h, p.reg->wire, p.data);
        absl::Status sent = transport_->Send(h.dst, h, p.data, p.region, p.bytes);
        if (!sent.ok()) {
          Settle(r, s, absl::Status(sent.code(), absl::StrCat("sending to server ", s, ": ",
                                                              sent.message())));
          break;
        }
      }
    }
    Release(r);  // the send thread's reference
  }

  // --- receive thread ---
  absl::StatusOr<Destination> Resolve(NodeId peer, const FrameHeader& h) override {
    STEPMESH_ASSIGN_OR_RETURN(Request * r, PendingFor(peer, h));
    const int s = static_cast<int>(NodeRank(peer));
    if (r->pull_key[s] == kNoPull) {
      if (h.payload_bytes != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("server ", s, " replied with data to a push-only request"));
      }
      return Destination{};
    }
    if (h.key != r->pull_key[s]) {
      return absl::InvalidArgumentError(absl::StrCat("server ", s, " replied under key ", h.key,
                                                     ", the request pulls key ", r->pull_key[s]));
    }
    const Registration& reg = *r->pull_reg[s];
    if (h.dtype != reg.view.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "reply dtype ", DTypeName(h.dtype), " under key ", h.key, " but the pull tensor is ",
          DTypeName(reg.view.dtype)));
    }
    if (h.payload_bytes > reg.view.bytes()) {
      return absl::OutOfRangeError(absl::StrCat("reply of ", h.payload_bytes, " bytes under key ",
                                                h.key, " exceeds the pull tensor's ",
                                                reg.view.bytes()));
    }
    return Destination{reg.wire.wire, reg.view.bytes(), reg.wire.region};
  }

  void OnFrame(NodeId peer, const FrameHeader& h, absl::Status status) override {
    MarkActivity();
    if (h.type != FrameType::kReply && h.type != FrameType::kError) return;
    absl::StatusOr<Request*> r = PendingFor(peer, h);
    if (!r.ok()) {
      STEPMESH_LOG(kWarning, "dropped a frame from server ", NodeRank(peer), ": ",
                   r.status().ToString(), " (frame status: ", status.ToString(), ")");
      return;
    }
    const int s = static_cast<int>(NodeRank(peer));
    if (h.type == FrameType::kReply && status.ok() && (*r)->pull_key[s] != kNoPull) {
      const Registration& reg = *(*r)->pull_reg[s];
      status = CheckPayload(h, reg.wire, reg.wire.wire);
      if (status.ok()) status = StageIn(reg.wire, reg.view.data, 0, h.payload_bytes);
    }
    if (h.type == FrameType::kReply && status.ok()) {
      TraceStamps& t = (*r)->stamps[s];
      t.server_arrival_ns = h.stamps.server_arrival_ns;
      t.server_handler_ns = h.stamps.server_handler_ns;
      t.server_reply_ns = h.stamps.server_reply_ns;
      t.reply_arrival_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    }
    if (!status.ok()) {
      status = absl::Status(status.code(), absl::StrCat("server ", s, ": ", status.message()));
    }
    Settle(**r, s, status);
  }

  void HandlePeerLost(NodeId peer, const absl::Status& why) override {
    if (NodeRole(peer) != 2) return;
    const int s = static_cast<int>(NodeRank(peer));
    if (s >= options_.num_servers || lost_servers_[s].exchange(true)) return;
    const absl::Status failure =
        absl::UnavailableError(absl::StrCat("server ", s, " lost: ", why.message()));
    std::vector<std::pair<uint32_t, uint32_t>> pending;
    {
      ::stepmesh::core::MutexLock lock(&reg_mu_);
      for (uint32_t i = 0; i < requests_.size(); ++i) {
        Request& r = *requests_[i];
        if (r.state.load() == RequestState::kPending && r.addressed[s]) {
          pending.emplace_back(i, r.generation);
        }
      }
    }
    if (!pending.empty() || !stopped()) {
      STEPMESH_LOG(kWarning, "worker ", rank_, ": server ", s, " lost with ", pending.size(),
                   " request(s) pending: ", why.ToString());
    }
    for (auto [index, generation] : pending) {
      Request& r = *requests_[index];
      if (r.generation == generation && r.state.load() == RequestState::kPending) {
        Settle(r, s, failure);
      }
    }
  }

  // A restarted server rejoined: dial it again and let requests address it.
  // Requests that were in flight when it was lost already failed (UNAVAILABLE);
  // the new process starts empty, so its registrations are the app's to redo.
  void HandlePeerJoined(NodeId peer, const std::string& endpoint) override {
    if (NodeRole(peer) != 2 || stopped()) return;
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
    lost_servers_[s].store(false, std::memory_order_release);
    STEPMESH_LOG(kInfo, "worker ", rank_, ": server ", s, " rejoined at ", endpoint);
  }

  void CancelAll(const absl::Status& why) override {
    // Threads are stopped: nothing else touches the requests now.
    for (auto& r : requests_) {
      if (r->state.load() != RequestState::kPending) continue;
      {
        ::stepmesh::core::MutexLock lock(&r->status_mu);
        if (r->status.ok()) r->status = why;
      }
      Complete(*r);
    }
    // No reply comes any more: streams waiting on the GPU timeline must not
    // wait forever.
    ::stepmesh::core::MutexLock lock(&reg_mu_);
    for (auto& [id, reg] : pull_regs_) reg->arrivals->ReleaseWaiters();
  }

  // --- helpers ---
  absl::StatusOr<Request*> PendingFor(NodeId peer, const FrameHeader& h) {
    const uint32_t index = static_cast<uint32_t>(h.request_id >> 32);
    const uint32_t generation = static_cast<uint32_t>(h.request_id);
    const uint32_t s = NodeRank(peer);
    if (NodeRole(peer) != 2 || s >= static_cast<uint32_t>(options_.num_servers)) {
      return absl::PermissionDeniedError("frame from a node that is not a server");
    }
    // State first (acquire): a pending request's fields are published with it.
    if (index >= requests_.size() ||
        requests_[index]->state.load(std::memory_order_acquire) != RequestState::kPending ||
        requests_[index]->generation.load(std::memory_order_acquire) != generation) {
      return absl::FailedPreconditionError("reply for an unknown or finished request");
    }
    Request* r = requests_[index].get();
    if (!r->addressed[s] || r->settled[s].load(std::memory_order_acquire)) {
      return absl::FailedPreconditionError(
          absl::StrCat("unexpected or duplicate reply from server ", s));
    }
    return r;
  }

  void Settle(Request& r, int server, const absl::Status& status) {
    if (r.settled[server].exchange(true, std::memory_order_acq_rel)) return;
    if (!status.ok()) {
      ::stepmesh::core::MutexLock lock(&r.status_mu);
      if (r.status.ok()) r.status = status;
    }
    // The reply is in the pull tensor (staged in, or flushed): streams waiting
    // for the next reply under this key may go (StreamWaitNextPull).
    if (r.pull_key[server] != kNoPull) {
      Registration& reg = *r.pull_reg[server];
      reg.arrivals->Store(++reg.arrived);
    }
    Release(r);
  }

  void Release(Request& r) {
    if (r.outstanding.fetch_sub(1, std::memory_order_acq_rel) == 1) Complete(r);
  }

  void Complete(Request& r) {
    {
      ::stepmesh::core::MutexLock lock(&reg_mu_);
      for (int i = 0; i < r.num_pushes; ++i) r.pushes[i].reg->in_flight = false;
      for (int s = 0; s < options_.num_servers; ++s) {
        if (r.pull_key[s] != kNoPull) r.pull_reg[s]->in_flight = false;
      }
    }
    r.complete_ns = options_.trace.enabled ? MonotonicNowNs() : 0;
    r.state.store(RequestState::kDone, std::memory_order_seq_cst);
    done_flags_[r.index]->Store(r.generation.load(std::memory_order_relaxed));  // StreamWaitReply
    NotifyWaiters();
  }

  // Used when a request could not even be queued: undo as if it never happened.
  void Fail(Request& r, const absl::Status& why) {
    {
      ::stepmesh::core::MutexLock lock(&r.status_mu);
      r.status = why;
    }
    Complete(r);
    r.state.store(RequestState::kReleased);
    ::stepmesh::core::MutexLock lock(&reg_mu_);
    for (uint32_t i = 0; i < requests_.size(); ++i) {
      if (requests_[i].get() == &r) free_.push_back(i);
    }
  }

  absl::StatusOr<Request*> Lookup(RequestHandle handle) {
    if (!handle.valid() || handle.index() >= requests_.size()) {
      return absl::InvalidArgumentError("invalid request handle");
    }
    Request* r = requests_[handle.index()].get();
    const RequestState state = r->state.load(std::memory_order_acquire);
    if (r->generation != handle.generation()) {
      return absl::FailedPreconditionError("stale request handle (its slot was reused)");
    }
    if (state == RequestState::kReleased) {
      return absl::FailedPreconditionError("handle already waited on");
    }
    if (state == RequestState::kFree) return absl::InvalidArgumentError("invalid request handle");
    return r;
  }

  absl::Status CheckCapacity() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(reg_mu_) {
    if (push_regs_.size() + pull_regs_.size() >= static_cast<size_t>(options_.max_registrations)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("registration limit ", options_.max_registrations, " reached"));
    }
    return absl::OkStatus();
  }

  ::stepmesh::core::Mutex reg_mu_;
  absl::flat_hash_map<Key, std::unique_ptr<Registration>> push_regs_ ABSL_GUARDED_BY(reg_mu_);
  absl::flat_hash_map<std::pair<Key, int>, std::unique_ptr<Registration>> pull_regs_
      ABSL_GUARDED_BY(reg_mu_);
  std::vector<std::unique_ptr<Request>> requests_;
  std::vector<std::unique_ptr<HostFlag>> done_flags_;  // per request slot
  std::vector<uint32_t> free_ ABSL_GUARDED_BY(reg_mu_);
  std::unique_ptr<std::atomic<bool>[]> lost_servers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AFTensorWorker>> CreateWorker(const MeshOptions& options,
                                                             std::shared_ptr<Backend> backend,
                                                             const TransportFactory& transport) {
  MeshOptions worker_options = options;
  worker_options.role = Role::kWorker;
  STEPMESH_RETURN_IF_ERROR(worker_options.Validate());
  if (backend == nullptr) {
    STEPMESH_ASSIGN_OR_RETURN(backend, CreateBackend(options));
  }
  auto worker = std::make_unique<Worker>(worker_options, std::move(backend));
  STEPMESH_RETURN_IF_ERROR(worker->Init(transport));
  return worker;
}

}  // namespace stepmesh::core

namespace stepmesh {

absl::StatusOr<std::unique_ptr<AFTensorWorker>> AFTensorWorker::Create(
    const MeshOptions& options, std::shared_ptr<Backend> backend) {
  return core::CreateWorker(options, std::move(backend), core::CreateTransport);
}

}  // namespace stepmesh
