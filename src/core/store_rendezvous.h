#pragma once
// The framework-store implementation of the rendezvous seam
// (src/core/rendezvous.h): a stepmesh::RendezvousStore (set / get / add /
// wait, torch.distributed.Store's shape) handed in by the caller.
//
// Keys under "stepmesh/<mesh_id or default>/":
//   shape, shape/claim            the first joiner's shape; another is refused
//   rank/<role>/<r>               a counter: the participant whose add made it 1 holds r
//   next/<role>                   a counter handing out ranks to rank -1 joiners
//   member/<role>/<r>             {"endpoint", "proof"} (proof: HMAC with the mesh token)
//   present/<role>/<r>            1 once the member key is written (for the roster error)
//   beat/<role>/<r>               our heartbeat: +1 every heartbeat_interval
//   left/<role>/<r>               1 after an orderly leave
//   barrier/<n>                   members that entered barrier n
// A store has no watch: the monitor reads the beat and left counters every
// heartbeat_interval (Add(key, 0)); a beat unchanged for options.timeout is a
// lost member. A store has no leases either: keys stay until the framework
// drops the store (a long-lived store needs a new mesh_id per run).

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "src/core/rendezvous.h"
#include "stepmesh/options.h"
#include "stepmesh/rendezvous_store.h"

namespace stepmesh::core {

absl::StatusOr<std::unique_ptr<Rendezvous>> JoinStore(std::shared_ptr<RendezvousStore> store,
                                                      const MeshOptions& options,
                                                      const std::string& endpoint);

}  // namespace stepmesh::core
