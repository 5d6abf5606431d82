# Included through CMAKE_PROJECT_INCLUDE by the `fuzz` preset so tests/fuzz is
# added without editing the top-level CMakeLists.txt; a no-op once that file
# adds tests/fuzz itself (when STEPMESH_BUILD_FUZZERS is ON).
function(stepmesh_add_fuzzers_once)
  if(NOT TARGET stepmesh_fuzz_frame)
    add_subdirectory(${CMAKE_SOURCE_DIR}/tests/fuzz ${CMAKE_BINARY_DIR}/tests/fuzz)
  endif()
endfunction()
cmake_language(DEFER DIRECTORY ${CMAKE_SOURCE_DIR} CALL stepmesh_add_fuzzers_once)
