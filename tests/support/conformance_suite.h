#pragma once
// Conformance cases every transport must pass with one worker and one server:
// bad input gets a clear status and changes nothing, other traffic goes on, a
// vanished peer fails requests instead of the process. Call from a TEST_CASE
// (the suite uses Catch SECTIONs); `make` builds a fresh mesh each time.

#include <functional>
#include <memory>

#include "src/core/transport.h"
#include "stepmesh/options.h"
#include "stepmesh/scheduler.h"
#include "stepmesh/server.h"
#include "stepmesh/worker.h"
#include "tests/support/loopback_mesh.h"

namespace stepmesh::testing {

// One worker and one server in this process, over `transport` (REQUIREs it came up).
std::unique_ptr<LoopbackMesh> StartPair(MeshOptions options,
                                        const core::TransportFactory& transport);

void RunBadInputConformance(const std::function<std::unique_ptr<LoopbackMesh>()>& make);

}  // namespace stepmesh::testing
