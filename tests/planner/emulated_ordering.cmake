# ctest afd_emulated_ratio_ordering: the emulated AFD cluster (afd_launch
# --emulate-compute: real processes and real bytes over TCP, the kernels
# replaced by sleeps from the latency model) runs 1A1F and 3A1F for a few
# seconds each; the measured decode throughput per instance must be ordered
# as the planner predicts. The plan puts the two ratios ~40 % apart, far
# more than what a loaded machine's wake-up delays take off either.
#   cmake -DPLANNER=<stepmesh_plan> -DLAUNCH=<afd_launch> -DPLAN=<plan.json>
#         -DWORK=<dir> -P emulated_ordering.cmake
file(MAKE_DIRECTORY ${WORK})
execute_process(COMMAND ${PLANNER} ${PLAN} --max-attention 3 --json ${WORK}/plan.json
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "stepmesh_plan exited ${rc}:\n${out}\n${err}")
endif()
file(READ ${WORK}/plan.json plan_json)
set(ratios 1 3)
foreach(x ${ratios})
  math(EXPR i "${x} - 1")
  string(JSON predicted_${x} GET "${plan_json}" ratios ${i} full)
  execute_process(
    COMMAND ${LAUNCH} --attention ${x} --ffn 1 --requests 3 --prompt-len 4 --decode-steps 20
            --micro-batches 3 --emulate-compute ${PLAN} --timeout-ms 30000 --deadline-s 120
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "afd_launch ${x}A1F exited ${rc}:\n${out}\n${err}")
  endif()
  string(REGEX MATCH "model time, x[0-9.e+]+: ([0-9.e+]+) per instance" line "${out}")
  if(NOT line)
    message(FATAL_ERROR "afd_launch ${x}A1F printed no emulated throughput:\n${out}")
  endif()
  set(measured_${x} ${CMAKE_MATCH_1})
  message(STATUS "${x}A1F: planner ${predicted_${x}} tokens/s per instance, emulated ${measured_${x}}")
endforeach()
if(predicted_3 GREATER predicted_1)
  set(want "3A1F > 1A1F")
  set(ok FALSE)
  if(measured_3 GREATER measured_1)
    set(ok TRUE)
  endif()
else()
  set(want "1A1F >= 3A1F")
  set(ok FALSE)
  if(NOT measured_3 GREATER measured_1)
    set(ok TRUE)
  endif()
endif()
if(NOT ok)
  message(FATAL_ERROR "the planner predicts ${want} but the emulated cluster measured "
                      "1A1F ${measured_1}, 3A1F ${measured_3} tokens/s per instance")
endif()
message(STATUS "ordering ${want}: as the planner predicts")
