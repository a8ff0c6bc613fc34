# FindCBLAS: a C BLAS interface (cblas.h + library). Prefers OpenBLAS (its CMake config as
# shipped by Debian's libopenblas-dev), then any BLAS found by FindBLAS with a cblas.h beside it.
# Defines CBLAS_FOUND and the imported target CBLAS::CBLAS. Hint: CBLAS_ROOT.
include(FindPackageHandleStandardArgs)

if(NOT TARGET CBLAS::CBLAS)
  find_package(OpenBLAS QUIET CONFIG)
  if(OpenBLAS_FOUND AND OpenBLAS_LIBRARIES)
    find_path(CBLAS_INCLUDE_DIR cblas.h HINTS ${OpenBLAS_INCLUDE_DIRS} NO_DEFAULT_PATH)
    set(CBLAS_LIBRARY "${OpenBLAS_LIBRARIES}")
  endif()
  if(NOT CBLAS_INCLUDE_DIR OR NOT CBLAS_LIBRARY)
    find_library(CBLAS_LIBRARY NAMES openblas cblas blas HINTS ${CBLAS_ROOT} ENV CBLAS_ROOT PATH_SUFFIXES lib lib64)
    find_path(CBLAS_INCLUDE_DIR cblas.h HINTS ${CBLAS_ROOT} ENV CBLAS_ROOT PATH_SUFFIXES include include/openblas)
  endif()
endif()

find_package_handle_standard_args(CBLAS REQUIRED_VARS CBLAS_LIBRARY CBLAS_INCLUDE_DIR)

if(CBLAS_FOUND AND NOT TARGET CBLAS::CBLAS)
  add_library(CBLAS::CBLAS UNKNOWN IMPORTED GLOBAL)
  set_target_properties(CBLAS::CBLAS PROPERTIES
    IMPORTED_LOCATION "${CBLAS_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CBLAS_INCLUDE_DIR}")
endif()
mark_as_advanced(CBLAS_LIBRARY CBLAS_INCLUDE_DIR)
