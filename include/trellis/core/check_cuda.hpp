// TRELLIS_CHECK_CUDA / TRELLIS_CHECK_CUBLAS: turn CUDA runtime and cuBLASLt status codes into
// trellis::Error with the library's own error string. Needs the CUDA toolkit headers (g++ is fine).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "trellis/core/error.hpp"

namespace trellis::detail {
inline void check_cuda(cudaError_t status, const char* expr, const char* file, int line) {
  if (status != cudaSuccess) [[unlikely]] {
    throw_error(concat("CUDA error ", cudaGetErrorName(status), " (", cudaGetErrorString(status),
                       ") in ", expr),
                file, line);
  }
}

inline void check_cublas(cublasStatus_t status, const char* expr, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]] {
    throw_error(concat("cuBLAS error ", cublasLtGetStatusName(status), " (",
                       cublasLtGetStatusString(status), ") in ", expr),
                file, line);
  }
}
}  // namespace trellis::detail

#define TRELLIS_CHECK_CUDA(expr)                                          \
  do {                                                                    \
    ::trellis::detail::check_cuda((expr), #expr, __FILE__, __LINE__);     \
  } while (0)

#define TRELLIS_CHECK_CUBLAS(expr)                                        \
  do {                                                                    \
    ::trellis::detail::check_cublas((expr), #expr, __FILE__, __LINE__);   \
  } while (0)
