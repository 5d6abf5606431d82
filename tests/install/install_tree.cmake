# cmake --install of the build tree into PREFIX, from scratch.
file(REMOVE_RECURSE ${PREFIX})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${PREFIX}
                OUTPUT_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${PREFIX} failed")
endif()
file(GLOB_RECURSE config LIST_DIRECTORIES false ${PREFIX}/*/stepmeshConfig.cmake)
file(READ ${config} text)
# The installed config evaluates nothing this build already decided.
if(text MATCHES "(^|[^a-z_])if\\((ON|OFF|TRUE|FALSE|1|0)?\\)")
  message(FATAL_ERROR "${config} carries a constant condition: ${CMAKE_MATCH_0}")
endif()
# The shared library's target asks its consumers for Abseil and nothing else.
file(GLOB_RECURSE targets LIST_DIRECTORIES false ${PREFIX}/*/stepmeshTargets.cmake)
file(READ ${targets} text)
if(text MATCHES "HWLOC|IBVERBS|CUDA|Threads")
  message(FATAL_ERROR "${targets} imposes a private dependency: ${CMAKE_MATCH_0}")
endif()
message(STATUS "installed into ${PREFIX}")
