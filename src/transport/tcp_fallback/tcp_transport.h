#pragma once
// The TCP fallback: the same frames as RDMA over one TCP connection per peer
// pair. Sends are a writev of frame + payload from the registered source;
// receives land the payload straight in the registered destination, with
// SO_RCVLOWAT set to the rest of the frame part (at most 256 KiB) so the
// receive thread wakes once per large chunk, not once per segment.

#include <memory>

#include "absl/status/statusor.h"
#include "src/core/transport.h"
#include "stepmesh/options.h"

namespace stepmesh::tcp {

absl::StatusOr<std::unique_ptr<core::Transport>> CreateTcpTransport(const MeshOptions& options);

}  // namespace stepmesh::tcp
