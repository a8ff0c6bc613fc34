# One translation unit per public header, including that header alone (twice, to check the
# include guard), so every header is proven self-contained:
#   - host headers with the host compiler and only trellis::trellis (g++ alone can include them),
#     with nlohmann-json poisoned: the core needs no third-party library;
#   - the file-format headers (io/, train/, plan/ and the umbrellas that include them) with
#     trellis::json, the component that brings nlohmann-json;
#   - headers that need MPI (name contains "mpi", or under a folder named mpi/) with trellis::mpi;
#   - CUDA headers (*.cuh with nvcc; .hpp whose name contains "cuda" or "nccl" with g++ and the
#     CUDA toolkit), only in builds with TRELLIS_ENABLE_CUDA.
# Plus all host headers together in sorted and reverse order (one TU each).
# The test `core.headers_self_contained` then checks that every header on disk was compiled.
file(GLOB_RECURSE _headers RELATIVE "${PROJECT_SOURCE_DIR}/include"
     CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/include/trellis/*.hpp" "${PROJECT_SOURCE_DIR}/include/trellis/*.cuh")
list(SORT _headers)

set(_dir "${CMAKE_CURRENT_BINARY_DIR}/header_checks")
set(_host_sources "")
set(_json_sources "")
set(_mpi_sources "")
set(_cuda_sources "")
set(_symbols "")
set(_count 0)
set(_all_host_forward "")
set(_all_host_reverse "")
set(_skipped 0)
foreach(_header IN LISTS _headers)
  string(MAKE_C_IDENTIFIER "${_header}" _id)
  set(_kind host)
  if(_header MATCHES "\\.cuh$")
    set(_kind cuda_device)
  elseif(_header MATCHES "^trellis/(io|train|plan)/" OR _header MATCHES "^trellis/(io|train|plan|trellis)\\.hpp$")
    set(_kind json)
  elseif(_header MATCHES "(cuda|nccl)[^/]*$")
    set(_kind cuda_host)
  elseif(_header MATCHES "mpi[^/]*$" OR _header MATCHES "/mpi/")
    set(_kind mpi)
  endif()
  if((_kind MATCHES "^cuda" AND NOT TARGET trellis::cuda) OR (_kind STREQUAL "mpi" AND NOT TARGET trellis::mpi))
    math(EXPR _skipped "${_skipped} + 1")
    continue()
  endif()
  if(_header MATCHES "nccl" AND NOT TARGET trellis::nccl)
    math(EXPR _skipped "${_skipped} + 1")
    continue()
  endif()
  set(_ext cpp)
  if(_kind STREQUAL "cuda_device")
    set(_ext cu)
  endif()
  set(_file "${_dir}/${_id}.${_ext}")
  file(CONFIGURE OUTPUT "${_file}" CONTENT
"// generated: ${_header} must compile on its own
#include <${_header}>
#include <${_header}>
int trellis_header_check_${_id}() { return 1; }
")
  if(_kind MATCHES "^(host|json)$")
    list(APPEND _${_kind}_sources "${_file}")
    string(APPEND _all_host_forward "#include <${_header}>\n")
    string(PREPEND _all_host_reverse "#include <${_header}>\n")
  elseif(_kind STREQUAL "mpi")
    list(APPEND _mpi_sources "${_file}")
  else()
    list(APPEND _cuda_sources "${_file}")
  endif()
  string(APPEND _symbols "int trellis_header_check_${_id}();\n")
  string(APPEND _calls "  compiled += trellis_header_check_${_id}();\n")
  math(EXPR _count "${_count} + 1")
endforeach()

# All host headers in one translation unit, in sorted and in reverse order: a header that leaks
# something into the next (e.g. a system header included inside a namespace) fails here.
foreach(_order forward reverse)
  file(CONFIGURE OUTPUT "${_dir}/all_host_headers_${_order}.cpp" CONTENT
"// generated: every host header together (${_order} order)
${_all_host_${_order}}int trellis_all_host_headers_${_order}() { return 1; }
")
  list(APPEND _json_sources "${_dir}/all_host_headers_${_order}.cpp")
endforeach()

file(CONFIGURE OUTPUT "${_dir}/main.cpp" CONTENT
"// generated: counts the headers compiled alone and compares with the headers on disk
#include <cstdio>
#include <filesystem>
#include <string>
${_symbols}
int main(int argc, char** argv) {
  int compiled = 0;
${_calls}
  int on_disk = 0;
  for (auto& entry : std::filesystem::recursive_directory_iterator(argv[1])) {
    auto ext = entry.path().extension().string();
    if (ext == \".hpp\" || ext == \".cuh\") ++on_disk;
  }
  const int skipped = ${_skipped};  // need a component this build does not have
  std::printf(\"headers compiled alone: %d, skipped (component not built): %d, on disk: %d\\n\",
              compiled, skipped, on_disk);
  if (compiled + skipped != on_disk) {
    std::printf(\"a header was added or removed since configure: re-run cmake\\n\");
    return 1;
  }
  return compiled == ${_count} && compiled > 0 ? 0 : 1;
}
")

# The core's headers see a nlohmann-json that stops the compile: any of them reaching it fails.
foreach(_name json.hpp json_fwd.hpp)
  file(CONFIGURE OUTPUT "${_dir}/poison/nlohmann/${_name}" CONTENT
"#error \"a core header includes nlohmann-json: only io/, train/ and plan/ may (component trellis::json)\"
")
endforeach()
add_library(trellis_header_checks_host OBJECT ${_host_sources})
target_include_directories(trellis_header_checks_host BEFORE PRIVATE "${_dir}/poison")
target_link_libraries(trellis_header_checks_host PRIVATE trellis::trellis trellis_warnings)
add_library(trellis_header_checks_json OBJECT ${_json_sources})
target_link_libraries(trellis_header_checks_json PRIVATE trellis::json trellis_warnings)
set(_objects $<TARGET_OBJECTS:trellis_header_checks_host> $<TARGET_OBJECTS:trellis_header_checks_json>)
set(_libs trellis::json)
if(_mpi_sources)
  add_library(trellis_header_checks_mpi OBJECT ${_mpi_sources})
  target_link_libraries(trellis_header_checks_mpi PRIVATE trellis::mpi trellis_warnings)
  list(APPEND _objects $<TARGET_OBJECTS:trellis_header_checks_mpi>)
  list(APPEND _libs trellis::mpi)
endif()
if(_cuda_sources)
  add_library(trellis_header_checks_cuda OBJECT ${_cuda_sources})
  target_link_libraries(trellis_header_checks_cuda PRIVATE trellis::cuda trellis_warnings)
  if(TARGET trellis::nccl)
    target_link_libraries(trellis_header_checks_cuda PRIVATE trellis::nccl)
    list(APPEND _libs trellis::nccl)
  endif()
  list(APPEND _objects $<TARGET_OBJECTS:trellis_header_checks_cuda>)
  list(APPEND _libs trellis::cuda)
endif()
add_executable(trellis_header_checks "${_dir}/main.cpp" ${_objects})
target_link_libraries(trellis_header_checks PRIVATE ${_libs})
add_test(NAME core.headers_self_contained
         COMMAND trellis_header_checks "${PROJECT_SOURCE_DIR}/include/trellis")
set_tests_properties(core.headers_self_contained PROPERTIES LABELS "core")
