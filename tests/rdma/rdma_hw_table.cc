// TransportTable() for rdma_hw_tests: the hardware rows (rdma-hw), so the
// conformance, bad-input and fault suites compiled into that binary run over
// real verbs. It replaces tests/support/transport_table_software.cc at link time.

#include <utility>
#include <vector>

#include "tests/support/transport_table.h"

namespace stepmesh::testing {

std::vector<TransportCase> TransportTable() {
  std::vector<TransportCase> rows;
  for (TransportCase& row : AllTransportRows()) {
    if (row.hardware) rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace stepmesh::testing
