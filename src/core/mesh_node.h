#pragma once
// What a worker and a server share: joining the mesh, the transport, the send
// and receive threads, the send queue, and waiting under the poll mode. One
// final class for both roles; it owns the role's logic (src/core/role_logic.h)
// and calls it through that interface only.

#include <atomic>
#include <bit>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "src/base/sync.h"
#include "src/base/thread_util.h"
#include "src/core/lost_peers.h"
#include "src/core/membership_view.h"
#include "src/core/payload_io.h"
#include "src/core/region_table.h"
#include "src/core/rendezvous.h"
#include "src/core/role_logic.h"
#include "src/core/stats_recorder.h"
#include "src/core/trace_ring.h"
#include "src/core/transport.h"
#include "stepmesh/backend.h"
#include "stepmesh/options.h"
#include "stepmesh/trace.h"

namespace stepmesh::core {

// Whether one wait site should spin before it blocks (adaptive poll mode). A
// spin pays off when the wait ends within the spin budget. When the waits of a
// site keep outlasting the budget (2A2F layers take about 2 ms against 1 ms),
// the spin ends in a sleep anyway, and meanwhile takes the core from the
// threads doing the copies the wait is for. Remembers the last 8 waits of its
// site, so it follows a change of load within a few waits. Concurrent waiters
// of one site may lose a sample to a racing update, which is harmless.
class SpinAdvisor {
 public:
  bool ShouldSpin() const {
    return std::popcount(history_.load(std::memory_order_relaxed) & 0xFFu) < 4;
  }
  void Record(absl::Duration waited, absl::Duration budget) {
    const uint32_t h = history_.load(std::memory_order_relaxed);
    history_.store((h << 1) | (waited > budget ? 1u : 0u), std::memory_order_relaxed);
  }

 private:
  std::atomic<uint32_t> history_{0};
};

class MeshNode final {
 public:
  MeshNode(const MeshOptions& options, std::shared_ptr<Backend> backend);
  // Stops (Stop()) before the logic goes.
  ~MeshNode();
  MeshNode(const MeshNode&) = delete;
  MeshNode& operator=(const MeshNode&) = delete;

  // The role's logic, made over this node; once, before Start(). Returns it.
  template <typename Logic>
  Logic& Adopt(std::unique_ptr<Logic> logic) {
    Logic& out = *logic;
    logic_ = std::move(logic);
    return out;
  }

  // How Start() joins (the composition root's choice per options.rendezvous);
  // unset: our scheduler (JoinScheduler). Before Start().
  void SetRendezvousFactory(RendezvousFactory factory) { rendezvous_factory_ = std::move(factory); }

  // Creates the transport, joins the rendezvous, connects to the other role's
  // nodes and starts the progress threads.
  absl::Status Start(const TransportFactory& factory);
  // Leaves the mesh and stops the threads; idempotent.
  void Stop();
  bool stopped() const { return stopping_.load(std::memory_order_acquire); }
  // Participant::Leave began: true for the first caller only.
  bool BeginLeave() { return !leaving_.exchange(true); }
  // Set once Leave began (any thread).
  bool leaving() const { return leaving_.load(std::memory_order_relaxed); }
  // Held around every RoleLogic::Execute: taken to change what Execute reads.
  std::mutex& send_lock() { return send_mu_; }

  absl::Status EnqueueSend(SendItem item);
  // Runs RoleLogic::Execute(item) on the calling thread instead, when that
  // cannot reorder or hold anything: no ready event, a transport whose Send
  // never waits, nothing queued or being sent. False: the caller enqueues.
  // Call holding no lock Execute takes.
  bool TrySendInline(const SendItem& item);
  // TrySendInline's test alone: a lock that owns the send lock when `item`
  // may run on the calling thread now (nothing queued or being sent, no ready
  // event, a Send that never waits, not stopping), empty otherwise (enqueue
  // it). Its holder runs RoleLogic::Execute(item) before letting go, having
  // released every lock Execute takes; never blocks, so any lock may be held
  // while claiming.
  std::unique_lock<std::mutex> ClaimInlineSend(const SendItem& item);

  // Blocks until done() or the deadline, per the poll mode. Returns done().
  template <typename Done>
  bool AwaitUntil(Done done, absl::Time deadline);
  // AwaitUntil for the application's waits on the data path (Wait,
  // GetBatch): where the transport may be polled from any thread
  // (Transport::PollFromAnyThread), the caller polls it itself until done(),
  // and the receive thread steps aside meanwhile, so the frame that ends the
  // wait is read, delivered and seen by the thread waiting for it, without a
  // wake-up in between. One caller polls at a time; others wait for the poll
  // (or their done()). `more_coming`, asked once done(): whether frames no
  // caller waits for are still on their way (other requests in flight,
  // batches collecting), so the receive thread must resume at once; else it
  // resumes when a wait that does not poll needs it (ResumeReceiver) or
  // within its 2 ms slice -- waking it costs the caller a preemption on a
  // busy machine. Call holding no lock the receive path takes, never from
  // the receive path itself (it then only waits). Returns done().
  bool AwaitDriving(absl::FunctionRef<bool()> done, absl::Time deadline,
                    absl::FunctionRef<bool()> more_coming);
  // For waits that do not poll (Test, the stream waits, AwaitUntil): the
  // receive thread, if it stepped aside for a caller that has left, resumes now.
  void ResumeReceiver() {
    if (drivers_.load(std::memory_order_seq_cst) == 0) {
      WakeIfSleeping(recv_resume_, recv_resume_sleepers_);
    }
  }
  void NotifyWaiters();
  // The logic's receive path calls this per frame so the adaptive receive
  // loop knows the link is busy (the poller only).
  void MarkActivity() { ++activity_; }

  // Registers `view` with the transport as `num_slots` equal slots; `writers`
  // (one per slot) may write remotely, none when empty. Refuses memory that
  // aliases another registration if either side receives remote writes.
  absl::StatusOr<WireTensor> RegisterTensor(uint64_t key, const TensorView& view,
                                            uint32_t num_slots, std::vector<NodeId> writers);
  absl::Status UnregisterTensor(RegionId id, const void* base, uint64_t key);
  // RESOURCE_EXHAUSTED when `registered` tensors already reach options.max_registrations.
  absl::Status CheckRegistrationLimit(size_t registered) const;

  NodeId PeerId(int rank) const;  // a node of the other role
  int PeerCount() const;

  // The node's own options: num_workers/num_servers are the capacity, the
  // rank range every per-peer table is sized for (ranks that are not members
  // are lost()).
  const MeshOptions& options() const { return options_; }
  Backend& backend() { return *backend_; }
  const PayloadIo& io() const { return io_; }
  // The other role's ranks that are gone (or not yet members).
  LostPeers& lost() { return lost_; }
  // Who is in the mesh, by epoch (docs/elastic.md).
  MembershipView& membership() { return membership_; }
  const MembershipView& membership() const { return membership_; }
  // Always on: relaxed atomic adds (src/core/stats_recorder.h).
  StatsRecorder& stats() { return stats_; }
  // The newest options.trace.events requests, for ChromeTraceJson()
  // (src/core/chrome_trace.h says what a record holds); off when 0.
  TraceRing& trace_ring() { return trace_ring_; }
  // After Start().
  Transport& transport() { return *transport_; }
  // After Start(), until Stop().
  Rendezvous& rendezvous() { return *rendezvous_; }
  NodeId self() const { return self_; }
  int rank() const { return rank_; }

  // The recorder's counters plus this node's rank, send queue depth and membership epoch.
  MeshStats BaseStats() const;
  // The trace ring as Chrome trace JSON on the scheduler's clock, estimated
  // now (or, after Stop(), the estimate Stop() took before leaving).
  absl::StatusOr<std::string> ExportChromeTrace();

 private:
  // As given (the start shape and the capacity): what the rendezvous joins with.
  const MeshOptions mesh_options_;
  const MeshOptions options_;  // at the capacity (options())
  std::shared_ptr<Backend> backend_;
  const PayloadIo io_;  // staging and checksums of payloads, any thread
  LostPeers lost_;
  MembershipView membership_;
  std::unique_ptr<Transport> transport_;
  RendezvousFactory rendezvous_factory_;
  std::unique_ptr<Rendezvous> rendezvous_;
  NodeId self_ = kNoNode;
  int rank_ = -1;
  StatsRecorder stats_;
  TraceRing trace_ring_;

  // The transport registration behind RegisterTensor: in place where the
  // transport reaches the memory, else through pinned host staging.
  absl::StatusOr<WireTensor> RegisterWire(RegionInfo info, const TensorView& view)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(regions_mu_);
  void SendLoop();
  void RecvLoop();
  void WaitForSendWork();
  // AwaitDriving's poll, holding poll_mu_: Poll until done(), the deadline or
  // a stop. False in `*poll_ok` when a Poll failed (the receive thread, which
  // logs it, takes over again).
  bool DriveLocked(absl::FunctionRef<bool()> done, absl::Time deadline, bool* poll_ok);
  // Whether a driven wait is over at `now`: done() (then `*result` is true),
  // the deadline passed or the node stops.
  bool WaitOver(absl::FunctionRef<bool()> done, absl::Time deadline, absl::Time now,
                bool* result) const;
  // The receive thread's pause while AwaitDriving callers poll.
  void StepAside();
  // Wakes whoever sleeps on `word` (counted by `sleepers`), if anyone does.
  static void WakeIfSleeping(base::WakeWord& word, const std::atomic<int>& sleepers);

  uint64_t activity_ = 0;     // the poller only (poll_mu_'s holder)
  SpinAdvisor await_advice_;  // AwaitUntil (Wait, GetBatch)
  SpinAdvisor send_advice_;   // the send thread waiting for work
  SpinAdvisor recv_advice_;   // the receive thread between frames
  std::atomic<bool> stopping_{false};
  std::atomic<bool> leaving_{false};
  bool started_ = false;
  std::thread send_thread_;
  std::thread recv_thread_;
  base::Mutex regions_mu_;
  RegionTable regions_ ABSL_GUARDED_BY(regions_mu_);
  RegionId next_region_ ABSL_GUARDED_BY(regions_mu_) = 1;
  absl::flat_hash_map<RegionId, std::unique_ptr<Memory>> staging_ ABSL_GUARDED_BY(regions_mu_);

  base::Mutex queue_mu_;
  std::vector<SendItem> queue_ ABSL_GUARDED_BY(queue_mu_);  // ring
  size_t queue_head_ ABSL_GUARDED_BY(queue_mu_) = 0;
  size_t queue_size_ ABSL_GUARDED_BY(queue_mu_) = 0;
  std::atomic<size_t> queued_{0};
  // Items accepted by EnqueueSend and not yet executed (queued or waiting for
  // their ready event): Stop() lets them go out before leaving.
  std::atomic<size_t> unsent_{0};
  std::atomic<bool> send_sleeping_{false};
  // Held around every Execute (send thread or TrySendInline): one sender
  // at a time, as Transport::Send requires. A std::mutex for try_lock.
  std::mutex send_mu_;
  base::WakeWord send_wake_;  // the send thread sleeps on it (WaitForSendWork)

  base::Mutex clock_mu_;  // ExportChromeTrace against Stop()
  std::optional<ClockSync> last_clock_ ABSL_GUARDED_BY(clock_mu_);

  base::WakeWord wait_wake_;  // AwaitUntil sleeps on it; NotifyWaiters bumps it
  std::atomic<int> sleepers_{0};

  // The poll (AwaitDriving). poll_mu_ is held around every Transport::Poll
  // and RoleLogic::AfterPoll, by the receive thread or by one driving
  // waiter: the receive path's "receive thread only" state belongs to its
  // holder, and the lock hands it over with its memory. A std::mutex for
  // try_lock (and visible to TSan).
  bool drive_ = false;  // the transport's PollFromAnyThread; set by Start()
  std::mutex poll_mu_;
  std::atomic<int> drivers_{0};            // AwaitDriving callers wanting or holding the poll
  std::atomic<std::thread::id> driver_{};  // the one holding it, while it polls
  // Set while the receive thread sleeps in a Poll that a driver must Wake.
  std::atomic<bool> recv_blocked_{false};
  base::WakeWord recv_resume_;  // the receive thread steps aside on it; drivers leaving bump it
  std::atomic<int> recv_resume_sleepers_{0};
  base::WakeWord poll_free_;  // drivers wait on it for the poll (or their done())
  std::atomic<int> poll_free_sleepers_{0};

  // Last: destroyed first, after the destructor stopped the threads that call it.
  std::unique_ptr<RoleLogic> logic_;
};

template <typename Done>
bool MeshNode::AwaitUntil(Done done, absl::Time deadline) {
  if (done()) return true;
  ResumeReceiver();  // this wait needs the receive thread
  const PollMode mode = options_.threads.poll_mode;
  const absl::Time start = absl::Now();
  const auto finish = [&](bool result) {
    if (mode == PollMode::kAdaptive) {
      await_advice_.Record(absl::Now() - start, options_.threads.spin_budget);
    }
    return result;
  };
  if (mode == PollMode::kSpin || (mode == PollMode::kAdaptive && await_advice_.ShouldSpin())) {
    const absl::Time spin_until = mode == PollMode::kSpin
                                      ? deadline
                                      : std::min(deadline, start + options_.threads.spin_budget);
    while (absl::Now() < spin_until) {
      for (int i = 0; i < 64; ++i) {
        if (done()) return finish(true);
        base::CpuRelax();
      }
      // With more threads than cores a pure spinner holds the core the thread it
      // waits for needs: yielding makes each hand-off microseconds, not a time slice.
      std::this_thread::yield();
    }
    if (mode == PollMode::kSpin) return done();
  }
  // Announce, then re-check (see WakeWord): a NotifyWaiters after the announcement
  // bumps the word, one before it is seen by done().
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  for (;;) {
    const uint32_t seen = wait_wake_.Load();
    if (done()) break;
    const absl::Time now = absl::Now();
    if (now >= deadline) break;
    // Bounded slices, for conditions that change without a NotifyWaiters.
    wait_wake_.WaitWhile(seen, std::min(deadline - now, absl::Milliseconds(2)));
  }
  sleepers_.fetch_sub(1, std::memory_order_acq_rel);
  return finish(done());
}

}  // namespace stepmesh::core
