// Device helpers shared by the CUDA training kernels (nvcc): element loads/stores through fp32,
// warp and block reductions, and the deterministic column-sum pattern (partial sums per fixed
// chunk of rows into a workspace, then the chunks added in order).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace trellis::kernels::cuda {

namespace device {

template <class T>
__device__ __forceinline__ float to_float(T v) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return __uint_as_float(static_cast<std::uint32_t>(v.bits) << 16);
  } else if constexpr (std::is_same_v<T, half>) {
    return __half2float(__ushort_as_half(v.bits));
  } else {
    return static_cast<float>(v);
  }
}

template <class T>
__device__ __forceinline__ T from_float(float f) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    return bfloat16(from_bits, __bfloat16_as_ushort(__float2bfloat16_rn(f)));
  } else if constexpr (std::is_same_v<T, half>) {
    return half(from_bits, __half_as_ushort(__float2half_rn(f)));
  } else {
    return static_cast<T>(f);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ __forceinline__ float block_sum(float v, float* scratch /* [32] shared */) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

// Max over the block, like block_sum.
__device__ __forceinline__ float block_max(float v, float* scratch /* [32] shared */) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < warps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

// Column partial sums: partial[chunk, j] = sum over rows r in chunk of f(r, j). grid (ceil(cols /
// blockDim.x), chunks); each thread owns one column of one chunk (coalesced along j).
template <class F>
__global__ void column_partials_kernel(std::int64_t rows, std::int64_t cols, std::int64_t rows_per_chunk,
                                       float* __restrict__ partial, F f) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t chunk = blockIdx.y;
  if (j >= cols) return;
  const std::int64_t r0 = chunk * rows_per_chunk;
  const std::int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  float sum = 0.0f;
  for (std::int64_t r = r0; r < r1; ++r) sum += f(r, j);
  partial[chunk * cols + j] = sum;
}

// dst[j] = (accumulate ? dst[j] : 0) + sum over chunks, in chunk order.
template <class S>
__global__ void column_finish_kernel(std::int64_t chunks, std::int64_t cols, const float* __restrict__ partial,
                                     S* __restrict__ dst, bool accumulate) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  float sum = accumulate ? to_float(dst[j]) : 0.0f;
  for (std::int64_t c = 0; c < chunks; ++c) sum += partial[c * cols + j];
  dst[j] = from_float<S>(sum);
}

}  // namespace device

// Rows summed per chunk by the deterministic column sums.
inline constexpr std::int64_t column_chunk_rows = 256;

inline std::int64_t column_chunks(std::int64_t rows) {
  return rows <= 0 ? 0 : (rows + column_chunk_rows - 1) / column_chunk_rows;
}
// Workspace bytes for `sums` column sums of a rows x cols problem.
inline std::size_t column_sums_workspace_bytes(std::int64_t rows, std::int64_t cols, int sums = 1) {
  std::size_t bytes = static_cast<std::size_t>(column_chunks(rows)) * static_cast<std::size_t>(cols) * sizeof(float);
  bytes = (bytes + 255) / 256 * 256;
  return bytes * static_cast<std::size_t>(sums);
}

namespace detail {
// Launches partials + finish for one column sum; `partial` has column_sums_workspace_bytes(rows, cols).
template <class S, class F>
void launch_column_sums(std::int64_t rows, std::int64_t cols, F f, S* dst, bool accumulate, float* partial,
                        cudaStream_t stream) {
  if (cols <= 0) return;
  const std::int64_t chunks = column_chunks(rows);
  const unsigned blocks_x = static_cast<unsigned>((cols + 255) / 256);
  if (chunks > 0) {
    TRELLIS_CHECK(chunks <= 65535, "column sums: ", rows, " rows exceed the grid limit");
    device::column_partials_kernel<<<dim3(blocks_x, static_cast<unsigned>(chunks)), 256, 0, stream>>>(
        rows, cols, column_chunk_rows, partial, f);
    TRELLIS_CHECK_CUDA(cudaGetLastError());
  }
  device::column_finish_kernel<S><<<blocks_x, 256, 0, stream>>>(chunks, cols, partial, dst, accumulate);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

inline unsigned grid_for(std::int64_t n, int threads, std::int64_t max_blocks = 0x7fffffffLL) {
  std::int64_t blocks = (n + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks < max_blocks ? blocks : max_blocks);
}
}  // namespace detail

}  // namespace trellis::kernels::cuda
