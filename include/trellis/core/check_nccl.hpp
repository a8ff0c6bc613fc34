// TRELLIS_CHECK_NCCL: NCCL status codes to trellis::Error, with ncclGetErrorString and the
// communicator's last error text (ncclGetLastError), which often names the real cause.
#pragma once

#include <nccl.h>

#include "trellis/core/error.hpp"

namespace trellis::detail {
inline void check_nccl(ncclResult_t status, const char* expr, const char* file, int line) {
  if (status != ncclSuccess && status != ncclInProgress) [[unlikely]] {
    const char* last = ncclGetLastError(nullptr);
    throw_error(concat("NCCL error ", ncclGetErrorString(status), " in ", expr,
                       (last && *last) ? " -- last error: " : "", (last ? last : "")),
                file, line);
  }
}
}  // namespace trellis::detail

#define TRELLIS_CHECK_NCCL(expr)                                          \
  do {                                                                    \
    ::trellis::detail::check_nccl((expr), #expr, __FILE__, __LINE__);     \
  } while (0)
