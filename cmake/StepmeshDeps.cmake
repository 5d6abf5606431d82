# Finds stepmesh's dependencies the standard way; every one is a Debian package
# that scripts/install-deps.sh installs.
find_package(Threads REQUIRED)
find_package(absl CONFIG REQUIRED)

# Abseil's static archives, next to its CMake package where the distribution
# ships them (Debian's libabsl-dev does). STEPMESH_STATIC_ABSEIL links them
# into this project's programs (src/CMakeLists.txt).
file(GLOB STEPMESH_ABSL_ARCHIVES "${absl_DIR}/../../libabsl_*.a")
if(STEPMESH_STATIC_ABSEIL AND NOT STEPMESH_ABSL_ARCHIVES)
  message(FATAL_ERROR "STEPMESH_STATIC_ABSEIL=ON, but no libabsl_*.a next to ${absl_DIR}")
endif()
find_package(PkgConfig REQUIRED)
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)

set(STEPMESH_HAVE_RDMA OFF)
if(STEPMESH_ENABLE_RDMA)
  pkg_check_modules(IBVERBS IMPORTED_TARGET libibverbs)
  if(IBVERBS_FOUND)
    set(STEPMESH_HAVE_RDMA ON)
  else()
    message(STATUS "stepmesh: libibverbs not found, RDMA transport disabled")
  endif()
endif()

# The libfabric transport: headers only at build time (libfabric.so.1 is
# dlopen'ed when the transport is selected), so the library links and runs
# on machines without libfabric.
set(STEPMESH_HAVE_LIBFABRIC OFF)
if(STEPMESH_ENABLE_LIBFABRIC)
  pkg_check_modules(LIBFABRIC libfabric>=1.9)
  if(LIBFABRIC_FOUND)
    set(STEPMESH_HAVE_LIBFABRIC ON)
  else()
    message(STATUS "stepmesh: libfabric not found, libfabric transport disabled")
  endif()
endif()

# The etcd rendezvous (src/rendezvous/etcd): etcd's JSON gateway over libcurl.
set(STEPMESH_HAVE_ETCD OFF)
if(STEPMESH_ENABLE_ETCD)
  pkg_check_modules(CURL IMPORTED_TARGET libcurl)
  pkg_check_modules(JSONCPP IMPORTED_TARGET jsoncpp)
  if(CURL_FOUND AND JSONCPP_FOUND)
    set(STEPMESH_HAVE_ETCD ON)
  else()
    message(STATUS "stepmesh: libcurl or jsoncpp not found, etcd rendezvous disabled")
  endif()
endif()

if(STEPMESH_BUILD_TESTS)
  find_package(Catch2 2 REQUIRED)
  include(Catch)
endif()
if(STEPMESH_BUILD_BENCHMARKS)
  find_package(benchmark REQUIRED)
  pkg_check_modules(ZMQ IMPORTED_TARGET libzmq)
endif()
