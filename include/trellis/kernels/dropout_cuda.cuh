// CUDA dropout kernel (contract: kernels/dropout.hpp, host twin kernels/dropout_host.hpp): the
// same hash decides every element, so the masks equal the host backend's bit for bit.
//   cuda::dropout_apply(args, x, stream)     x *= keep / (1 - p) in place (device pointer)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/cuda_common.cuh"
#include "trellis/kernels/dropout.hpp"

namespace trellis::kernels::cuda {

namespace device {
template <class T>
__global__ void dropout_kernel(DropoutArgs a, T* x, float scale) {
  const std::int64_t n = a.rows * a.width;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = i / a.width, c = i % a.width;
    const bool keep = dropout_keep(dropout_key_of_row(a, r), c, a.p);
    x[i] = from_float<T>(keep ? to_float(x[i]) * scale : 0.0f);
  }
}
}  // namespace device

template <class T>
void dropout_apply(const DropoutArgs& a, T* x, cudaStream_t stream) {
  TRELLIS_CHECK(a.p >= 0.0f && a.p < 1.0f && a.batch > 0 && a.rows >= 0 && a.width >= 0 && a.row0 >= 0,
                "dropout: p=", a.p, " batch=", a.batch, " rows=", a.rows, " width=", a.width, " row0=", a.row0);
  const std::int64_t n = a.rows * a.width;
  if (n == 0) return;
  device::dropout_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(a, x, 1.0f / (1.0f - a.p));
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace trellis::kernels::cuda
