#pragma once
// The TCP fallback: the same frames as RDMA over one TCP connection per peer
// pair. Sends are a writev of frame + payload from the registered source;
// receives land the payload straight in the registered destination, with
// SO_RCVLOWAT set to the rest of the frame part (at most 256 KiB) so the
// receive thread wakes once per large chunk, not once per segment.

#include <cstddef>
#include <functional>
#include <limits>
#include <memory>

#include "absl/status/statusor.h"
#include "src/core/transport.h"
#include "stepmesh/options.h"

namespace stepmesh::tcp {

absl::StatusOr<std::unique_ptr<core::Transport>> CreateTcpTransport(const MeshOptions& options);

// Test seam for fault injection (tests/reliability): what to do to one frame on
// the wire. Only byte-level faults live here; frame-level ones (drop, delay,
// duplicate, ...) are a Transport decorator and work on any transport.
struct TcpWireFault {
  size_t flip_payload_byte = std::numeric_limits<size_t>::max();  // corrupt a copy
  size_t truncate_payload_to = std::numeric_limits<size_t>::max();
  bool close_after = false;  // shut the connection once this frame is written
};
// Sees every frame just before it is written; may alter the encoded header
// (e.g. flip a byte, which the receiver's CRC check must catch). Send thread.
using TcpWireHook = std::function<TcpWireFault(core::NodeId peer, const core::FrameHeader& header,
                                               core::FrameBytes& encoded)>;
absl::StatusOr<std::unique_ptr<core::Transport>> CreateTcpTransport(const MeshOptions& options,
                                                                    TcpWireHook hook);

}  // namespace stepmesh::tcp
