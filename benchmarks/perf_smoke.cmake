# ctest smoke run of stepmesh_perf: a tiny 2A2F run with every baseline must
# finish (exit 0) and write JSON in which every row asked for is available and
# carries numeric ours/baseline ratios. ZeroMQ is required (libzmq3-dev is in
# scripts/install-deps.sh): a build without it fails here instead of quietly
# dropping the baseline. Keeps the benchmark from rotting; the numbers it
# measures mean nothing.
#   cmake -DPERF=<stepmesh_perf> -DOUT=<json> -P perf_smoke.cmake
cmake_minimum_required(VERSION 3.25)  # string(JSON), IN_LIST
file(REMOVE ${OUT} ${OUT}.metrics.worker0 ${OUT}.metrics.worker1 ${OUT}.metrics.server0
            ${OUT}.metrics.server1)
execute_process(
  COMMAND ${PERF} --pattern 2A2F --sizes 4096:8192 --iters 50 --warmup 10 --reps 2
          --baseline raw-tcp,raw-naive,zmq,memcpy --json ${OUT} --deadline-s 120
          --metrics-file ${OUT}.metrics
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "stepmesh_perf exited ${rc}:\n${out}\n${err}")
endif()
if(NOT EXISTS ${OUT})
  message(FATAL_ERROR "stepmesh_perf exited 0 but wrote no ${OUT}:\n${out}")
endif()
file(READ ${OUT} json)
# raw-tcp is the floor row (best of the five raw disciplines), the other raw
# rows are measured beside it.
set(wanted raw-tcp raw-spin raw-block raw-spin-plain raw-block-plain raw-2thread raw-naive zmq memcpy)
string(JSON n_results LENGTH "${json}" results)
if(n_results LESS 1)
  message(FATAL_ERROR "${OUT} has no results:\n${json}")
endif()
math(EXPR last_result "${n_results} - 1")
foreach(i RANGE ${last_result})
  string(JSON n_methods LENGTH "${json}" results ${i} methods)
  math(EXPR last_method "${n_methods} - 1")
  set(seen)
  foreach(j RANGE ${last_method})
    string(JSON method GET "${json}" results ${i} methods ${j} method)
    string(JSON available GET "${json}" results ${i} methods ${j} available)
    if(NOT available)
      string(JSON note GET "${json}" results ${i} methods ${j} note)
      message(FATAL_ERROR "result ${i}: ${method} unavailable (${note})")
    endif()
    string(JSON p50 GET "${json}" results ${i} methods ${j} latency p50_us)
    if(NOT p50 GREATER 0)
      message(FATAL_ERROR "result ${i}: ${method} p50 is ${p50}")
    endif()
    if(j GREATER 0)
      foreach(key ratio_p50 ratio_p99)
        string(JSON type TYPE "${json}" results ${i} methods ${j} ${key})
        string(JSON value GET "${json}" results ${i} methods ${j} ${key})
        if(NOT type STREQUAL "NUMBER" OR NOT value GREATER 0)
          message(FATAL_ERROR "result ${i}: ${method} ${key} is ${value} (${type}), not a positive number")
        endif()
      endforeach()
    elseif(NOT method STREQUAL "stepmesh")
      message(FATAL_ERROR "result ${i}: the first row is ${method}, not stepmesh")
    endif()
    list(APPEND seen ${method})
  endforeach()
  foreach(w ${wanted})
    if(NOT w IN_LIST seen)
      message(FATAL_ERROR "result ${i} lacks the ${w} row (rows: ${seen})")
    endif()
  endforeach()
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
message(STATUS "stepmesh_perf smoke: OK (${n_results} size(s), rows ${seen})")
