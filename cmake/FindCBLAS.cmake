# FindCBLAS: a C BLAS interface (cblas.h + library), chosen by TRELLIS_BLAS (cache variable):
#   auto     (default) OpenBLAS (its CMake config as shipped by Debian's libopenblas-dev), else BLIS,
#            else any BLAS found by name with a cblas.h beside it
#   openblas OpenBLAS only
#   blis     BLIS only (Debian: libblis-dev; cblas.h and libblis.so under <multiarch>/blis-<threading>/)
# Defines CBLAS_FOUND, CBLAS_VENDOR (openblas, blis or other) and the imported target CBLAS::CBLAS.
# Hint: CBLAS_ROOT. Each vendor has its own cache entries, so switching TRELLIS_BLAS re-finds.
# MKL is not searched for (not installable on the development machines; any CBLAS found through
# CBLAS_ROOT works, see docs/kernels_host.md).
include(FindPackageHandleStandardArgs)

set(TRELLIS_BLAS "auto" CACHE STRING "CBLAS for trellis::blas: auto (OpenBLAS, else BLIS, else any), openblas, blis")
set_property(CACHE TRELLIS_BLAS PROPERTY STRINGS auto openblas blis)
if(NOT TRELLIS_BLAS MATCHES "^(auto|openblas|blis)$")
  message(FATAL_ERROR "TRELLIS_BLAS must be auto, openblas or blis, got '${TRELLIS_BLAS}'")
endif()

if(NOT TARGET CBLAS::CBLAS)
  set(CBLAS_LIBRARY "")
  set(CBLAS_INCLUDE_DIR "")
  if(TRELLIS_BLAS STREQUAL "auto" OR TRELLIS_BLAS STREQUAL "openblas")
    find_package(OpenBLAS QUIET CONFIG)
    if(OpenBLAS_FOUND AND OpenBLAS_LIBRARIES)
      find_path(CBLAS_OPENBLAS_INCLUDE_DIR cblas.h HINTS ${OpenBLAS_INCLUDE_DIRS} NO_DEFAULT_PATH)
      set(CBLAS_OPENBLAS_LIBRARY "${OpenBLAS_LIBRARIES}")
    else()
      find_library(CBLAS_OPENBLAS_LIBRARY NAMES openblas HINTS ${CBLAS_ROOT} ENV CBLAS_ROOT PATH_SUFFIXES lib lib64)
      find_path(CBLAS_OPENBLAS_INCLUDE_DIR cblas.h HINTS ${CBLAS_ROOT} ENV CBLAS_ROOT
                PATH_SUFFIXES include/openblas include/x86_64-linux-gnu/openblas-pthread include)
    endif()
    if(CBLAS_OPENBLAS_LIBRARY AND CBLAS_OPENBLAS_INCLUDE_DIR)
      set(CBLAS_LIBRARY "${CBLAS_OPENBLAS_LIBRARY}")
      set(CBLAS_INCLUDE_DIR "${CBLAS_OPENBLAS_INCLUDE_DIR}")
      set(CBLAS_VENDOR openblas)
    endif()
  endif()
  if(NOT CBLAS_LIBRARY AND (TRELLIS_BLAS STREQUAL "auto" OR TRELLIS_BLAS STREQUAL "blis"))
    # Debian installs BLIS per threading model; prefer pthreads, then OpenMP, then serial.
    set(_blis_dirs "")
    foreach(_t pthread openmp serial)
      list(APPEND _blis_dirs "${CMAKE_LIBRARY_ARCHITECTURE}/blis-${_t}" "x86_64-linux-gnu/blis-${_t}")
    endforeach()
    find_library(CBLAS_BLIS_LIBRARY NAMES blis HINTS ${CBLAS_ROOT} ENV CBLAS_ROOT
                 PATH_SUFFIXES ${_blis_dirs} lib lib64)
    if(CBLAS_BLIS_LIBRARY)
      # cblas.h beside the library's threading model (same directory name under include/); Debian's
      # /usr/lib/<arch>/libblis.so is an alternatives link into one of them.
      get_filename_component(_blis_real "${CBLAS_BLIS_LIBRARY}" REALPATH)
      get_filename_component(_blis_libdir "${_blis_real}" DIRECTORY)
      get_filename_component(_blis_flavour "${_blis_libdir}" NAME)
      find_path(CBLAS_BLIS_INCLUDE_DIR cblas.h HINTS ${CBLAS_ROOT} ENV CBLAS_ROOT
                PATH_SUFFIXES "include/${CMAKE_LIBRARY_ARCHITECTURE}/${_blis_flavour}"
                              "include/x86_64-linux-gnu/${_blis_flavour}" "${CMAKE_LIBRARY_ARCHITECTURE}/${_blis_flavour}"
                              "x86_64-linux-gnu/${_blis_flavour}" include/blis include
                NO_CMAKE_SYSTEM_PATH)
      if(NOT CBLAS_BLIS_INCLUDE_DIR AND EXISTS "/usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/${_blis_flavour}/cblas.h")
        set(CBLAS_BLIS_INCLUDE_DIR "/usr/include/${CMAKE_LIBRARY_ARCHITECTURE}/${_blis_flavour}" CACHE PATH "" FORCE)
      endif()
    endif()
    if(CBLAS_BLIS_LIBRARY AND CBLAS_BLIS_INCLUDE_DIR)
      set(CBLAS_LIBRARY "${_blis_real}")
      set(CBLAS_INCLUDE_DIR "${CBLAS_BLIS_INCLUDE_DIR}")
      set(CBLAS_VENDOR blis)
    endif()
  endif()
  if(NOT CBLAS_LIBRARY AND TRELLIS_BLAS STREQUAL "auto")
    find_library(CBLAS_OTHER_LIBRARY NAMES cblas blas HINTS ${CBLAS_ROOT} ENV CBLAS_ROOT PATH_SUFFIXES lib lib64)
    find_path(CBLAS_OTHER_INCLUDE_DIR cblas.h HINTS ${CBLAS_ROOT} ENV CBLAS_ROOT PATH_SUFFIXES include)
    if(CBLAS_OTHER_LIBRARY AND CBLAS_OTHER_INCLUDE_DIR)
      set(CBLAS_LIBRARY "${CBLAS_OTHER_LIBRARY}")
      set(CBLAS_INCLUDE_DIR "${CBLAS_OTHER_INCLUDE_DIR}")
      set(CBLAS_VENDOR other)
    endif()
  endif()
endif()

find_package_handle_standard_args(CBLAS REQUIRED_VARS CBLAS_LIBRARY CBLAS_INCLUDE_DIR)

if(CBLAS_FOUND AND NOT TARGET CBLAS::CBLAS)
  add_library(CBLAS::CBLAS UNKNOWN IMPORTED GLOBAL)
  set_target_properties(CBLAS::CBLAS PROPERTIES
    IMPORTED_LOCATION "${CBLAS_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${CBLAS_INCLUDE_DIR}")
  set(CBLAS_VENDOR "${CBLAS_VENDOR}" CACHE INTERNAL "vendor of CBLAS::CBLAS")
  message(STATUS "trellis: CBLAS is ${CBLAS_VENDOR}: ${CBLAS_LIBRARY} (TRELLIS_BLAS=${TRELLIS_BLAS})")
endif()
mark_as_advanced(CBLAS_OPENBLAS_LIBRARY CBLAS_OPENBLAS_INCLUDE_DIR CBLAS_BLIS_LIBRARY CBLAS_BLIS_INCLUDE_DIR
                 CBLAS_OTHER_LIBRARY CBLAS_OTHER_INCLUDE_DIR)
