# Defines the libFuzzer executables; shared by tests/fuzz/CMakeLists.txt and
# fuzz_project_include.cmake. scripts/run-fuzz.sh lists the same targets.
#   frame       the data frame header decoder
#   control     the rendezvous message decoder (header + payload)
#   rdma_boot   the RDMA bootstrap messages (hello, adverts, withdrawals);
#               rdma_wire.cc is compiled in, so no libibverbs is needed
#   tcp_stream  the TCP transport's receive path fed a stream cut at arbitrary
#               split points (same result as the stream in one piece)
#   handshake   the acceptor's side of the data-connection handshake
#   control_stream  the scheduler's control-message reassembly, split points
#               as for tcp_stream
set(STEPMESH_FUZZ_TARGETS frame control rdma_boot tcp_stream handshake control_stream
    CACHE INTERNAL "")
function(stepmesh_define_fuzzers dir)
  if(TARGET stepmesh_fuzz_frame)
    return()
  endif()
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(WARNING "stepmesh: fuzzers need clang; not building them")
    return()
  endif()
  set(extra_rdma_boot ${PROJECT_SOURCE_DIR}/src/transport/rdma/rdma_wire.cc)
  foreach(target ${STEPMESH_FUZZ_TARGETS})
    add_executable(stepmesh_fuzz_${target} ${dir}/fuzz_${target}.cc ${extra_${target}})
    target_link_libraries(stepmesh_fuzz_${target} PRIVATE stepmesh)
    target_include_directories(stepmesh_fuzz_${target} PRIVATE ${PROJECT_SOURCE_DIR})
    target_compile_options(stepmesh_fuzz_${target} PRIVATE -fsanitize=fuzzer)
    target_link_options(stepmesh_fuzz_${target} PRIVATE -fsanitize=fuzzer)
    set_target_properties(stepmesh_fuzz_${target} PROPERTIES
      RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests/fuzz)
  endforeach()
endfunction()
