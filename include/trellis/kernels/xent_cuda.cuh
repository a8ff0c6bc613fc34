// CUDA softmax cross-entropy over logits [rows, vocab] (row stride ld), same contracts as
// kernels/xent_host.hpp: never materialises the probabilities; one block per row reads the row
// once for its online max / sum of exponentials and once more to write d logits.
//   cuda::softmax_xent_forward(rows, vocab, ld, logits, targets, loss, lse, stream);
//   cuda::softmax_xent_backward(rows, vocab, ld, logits, targets, lse, grad_scale, dlogits, ld_grad, stream);
//   cuda::softmax_xent_forward_backward(rows, vocab, ld, logits, targets, loss, grad_scale, dlogits,
//                                       ld_grad, stream [, lse]);   dlogits may alias logits
// loss_r = lse_r - logit[r, target_r]; d logits = grad_scale (softmax - onehot); target < 0: loss 0,
// zero gradient. A target >= vocab cannot raise an error from the device: the row gets loss NaN.
//
// Vocab-parallel pieces (this rank holds columns [vocab_start, vocab_start + vocab_local)), the
// caller runs the all-reduces in between, as with the host kernels:
//   xent_partial_max -> all_reduce(max) -> xent_partial_sumexp -> all_reduce(sum);
//   xent_partial_target -> all_reduce(sum); xent_finish -> loss, lse; xent_backward_sharded.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/cuda_common.cuh"

namespace trellis::kernels::cuda {

namespace device {

inline constexpr int kXentThreads = 256;

// (max, sum of exp(x - max)) pairs merge associatively.
__device__ __forceinline__ void merge_max_sum(float& m, float& s, float m2, float s2) {
  float hi = fmaxf(m, m2);
  if (hi == -INFINITY) return;  // both empty
  s = s * __expf(m - hi) + s2 * __expf(m2 - hi);
  m = hi;
}

template <class T>
__device__ float row_lse(const T* x, std::int64_t vocab) {
  __shared__ float shared_m[32], shared_s[32];
  float m = -INFINITY, s = 0.0f;
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    float v = to_float(x[j]);
    if (v > m) {
      s = s * __expf(m - v) + 1.0f;
      m = v;
    } else {
      s += __expf(v - m);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, offset), s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    merge_max_sum(m, s, m2, s2);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (lane == 0) shared_m[warp] = m, shared_s[warp] = s;
  __syncthreads();
  m = lane < warps ? shared_m[lane] : -INFINITY;
  s = lane < warps ? shared_s[lane] : 0.0f;
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, offset), s2 = __shfl_xor_sync(0xffffffffu, s, offset);
    merge_max_sum(m, s, m2, s2);
  }
  return m + logf(s);
}

// g = grad_scale (softmax - onehot(target_local)); an ignored row gets 0. target_local may lie
// outside [0, vocab) (the target is another rank's column).
template <class T, class G>
__device__ void write_row_grad(const T* x, std::int64_t vocab, float lse, std::int64_t target_local, bool ignored,
                               float grad_scale, G* g) {
  for (std::int64_t j = threadIdx.x; j < vocab; j += blockDim.x) {
    float p = ignored ? 0.0f : __expf(to_float(x[j]) - lse);
    float d = ignored ? 0.0f : grad_scale * (p - (j == target_local ? 1.0f : 0.0f));
    g[j] = from_float<G>(d);
  }
}

template <class T>
__global__ void xent_forward_kernel(std::int64_t vocab, std::int64_t ld, const T* __restrict__ logits,
                                    const std::int32_t* __restrict__ targets, float* __restrict__ loss,
                                    float* __restrict__ lse) {
  const std::int64_t r = blockIdx.x;
  const T* x = logits + r * ld;
  const std::int32_t t = targets[r];
  float l = row_lse(x, vocab);
  if (threadIdx.x == 0) {
    if (lse) lse[r] = l;
    loss[r] = t < 0 ? 0.0f : (t < vocab ? l - to_float(x[t]) : NAN);
  }
}

template <class T, class G>
__global__ void xent_backward_kernel(std::int64_t vocab, std::int64_t ld, const T* __restrict__ logits,
                                     const std::int32_t* __restrict__ targets, const float* __restrict__ lse,
                                     float grad_scale, G* __restrict__ dlogits, std::int64_t ld_grad) {
  const std::int64_t r = blockIdx.x;
  write_row_grad(logits + r * ld, vocab, lse[r], targets[r], targets[r] < 0, grad_scale, dlogits + r * ld_grad);
}

// Not __restrict__: dlogits may alias logits (each element is read, then written, by one thread).
template <class T, class G>
__global__ void xent_forward_backward_kernel(std::int64_t vocab, std::int64_t ld, const T* logits,
                                             const std::int32_t* targets, float* loss, float grad_scale, G* dlogits,
                                             std::int64_t ld_grad, float* lse) {
  const std::int64_t r = blockIdx.x;
  const T* x = logits + r * ld;
  const std::int32_t t = targets[r];
  const float target_logit = (t >= 0 && t < vocab) ? to_float(x[t]) : 0.0f;  // before any in-place write
  float l = row_lse(x, vocab);  // ends with every thread past a __syncthreads: all reads of x done
  __syncthreads();
  if (threadIdx.x == 0) {
    if (lse) lse[r] = l;
    loss[r] = t < 0 ? 0.0f : (t < vocab ? l - target_logit : NAN);
  }
  write_row_grad(x, vocab, l, t, t < 0, grad_scale, dlogits + r * ld_grad);
}

template <class T>
__global__ void xent_partial_max_kernel(std::int64_t vocab_local, std::int64_t ld, const T* __restrict__ logits,
                                        float* __restrict__ row_max) {
  __shared__ float scratch[32];
  const T* x = logits + static_cast<std::int64_t>(blockIdx.x) * ld;
  float m = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < vocab_local; j += blockDim.x) m = fmaxf(m, to_float(x[j]));
  m = block_max(m, scratch);
  if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

template <class T>
__global__ void xent_partial_sumexp_kernel(std::int64_t vocab_local, std::int64_t ld, const T* __restrict__ logits,
                                           const float* __restrict__ global_max, float* __restrict__ sumexp) {
  __shared__ float scratch[32];
  const T* x = logits + static_cast<std::int64_t>(blockIdx.x) * ld;
  const float m = global_max[blockIdx.x];
  float s = 0.0f;
  for (std::int64_t j = threadIdx.x; j < vocab_local; j += blockDim.x) s += __expf(to_float(x[j]) - m);
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) sumexp[blockIdx.x] = s;
}

template <class T>
__global__ void xent_partial_target_kernel(std::int64_t rows, std::int64_t vocab_local, std::int64_t ld,
                                           const T* __restrict__ logits, const std::int32_t* __restrict__ targets,
                                           std::int64_t vocab_start, float* __restrict__ target_logit) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const std::int64_t t = targets[r] - vocab_start;
  target_logit[r] = targets[r] >= 0 && t >= 0 && t < vocab_local ? to_float(logits[r * ld + t]) : 0.0f;
}

// A template only so that the header can be included by several translation units (ODR).
template <int Unused = 0>
__global__ void xent_finish_kernel(std::int64_t rows, const float* __restrict__ global_max,
                                   const float* __restrict__ global_sumexp, const float* __restrict__ target_logit,
                                   const std::int32_t* __restrict__ targets, float* __restrict__ loss,
                                   float* __restrict__ lse) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const float l = global_max[r] + logf(global_sumexp[r]);
  if (lse) lse[r] = l;
  loss[r] = targets[r] < 0 ? 0.0f : l - target_logit[r];
}

template <class T, class G>
__global__ void xent_backward_sharded_kernel(std::int64_t vocab_local, std::int64_t ld, const T* logits,
                                             const std::int32_t* __restrict__ targets, std::int64_t vocab_start,
                                             const float* __restrict__ lse, float grad_scale, G* dlogits,
                                             std::int64_t ld_grad) {
  const std::int64_t r = blockIdx.x;
  write_row_grad(logits + r * ld, vocab_local, lse[r], targets[r] - vocab_start, targets[r] < 0, grad_scale,
                 dlogits + r * ld_grad);
}

}  // namespace device

namespace detail {
inline void check_xent(const char* what, std::int64_t rows, std::int64_t vocab, std::int64_t ld) {
  TRELLIS_CHECK(rows >= 0 && vocab > 0 && ld >= vocab, what, ": bad shape rows=", rows, " vocab=", vocab, " ld=", ld);
  TRELLIS_CHECK(rows <= 0x7fffffffLL, what, ": too many rows (", rows, ")");
}
}  // namespace detail

template <class T>
void softmax_xent_forward(std::int64_t rows, std::int64_t vocab, std::int64_t ld, const T* logits,
                          const std::int32_t* targets, float* loss, float* lse, cudaStream_t stream) {
  detail::check_xent("softmax_xent_forward", rows, vocab, ld);
  TRELLIS_CHECK(logits && targets && loss, "softmax_xent_forward: null pointer");
  if (rows == 0) return;
  device::xent_forward_kernel<<<static_cast<unsigned>(rows), device::kXentThreads, 0, stream>>>(vocab, ld, logits,
                                                                                               targets, loss, lse);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T, class G>
void softmax_xent_backward(std::int64_t rows, std::int64_t vocab, std::int64_t ld, const T* logits,
                           const std::int32_t* targets, const float* lse, float grad_scale, G* dlogits,
                           std::int64_t ld_grad, cudaStream_t stream) {
  detail::check_xent("softmax_xent_backward", rows, vocab, ld);
  TRELLIS_CHECK(ld_grad >= vocab, "softmax_xent_backward: ld_grad ", ld_grad, " < vocab ", vocab);
  TRELLIS_CHECK(logits && targets && lse && dlogits, "softmax_xent_backward: null pointer");
  if (rows == 0) return;
  device::xent_backward_kernel<<<static_cast<unsigned>(rows), device::kXentThreads, 0, stream>>>(
      vocab, ld, logits, targets, lse, grad_scale, dlogits, ld_grad);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T, class G>
void softmax_xent_forward_backward(std::int64_t rows, std::int64_t vocab, std::int64_t ld, const T* logits,
                                   const std::int32_t* targets, float* loss, float grad_scale, G* dlogits,
                                   std::int64_t ld_grad, cudaStream_t stream, float* lse = nullptr) {
  detail::check_xent("softmax_xent_forward_backward", rows, vocab, ld);
  TRELLIS_CHECK(ld_grad >= vocab, "softmax_xent_forward_backward: ld_grad ", ld_grad, " < vocab ", vocab);
  TRELLIS_CHECK(logits && targets && loss && dlogits, "softmax_xent_forward_backward: null pointer");
  if (rows == 0) return;
  device::xent_forward_backward_kernel<<<static_cast<unsigned>(rows), device::kXentThreads, 0, stream>>>(
      vocab, ld, logits, targets, loss, grad_scale, dlogits, ld_grad, lse);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

// ---- vocab-parallel pieces ------------------------------------------------------------------

template <class T>
void xent_partial_max(std::int64_t rows, std::int64_t vocab_local, std::int64_t ld, const T* logits, float* row_max,
                      cudaStream_t stream) {
  detail::check_xent("xent_partial_max", rows, vocab_local, ld);
  if (rows == 0) return;
  device::xent_partial_max_kernel<<<static_cast<unsigned>(rows), device::kXentThreads, 0, stream>>>(vocab_local, ld,
                                                                                                   logits, row_max);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T>
void xent_partial_sumexp(std::int64_t rows, std::int64_t vocab_local, std::int64_t ld, const T* logits,
                         const float* global_max, float* sumexp, cudaStream_t stream) {
  detail::check_xent("xent_partial_sumexp", rows, vocab_local, ld);
  if (rows == 0) return;
  device::xent_partial_sumexp_kernel<<<static_cast<unsigned>(rows), device::kXentThreads, 0, stream>>>(
      vocab_local, ld, logits, global_max, sumexp);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T>
void xent_partial_target(std::int64_t rows, std::int64_t vocab_local, std::int64_t ld, const T* logits,
                         const std::int32_t* targets, std::int64_t vocab_start, float* target_logit,
                         cudaStream_t stream) {
  detail::check_xent("xent_partial_target", rows, vocab_local, ld);
  if (rows == 0) return;
  device::xent_partial_target_kernel<<<detail::grid_for(rows, 256), 256, 0, stream>>>(rows, vocab_local, ld, logits,
                                                                                      targets, vocab_start,
                                                                                      target_logit);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

inline void xent_finish(std::int64_t rows, const float* global_max, const float* global_sumexp,
                        const float* target_logit, const std::int32_t* targets, float* loss, float* lse,
                        cudaStream_t stream) {
  TRELLIS_CHECK(rows >= 0, "xent_finish: negative rows ", rows);
  if (rows == 0) return;
  device::xent_finish_kernel<0><<<detail::grid_for(rows, 256), 256, 0, stream>>>(rows, global_max, global_sumexp,
                                                                             target_logit, targets, loss, lse);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T, class G>
void xent_backward_sharded(std::int64_t rows, std::int64_t vocab_local, std::int64_t ld, const T* logits,
                           const std::int32_t* targets, std::int64_t vocab_start, const float* lse, float grad_scale,
                           G* dlogits, std::int64_t ld_grad, cudaStream_t stream) {
  detail::check_xent("xent_backward_sharded", rows, vocab_local, ld);
  TRELLIS_CHECK(ld_grad >= vocab_local, "xent_backward_sharded: ld_grad ", ld_grad, " < vocab_local ", vocab_local);
  if (rows == 0) return;
  device::xent_backward_sharded_kernel<<<static_cast<unsigned>(rows), device::kXentThreads, 0, stream>>>(
      vocab_local, ld, logits, targets, vocab_start, lse, grad_scale, dlogits, ld_grad);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace trellis::kernels::cuda
