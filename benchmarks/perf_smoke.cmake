# ctest smoke run of stepmesh_perf: a tiny 2A2F run with every baseline must
# finish and write JSON that carries the ours/baseline ratios. Keeps the
# benchmark from rotting; it measures nothing worth reading.
#   cmake -DPERF=<stepmesh_perf> -DOUT=<json> -P perf_smoke.cmake
file(REMOVE ${OUT})
execute_process(
  COMMAND ${PERF} --pattern 2A2F --sizes 4096:8192 --iters 50 --warmup 10 --reps 2
          --baseline raw-tcp,zmq,memcpy --json ${OUT} --deadline-s 120
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "stepmesh_perf exited ${rc}:\n${out}\n${err}")
endif()
file(READ ${OUT} json)
foreach(needle "\"raw-tcp\"" "\"memcpy\"" "\"ratio_p50\"" "\"ratio_p99\"")
  string(FIND "${json}" "${needle}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${OUT} lacks ${needle}:\n${json}")
  endif()
endforeach()
message(STATUS "stepmesh_perf smoke: OK")
