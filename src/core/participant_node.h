#pragma once
// The Participant methods (stepmesh/participant.h) written once over a mesh
// node: a role (Worker, Server) derives from ParticipantNode<its API> and adds
// its data path and its own in-flight count, nothing else of these.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "src/core/chrome_trace.h"
#include "src/core/mesh_node.h"
#include "stepmesh/participant.h"
#include "stepmesh/status.h"

namespace stepmesh::core {

template <typename RoleApi>
class ParticipantNode : public RoleApi, public MeshNode {
  static_assert(std::is_base_of_v<Participant, RoleApi>);

 public:
  ParticipantNode(const MeshOptions& options, std::shared_ptr<Backend> backend)
      : MeshNode(options, std::move(backend)) {}

  int rank() const final { return rank_; }
  Backend& backend() final { return *backend_; }

  MeshStats Stats() final {
    MeshStats s = BaseStats();
    s.in_flight = InFlight();
    return s;
  }

  absl::StatusOr<ClockSync> SchedulerClock() final {
    return rendezvous_->EstimateClock(8, options_.timeout);
  }

  absl::StatusOr<std::string> ChromeTraceJson() final { return ExportChromeTrace(); }
  absl::Status WriteChromeTrace(const std::string& path) final {
    STEPMESH_ASSIGN_OR_RETURN(const std::string json, ExportChromeTrace());
    return WriteTextFile(path, json);
  }

  absl::Status Barrier() final { return rendezvous_->Barrier(options_.timeout); }

  absl::Status Shutdown() final {
    Stop();
    return absl::OkStatus();
  }

  Membership CurrentMembership() const final { return membership_.Current(); }
  absl::StatusOr<Membership> WaitMembershipChange(uint64_t after_epoch,
                                                  absl::Duration timeout) final {
    return membership_.WaitChange(after_epoch, timeout);
  }

  absl::Status Leave(absl::Duration timeout) final {
    if (stopped() || leaving_.exchange(true)) return absl::OkStatus();
    absl::Status drained = Drain(absl::Now() + timeout);
    Stop();
    return drained;
  }

 protected:
  // The role's drain (Participant::Leave), until `deadline`; Stop() follows.
  virtual absl::Status Drain(absl::Time deadline) = 0;
  // Set once Leave began (any thread).
  bool leaving() const { return leaving_.load(std::memory_order_relaxed); }

  // The role's MeshStats::in_flight (any thread).
  virtual uint64_t InFlight() = 0;

 private:
  std::atomic<bool> leaving_{false};
};

}  // namespace stepmesh::core
