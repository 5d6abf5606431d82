# The test registry check: the ctest names of this build must equal the
# committed list for its configuration (tests/expected_tests/<config>.txt), so
# a test that stops being registered (a CMake condition that turned false, a
# deleted case, an executable that lists nothing) fails the suite instead of
# vanishing, and a new test is added to the list on purpose.
#
# <config> is "cuda" (nvcc found: the CUDA backend, its fake-API tests and the
# GPU programs are built) or "cpu" (no CUDA toolkit), plus a suffix for every
# optional part that is off: -noexamples, -nordma, -nopython, -nobenchmarks.
# The two standard configurations (cpu, cuda: scripts/install-deps.sh
# installed everything) must have a list; another one is checked only when
# its list was committed.
#
# Regenerate after adding or removing tests on purpose (docs/testing.md):
#   scripts/update-expected-tests.sh [build dir]     (default: build)

function(stepmesh_add_test_registry)
  if(STEPMESH_HAVE_CUDA)
    set(config cuda)
  else()
    set(config cpu)
  endif()
  if(NOT STEPMESH_BUILD_EXAMPLES)
    string(APPEND config -noexamples)
  endif()
  if(NOT STEPMESH_HAVE_RDMA)
    string(APPEND config -nordma)
  endif()
  if(NOT TARGET _stepmesh)
    string(APPEND config -nopython)
  endif()
  if(NOT STEPMESH_BUILD_BENCHMARKS)
    string(APPEND config -nobenchmarks)
  endif()
  set(list ${PROJECT_SOURCE_DIR}/tests/expected_tests/${config}.txt)
  # Read by scripts/update-expected-tests.sh.
  file(WRITE ${PROJECT_BINARY_DIR}/stepmesh_test_config.txt "${config}\n")
  if(NOT config MATCHES "^(cpu|cuda)$" AND NOT EXISTS ${list})
    message(STATUS "test_registry: configuration ${config} has no expected list; not checked")
    return()
  endif()
  add_test(NAME test_registry
    COMMAND ${PROJECT_SOURCE_DIR}/tests/test_registry.sh ${PROJECT_BINARY_DIR} ${list} ${config})
  # ctest -N runs every PRE_TEST discovery; generous for a loaded machine.
  set_tests_properties(test_registry PROPERTIES TIMEOUT 300)
endfunction()

# At the end of the root CMakeLists: examples, benchmarks and python add tests
# after tests/.
cmake_language(DEFER DIRECTORY ${PROJECT_SOURCE_DIR} CALL stepmesh_add_test_registry)
