#pragma once
// A participant's side of the rendezvous: join, receive the roster, barriers,
// and a monitor thread that answers liveness pings and reports peers that the
// scheduler saw leave or come back.

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
#include "stepmesh/options.h"

namespace stepmesh::core {

struct RendezvousEvents {
  std::function<void(NodeId, absl::Status)> on_peer_lost;
  std::function<void(NodeId, const std::string& endpoint)> on_peer_joined;
};

class RendezvousClient {
 public:
  // Joins and blocks until the roster arrives (options.timeout).
  static absl::StatusOr<std::unique_ptr<RendezvousClient>> Join(const MeshOptions& options,
                                                                const std::string& endpoint);
  ~RendezvousClient();

  int rank() const { return rank_; }
  NodeId self() const { return self_; }
  const std::vector<RosterEntry>& roster() const { return roster_; }

  // Starts the monitor thread; events run on it.
  void StartMonitor(RendezvousEvents events);
  absl::Status Barrier(absl::Duration timeout);
  // Orderly leave: the scheduler will not report this node as lost.
  void Leave();

 private:
  RendezvousClient(base::UniqueFd fd, absl::Duration timeout)
      : fd_(std::move(fd)), timeout_(timeout) {}
  void MonitorLoop();
  // Challenge-response with the scheduler (options.auth_token set).
  absl::Status Authenticate(const std::string& secret, absl::Time deadline);
  absl::Status Send(const ControlMessage& message);

  base::UniqueFd fd_;
  absl::Duration timeout_;
  int rank_ = -1;
  NodeId self_ = kNoNode;
  std::vector<RosterEntry> roster_;
  RendezvousEvents events_;
  std::thread monitor_;
  std::atomic<bool> stop_{false};

  base::Mutex write_mu_;  // the monitor (pongs) and callers (barriers) both write
  base::Mutex mu_;
  uint64_t barrier_sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t barrier_released_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status scheduler_status_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> left_{false};
};

}  // namespace stepmesh::core
