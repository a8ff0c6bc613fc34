// CUDA LayerNorm and RMSNorm over the last dimension of [rows, dim], same contracts as
// kernels/norms_host.hpp (fused residual add, fp32 statistics, dinput overwritten or added to,
// dweight/dbias always ADDED to):
//   cuda::layernorm_forward(rows, dim, x, weight, bias, out, mean, rstd, eps, stream [, residual, sum_out]);
//   cuda::layernorm_backward(rows, dim, dout, input, weight, mean, rstd, dinput, dweight, dbias,
//                            workspace, workspace_bytes, stream [, accumulate_dinput]);
//   cuda::rmsnorm_forward / cuda::rmsnorm_backward: the same without mean and bias.
// One warp per row. Weight gradients are deterministic column sums over fixed row chunks
// (workspace: norm_backward_workspace_bytes(rows, dim)).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/cuda_common.cuh"

namespace trellis::kernels::cuda {

namespace device {

inline constexpr int kNormRowsPerBlock = 8;  // warps per block, one row each

// Reads element j of the (summed) input row; with a residual it writes the rounded sum first.
template <class T>
__device__ __forceinline__ float norm_input(const T* xr, const T* rr, T* sr, std::int64_t j) {
  if (rr == nullptr) return to_float(xr[j]);
  T s = from_float<T>(to_float(xr[j]) + to_float(rr[j]));
  sr[j] = s;
  return to_float(s);  // normalise what is stored, as the host does
}

template <class T, class W, bool Layer>
__global__ void norm_forward_kernel(std::int64_t rows, std::int64_t dim, const T* __restrict__ x,
                                    const W* __restrict__ weight, const W* __restrict__ bias, T* __restrict__ out,
                                    float* __restrict__ mean, float* __restrict__ rstd, float eps, const T* residual,
                                    T* sum_out) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kNormRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const T* xr = x + r * dim;
  const T* rr = residual ? residual + r * dim : nullptr;
  T* sr = residual ? sum_out + r * dim : nullptr;
  const T* src = residual ? static_cast<const T*>(sr) : xr;  // second pass reads the stored sum
  float sum = 0.0f;
  for (std::int64_t j = lane; j < dim; j += 32) sum += norm_input(xr, rr, sr, j);
  sum = warp_sum(sum);
  const float mu = Layer ? sum / static_cast<float>(dim) : 0.0f;
  float var = 0.0f;
  for (std::int64_t j = lane; j < dim; j += 32) {
    float d = to_float(src[j]) - mu;
    var += d * d;
  }
  var = warp_sum(var) / static_cast<float>(dim);
  const float rs = rsqrtf(var + eps);
  T* o = out + r * dim;
  for (std::int64_t j = lane; j < dim; j += 32) {
    float y = (to_float(src[j]) - mu) * rs * to_float(weight[j]);
    if (Layer && bias) y += to_float(bias[j]);
    o[j] = from_float<T>(y);
  }
  if (lane == 0) {
    if (Layer && mean) mean[r] = mu;
    if (rstd) rstd[r] = rs;
  }
}

template <class T, class W, bool Layer>
__global__ void norm_backward_input_kernel(std::int64_t rows, std::int64_t dim, const T* __restrict__ dout,
                                           const T* __restrict__ input, const W* __restrict__ weight,
                                           const float* __restrict__ mean, const float* __restrict__ rstd,
                                           T* __restrict__ dinput, bool accumulate) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * kNormRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float mu = Layer ? mean[r] : 0.0f, rs = rstd[r];
  const T* xr = input + r * dim;
  const T* dr = dout + r * dim;
  float g_sum = 0.0f, gx_sum = 0.0f;
  for (std::int64_t j = lane; j < dim; j += 32) {
    float g = to_float(dr[j]) * to_float(weight[j]);
    g_sum += g;
    gx_sum += g * (to_float(xr[j]) - mu) * rs;
  }
  const float g_mean = Layer ? warp_sum(g_sum) / static_cast<float>(dim) : 0.0f;
  const float gx_mean = warp_sum(gx_sum) / static_cast<float>(dim);
  T* dx = dinput + r * dim;
  for (std::int64_t j = lane; j < dim; j += 32) {
    float g = to_float(dr[j]) * to_float(weight[j]);
    float xh = (to_float(xr[j]) - mu) * rs;
    float v = rs * (g - g_mean - xh * gx_mean);
    dx[j] = from_float<T>(accumulate ? to_float(dx[j]) + v : v);
  }
}

// f(r, j) = dout[r, j] * xhat[r, j]  (weight gradient term)
template <class T, bool Layer>
struct NormWeightGradTerm {
  const T* dout;
  const T* input;
  const float* mean;
  const float* rstd;
  std::int64_t dim;
  __device__ float operator()(std::int64_t r, std::int64_t j) const {
    float mu = Layer ? mean[r] : 0.0f;
    return to_float(dout[r * dim + j]) * (to_float(input[r * dim + j]) - mu) * rstd[r];
  }
};
template <class T>
struct RowElement {
  const T* x;
  std::int64_t dim;
  __device__ float operator()(std::int64_t r, std::int64_t j) const { return to_float(x[r * dim + j]); }
};

}  // namespace device

// Workspace for layernorm_backward / rmsnorm_backward (two column sums).
inline std::size_t norm_backward_workspace_bytes(std::int64_t rows, std::int64_t dim) {
  return column_sums_workspace_bytes(rows, dim, 2);
}

namespace detail {
inline void check_norm(const char* what, std::int64_t rows, std::int64_t dim) {
  TRELLIS_CHECK(rows >= 0 && dim > 0, what, ": bad shape rows=", rows, " dim=", dim);
  TRELLIS_CHECK((rows + device::kNormRowsPerBlock - 1) / device::kNormRowsPerBlock <= 0x7fffffffLL, what,
                ": too many rows");
}
inline unsigned norm_blocks(std::int64_t rows) {
  return static_cast<unsigned>((rows + device::kNormRowsPerBlock - 1) / device::kNormRowsPerBlock);
}
}  // namespace detail

template <class T, class W>
void layernorm_forward(std::int64_t rows, std::int64_t dim, const T* x, const W* weight, const W* bias, T* out,
                       float* mean, float* rstd, float eps, cudaStream_t stream, const T* residual = nullptr,
                       T* sum_out = nullptr) {
  detail::check_norm("layernorm_forward", rows, dim);
  TRELLIS_CHECK(x && out && weight, "layernorm_forward: null x, out or weight");
  TRELLIS_CHECK(!residual || sum_out, "layernorm_forward: a residual needs sum_out for the summed input");
  if (rows == 0) return;
  device::norm_forward_kernel<T, W, true><<<detail::norm_blocks(rows), 32 * device::kNormRowsPerBlock, 0, stream>>>(
      rows, dim, x, weight, bias, out, mean, rstd, eps, residual, sum_out);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T, class W>
void rmsnorm_forward(std::int64_t rows, std::int64_t dim, const T* x, const W* weight, T* out, float* rstd, float eps,
                     cudaStream_t stream, const T* residual = nullptr, T* sum_out = nullptr) {
  detail::check_norm("rmsnorm_forward", rows, dim);
  TRELLIS_CHECK(x && out && weight, "rmsnorm_forward: null x, out or weight");
  TRELLIS_CHECK(!residual || sum_out, "rmsnorm_forward: a residual needs sum_out for the summed input");
  if (rows == 0) return;
  device::norm_forward_kernel<T, W, false><<<detail::norm_blocks(rows), 32 * device::kNormRowsPerBlock, 0, stream>>>(
      rows, dim, x, weight, static_cast<const W*>(nullptr), out, nullptr, rstd, eps, residual, sum_out);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T, class W>
void layernorm_backward(std::int64_t rows, std::int64_t dim, const T* dout, const T* input, const W* weight,
                        const float* mean, const float* rstd, T* dinput, W* dweight, W* dbias, void* workspace,
                        std::size_t workspace_bytes, cudaStream_t stream, bool accumulate_dinput = false) {
  detail::check_norm("layernorm_backward", rows, dim);
  TRELLIS_CHECK(dout && input && weight && mean && rstd && dinput, "layernorm_backward: null pointer");
  TRELLIS_CHECK(workspace_bytes >= norm_backward_workspace_bytes(rows, dim), "layernorm_backward: workspace of ",
                workspace_bytes, " bytes, needs ", norm_backward_workspace_bytes(rows, dim));
  if (rows > 0) {
    device::norm_backward_input_kernel<T, W, true>
        <<<detail::norm_blocks(rows), 32 * device::kNormRowsPerBlock, 0, stream>>>(rows, dim, dout, input, weight,
                                                                                   mean, rstd, dinput,
                                                                                   accumulate_dinput);
    TRELLIS_CHECK_CUDA(cudaGetLastError());
  }
  float* partial = static_cast<float*>(workspace);
  if (dweight)
    detail::launch_column_sums(rows, dim, device::NormWeightGradTerm<T, true>{dout, input, mean, rstd, dim}, dweight,
                               true, partial, stream);
  if (dbias)
    detail::launch_column_sums(rows, dim, device::RowElement<T>{dout, dim}, dbias, true,
                               partial + column_sums_workspace_bytes(rows, dim) / sizeof(float), stream);
}

template <class T, class W>
void rmsnorm_backward(std::int64_t rows, std::int64_t dim, const T* dout, const T* input, const W* weight,
                      const float* rstd, T* dinput, W* dweight, void* workspace, std::size_t workspace_bytes,
                      cudaStream_t stream, bool accumulate_dinput = false) {
  detail::check_norm("rmsnorm_backward", rows, dim);
  TRELLIS_CHECK(dout && input && weight && rstd && dinput, "rmsnorm_backward: null pointer");
  TRELLIS_CHECK(workspace_bytes >= norm_backward_workspace_bytes(rows, dim), "rmsnorm_backward: workspace of ",
                workspace_bytes, " bytes, needs ", norm_backward_workspace_bytes(rows, dim));
  if (rows > 0) {
    device::norm_backward_input_kernel<T, W, false>
        <<<detail::norm_blocks(rows), 32 * device::kNormRowsPerBlock, 0, stream>>>(
            rows, dim, dout, input, weight, static_cast<const float*>(nullptr), rstd, dinput, accumulate_dinput);
    TRELLIS_CHECK_CUDA(cudaGetLastError());
  }
  if (dweight)
    detail::launch_column_sums(rows, dim, device::NormWeightGradTerm<T, false>{dout, input, nullptr, rstd, dim},
                               dweight, true, static_cast<float*>(workspace), stream);
}

}  // namespace trellis::kernels::cuda
