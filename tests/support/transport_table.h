#pragma once
// The transports the conformance and fault suites run over, one row each, so
// a suite covers every transport by iterating the table (one Catch
// DYNAMIC_SECTION per row) and a new transport is one new row here.
//
// Rows: "tcp"; where libfabric is built, "libfabric-tcp" and "libfabric-shm"
// (the libfabric transport over libfabric's tcp;ofi_rxm and shm providers,
// docs/libfabric.md); where RDMA is built, "rdma-fake-sync" and "rdma-fake-async"
// (the RDMA transport over the in-process fake fabric, tests/rdma/fake_verbs.h,
// executing work requests inside post_send or asynchronously on a fabric
// thread), and "rdma-hw" (real verbs; a hardware row, run only by
// rdma_hw_tests, which exits 77 without a NIC).

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
  // Needs a device (a NIC): only the hardware test binary runs it.
  bool hardware = false;
};

// Every row, hardware ones included.
std::vector<TransportCase> AllTransportRows();

// The rows this test binary runs: the software rows
// (transport_table_software.cc), or in rdma_hw_tests the hardware rows
// (tests/rdma/rdma_hw_table.cc). A link-time choice: each binary links exactly
// one definition, so the suites iterate TransportTable() unchanged.
std::vector<TransportCase> TransportTable();

// `base` with the row's transport name set.
MeshOptions OptionsFor(const TransportCase& row, MeshOptions base = {});

}  // namespace stepmesh::testing
