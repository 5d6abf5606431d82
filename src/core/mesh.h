#pragma once
// The core's construction entry points, with the transport injected: the
// public Create() functions (src/compose) pass the transport named in the
// options; tests and tools inject their own (fake verbs, fault injection).

#include <memory>

#include "absl/status/statusor.h"
#include "src/core/rendezvous.h"
#include "src/core/transport.h"
#include "stepmesh/backend.h"
#include "stepmesh/options.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"

namespace stepmesh::core {

// `options` as a participant of `role` runs with it, checked.
absl::StatusOr<MeshOptions> OptionsForRole(const MeshOptions& options, Role role);

// `backend` must not be null. `rendezvous` joins the mesh (unset: our
// scheduler, src/core/rendezvous.h).
absl::StatusOr<std::unique_ptr<AFTensorWorker>> CreateWorker(const MeshOptions& options,
                                                             std::shared_ptr<Backend> backend,
                                                             const TransportFactory& transport,
                                                             RendezvousFactory rendezvous = {});
absl::StatusOr<std::unique_ptr<AFTensorServer>> CreateServer(const MeshOptions& options,
                                                             std::shared_ptr<Backend> backend,
                                                             const TransportFactory& transport,
                                                             RendezvousFactory rendezvous = {});

}  // namespace stepmesh::core
