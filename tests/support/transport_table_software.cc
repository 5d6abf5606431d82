// TransportTable() for every test binary but rdma_hw_tests: the rows that
// need no hardware. Alone in its file so that a binary defining its own
// (tests/rdma/rdma_hw_table.cc) never links this one.

#include <utility>
#include <vector>

#include "tests/support/transport_table.h"

namespace stepmesh::testing {

std::vector<TransportCase> TransportTable() {
  std::vector<TransportCase> rows;
  for (TransportCase& row : AllTransportRows()) {
    if (!row.hardware) rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace stepmesh::testing
