# libstepmesh.so exports the public API (include/stepmesh) and nothing
# internal. Fails when `nm -D --defined-only` shows a symbol of an internal
# namespace (every `namespace stepmesh::X` under src/: core, base, rdma, ...),
# of an anonymous namespace, or one that is not stepmesh's at all (a static
# dependency's symbols). The one exception is what the C++ ABI forces: the
# standard library's templates and their typeinfo, instantiated in the library
# with vague linkage (nm types W, V, u), are default-visible in libstdc++'s
# headers and stay so; they are the same in every object that instantiates them.
execute_process(COMMAND ${NM} -D --defined-only -C ${LIBRARY}
                OUTPUT_VARIABLE symbols RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only -C ${LIBRARY} failed")
endif()

# The internal namespaces, from the sources themselves.
file(GLOB_RECURSE sources ${SOURCE_DIR}/src/*.h ${SOURCE_DIR}/src/*.cc ${SOURCE_DIR}/src/*.cu)
set(internal "")
foreach(f IN LISTS sources)
  file(STRINGS ${f} lines REGEX "^namespace stepmesh::[a-z_0-9:]+ {")
  foreach(l IN LISTS lines)
    string(REGEX REPLACE "^namespace stepmesh::([a-z_0-9]+).*" "\\1" ns "${l}")
    list(APPEND internal ${ns})
  endforeach()
endforeach()
list(REMOVE_DUPLICATES internal)
if(NOT internal)
  message(FATAL_ERROR "found no internal namespace under ${SOURCE_DIR}/src")
endif()

string(REPLACE "\n" ";" lines "${symbols}")
set(public 0)
set(bad "")
foreach(l IN LISTS lines)
  # "<address> <type> <name>"
  if(NOT l MATCHES "^[0-9a-f]+ ([A-Za-z]) (.*)$")
    continue()
  endif()
  set(type "${CMAKE_MATCH_1}")
  set(name "${CMAKE_MATCH_2}")
  set(reason "")
  foreach(ns IN LISTS internal)
    if(name MATCHES "stepmesh::${ns}::")
      set(reason "internal namespace stepmesh::${ns}")
    endif()
  endforeach()
  if(name MATCHES "\\(anonymous namespace\\)")
    set(reason "anonymous namespace")
  elseif(NOT reason AND NOT name MATCHES "stepmesh::")
    if(NOT type MATCHES "^[WVu]$" OR
       NOT name MATCHES "^((typeinfo|typeinfo name|vtable) for )?std::")
      set(reason "not stepmesh's")
    endif()
  endif()
  if(reason)
    list(APPEND bad "  ${name}   (${reason})")
  else()
    math(EXPR public "${public} + 1")
  endif()
endforeach()
list(LENGTH bad nbad)
if(nbad GREATER 0)
  string(REPLACE ";" "\n" bad "${bad}")
  message(FATAL_ERROR "${LIBRARY} exports ${nbad} symbol(s) outside the public API:\n${bad}")
endif()
# The public API must be there too (the check above passes on an empty table).
foreach(required "stepmesh::AFTensorWorker::Create" "stepmesh::AFTensorServer::Create"
                 "stepmesh::Scheduler::Start" "stepmesh::MeshOptions::FromEnv"
                 "stepmesh::PrometheusText" "stepmesh::RoleFromEnv"
                 "typeinfo for stepmesh::Backend")
  string(FIND "${symbols}" "${required}" at)
  if(at LESS 0)
    message(FATAL_ERROR "${LIBRARY} does not export ${required}")
  endif()
endforeach()
message(STATUS "${LIBRARY}: ${public} exported symbols, all public API (internal namespaces checked: ${internal})")
