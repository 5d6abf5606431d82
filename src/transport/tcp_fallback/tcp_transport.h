#pragma once
// The TCP fallback: the same frames as RDMA over one TCP connection per peer
// pair, or one per rail (MeshOptions::tcp_rails, docs/tcp.md). Sends are a writev of frame +
// payload from the registered source; receives land the payload straight in the registered
// destination, with SO_RCVLOWAT set to the rest of the frame part (at most 256 KiB) so the receive
// thread wakes once per large chunk, not once per segment.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "src/core/transport.h"
#include "stepmesh/options.h"

namespace stepmesh::tcp {

absl::StatusOr<std::unique_ptr<core::Transport>> CreateTcpTransport(const MeshOptions& options);

// Tests only (a TCP transport from CreateTcpTransport): shuts rail `rail`'s
// connection to `peer` down in both directions, as a failed link ends it;
// and the payload bytes each rail to `peer` carried so far. NOT_FOUND when
// the pair has no such rail.
absl::Status ShutdownRailForTesting(core::Transport& transport, core::NodeId peer, int rail);
absl::StatusOr<std::vector<uint64_t>> RailBytesForTesting(core::Transport& transport,
                                                          core::NodeId peer);
// Tests only: sets SO_SNDBUF and SO_RCVBUF of the connection(s) to `peer`
// (each rail's) to `bytes`, so that a test holds a frame larger than what the
// kernel buffers. NOT_FOUND when there is no connection to `peer`.
absl::Status SetSocketBuffersForTesting(core::Transport& transport, core::NodeId peer, int bytes);

}  // namespace stepmesh::tcp
