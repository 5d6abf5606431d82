# Installs headers, libstepmesh.so (SONAME, exported symbols only), libstepmesh.a,
# stepmesh_scheduler, the CMake package and stepmesh.pc (docs/integration.md).
#
# Two export sets, so that find_package(stepmesh) asks a consumer of the shared
# library for nothing but Abseil: stepmesh::stepmesh (shared) needs no more,
# while stepmesh::stepmesh_static carries hwloc and the static CUDA runtime as
# link dependencies (libibverbs is opened at run time, never linked) and is
# loaded only for COMPONENTS static.
include(CMakePackageConfigHelpers)

set(stepmesh_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/stepmesh)

install(DIRECTORY include/stepmesh DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS stepmesh_shared EXPORT stepmeshTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS stepmesh EXPORT stepmeshStaticTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS stepmesh_scheduler stepmesh_doctor stepmesh_trace_merge RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT stepmeshTargets NAMESPACE stepmesh:: DESTINATION ${stepmesh_cmake_dir})
install(EXPORT stepmeshStaticTargets NAMESPACE stepmesh:: DESTINATION ${stepmesh_cmake_dir})

# What linking libstepmesh.a needs, as this build found it (no conditions left
# for the consumer's configure to evaluate).
set(STEPMESH_STATIC_DEPENDENCIES
    "    find_dependency(Threads)\n    find_dependency(PkgConfig)\n"
    "    pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)\n")
if(STEPMESH_HAVE_ETCD)
  list(APPEND STEPMESH_STATIC_DEPENDENCIES
       "    pkg_check_modules(CURL REQUIRED IMPORTED_TARGET libcurl)\n"
       "    pkg_check_modules(JSONCPP REQUIRED IMPORTED_TARGET jsoncpp)\n")
endif()
if(STEPMESH_HAVE_CUDA)
  list(APPEND STEPMESH_STATIC_DEPENDENCIES "    find_dependency(CUDAToolkit)\n")
endif()
string(JOIN "" STEPMESH_STATIC_DEPENDENCIES ${STEPMESH_STATIC_DEPENDENCIES})
configure_package_config_file(cmake/stepmeshConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/stepmeshConfig.cmake
  INSTALL_DESTINATION ${stepmesh_cmake_dir})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/stepmeshConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/stepmeshConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/stepmeshConfigVersion.cmake
        DESTINATION ${stepmesh_cmake_dir})

# pkg-config. Requires: the Abseil modules the public headers include;
# Requires.private/Libs.private: what linking libstepmesh.a also needs
# (pkg-config --static). Cflags carry -std=c++20: the headers need it and a
# plain `c++ $(pkg-config --cflags --libs stepmesh)` must work (g++ 12
# defaults to C++17); a later -std= on the command line still wins.
# hwloc is a plain -l flag, not Requires.private: pkg-config
# reads the Cflags of every Requires.private module even without --static, so
# naming it would make its .pc file (the -dev packages) a requirement of
# every consumer of the shared library.
set(STEPMESH_PC_REQUIRES_PRIVATE "absl_synchronization absl_flat_hash_map")
set(STEPMESH_PC_LIBS_PRIVATE "-lhwloc")
if(STEPMESH_HAVE_RDMA)  # libibverbs itself is opened at run time (dlopen)
  foreach(lib IN LISTS CMAKE_DL_LIBS)
    string(APPEND STEPMESH_PC_LIBS_PRIVATE " -l${lib}")
  endforeach()
endif()
if(STEPMESH_HAVE_CUDA)
  get_target_property(cudart_static CUDA::cudart_static IMPORTED_LOCATION)
  get_filename_component(cudart_dir "${cudart_static}" DIRECTORY)
  string(APPEND STEPMESH_PC_LIBS_PRIVATE " -L${cudart_dir} -lcudart_static -lrt -ldl")
endif()
if(STEPMESH_HAVE_ETCD)
  string(APPEND STEPMESH_PC_LIBS_PRIVATE " -lcurl -ljsoncpp")
endif()
string(APPEND STEPMESH_PC_LIBS_PRIVATE " -pthread")
# Relocatable: the prefix is found from the .pc file's own place, so the file
# is right wherever `cmake --install --prefix` puts the tree.
file(RELATIVE_PATH STEPMESH_PC_UP /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
string(REGEX REPLACE "/$" "" STEPMESH_PC_UP "${STEPMESH_PC_UP}")
set(STEPMESH_PC_PREFIX "\${pcfiledir}/${STEPMESH_PC_UP}")
configure_file(cmake/stepmesh.pc.in ${CMAKE_CURRENT_BINARY_DIR}/stepmesh.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/stepmesh.pc
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
