include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(DIRECTORY include/stepmesh DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS stepmesh EXPORT stepmeshTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS stepmesh_scheduler RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT stepmeshTargets NAMESPACE stepmesh::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/stepmesh)
configure_package_config_file(cmake/stepmeshConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/stepmeshConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/stepmesh)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/stepmeshConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/stepmeshConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/stepmeshConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/stepmesh)
