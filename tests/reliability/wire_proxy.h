#pragma once
// Byte-level faults for a transport whose data connections are TCP streams of
// stepmesh frames (the TCP fallback), with no hook inside the transport: a
// decorator that hides the node's listener behind a proxy. Peers dial the
// proxy, which dials the real listener and forwards both directions byte for
// byte, following the handshake and then frame by frame, and damages the
// frames the plan's byte-level rules pick: a header byte flipped after its
// CRC, a payload byte flipped, or a frame cut at half its payload and its
// connection closed (a sender dying mid-frame).

#include <memory>

#include "src/core/transport.h"
#include "tests/reliability/fault_transport.h"

namespace stepmesh::testing {

std::unique_ptr<core::Transport> WrapWithWireProxy(std::unique_ptr<core::Transport> inner,
                                                   std::shared_ptr<FaultPlan> plan);

}  // namespace stepmesh::testing
