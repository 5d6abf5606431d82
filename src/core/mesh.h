#pragma once
// Internal construction entry points: the public Create() functions use the
// transport named in the options; tests and tools inject their own (fake
// verbs, fault injection) through a TransportFactory.

#include <memory>

#include "absl/status/statusor.h"
#include "src/core/transport.h"
#include "stepmesh/backend.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"

namespace stepmesh::core {

// The backend named in the options ("cpu_mock" or "cuda"), configured from them.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const MeshOptions& options);

// "tcp", "rdma" or "auto" (rdma when built with it and a device is present).
absl::StatusOr<std::unique_ptr<Transport>> CreateTransport(const MeshOptions& options);

absl::StatusOr<std::unique_ptr<AFTensorWorker>> CreateWorker(const MeshOptions& options,
                                                             std::shared_ptr<Backend> backend,
                                                             const TransportFactory& transport);
absl::StatusOr<std::unique_ptr<AFTensorServer>> CreateServer(const MeshOptions& options,
                                                             std::shared_ptr<Backend> backend,
                                                             const TransportFactory& transport);

}  // namespace stepmesh::core
