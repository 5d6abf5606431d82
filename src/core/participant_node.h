#pragma once
// A participant (stepmesh/participant.h) by composition: one mesh node
// (src/core/mesh_node.h) owning the role's logic. The Participant methods are
// written here once over the node; a role's facade (Worker, Server) derives
// from ParticipantNode<its API, its logic> and forwards its data path to the
// logic, nothing else. CreateParticipant is the one Create path of both.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "src/core/chrome_trace.h"
#include "src/core/mesh.h"
#include "src/core/mesh_node.h"
#include "stepmesh/participant.h"
#include "stepmesh/status.h"

namespace stepmesh::core {

// `Logic` is a RoleLogic made as Logic(MeshNode&), with Init() (before the
// node starts), Drain(deadline) (Participant::Leave, before Stop) and
// InFlight() (MeshStats::in_flight, any thread).
template <typename RoleApi, typename Logic>
class ParticipantNode : public RoleApi {
  static_assert(std::is_base_of_v<Participant, RoleApi>);
  static_assert(std::is_base_of_v<RoleLogic, Logic>);

 public:
  using Api = RoleApi;

  ParticipantNode(const MeshOptions& options, std::shared_ptr<Backend> backend)
      : node_(options, std::move(backend)), logic_(node_.Adopt(std::make_unique<Logic>(node_))) {}

  absl::Status Init(const TransportFactory& factory, RendezvousFactory rendezvous) {
    node_.SetRendezvousFactory(std::move(rendezvous));
    STEPMESH_RETURN_IF_ERROR(logic_.Init());
    return node_.Start(factory);
  }

  int rank() const final { return node_.rank(); }
  Backend& backend() final { return node_.backend(); }

  MeshStats Stats() final {
    MeshStats s = node_.BaseStats();
    s.in_flight = logic_.InFlight();
    return s;
  }

  absl::StatusOr<ClockSync> SchedulerClock() final {
    return node_.rendezvous().EstimateClock(8, node_.options().timeout);
  }

  absl::StatusOr<std::string> ChromeTraceJson() final { return node_.ExportChromeTrace(); }
  absl::Status WriteChromeTrace(const std::string& path) final {
    STEPMESH_ASSIGN_OR_RETURN(const std::string json, node_.ExportChromeTrace());
    return WriteTextFile(path, json);
  }

  absl::Status Barrier() final { return node_.rendezvous().Barrier(node_.options().timeout); }

  absl::Status Shutdown() final {
    node_.Stop();
    return absl::OkStatus();
  }

  Membership CurrentMembership() const final { return node_.membership().Current(); }
  absl::StatusOr<Membership> WaitMembershipChange(uint64_t after_epoch,
                                                  absl::Duration timeout) final {
    return node_.membership().WaitChange(after_epoch, timeout);
  }

  absl::Status Leave(absl::Duration timeout) final {
    if (node_.stopped() || !node_.BeginLeave()) return absl::OkStatus();
    absl::Status drained = logic_.Drain(absl::Now() + timeout);
    node_.Stop();
    return drained;
  }

 protected:
  Logic& logic() { return logic_; }
  const Logic& logic() const { return logic_; }

 private:
  MeshNode node_;
  Logic& logic_;  // owned by node_
};

// Validates `options` for `role`, makes the participant `Node` and starts it.
template <typename Node>
absl::StatusOr<std::unique_ptr<typename Node::Api>> CreateParticipant(
    const MeshOptions& options, Role role, std::shared_ptr<Backend> backend,
    const TransportFactory& transport, RendezvousFactory rendezvous, absl::string_view what) {
  STEPMESH_ASSIGN_OR_RETURN(MeshOptions role_options, OptionsForRole(options, role));
  if (backend == nullptr) return absl::InvalidArgumentError(absl::StrCat(what, ": no backend"));
  auto node = std::make_unique<Node>(role_options, std::move(backend));
  STEPMESH_RETURN_IF_ERROR(node->Init(transport, std::move(rendezvous)));
  return std::unique_ptr<typename Node::Api>(std::move(node));
}

}  // namespace stepmesh::core
