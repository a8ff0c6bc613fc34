# Runs train_gpt twice, as 2 thread ranks and as 2 MPI processes (--mpi), with the same flags, and
# requires the same training outcome: the summary line's first/last train loss and the validation
# loss agree within 2e-4 (printed with 4 decimals; the MPI and thread reductions add in different
# orders). Both runs must succeed.
#   cmake -DTRAIN_GPT=<exe> -DMPIEXEC=<mpiexec> -DWORK=<dir> -P compare_train_gpt.cmake
foreach(var TRAIN_GPT MPIEXEC WORK)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "compare_train_gpt: -D${var}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
set(flags --dp 2 --layers 2 --heads 2 --width 64 --context 32 --batch 8 --steps 8 --warmup 2
          --eval-every 4 --sample-tokens 0 --peak-gflops 10)

function(summary_of out_var label)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${label} run failed (exit ${rc}):\n${out}\n${err}")
  endif()
  string(REGEX MATCH "train loss ([0-9.]+) -> ([0-9.]+); validation loss ([0-9.]+)" line "${out}")
  if(NOT line)
    message(FATAL_ERROR "${label} run printed no summary line:\n${out}")
  endif()
  set(${out_var} "${CMAKE_MATCH_1};${CMAKE_MATCH_2};${CMAKE_MATCH_3}" PARENT_SCOPE)
  message(STATUS "${label}: ${line}")
endfunction()

summary_of(threads "threads" "${TRAIN_GPT}" ${flags} --ckpt-dir "${WORK}/threads")
summary_of(mpi "mpi" "${MPIEXEC}" -n 2 --oversubscribe --allow-run-as-root --mca btl self,vader --bind-to none
           "${TRAIN_GPT}" --mpi ${flags} --ckpt-dir "${WORK}/mpi")
foreach(i RANGE 2)
  list(GET threads ${i} a)
  list(GET mpi ${i} b)
  # CMake has no floating point: compare as fixed-point 1e-4 units
  string(REPLACE "." "" a_i "${a}")
  string(REPLACE "." "" b_i "${b}")
  string(REGEX REPLACE "^0+([0-9])" "\\1" a_i "${a_i}")
  string(REGEX REPLACE "^0+([0-9])" "\\1" b_i "${b_i}")
  math(EXPR diff "${a_i} - ${b_i}")
  if(diff GREATER 2 OR diff LESS -2)
    message(FATAL_ERROR "threads and MPI differ: ${threads} vs ${mpi} (first loss; last loss; validation loss)")
  endif()
endforeach()
message(STATUS "threads == MPI: ${threads}")
