// CUDA multi-tensor AdamW and global gradient norm, same contracts as kernels/adamw_host.hpp
// (AdamWConfig, AdamWTensor: fp32 params and moments, fp32/half/bfloat16 grads; spans hold
// device pointers here):
//   cuda::adamw_step(tensors, config, step, grad_scale, stream);
//   cuda::grad_norm_squared(grads, out, workspace, workspace_bytes, stream);  // *out (device double)
//       = sum of squares of every element (fp64 partial sums per fixed chunk, added in order:
//         deterministic); workspace: grad_norm_workspace_bytes(grads)
// Many tensors go into one launch: the kernel argument carries up to kAdamWTensorsPerLaunch
// descriptors, each block finds its tensor and chunk from a prefix table (no device allocation).
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/adamw_host.hpp"
#include "trellis/kernels/cuda_common.cuh"

namespace trellis::kernels::cuda {

inline constexpr int kAdamWTensorsPerLaunch = 32;
inline constexpr std::int64_t kOptimChunk = 8192;  // elements per block
inline constexpr int kOptimThreads = 256;

namespace device {

template <class G>
struct MultiTensorBatch {
  int count = 0;
  float* param[kAdamWTensorsPerLaunch];
  const G* grad[kAdamWTensorsPerLaunch];
  float* m[kAdamWTensorsPerLaunch];
  float* v[kAdamWTensorsPerLaunch];
  std::int64_t size[kAdamWTensorsPerLaunch];
  float decay[kAdamWTensorsPerLaunch];
  int first_block[kAdamWTensorsPerLaunch + 1];  // prefix sums of chunks per tensor
};

template <class G>
__device__ __forceinline__ int find_tensor(const MultiTensorBatch<G>& batch, int block) {
  int t = 0;
  while (t + 1 < batch.count && batch.first_block[t + 1] <= block) ++t;
  return t;
}

template <class G>
__global__ void __launch_bounds__(kOptimThreads) adamw_kernel(MultiTensorBatch<G> batch, float grad_scale, float b1,
                                                              float b2, float eps, float step_size,
                                                              float inv_sqrt_bc2) {
  const int t = find_tensor(batch, blockIdx.x);
  const std::int64_t e0 = static_cast<std::int64_t>(blockIdx.x - batch.first_block[t]) * kOptimChunk;
  const std::int64_t e1 = e0 + kOptimChunk < batch.size[t] ? e0 + kOptimChunk : batch.size[t];
  float* p = batch.param[t];
  float* m = batch.m[t];
  float* v = batch.v[t];
  const G* g = batch.grad[t];
  const float decay = batch.decay[t];
  for (std::int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
    const float gs = grad_scale * to_float(g[e]);
    const float mn = b1 * m[e] + (1.0f - b1) * gs;
    const float vn = b2 * v[e] + (1.0f - b2) * gs * gs;
    m[e] = mn;
    v[e] = vn;
    p[e] = p[e] * decay - step_size * mn / (sqrtf(vn) * inv_sqrt_bc2 + eps);
  }
}

template <class G>
__global__ void __launch_bounds__(kOptimThreads) sum_squares_kernel(MultiTensorBatch<G> batch,
                                                                    double* __restrict__ partial) {
  using BlockReduce = cub::BlockReduce<double, kOptimThreads>;
  __shared__ typename BlockReduce::TempStorage storage;
  const int t = find_tensor(batch, blockIdx.x);
  const std::int64_t e0 = static_cast<std::int64_t>(blockIdx.x - batch.first_block[t]) * kOptimChunk;
  const std::int64_t e1 = e0 + kOptimChunk < batch.size[t] ? e0 + kOptimChunk : batch.size[t];
  const G* g = batch.grad[t];
  double sum = 0.0;
  for (std::int64_t e = e0 + threadIdx.x; e < e1; e += blockDim.x) {
    const double x = to_float(g[e]);
    sum += x * x;
  }
  sum = BlockReduce(storage).Sum(sum);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// One block: out = (accumulate ? *out : 0) + sum of partials, in a fixed order.
// A template only so that the header can be included by several translation units (ODR).
template <int Unused = 0>
__global__ void __launch_bounds__(kOptimThreads) sum_partials_kernel(const double* __restrict__ partial,
                                                                     std::int64_t count, double* out,
                                                                     bool accumulate) {
  using BlockReduce = cub::BlockReduce<double, kOptimThreads>;
  __shared__ typename BlockReduce::TempStorage storage;
  double sum = 0.0;
  for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partial[i];
  sum = BlockReduce(storage).Sum(sum);
  if (threadIdx.x == 0) *out = (accumulate ? *out : 0.0) + sum;
}

}  // namespace device

namespace detail {
inline int chunks_of(std::int64_t n) { return static_cast<int>((n + kOptimChunk - 1) / kOptimChunk); }
}  // namespace detail

template <class G>
void adamw_step(std::span<const AdamWTensor<G>> tensors, const AdamWConfig& config, std::int64_t step,
                float grad_scale, cudaStream_t stream) {
  const kernels::detail::AdamWScalars scalars = kernels::detail::adamw_prepare(tensors, config, step);
  const float step_size = scalars.step_size, inv_sqrt_bc2 = scalars.inv_sqrt_bc2;
  device::MultiTensorBatch<G> batch;
  auto flush = [&] {
    if (batch.count == 0) return;
    if (batch.first_block[batch.count] > 0) {
      device::adamw_kernel<G><<<static_cast<unsigned>(batch.first_block[batch.count]), kOptimThreads, 0, stream>>>(
          batch, grad_scale, config.beta1, config.beta2, config.eps, step_size, inv_sqrt_bc2);
      TRELLIS_CHECK_CUDA(cudaGetLastError());
    }
    batch.count = 0;
  };
  batch.first_block[0] = 0;
  for (const auto& x : tensors) {
    if (x.param.empty()) continue;
    const int c = batch.count;
    batch.param[c] = x.param.data(), batch.grad[c] = x.grad.data(), batch.m[c] = x.m.data(), batch.v[c] = x.v.data();
    batch.size[c] = static_cast<std::int64_t>(x.param.size());
    batch.decay[c] = 1.0f - config.lr * config.weight_decay * x.decay_mult;
    batch.first_block[c + 1] = batch.first_block[c] + detail::chunks_of(batch.size[c]);
    batch.count = c + 1;
    if (batch.count == kAdamWTensorsPerLaunch) flush(), batch.first_block[0] = 0;
  }
  flush();
}

// Workspace bytes for grad_norm_squared over these tensors (one double per chunk).
template <class G>
std::size_t grad_norm_workspace_bytes(std::span<const std::span<const G>> grads) {
  std::size_t chunks = 0;
  for (const auto& g : grads) chunks += static_cast<std::size_t>(detail::chunks_of(static_cast<std::int64_t>(g.size())));
  return (chunks > 0 ? chunks : 1) * sizeof(double);
}

// *out (device) = sum of squares of all elements of all grads.
template <class G>
void grad_norm_squared(std::span<const std::span<const G>> grads, double* out, void* workspace,
                       std::size_t workspace_bytes, cudaStream_t stream) {
  TRELLIS_CHECK(out != nullptr, "grad_norm_squared: null output");
  TRELLIS_CHECK(workspace && workspace_bytes >= grad_norm_workspace_bytes(grads), "grad_norm_squared: workspace of ",
                workspace_bytes, " bytes, needs ", grad_norm_workspace_bytes(grads));
  double* partial = static_cast<double*>(workspace);
  std::int64_t written = 0;
  device::MultiTensorBatch<G> batch;
  batch.first_block[0] = 0;
  auto flush = [&] {
    if (batch.count == 0) return;
    const int blocks = batch.first_block[batch.count];
    if (blocks > 0) {
      device::sum_squares_kernel<G><<<static_cast<unsigned>(blocks), kOptimThreads, 0, stream>>>(batch, partial + written);
      TRELLIS_CHECK_CUDA(cudaGetLastError());
    }
    written += blocks;
    batch.count = 0;
    batch.first_block[0] = 0;
  };
  for (const auto& g : grads) {
    if (g.empty()) continue;
    const int c = batch.count;
    batch.grad[c] = g.data();
    batch.size[c] = static_cast<std::int64_t>(g.size());
    batch.first_block[c + 1] = batch.first_block[c] + detail::chunks_of(batch.size[c]);
    batch.count = c + 1;
    if (batch.count == kAdamWTensorsPerLaunch) flush();
  }
  flush();
  device::sum_partials_kernel<0><<<1, kOptimThreads, 0, stream>>>(partial, written, out, false);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace trellis::kernels::cuda
