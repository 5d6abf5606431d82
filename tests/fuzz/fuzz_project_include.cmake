# Included through CMAKE_PROJECT_INCLUDE by the `fuzz` preset so the fuzzers
# are defined without editing the top-level CMakeLists.txt (deferred to the end
# of it, once the stepmesh target exists). A no-op when the top level adds
# tests/fuzz itself.
include(${CMAKE_CURRENT_LIST_DIR}/fuzzers.cmake)
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR}
               CALL stepmesh_define_fuzzers ${CMAKE_SOURCE_DIR}/tests/fuzz)
