# Warning flags for trellis' own tests, examples and benches (never for consumers).
include_guard(GLOBAL)
add_library(trellis_warnings INTERFACE)
target_compile_options(trellis_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wno-unused-parameter>
  $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall --expt-relaxed-constexpr>)

# trellis_program(<target>): common settings for our executables.
# Every program of ours links trellis::json: they save checkpoints, write metrics or read cluster
# files (the top level requires the component when they are built).
function(trellis_program target)
  target_link_libraries(${target} PRIVATE trellis_warnings trellis::json)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
endfunction()
