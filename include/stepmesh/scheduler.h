#pragma once
// The rendezvous service: collects every participant's endpoint, hands out the
// roster, runs barriers and tells everyone when a participant leaves. Runs in
// any process (tests, the launcher) or as the stepmesh_scheduler program.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "stepmesh/export.h"
#include "stepmesh/options.h"

namespace stepmesh {

class STEPMESH_EXPORT Scheduler {
 public:
  // Listens on options.scheduler (port 0 picks a free one: see address()).
  static absl::StatusOr<std::unique_ptr<Scheduler>> Start(const MeshOptions& options);
  virtual ~Scheduler() = default;
  virtual std::string address() const = 0;  // "host:port" actually bound
  // Blocks until every participant has joined and then left (or timeout).
  virtual absl::Status WaitUntilDone(absl::Duration timeout) = 0;
  // StepMesh's scheduler: blocks while the participants run, however long.
  // DEADLINE_EXCEEDED (naming how many joined) only when the mesh did not form
  // within options.timeout; afterwards it returns once every participant has
  // left or was lost (silent for options.timeout: liveness is the heartbeat's).
  // CANCELLED when Stop() runs meanwhile.
  virtual absl::Status WaitForParticipants() = 0;
  virtual void Stop() = 0;
};

}  // namespace stepmesh
