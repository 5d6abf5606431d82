// The main() of every Catch2 executable built by stepmesh_add_test_executable.
#include "tests/support/catch_session.h"

int main(int argc, char** argv) { return stepmesh::testing::RunCatchSession(argc, argv); }
