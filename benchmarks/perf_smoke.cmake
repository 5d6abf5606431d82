# ctest smoke run of stepmesh_perf: a tiny 2A2F run with every baseline must
# finish and write JSON that carries the ours/baseline ratios. Keeps the
# benchmark from rotting; it measures nothing worth reading.
#   cmake -DPERF=<stepmesh_perf> -DOUT=<json> -P perf_smoke.cmake
file(REMOVE ${OUT} ${OUT}.metrics.worker0 ${OUT}.metrics.worker1 ${OUT}.metrics.server0
            ${OUT}.metrics.server1)
execute_process(
  COMMAND ${PERF} --pattern 2A2F --sizes 4096:8192 --iters 50 --warmup 10 --reps 2
          --baseline raw-tcp,zmq,memcpy --json ${OUT} --deadline-s 120
          --metrics-file ${OUT}.metrics
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
# --metrics-file: every participant's Stats() at the end, in Prometheus text.
# 2 reps x (10 warmup + 25 iterations) requests per worker, one batch per
# request on each server; 4096 bytes pushed to each server per request.
foreach(node "worker;0" "worker;1" "server;0" "server;1")
  list(GET node 0 role)
  list(GET node 1 rank)
  file(READ ${OUT}.metrics.${role}${rank} text)
  set(labels "role=\"${role}\",rank=\"${rank}\"")
  set(needles "stepmesh_requests_total{${labels},code=\"OK\"} 70\n"
              "# TYPE stepmesh_stage_seconds histogram\n")
  if(role STREQUAL "worker")
    list(APPEND needles
         "stepmesh_peer_sent_bytes_total{${labels},peer_role=\"server\",peer=\"1\"} 286720\n"
         "stepmesh_peer_received_bytes_total{${labels},peer_role=\"server\",peer=\"0\"} 573440\n"
         "stepmesh_stage_seconds_count{${labels},stage=\"total\"} 70\n")
  else()
    list(APPEND needles
         "stepmesh_peer_received_frames_total{${labels},peer_role=\"worker\",peer=\"1\"} 70\n"
         "stepmesh_stage_seconds_count{${labels},stage=\"respond\"} 140\n")
  endif()
  foreach(needle IN LISTS needles)
    string(FIND "${text}" "${needle}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "${OUT}.metrics.${role}${rank} lacks ${needle}:\n${text}")
    endif()
  endforeach()
endforeach()
message(STATUS "stepmesh_perf smoke: OK")
