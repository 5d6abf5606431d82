# Compiles every public header alone: each must be self-contained and free of
# CUDA, verbs, hwloc and torch includes.
file(GLOB STEPMESH_PUBLIC_HEADERS RELATIVE ${PROJECT_SOURCE_DIR}/include
     ${PROJECT_SOURCE_DIR}/include/stepmesh/*.h)
set(header_check_sources)
foreach(header ${STEPMESH_PUBLIC_HEADERS})
  string(MAKE_C_IDENTIFIER ${header} name)
  set(source ${CMAKE_CURRENT_BINARY_DIR}/header_check/${name}.cc)
  file(WRITE ${source} "#include \"${header}\"\n#include \"${header}\"  // and twice: #pragma once\n")
  list(APPEND header_check_sources ${source})
  file(READ ${PROJECT_SOURCE_DIR}/include/${header} contents)
  if(contents MATCHES "#include [<\"](cuda|infiniband|hwloc|torch|ATen)")
    message(FATAL_ERROR "public header ${header} includes a non-public dependency")
  endif()
endforeach()
add_library(stepmesh_header_check OBJECT ${header_check_sources})
target_link_libraries(stepmesh_header_check PRIVATE absl::status absl::statusor absl::time
                      absl::span absl::strings)
target_include_directories(stepmesh_header_check PRIVATE ${PROJECT_SOURCE_DIR}/include)
