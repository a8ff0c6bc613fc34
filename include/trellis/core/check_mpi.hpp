// TRELLIS_CHECK_MPI: MPI return codes to trellis::Error with MPI_Error_string.
#pragma once

#include <mpi.h>

#include "trellis/core/error.hpp"

namespace trellis::detail {
inline void check_mpi(int status, const char* expr, const char* file, int line) {
  if (status != MPI_SUCCESS) [[unlikely]] {
    char text[MPI_MAX_ERROR_STRING] = {};
    int length = 0;
    MPI_Error_string(status, text, &length);
    throw_error(concat("MPI error ", status, " (", text, ") in ", expr), file, line);
  }
}
}  // namespace trellis::detail

#define TRELLIS_CHECK_MPI(expr)                                           \
  do {                                                                    \
    ::trellis::detail::check_mpi((expr), #expr, __FILE__, __LINE__);      \
  } while (0)
