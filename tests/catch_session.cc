// Catch2's implementation, compiled once per build (about 30 s of CPU at -O2)
// and linked by every test executable: the Catch2 programs through
// stepmesh_test_main (test_main.cc), the hardware programs, which bring their
// own main() that exits 77 without the hardware.
#define CATCH_CONFIG_RUNNER
#include "tests/support/catch_session.h"

#include <catch2/catch.hpp>

namespace stepmesh::testing {

int RunCatchSession(int argc, char** argv) { return Catch::Session().run(argc, argv) == 0 ? 0 : 1; }

}  // namespace stepmesh::testing
