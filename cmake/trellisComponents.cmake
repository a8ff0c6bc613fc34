# Defines the optional trellis::<component> targets on top of trellis::trellis.
# Used twice, so the build tree and an installed package behave the same:
#   - by the top-level CMakeLists.txt (components whose dependencies are found), and
#   - by trellisConfig.cmake for each component named in find_package(trellis COMPONENTS ...).
# Targets are IMPORTED GLOBAL INTERFACE libraries, so add_subdirectory/FetchContent users see them.
include_guard(GLOBAL)

set(TRELLIS_KNOWN_COMPONENTS json blas dnnl mpi cuda nccl)

# CMake 3.25 knows nvcc's language levels only up to C++17. trellis needs C++20 in CUDA too, so
# teach CMake the flag when the CUDA language is enabled and CMake does not know it yet; then
# CUDA_STANDARD 20 / CMAKE_CUDA_STANDARD 20 work as usual (newer CMake: nothing changes).
if(CMAKE_CUDA_COMPILER_LOADED AND CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA"
   AND NOT DEFINED CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
  set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
  list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
endif()

# trellis_add_component(<name> <found-var> [REQUIRED])
# Sets <found-var> to TRUE when the component target exists afterwards, and
# TRELLIS_COMPONENT_MESSAGE to the reason when it does not.
function(trellis_add_component name found_var)
  set(required "")
  if("REQUIRED" IN_LIST ARGN)
    set(required REQUIRED)
  endif()
  set(${found_var} FALSE PARENT_SCOPE)
  if(TARGET trellis::${name})
    set(${found_var} TRUE PARENT_SCOPE)
    return()
  endif()
  if(NOT name IN_LIST TRELLIS_KNOWN_COMPONENTS)
    set(TRELLIS_COMPONENT_MESSAGE
        "unknown trellis component '${name}'; known components: ${TRELLIS_KNOWN_COMPONENTS}" PARENT_SCOPE)
    return()
  endif()

  if(name STREQUAL "json")
    # The file formats (io/: safetensors headers, JSON; train/: checkpoints, metrics; plan/:
    # cluster files) read and write JSON with nlohmann-json. The rest of trellis needs nothing.
    find_package(nlohmann_json 3.10 QUIET CONFIG)
    if(NOT nlohmann_json_FOUND)
      set(TRELLIS_COMPONENT_MESSAGE
          "trellis component 'json' needs nlohmann-json 3.10 or newer: install nlohmann-json3-dev (vcpkg: nlohmann-json, Conan: nlohmann_json), or set nlohmann_json_DIR to its CMake config" PARENT_SCOPE)
      return()
    endif()
    add_library(trellis::json INTERFACE IMPORTED GLOBAL)
    target_link_libraries(trellis::json INTERFACE trellis::trellis nlohmann_json::nlohmann_json)

  elseif(name STREQUAL "blas")
    find_package(CBLAS QUIET)
    if(NOT CBLAS_FOUND)
      set(TRELLIS_COMPONENT_MESSAGE
          "trellis component 'blas' needs a CBLAS library (TRELLIS_BLAS=${TRELLIS_BLAS}): install libopenblas-dev (or libblis-dev with TRELLIS_BLAS=blis), or set CBLAS_ROOT to its prefix" PARENT_SCOPE)
      return()
    endif()
    add_library(trellis::blas INTERFACE IMPORTED GLOBAL)
    target_link_libraries(trellis::blas INTERFACE trellis::trellis CBLAS::CBLAS ${CMAKE_DL_LIBS})  # dlsym: blas_core.hpp
    target_compile_definitions(trellis::blas INTERFACE TRELLIS_HAS_CBLAS=1)

  elseif(name STREQUAL "dnnl")
    # oneDNN (Debian: libdnnl-dev) for bf16 GEMMs on AMX / AVX512-BF16. Debian's build threads with
    # OpenMP (libgomp); the header sets OpenMP's thread count per calling thread, so libgomp is
    # linked directly (its library only: no -fopenmp for the user's code).
    # Debian's oneDNN config calls find_package(OpenCL REQUIRED) (its GPU runtime), which stops
    # the whole configure when the OpenCL headers are missing: probe first, skip the component.
    find_package(OpenCL QUIET)
    if(NOT OpenCL_FOUND)
      set(TRELLIS_COMPONENT_MESSAGE
          "trellis component 'dnnl' needs OpenCL's headers and loader for Debian's oneDNN config: install ocl-icd-opencl-dev" PARENT_SCOPE)
      return()
    endif()
    find_package(dnnl QUIET CONFIG)
    if(NOT dnnl_FOUND OR NOT TARGET DNNL::dnnl)
      set(TRELLIS_COMPONENT_MESSAGE
          "trellis component 'dnnl' needs oneDNN (dnnl.hpp + libdnnl): install libdnnl-dev, or set dnnl_DIR to its CMake config" PARENT_SCOPE)
      return()
    endif()
    find_package(OpenMP QUIET COMPONENTS CXX)
    if(NOT OpenMP_CXX_FOUND)
      set(TRELLIS_COMPONENT_MESSAGE
          "trellis component 'dnnl' needs OpenMP (libgomp) for oneDNN's thread control" PARENT_SCOPE)
      return()
    endif()
    add_library(trellis::dnnl INTERFACE IMPORTED GLOBAL)
    target_link_libraries(trellis::dnnl INTERFACE trellis::trellis DNNL::dnnl ${OpenMP_CXX_LIBRARIES})
    # C++ translation units only: nvcc's front end (CUDA 13) aborts with an internal error on
    # dnnl.hpp, so .cu files keep the fp32 path for host bf16 GEMMs (they run device kernels).
    target_compile_definitions(trellis::dnnl INTERFACE $<$<COMPILE_LANGUAGE:CXX>:TRELLIS_HAS_DNNL=1>)

  elseif(name STREQUAL "mpi")
    find_package(MPI QUIET COMPONENTS CXX)
    if(NOT MPI_CXX_FOUND)
      set(TRELLIS_COMPONENT_MESSAGE
          "trellis component 'mpi' needs MPI for C++ (MPI::MPI_CXX): install libopenmpi-dev openmpi-bin, or set MPI_HOME" PARENT_SCOPE)
      return()
    endif()
    add_library(trellis::mpi INTERFACE IMPORTED GLOBAL)
    target_link_libraries(trellis::mpi INTERFACE trellis::trellis MPI::MPI_CXX)
    target_compile_definitions(trellis::mpi INTERFACE TRELLIS_HAS_MPI=1)

  elseif(name STREQUAL "cuda")
    find_package(CUDAToolkit QUIET)
    if(NOT CUDAToolkit_FOUND)
      set(TRELLIS_COMPONENT_MESSAGE
          "trellis component 'cuda' needs the CUDA toolkit: install it and put nvcc on PATH, or set CUDAToolkit_ROOT" PARENT_SCOPE)
      return()
    endif()
    if(NOT TARGET CCCL::CCCL)
      find_package(CCCL QUIET CONFIG HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake" "${CUDAToolkit_LIBRARY_ROOT}/lib64/cmake")
    endif()
    add_library(trellis::cuda INTERFACE IMPORTED GLOBAL)
    target_link_libraries(trellis::cuda INTERFACE trellis::trellis CUDA::cudart CUDA::cublasLt)
    if(TARGET CUDA::nvtx3)
      target_link_libraries(trellis::cuda INTERFACE CUDA::nvtx3)
    endif()
    if(TARGET CCCL::CCCL)
      target_link_libraries(trellis::cuda INTERFACE CCCL::CCCL)
    endif()
    target_compile_definitions(trellis::cuda INTERFACE TRELLIS_HAS_CUDA=1)

  elseif(name STREQUAL "nccl")
    trellis_add_component(cuda cuda_found)
    if(NOT cuda_found)
      set(TRELLIS_COMPONENT_MESSAGE "trellis component 'nccl' needs component 'cuda': ${TRELLIS_COMPONENT_MESSAGE}" PARENT_SCOPE)
      return()
    endif()
    find_package(NCCL QUIET)
    if(NOT NCCL_FOUND)
      set(TRELLIS_COMPONENT_MESSAGE
          "trellis component 'nccl' needs NCCL (nccl.h + libnccl): install libnccl-dev or the NCCL that ships with the CUDA toolkit, or set NCCL_ROOT to its prefix" PARENT_SCOPE)
      return()
    endif()
    add_library(trellis::nccl INTERFACE IMPORTED GLOBAL)
    target_link_libraries(trellis::nccl INTERFACE trellis::cuda NCCL::NCCL)
    target_compile_definitions(trellis::nccl INTERFACE TRELLIS_HAS_NCCL=1)
  endif()
  set(${found_var} TRUE PARENT_SCOPE)
endfunction()
