#pragma once
// The RDMA transport over the in-process fake fabric (tests/rdma/fake_verbs.h):
// every transport the factory makes is a fake host of its own (NIC, GID) on
// one shared fabric, as every participant of a mesh is on real hardware.

#include <memory>

#include "src/core/transport.h"
#include "src/transport/rdma/rdma_transport.h"
#include "tests/rdma/fake_verbs.h"

namespace stepmesh::testing {

core::TransportFactory FakeRdmaFactory(std::shared_ptr<FakeFabric> fabric);

}  // namespace stepmesh::testing
