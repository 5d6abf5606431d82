// The conformance suite over every transport of the table
// (tests/support/transport_table.h): byte-exact exchanges in the mesh shapes
// AFD uses, with and without payload checksums, and bad input answered with a
// clear status that changes nothing.

#include <catch2/catch.hpp>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "tests/support/conformance_suite.h"
#include "tests/support/mesh_scenarios.h"
#include "tests/support/sanitizer.h"
#include "tests/support/status.h"
#include "tests/support/transport_table.h"

namespace stepmesh::testing {
namespace {

MeshOptions Base(const TransportCase& row, absl::Duration timeout = absl::Seconds(10)) {
  MeshOptions o;
  o.timeout = timeout;
  return OptionsFor(row, o);
}

void Verify(const TransportInstance& instance) {
  if (instance.verify) CHECK_OK(instance.verify());
}

TEST_CASE("conformance: in-process meshes exchange byte-exact data", "[conformance]") {
  for (const TransportCase& row : TransportTable()) {
    DYNAMIC_SECTION(row.name) {
      for (auto [w, s] : {std::pair{1, 1}, std::pair{1, 2}, std::pair{2, 2}, std::pair{2, 1}}) {
        const TransportInstance transport = row.make();
        Scenario sc;
        sc.workers = w;
        sc.servers = s;
        // 20 iterations x 3 micro-batches: every micro-batch's slots and
        // keys reused 19 times with a byte pattern new each iteration (a stale
        // or misplaced byte fails), all micro-batches in flight together.
        // More iterations repeat the same steady state: nothing here wraps
        // (the RDMA header ring holds 256; its wrap-around is rdma_tests'
        // small-credit-window case, the long soak the process test's).
        // Under TSan 4 (every slot reused 3 times): the 20 cost it 66 s of CI.
        sc.iterations = SteadyStateRepetitions(20, 4);
        INFO(w << "A" << s << "F, " << sc.micro_batches << " micro-batches x " << sc.iterations);
        CHECK_OK(RunInProcess(sc, Base(row), transport.factory));
        Verify(transport);
      }
    }
  }
}

TEST_CASE("conformance: 2A2F with payload checksums on", "[conformance]") {
  for (const TransportCase& row : TransportTable()) {
    DYNAMIC_SECTION(row.name) {
      const TransportInstance transport = row.make();
      Scenario sc;
      sc.iterations = SteadyStateRepetitions(30, 6);
      MeshOptions o = Base(row);
      o.payload_checksum = true;  // every payload sealed and checked, none may fail
      CHECK_OK(RunInProcess(sc, o, transport.factory));
      Verify(transport);
    }
  }
}

TEST_CASE("conformance: bad input gets a clear status and leaves other traffic intact",
          "[conformance][bad-input]") {
  for (const TransportCase& row : TransportTable()) {
    DYNAMIC_SECTION(row.name) {
      const TransportInstance transport = row.make();
      RunBadInputConformance(
          [&] { return StartPair(Base(row, absl::Seconds(5)), transport.factory); });
      Verify(transport);
    }
  }
}

}  // namespace
}  // namespace stepmesh::testing
