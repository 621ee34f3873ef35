# Install rules: `cmake --install <build> --prefix P` gives P/lib/cmake/flatshard with a package
# config, so another project's `find_package(flatshard)` yields flatshard::flatshard (and
# flatshard::planner, the offline planner; flatshard::models, the reference models) carrying
# LibTorch, NCCL and Abseil usage requirements.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(FLATSHARD_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/flatshard)

install(TARGETS flatshard EXPORT flatshardTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
set_target_properties(flatshard_planner PROPERTIES EXPORT_NAME planner)
target_include_directories(flatshard_planner INTERFACE $<INSTALL_INTERFACE:include/flatshard>)
install(TARGETS flatshard_planner EXPORT flatshardTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
if(TARGET flatshard_models)
  set_target_properties(flatshard_models PROPERTIES EXPORT_NAME models)
  target_include_directories(flatshard_models INTERFACE $<INSTALL_INTERFACE:include/flatshard>)
  install(TARGETS flatshard_models EXPORT flatshardTargets ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR})
  install(DIRECTORY models/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/flatshard/models
          FILES_MATCHING PATTERN "*.h")
endif()
# Public headers keep their repository paths under include/flatshard/, so both
# #include "fsdp/call.h" and #include <flatshard/fsdp/call.h> work for consumers.
foreach(dir support collectives flat_param optim wrap_policies fsdp checkpoint data planner)
  install(DIRECTORY ${dir}/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/flatshard/${dir}
          FILES_MATCHING PATTERN "*.h")
endforeach()
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/generated/flatshard/version.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/flatshard)

install(EXPORT flatshardTargets NAMESPACE flatshard:: DESTINATION ${FLATSHARD_INSTALL_CMAKEDIR})
configure_package_config_file(cmake/flatshardConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/flatshardConfig.cmake
  INSTALL_DESTINATION ${FLATSHARD_INSTALL_CMAKEDIR})
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/flatshardConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/flatshardConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/flatshardConfigVersion.cmake
        DESTINATION ${FLATSHARD_INSTALL_CMAKEDIR})
