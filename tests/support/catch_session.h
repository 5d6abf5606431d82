#pragma once
// Runs the Catch2 test cases linked into this program (Catch2 itself is
// compiled once, in tests/catch_session.cc; its Session class is only declared
// there). Returns 0 when every assertion passed, else 1: Catch2 v2 returns the
// number of failed assertions (capped at 255), and 77 failures would read as
// "skipped" to ctest.

namespace stepmesh::testing {

int RunCatchSession(int argc, char** argv);

}  // namespace stepmesh::testing
