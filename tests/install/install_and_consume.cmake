# Builds tests/install/consumer against the installed tree in PREFIX, without
# setting a C++ standard, as KIND says:
#   cmake      find_package(stepmesh) + stepmesh::stepmesh
#   pkgconfig  c++ main.cc $(pkg-config --cflags --libs stepmesh)
# then checks it links libstepmesh.so (not the archive), runs FORMATIONS
# process meshes of ROUNDS push+pull rounds each, and fails on any warning or
# error line on stderr.
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
file(GLOB_RECURSE pc LIST_DIRECTORIES false ${PREFIX}/*/stepmesh.pc)
get_filename_component(pc_dir "${pc}" DIRECTORY)
get_filename_component(lib_dir "${pc_dir}" DIRECTORY)

if(KIND STREQUAL "cmake")
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${CONSUMER_DIR} -B ${WORK_DIR}/build
                  -DCMAKE_PREFIX_PATH=${PREFIX} -DCMAKE_CXX_COMPILER=${CXX}
                  OUTPUT_VARIABLE out ERROR_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "configuring the consumer failed:\n${out}")
  endif()
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build
                  OUTPUT_VARIABLE out ERROR_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "building the consumer failed:\n${out}")
  endif()
  set(consumer ${WORK_DIR}/build/consumer)
  set(run_env "")
elseif(KIND STREQUAL "pkgconfig")
  # The very command line docs/integration.md gives, through a shell.
  set(cmd "\"${CXX}\" \"${CONSUMER_DIR}/main.cc\" -o \"${WORK_DIR}/consumer\" $(pkg-config --cflags --libs stepmesh)")
  execute_process(COMMAND ${CMAKE_COMMAND} -E env PKG_CONFIG_PATH=${pc_dir} sh -c "${cmd}"
                  OUTPUT_VARIABLE out ERROR_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${cmd} failed:\n${out}")
  endif()
  set(consumer ${WORK_DIR}/consumer)
  set(run_env LD_LIBRARY_PATH=${lib_dir})
else()
  message(FATAL_ERROR "KIND=${KIND}")
endif()

# Linked against the shared library, by its SONAME.
execute_process(COMMAND readelf -d ${consumer} OUTPUT_VARIABLE dynamic RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT dynamic MATCHES "NEEDED[^\n]*\\[libstepmesh\\.so\\.[0-9.]+\\]")
  message(FATAL_ERROR "${consumer} does not need libstepmesh.so.<soversion>:\n${dynamic}")
endif()
string(REGEX MATCH "libstepmesh\\.so\\.[0-9.]+" soname "${dynamic}")

execute_process(COMMAND ${CMAKE_COMMAND} -E env ${run_env} ${consumer}
                        --formations ${FORMATIONS} --rounds ${ROUNDS}
                OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc
                TIMEOUT 280)
message(STATUS "${KIND} consumer (${soname}): ${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the consumer failed (${rc}):\n${out}\n${err}")
endif()
# An orderly run logs no warning and no error ("[stepmesh W ...", "[stepmesh E ...").
if(err MATCHES "(^|\n)\\[stepmesh [WE] [^\n]*")
  message(FATAL_ERROR "an orderly run logged: ${CMAKE_MATCH_0}\nstderr:\n${err}")
endif()
