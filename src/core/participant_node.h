#pragma once
// The Participant methods (stepmesh/participant.h) written once over a mesh
// node: a role (Worker, Server) derives from ParticipantNode<its API> and adds
// its data path and its own in-flight count, nothing else of these.

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

 protected:
  // The role's MeshStats::in_flight (any thread).
  virtual uint64_t InFlight() = 0;
};

}  // namespace stepmesh::core
