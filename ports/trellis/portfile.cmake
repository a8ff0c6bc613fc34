# Overlay port: builds from this source tree (vcpkg install trellis --overlay-ports=<repo>/ports).
# Header-only: configure without tests/examples/benches, install, fix up the CMake config.
get_filename_component(SOURCE_PATH "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)

vcpkg_cmake_configure(
  SOURCE_PATH "${SOURCE_PATH}"
  OPTIONS
    -DTRELLIS_BUILD_TESTS=OFF
    -DTRELLIS_BUILD_EXAMPLES=OFF
    -DTRELLIS_BUILD_BENCH=OFF
    -DTRELLIS_INSTALL=ON
)
vcpkg_cmake_install()
vcpkg_cmake_config_fixup(PACKAGE_NAME trellis CONFIG_PATH share/cmake/trellis)
file(REMOVE_RECURSE "${CURRENT_PACKAGES_DIR}/debug" "${CURRENT_PACKAGES_DIR}/lib")
file(INSTALL "${CMAKE_CURRENT_LIST_DIR}/usage" DESTINATION "${CURRENT_PACKAGES_DIR}/share/${PORT}")
vcpkg_install_copyright(FILE_LIST "${SOURCE_PATH}/LICENSE")
