#pragma once
// The transports the conformance and fault suites run over, one row each, so
// a suite covers every transport by iterating the table (one Catch
// DYNAMIC_SECTION per row) and a new transport is one new row here.
//
// Rows today: "tcp", and "rdma-fake" (the RDMA transport over the in-process
// fake verbs) where RDMA is built. Planned: "rdma-fake-async" (the fake fabric
// completing work asynchronously) and "rdma-hw" (real verbs, present only when
// a device with an active port exists).

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "src/core/transport.h"
#include "stepmesh/options.h"

namespace stepmesh::testing {

class FakeFabric;

// One mesh's worth of a transport.
struct TransportInstance {
  core::TransportFactory factory;
  std::shared_ptr<FakeFabric> fabric;  // null unless the row runs on the fake fabric
  // After a clean run: an error when the fabric saw faults nobody reported
  // (RNR retries, access errors). Null where there is nothing to ask.
  std::function<absl::Status()> verify;
};

struct TransportCase {
  std::string name;       // "tcp", "rdma-fake"
  std::string transport;  // the MeshOptions::transport it stands for
  // A fresh instance for one mesh (a new fabric each time).
  std::function<TransportInstance()> make;
  // Byte-level faults can reach its wire (tests/reliability/fault_transport.h).
  bool wire_faults = false;
  // A payload lands in the receiver's slot before the receiver reads its
  // header (RDMA WRITE): a forged header cannot keep the bytes out of the slot.
  bool payload_lands_first = false;
};

std::vector<TransportCase> TransportTable();

// `base` with the row's transport name set.
MeshOptions OptionsFor(const TransportCase& row, MeshOptions base = {});

}  // namespace stepmesh::testing
