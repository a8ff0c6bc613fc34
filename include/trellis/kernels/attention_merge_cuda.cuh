// CUDA twin of host::merge_attention_partials (kernels/attention_host.hpp): folds a partial
// attention result (o_part, lse_part) into an accumulator, row by row, with the scalar rule of
// kernels/attention.hpp (merge_partials_row), in fp32. Ring attention calls it once per kv block.
//   cuda::merge_attention_partials(rows, head_dim, o_acc, lse_acc, o_part, lse_part, stream)
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/cuda_common.cuh"

namespace trellis::kernels::cuda {

namespace device {
// One thread per row: rows are batch x heads x chunk (thousands), head_dim 64..128.
template <class T>
__global__ void merge_partials_kernel(std::int64_t rows, std::int64_t head_dim, T* o_acc, float* lse_acc,
                                      const T* o_part, const float* lse_part) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float a = lse_acc[r], b = lse_part[r];
  if (b == -INFINITY) return;
  T* acc = o_acc + r * head_dim;
  const T* part = o_part + r * head_dim;
  if (a == -INFINITY) {
    for (std::int64_t p = 0; p < head_dim; ++p) acc[p] = part[p];
    lse_acc[r] = b;
    return;
  }
  const float hi = fmaxf(a, b), wa = expf(a - hi), wb = expf(b - hi), total = wa + wb;
  for (std::int64_t p = 0; p < head_dim; ++p)
    acc[p] = from_float<T>((to_float(acc[p]) * wa + to_float(part[p]) * wb) / total);
  lse_acc[r] = hi + logf(total);
}
}  // namespace device

template <class T>
void merge_attention_partials(std::int64_t rows, std::int64_t head_dim, T* o_acc, float* lse_acc, const T* o_part,
                              const float* lse_part, cudaStream_t stream) {
  TRELLIS_CHECK(rows >= 0 && head_dim > 0, "merge_attention_partials: bad shape rows=", rows, " head_dim=", head_dim);
  if (rows == 0) return;
  device::merge_partials_kernel<<<detail::grid_for(rows, 128), 128, 0, stream>>>(rows, head_dim, o_acc, lse_acc,
                                                                                   o_part, lse_part);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace trellis::kernels::cuda
