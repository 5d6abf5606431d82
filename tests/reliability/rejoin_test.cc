// Rejoin of a restarted worker over every transport of the table.

#include <catch2/catch.hpp>

#include "stepmesh/status.h"
#include "tests/reliability/harness.h"
#include "tests/support/status.h"
#include "tests/support/transport_table.h"

namespace stepmesh::testing {
namespace {

TEST_CASE("rejoin: a worker restarted in place is served again, over every transport", "[rejoin]") {
  for (const TransportCase& row : TransportTable()) {
    INFO(row.name);
    const TransportInstance transport = row.make();
    Harness mesh(MeshConfig(row.transport, /*workers=*/2, /*servers=*/2), transport.factory);
    REQUIRE(mesh.status().ok());
    // Batches hold both workers (kAllWorkers): each round needs both.
    auto both = [&](uint8_t fill) -> absl::Status {
      STEPMESH_ASSIGN_OR_RETURN(RequestHandle h0, mesh.Start(0, 0, fill));
      STEPMESH_ASSIGN_OR_RETURN(RequestHandle h1, mesh.Start(1, 0, fill + 1));
      STEPMESH_RETURN_IF_ERROR(mesh.Finish(0, 0, h0, fill, absl::Seconds(5)));
      return mesh.Finish(1, 0, h1, fill + 1, absl::Seconds(5));
    };
    for (int i = 0; i < 5; ++i) REQUIRE(both(static_cast<uint8_t>(10 * i)).ok());
    for (int restart = 0; restart < 2; ++restart) {
      const absl::Status restarted = mesh.RestartWorker(1);
      REQUIRE_OK(restarted);
      for (int i = 0; i < 5; ++i) {
        const absl::Status s = both(static_cast<uint8_t>(100 + 10 * i));
        REQUIRE_OK(s);
      }
    }
    CHECK(mesh.server_errors().empty());
    if (transport.verify) CHECK_OK(transport.verify());
  }
}

}  // namespace
}  // namespace stepmesh::testing
