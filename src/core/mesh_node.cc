#include "src/core/mesh_node.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "src/base/interfaces.h"
#include "src/base/logging.h"
#include "src/base/net.h"
#include "src/core/auth.h"
#include "src/core/chrome_trace.h"
#include "src/core/mesh.h"
#include "stepmesh/status.h"

namespace stepmesh::core {

// How long Stop() lets already accepted sends go out (at most options.timeout).
constexpr absl::Duration kSendDrain = absl::Seconds(2);

namespace {

// `options` with the per-peer rank ranges at the capacity.
MeshOptions AtCapacity(const MeshOptions& options) {
  MeshOptions out = options;
  out.num_workers = out.max_workers = options.WorkerCapacity();
  out.num_servers = out.max_servers = options.ServerCapacity();
  return out;
}

}  // namespace

MeshNode::MeshNode(const MeshOptions& options, std::shared_ptr<Backend> backend)
    : mesh_options_(options),
      options_(AtCapacity(options)),
      backend_(std::move(backend)),
      io_(*backend_, options.payload_checksum),
      lost_(PeerCount()),
      stats_(options.role, options.role == Role::kWorker ? Role::kServer : Role::kWorker,
             PeerCount()),
      trace_ring_(static_cast<size_t>(std::max(options.trace.events, 0)),
                  options.role == Role::kWorker ? WorkerTraceWords::Words(options_.num_servers)
                                                : ServerTraceWords::kWords) {}

MeshStats MeshNode::BaseStats() const {
  MeshStats s = stats_.Snapshot();
  s.rank = rank_;
  s.sends_queued = queued_.load(std::memory_order_relaxed);
  s.membership_epoch = membership_.epoch();
  s.member_workers = membership_.workers();
  s.member_servers = membership_.servers();
  return s;
}

absl::StatusOr<std::string> MeshNode::ExportChromeTrace() {
  if (!trace_ring_.on()) {
    return absl::FailedPreconditionError(
        "trace recording is off: set STEPMESH_TRACE_EVENTS (MeshOptions::trace.events) to the "
        "number of requests to keep");
  }
  // The records first: what was recorded until the call, not the clock
  // exchange's own round trips later.
  const TraceRing::Snapshot records = trace_ring_.Copy();
  ClockSync clock;
  {
    base::MutexLock lock(&clock_mu_);
    if (!stopped() && rendezvous_ != nullptr) {
      absl::StatusOr<ClockSync> now = rendezvous_->EstimateClock(8, options_.timeout);
      if (!now.ok()) {
        return absl::Status(
            now.status().code(),
            absl::StrCat("the scheduler's clock for the trace: ", now.status().message()));
      }
      last_clock_ = *now;
    }
    if (!last_clock_.has_value()) {
      return absl::FailedPreconditionError(
          "no scheduler clock estimate for the trace: the participant shut down before one "
          "was taken");
    }
    clock = *last_clock_;
  }
  const std::vector<EpochMark> epochs = membership_.Marks();
  return FormatChromeTrace(options_.role, rank_, PeerCount(), records, clock, membership_.epoch(),
                           epochs);
}

MeshNode::~MeshNode() { Stop(); }

absl::Status MeshNode::Start(const TransportFactory& factory) {
  if (logic_ == nullptr) return absl::InternalError("a mesh node started without its role logic");
  bool open_on_loopback = false;  // the scheduler warns about that, once for the mesh
  STEPMESH_RETURN_IF_ERROR(
      CheckAuthPolicy(options_, "the data listener", options_.bind_host, &open_on_loopback));
  // The transport picks the NIC nearest the accelerator: tell it where that is
  // (with CUDA the physical GPU behind the CUDA index, CUDA_VISIBLE_DEVICES
  // applied by the runtime).
  MeshOptions transport_options = options_;
  if (transport_options.rdma.gpu_pci_bus_id.empty() &&
      backend_->device().kind != DeviceKind::kCpu) {
    if (absl::StatusOr<MemoryLocation> where = backend_->Locate(nullptr); where.ok()) {
      transport_options.rdma.gpu_pci_bus_id = where->pci_bus_id;
    }
  }
  STEPMESH_ASSIGN_OR_RETURN(transport_, factory(transport_options));
  drive_ = transport_->PollFromAnyThread();
  STEPMESH_ASSIGN_OR_RETURN(std::string endpoint, transport_->LocalEndpoint());
  STEPMESH_ASSIGN_OR_RETURN(rendezvous_, rendezvous_factory_
                                             ? rendezvous_factory_(mesh_options_, endpoint)
                                             : JoinScheduler(mesh_options_, endpoint));
  rank_ = rendezvous_->rank();
  self_ = rendezvous_->self();

  // The roster is the membership of its epoch: ranks of the other role it
  // does not hold are not members (yet), so nothing addresses or awaits them.
  const Role other = PeerRole(options_.role);
  std::vector<PeerInfo> peers;
  std::vector<bool> member(static_cast<size_t>(PeerCount()), false);
  for (const RosterEntry& entry : rendezvous_->roster()) {
    if (NodeRole(entry.node) != other) continue;
    if (NodeRank(entry.node) >= static_cast<uint32_t>(PeerCount())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the roster names ", PeerName(entry.node), ", beyond this node's capacity of ",
          PeerCount(), " (max_workers/max_servers differ across the mesh?)"));
    }
    member[NodeRank(entry.node)] = true;
    peers.push_back({entry.node, entry.endpoint});
  }
  for (int r = 0; r < PeerCount(); ++r) {
    if (!member[static_cast<size_t>(r)]) lost_.MarkLost(r);
  }
  membership_.Reset(rendezvous_->roster(), rendezvous_->roster_epoch());
  logic_->OnRoster(rendezvous_->joined_running());
  STEPMESH_RETURN_IF_ERROR(transport_->Connect(self_, peers, absl::Now() + options_.timeout));

  {
    base::MutexLock lock(&queue_mu_);
    queue_.resize(static_cast<size_t>(options_.max_inflight_requests) + 4 * peers.size() + 64);
  }
  std::vector<int> send_cores = options_.threads.send_cores;
  std::vector<int> recv_cores = options_.threads.recv_cores;
  if (options_.threads.auto_pin && send_cores.empty() && recv_cores.empty()) {
    int numa = -1;
    if (absl::StatusOr<MemoryLocation> where = backend_->Locate(nullptr); where.ok()) {
      numa = where->numa_node;
    }
    std::vector<int> picked = base::PickProgressCores(numa, 2);
    if (picked.size() == 2) {
      send_cores = {picked[0]};
      recv_cores = {picked[1]};
    }
  }
  started_ = true;
  const std::string tag = absl::StrCat(options_.role == Role::kWorker ? "w" : "s", rank_);
  send_thread_ =
      base::StartNamedThread(absl::StrCat("sm-send-", tag), send_cores, [this] { SendLoop(); });
  recv_thread_ =
      base::StartNamedThread(absl::StrCat("sm-recv-", tag), recv_cores, [this] { RecvLoop(); });
  rendezvous_->StartMonitor({
      .on_peer_lost = [this](NodeId peer, absl::Status why) { logic_->OnPeerGone(peer, why); },
      .on_peer_joined = [this](NodeId peer,
                               const std::string& at) { logic_->OnPeerJoined(peer, at); },
      .on_peer_left = [this](NodeId peer) { logic_->OnPeerLeft(peer); },
      .on_membership = [this](const MembershipEvent& event) { membership_.Apply(event); },
  });
  return absl::OkStatus();
}

void MeshNode::Stop() {
  if (stopped()) return;
  // What the application already handed over goes out before the goodbye: a
  // server's Shutdown right after its last Respond must not drop that reply
  // (the worker would see the server leave with its request pending). Bounded:
  // a ready event that never completes, or a peer that does not read, does
  // not hold the shutdown longer than this.
  const absl::Time drain_deadline = absl::Now() + std::min(options_.timeout, kSendDrain);
  while (unsent_.load(std::memory_order_acquire) > 0 && absl::Now() < drain_deadline) {
    send_wake_.Bump();
    absl::SleepFor(absl::Microseconds(200));
  }
  if (trace_ring_.on() && rendezvous_ != nullptr && !stopping_.load()) {
    // A trace exported after Shutdown still needs the scheduler's clock: take
    // it while the scheduler is there (a failure leaves the export an error).
    base::MutexLock lock(&clock_mu_);
    absl::StatusOr<ClockSync> clock =
        rendezvous_->EstimateClock(4, std::min(options_.timeout, absl::Milliseconds(250)));
    if (clock.ok()) last_clock_ = *clock;
  }
  if (stopping_.exchange(true)) return;
  if (rendezvous_ != nullptr) rendezvous_->Leave();
  send_wake_.Bump();
  if (transport_ != nullptr) transport_->Wake();
  if (send_thread_.joinable()) send_thread_.join();
  // An inline send that saw the node running finishes before the transport goes.
  { std::lock_guard<std::mutex> lock(send_mu_); }
  if (transport_ != nullptr) transport_->Shutdown();
  if (recv_thread_.joinable()) recv_thread_.join();
  {
    // A waiter still driving the poll sees the stop within one Poll and lets go.
    std::lock_guard<std::mutex> poll(poll_mu_);
    if (logic_ != nullptr) {
      logic_->CancelAll(absl::CancelledError("the mesh participant shut down"));
    }
  }
  membership_.Close();
  NotifyWaiters();
  base::MutexLock lock(&clock_mu_);  // not while an export uses it
  rendezvous_.reset();
}

absl::StatusOr<MeshOptions> OptionsForRole(const MeshOptions& options, Role role) {
  MeshOptions out = options;
  out.role = role;
  STEPMESH_RETURN_IF_ERROR(out.Validate());
  if (out.interface == "auto") {
    // StepMesh's DMLC_INTERFACE=auto: resolved to a name here (base::PickAutoInterface).
    absl::StatusOr<std::vector<base::InterfaceAddress>> all = base::ListInterfaceAddresses();
    absl::StatusOr<std::string> picked =
        all.ok() ? base::PickAutoInterface(*all, out.node_host, base::RdmaNetdevs())
                 : absl::StatusOr<std::string>(all.status());
    if (!picked.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("STEPMESH_INTERFACE / DMLC_INTERFACE=auto: ", picked.status().message()));
    }
    out.interface = *picked;
  }
  if (!out.interface.empty()) {
    // The interface names the address both bound and (unless node_host says
    // otherwise) advertised; for RoCE it also narrows the GIDs to its subnets.
    absl::StatusOr<std::string> address = base::InterfaceAddressOf(out.interface);
    if (!address.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("interface '", out.interface,
                       "' (STEPMESH_INTERFACE / DMLC_INTERFACE): ", address.status().message()));
    }
    out.bind_host = *address;
    if (out.rdma.interface.empty()) out.rdma.interface = out.interface;
  }
  return out;
}

NodeId MeshNode::PeerId(int rank) const {
  return MakeNodeId(PeerRole(options_.role), static_cast<uint32_t>(rank));
}

int MeshNode::PeerCount() const {
  return options_.role == Role::kWorker ? options_.num_servers : options_.num_workers;
}

absl::StatusOr<WireTensor> MeshNode::RegisterTensor(uint64_t key, const TensorView& view,
                                                    uint32_t num_slots,
                                                    std::vector<NodeId> writers) {
  if (view.data == nullptr || view.bytes() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot register an empty tensor (key ", key, ")"));
  }
  RegionInfo info;
  info.key = key;
  info.slot_bytes = view.bytes() / num_slots;
  info.num_slots = num_slots;
  info.remote_writable = !writers.empty();
  info.slot_peers = std::move(writers);
  base::MutexLock lock(&regions_mu_);
  STEPMESH_RETURN_IF_ERROR(regions_.Add(view.data, view.bytes(), info.remote_writable, key));
  absl::StatusOr<WireTensor> out = RegisterWire(std::move(info), view);
  if (!out.ok()) regions_.Remove(view.data, key);
  return out;
}

absl::StatusOr<WireTensor> MeshNode::RegisterWire(RegionInfo info, const TensorView& view) {
  const bool on_device = view.device.kind != DeviceKind::kCpu;
  const bool require_direct = on_device && options_.rdma.gpudirect == GpuDirect::kRequire;
  if (!on_device ||
      (options_.rdma.gpudirect != GpuDirect::kOff && transport_->CanAccess(view.device))) {
    info.id = next_region_++;
    info.base = view.data;
    info.device = view.device;
    base::UniqueFd dmabuf;
    if (on_device) {
      // Without a dma-buf the transport still tries the address itself (peer memory).
      uint64_t offset = 0;
      if (absl::StatusOr<int> fd = backend_->ExportDmabuf(view.data, view.bytes(), &offset);
          fd.ok()) {
        dmabuf.Reset(*fd);
        info.dmabuf_fd = dmabuf.get();
        info.dmabuf_offset = offset;
      }
    }
    absl::Status direct = transport_->RegisterRegion(info);
    if (direct.ok()) {
      return WireTensor{info.id, static_cast<std::byte*>(view.data), false, on_device};
    }
    if (!on_device || require_direct) return direct;
    STEPMESH_LOG(kWarning, "key ", info.key, ": ", transport_->name(), " cannot register ",
                 DeviceName(view.device), " memory directly (", direct.message(),
                 "); staging it through pinned host memory");
    info.dmabuf_fd = -1;
  } else if (require_direct) {
    return absl::FailedPreconditionError(
        absl::StrCat("key ", info.key, ": GPUDirect is required but the ", transport_->name(),
                     " transport cannot reach ", DeviceName(view.device), " memory"));
  }
  STEPMESH_ASSIGN_OR_RETURN(std::unique_ptr<Memory> staging,
                            backend_->Allocate(view.bytes(), MemoryKind::kHostPinned));
  info.id = next_region_++;
  info.base = staging->data();
  info.device = Device::Cpu();
  STEPMESH_RETURN_IF_ERROR(transport_->RegisterRegion(info));
  WireTensor out{info.id, static_cast<std::byte*>(staging->data()), true, false};
  staging_[info.id] = std::move(staging);
  return out;
}

absl::Status MeshNode::UnregisterTensor(RegionId id, const void* base, uint64_t key) {
  base::MutexLock lock(&regions_mu_);
  STEPMESH_RETURN_IF_ERROR(transport_->UnregisterRegion(id));
  regions_.Remove(base, key);
  staging_.erase(id);
  return absl::OkStatus();
}

absl::Status MeshNode::CheckRegistrationLimit(size_t registered) const {
  if (registered >= static_cast<size_t>(options_.max_registrations)) {
    return absl::ResourceExhaustedError(
        absl::StrCat("registration limit ", options_.max_registrations, " reached"));
  }
  return absl::OkStatus();
}

absl::Status MeshNode::EnqueueSend(SendItem item) {
  if (item.ready != nullptr) item.queued_ns = absl::GetCurrentTimeNanos();
  {
    base::MutexLock lock(&queue_mu_);
    if (queue_size_ == queue_.size()) {
      return absl::ResourceExhaustedError("send queue full");
    }
    queue_[(queue_head_ + queue_size_) % queue_.size()] = item;
    ++queue_size_;
    queued_.fetch_add(1, std::memory_order_seq_cst);
    unsent_.fetch_add(1, std::memory_order_relaxed);
  }
  // Woken outside the lock: the send thread takes queue_mu_ first thing.
  if (send_sleeping_.load(std::memory_order_seq_cst)) send_wake_.Bump();
  return absl::OkStatus();
}

bool MeshNode::TrySendInline(const SendItem& item) {
  std::unique_lock<std::mutex> lock = ClaimInlineSend(item);
  if (!lock.owns_lock()) return false;
  logic_->Execute(item, absl::OkStatus());
  return true;
}

std::unique_lock<std::mutex> MeshNode::ClaimInlineSend(const SendItem& item) {
  if (item.ready != nullptr || !transport_->SendNeverWaits()) return {};
  if (unsent_.load(std::memory_order_acquire) != 0) return {};
  std::unique_lock<std::mutex> lock(send_mu_, std::try_to_lock);
  if (!lock.owns_lock()) return {};
  // Under the lock: the send thread holds it from before it executes an item
  // until after it counted it sent, so none is in progress or waiting now.
  if (unsent_.load(std::memory_order_acquire) != 0 || stopped()) return {};
  return lock;
}

void MeshNode::WaitForSendWork() {
  const PollMode mode = options_.threads.poll_mode;
  const absl::Time start = absl::Now();
  if (mode == PollMode::kSpin || (mode == PollMode::kAdaptive && send_advice_.ShouldSpin())) {
    const absl::Time until =
        start + (mode == PollMode::kSpin ? absl::Milliseconds(20) : options_.threads.spin_budget);
    while (queued_.load(std::memory_order_acquire) == 0 && !stopped()) {
      for (int i = 0; i < 64; ++i) base::CpuRelax();
      std::this_thread::yield();  // see AwaitUntil
      if (absl::Now() >= until) break;
    }
    if (mode == PollMode::kSpin) return;
  }
  send_sleeping_.store(true, std::memory_order_seq_cst);  // announce, then re-check (WakeWord)
  for (;;) {
    const uint32_t seen = send_wake_.Load();
    if (queued_.load(std::memory_order_seq_cst) != 0 || stopped()) break;
    send_wake_.WaitWhile(seen, absl::Milliseconds(50));
  }
  send_sleeping_.store(false, std::memory_order_relaxed);
  if (mode == PollMode::kAdaptive)
    send_advice_.Record(absl::Now() - start, options_.threads.spin_budget);
}

void MeshNode::SendLoop() {
  std::vector<SendItem> waiting;
  waiting.reserve(queue_.size());
  while (!stopped()) {
    {
      base::MutexLock lock(&queue_mu_);
      while (queue_size_ > 0) {
        waiting.push_back(queue_[queue_head_]);
        queue_head_ = (queue_head_ + 1) % queue_.size();
        --queue_size_;
        queued_.fetch_sub(1, std::memory_order_release);
      }
    }
    size_t kept = 0;
    bool progressed = false;
    int64_t now_ns = 0;  // read once per pass, only when an event is pending
    for (const SendItem& item : waiting) {
      absl::Status ready;
      if (item.ordered && kept > 0) {
        waiting[kept++] = item;  // behind an item still waiting for its event
        continue;
      }
      if (item.ready != nullptr) {
        absl::StatusOr<bool> reached = item.ready->Query();
        if (reached.ok() && !*reached) {
          // Never forever: a stream that does not get to the event (a wait
          // that is never released, a hung device) fails the send instead.
          if (now_ns == 0) now_ns = absl::GetCurrentTimeNanos();
          if (now_ns - item.queued_ns < absl::ToInt64Nanoseconds(options_.timeout)) {
            waiting[kept++] = item;  // order among the waiting is preserved
            continue;
          }
          reached = absl::DeadlineExceededError(absl::StrCat(
              "the ready event did not complete within ", absl::FormatDuration(options_.timeout)));
        }
        ready = reached.status();
      }
      {
        std::lock_guard<std::mutex> lock(send_mu_);
        logic_->Execute(item, ready);
        unsent_.fetch_sub(1, std::memory_order_release);
      }
      progressed = true;
    }
    waiting.resize(kept);
    if (waiting.empty()) {
      WaitForSendWork();
    } else if (!progressed) {
      if (options_.threads.poll_mode == PollMode::kBlocking) {
        absl::SleepFor(absl::Microseconds(20));
      } else {
        base::CpuRelax();
      }
    }
  }
  // Items never sent fail through CancelAll once the receive side stopped too.
}

void MeshNode::RecvLoop() {
  const PollMode mode = options_.threads.poll_mode;
  absl::Time last_busy = absl::Now();
  bool spin = mode != PollMode::kBlocking;  // after the latest frame
  while (!stopped()) {
    if (drivers_.load(std::memory_order_seq_cst) > 0) {
      StepAside();
      continue;
    }
    absl::Duration wait = absl::Milliseconds(50);
    if (mode == PollMode::kSpin ||
        (spin && absl::Now() - last_busy < options_.threads.spin_budget)) {
      wait = absl::ZeroDuration();
    }
    absl::Status s;
    bool active = false;
    {
      std::lock_guard<std::mutex> poll(poll_mu_);
      const uint64_t activity_before = activity_;
      // Announce a blocking Poll, then re-check (Dekker with AwaitDriving,
      // which counts itself in drivers_ before it reads recv_blocked_): a
      // driver either is seen here or sees this and wakes the Poll.
      const bool blocking = wait > absl::ZeroDuration();
      if (blocking) recv_blocked_.store(true, std::memory_order_seq_cst);
      if (!blocking || drivers_.load(std::memory_order_seq_cst) == 0) {
        s = transport_->Poll(*logic_, wait);
        logic_->AfterPoll();
      }
      if (blocking) recv_blocked_.store(false, std::memory_order_relaxed);
      active = activity_ != activity_before;
    }
    if (drivers_.load(std::memory_order_seq_cst) > 0)
      WakeIfSleeping(poll_free_, poll_free_sleepers_);
    if (!s.ok()) {
      STEPMESH_LOG(kError, "receive loop: ", s.ToString());
      absl::SleepFor(absl::Milliseconds(1));
    }
    if (active) {
      const absl::Time now = absl::Now();
      if (mode == PollMode::kAdaptive) {
        // The gap since the previous frame: whether polling through gaps like it pays.
        recv_advice_.Record(now - last_busy, options_.threads.spin_budget);
        spin = recv_advice_.ShouldSpin();
      }
      last_busy = now;
    } else if (wait == absl::ZeroDuration()) {
      std::this_thread::yield();  // an empty spin round: let the thread we wait for run
    }
  }
}

void MeshNode::StepAside() {
  // Announce, then re-check (see WakeWord): a driver leaving after the
  // announcement bumps the word, one leaving before it is seen in drivers_.
  recv_resume_sleepers_.fetch_add(1, std::memory_order_seq_cst);
  for (;;) {
    const uint32_t seen = recv_resume_.Load();
    if (drivers_.load(std::memory_order_seq_cst) == 0 || stopped()) break;
    // Bounded, as every wait here.
    recv_resume_.WaitWhile(seen, absl::Milliseconds(2));
  }
  recv_resume_sleepers_.fetch_sub(1, std::memory_order_acq_rel);
}

void MeshNode::WakeIfSleeping(base::WakeWord& word, const std::atomic<int>& sleepers) {
  if (sleepers.load(std::memory_order_seq_cst) > 0) word.Bump();
}

bool MeshNode::WaitOver(absl::FunctionRef<bool()> done, absl::Time deadline, absl::Time now,
                        bool* result) const {
  if (done()) {
    *result = true;
    return true;
  }
  return now >= deadline || stopped();
}

bool MeshNode::AwaitDriving(absl::FunctionRef<bool()> done, absl::Time deadline,
                            absl::FunctionRef<bool()> more_coming) {
  if (done()) return true;
  if (!drive_ || driver_.load(std::memory_order_relaxed) == std::this_thread::get_id()) {
    return AwaitUntil(done, deadline);
  }
  drivers_.fetch_add(1, std::memory_order_seq_cst);
  // A receive thread asleep in Poll holds the poll until woken.
  if (recv_blocked_.load(std::memory_order_seq_cst)) transport_->Wake();
  bool result = false;
  bool poll_ok = true;
  for (;;) {
    const absl::Time now = absl::Now();
    if (WaitOver(done, deadline, now, &result)) break;
    // Announce, then try (see WakeWord): whoever lets the poll go after the
    // announcement bumps the word; a NotifyWaiters does too (another driver
    // may have completed what this one waits for).
    poll_free_sleepers_.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = poll_free_.Load();
    bool owned = poll_mu_.try_lock();
    // The receive thread lets go within one non-blocking Poll (a microsecond
    // or so) once it sees drivers_: a short spin saves the futex round trip.
    for (int i = 0; i < 256 && !owned; ++i) {
      base::CpuRelax();
      owned = poll_mu_.try_lock();
    }
    if (!owned && !done()) {
      poll_free_.WaitWhile(seen, std::min(deadline - now, absl::Milliseconds(1)));
    }
    poll_free_sleepers_.fetch_sub(1, std::memory_order_acq_rel);
    if (owned) {
      result = DriveLocked(done, deadline, &poll_ok);
      poll_mu_.unlock();
      break;
    }
  }
  drivers_.fetch_sub(1, std::memory_order_seq_cst);
  // Another driver may take the poll now; the receive thread too, at once
  // when frames nobody waits for are coming (or this wait failed).
  WakeIfSleeping(poll_free_, poll_free_sleepers_);
  if (!result || more_coming()) WakeIfSleeping(recv_resume_, recv_resume_sleepers_);
  // A failed Poll is the receive thread's to report; a stop completes what
  // is pending (CancelAll) after this caller let go of the poll.
  if (!result && (!poll_ok || stopped())) return AwaitUntil(done, deadline);
  return result;
}

bool MeshNode::DriveLocked(absl::FunctionRef<bool()> done, absl::Time deadline, bool* poll_ok) {
  driver_.store(std::this_thread::get_id(), std::memory_order_relaxed);
  const PollMode mode = options_.threads.poll_mode;
  // As the receive thread: non-blocking polls while the latest frame (or the
  // start of the wait) is less than the spin budget ago, the transport's own
  // sleep otherwise, in bounded slices for what other threads change. Not by
  // the wait's whole length (AwaitUntil's advice): a 2A2F wait outlasts the
  // budget, yet its frames come back to back once they come, and a sleep per
  // chunk between them cost 2A2F ~8% (docs/benchmarks.md).
  absl::Time busy = absl::Now();
  bool result = false;
  for (;;) {
    const absl::Time now = absl::Now();
    if (WaitOver(done, deadline, now, &result)) break;
    const bool spinning = mode == PollMode::kSpin || (mode == PollMode::kAdaptive &&
                                                      now - busy < options_.threads.spin_budget);
    const uint64_t activity_before = activity_;
    const absl::Status s = transport_->Poll(
        *logic_, spinning ? absl::ZeroDuration() : std::min(deadline - now, absl::Milliseconds(2)));
    logic_->AfterPoll();
    if (!s.ok()) {
      *poll_ok = false;
      break;
    }
    if (activity_ != activity_before) {
      busy = absl::Now();
    } else if (spinning) {
      std::this_thread::yield();  // see AwaitUntil
    }
  }
  driver_.store(std::thread::id(), std::memory_order_relaxed);
  return result;
}

void MeshNode::NotifyWaiters() {
  WakeIfSleeping(wait_wake_, sleepers_);
  WakeIfSleeping(poll_free_, poll_free_sleepers_);
}

}  // namespace stepmesh::core
