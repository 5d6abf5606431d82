// The main() of every Catch2 executable built by stepmesh_add_test_executable.
// Catch2 v2 returns the number of failed assertions (capped at 255): mapped to
// 1 so no failure count can collide with a meaningful exit status (77 is
// "skipped" for the hardware programs).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

int main(int argc, char** argv) {
  const int failures = Catch::Session().run(argc, argv);
  return failures == 0 ? 0 : 1;
}
