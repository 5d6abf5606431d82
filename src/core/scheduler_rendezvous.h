#pragma once
// The scheduler implementation of the rendezvous seam (src/core/rendezvous.h,
// STEPMESH_RENDEZVOUS=scheduler://H:P, the default). A participant's side: join, receive the
// roster, barriers, and two threads once the mesh formed: a monitor that answers liveness pings
// (and nothing slower, so a peer event can never make this node look silent)
// and an event thread that runs the handlers of peers the scheduler saw leave
// or come back (they may connect, which takes a round trip or a timeout).
//
// Losing the scheduler after rendezvous is not fatal: the data plane never
// needs it. The monitor logs one warning and redials the same address; a
// scheduler restarted there rebuilds its roster from the participants that
// reconnect (kJoin with kJoinResume, carrying rank, endpoint and barriers).
// Meanwhile a barrier already entered keeps waiting (it is re-sent with the
// resume), and a new one fails UNAVAILABLE at once.

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "src/base/net.h"
#include "src/base/sync.h"
#include "src/core/control_message.h"
#include "src/core/peer_event_thread.h"
#include "src/core/rendezvous.h"
#include "stepmesh/options.h"
#include "stepmesh/trace.h"

namespace stepmesh::core {

// One clock exchange: sent and received on this host's clock, `scheduler`
// stamped by the scheduler in between. Assumes the two one-way delays equal:
// the error is at most half the round trip.
ClockSync ClockFromExchange(uint64_t sent_ns, uint64_t scheduler_ns, uint64_t received_ns);

class SchedulerRendezvous final : public Rendezvous {
 public:
  // Joins and blocks until the roster arrives (options.timeout).
  static absl::StatusOr<std::unique_ptr<SchedulerRendezvous>> Join(const MeshOptions& options,
                                                                   const std::string& endpoint);
  ~SchedulerRendezvous() override;

  // Starts the monitor and event threads; events run on the latter, in order.
  void StartMonitor(RendezvousEvents events) override;
  absl::Status Barrier(absl::Duration timeout) override;
  // Orderly leave: the scheduler will not report this node as lost.
  void Leave() override;
  // kDrain: the scheduler counts this node out now (the others hear "left").
  absl::Status AnnounceLeaving() override;
  // The scheduler's clock against this host's: `samples` exchanges (one at a
  // time, each bounded by `timeout`), the one with the shortest round trip kept.
  absl::StatusOr<ClockSync> EstimateClock(int samples, absl::Duration timeout) override;

 private:
  SchedulerRendezvous(const MeshOptions& options, std::string endpoint)
      : options_(options), endpoint_(std::move(endpoint)) {}
  // Connects, authenticates and sends a join (a resume when `resume`).
  absl::Status Dial(absl::Time deadline, bool resume);
  // Challenge-response with the scheduler (options.auth_token set).
  absl::Status Authenticate(absl::Time deadline);
  absl::Status Send(const ControlMessage& message);
  void MonitorLoop();
  void Post(std::function<void()> event) { peer_events_.Post(std::move(event)); }
  void Disconnected(const absl::Status& why);
  // One attempt to get the scheduler back; true when reconnected.
  bool Reconnect();

  const MeshOptions options_;
  const std::string endpoint_;
  RendezvousEvents events_;
  // The newest membership epoch heard (written by the monitor thread; read
  // when redialling a restarted scheduler, which resumes from it).
  std::atomic<uint64_t> epoch_{0};
  std::thread monitor_;
  PeerEventThread peer_events_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> left_{false};

  // The control connection: replaced by the monitor (under write_mu_) when it
  // reconnects; written by the monitor (pongs) and callers (barriers, leave).
  base::Mutex write_mu_;
  base::UniqueFd fd_;

  base::Mutex mu_;
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  bool gave_up_ ABSL_GUARDED_BY(mu_) = false;           // a restarted scheduler refused us
  absl::Status scheduler_status_ ABSL_GUARDED_BY(mu_);  // why not connected
  absl::Time disconnected_at_ ABSL_GUARDED_BY(mu_);
  uint64_t barrier_sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t barrier_released_ ABSL_GUARDED_BY(mu_) = 0;
  // EstimateClock: the send time of the exchange in flight, and its answer.
  uint64_t clock_sent_ns_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t clock_scheduler_ns_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t clock_received_ns_ ABSL_GUARDED_BY(mu_) = 0;
  base::Mutex clock_mu_;  // one EstimateClock at a time
};

}  // namespace stepmesh::core
