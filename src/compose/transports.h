#pragma once
// The composition root: the one place that knows every transport and backend
// implementation and picks among them by name. Everything below it (core,
// transports, backends) knows only the seams (core::Transport, Backend).

#include <memory>

#include "absl/status/statusor.h"
#include "src/core/rendezvous.h"
#include "src/core/transport.h"
#include "stepmesh/backend.h"
#include "stepmesh/options.h"

namespace stepmesh::compose {

// The transport named in options.transport: "tcp", "rdma", "libfabric"
// (options.fi_provider's provider), or "auto" (rdma
// when built with it and a device is present, else tcp). A core::TransportFactory.
absl::StatusOr<std::unique_ptr<core::Transport>> CreateTransport(const MeshOptions& options);

// The backend named in options.backend ("cpu_mock" or "cuda") on
// options.device, configured from the rest of the options
// (cuda_device_max_connections).
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const MeshOptions& options);

// Joins the rendezvous options.rendezvous names (scheduler:// or etcd://). A
// core::RendezvousFactory.
absl::StatusOr<std::unique_ptr<core::Rendezvous>> JoinRendezvous(const MeshOptions& options,
                                                                 const std::string& endpoint);

}  // namespace stepmesh::compose
