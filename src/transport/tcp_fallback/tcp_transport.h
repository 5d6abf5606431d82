#pragma once
// The TCP fallback: the same frames as RDMA over one TCP connection per peer
// pair. Sends are a writev of frame + payload from the registered source;
// receives land the payload straight in the registered destination.

#include <memory>

#include "absl/status/statusor.h"
#include "src/core/transport.h"
#include "stepmesh/options.h"

namespace stepmesh::core {

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const MeshOptions& options);

}  // namespace stepmesh::core
