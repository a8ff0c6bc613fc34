// CUDA elementwise kernels, same contracts as kernels/elementwise_host.hpp:
//   cuda::gelu_forward(n, x, out, stream);                      out = gelu_tanh(x), may alias x
//   cuda::gelu_backward(n, x, dout, dx, stream, accumulate);    dx (+)= dout * gelu_tanh'(x)
//   cuda::add(n, a, b, out, stream);                            out = a + b
//   cuda::column_sums(rows, cols, ld, x, sums, workspace, stream, accumulate)   sums[j] (+)= sum_i x[i, j]
// column_sums is deterministic (fixed row chunks added in order); its workspace holds
// column_sums_workspace_bytes(rows, cols) bytes. All pointers are device pointers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/cuda_common.cuh"
#include "trellis/kernels/epilogue.hpp"

namespace trellis::kernels::cuda {

namespace device {
template <class T>
__global__ void gelu_forward_kernel(std::int64_t n, const T* x, T* out) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<T>(gelu_tanh(to_float(x[i])));
}
template <class T>
__global__ void gelu_backward_kernel(std::int64_t n, const T* x, const T* dout, T* dx, bool accumulate) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    float g = to_float(dout[i]) * gelu_tanh_grad(to_float(x[i]));
    dx[i] = from_float<T>(accumulate ? to_float(dx[i]) + g : g);
  }
}
template <class TA, class TB, class TO>
__global__ void add_kernel(std::int64_t n, const TA* a, const TB* b, TO* out) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    out[i] = from_float<TO>(to_float(a[i]) + to_float(b[i]));
}
template <class T>
struct MatrixElement {  // f(r, j) = x[r * ld + j]
  const T* x;
  std::int64_t ld;
  __device__ float operator()(std::int64_t r, std::int64_t j) const { return to_float(x[r * ld + j]); }
};
}  // namespace device

template <class T>
void gelu_forward(std::int64_t n, const T* x, T* out, cudaStream_t stream) {
  TRELLIS_CHECK(n >= 0, "gelu_forward: negative size ", n);
  if (n == 0) return;
  device::gelu_forward_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(n, x, out);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T>
void gelu_backward(std::int64_t n, const T* x, const T* dout, T* dx, cudaStream_t stream, bool accumulate = false) {
  TRELLIS_CHECK(n >= 0, "gelu_backward: negative size ", n);
  if (n == 0) return;
  device::gelu_backward_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(n, x, dout, dx, accumulate);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

// out = a + b, summed in fp32; the types may differ (a bf16 part into an fp32 accumulator).
template <class TA, class TB, class TO>
void add(std::int64_t n, const TA* a, const TB* b, TO* out, cudaStream_t stream) {
  TRELLIS_CHECK(n >= 0, "add: negative size ", n);
  if (n == 0) return;
  device::add_kernel<<<detail::grid_for(n, 256), 256, 0, stream>>>(n, a, b, out);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T, class S>
void column_sums(std::int64_t rows, std::int64_t cols, std::int64_t ld, const T* x, S* sums, void* workspace,
                 std::size_t workspace_bytes, cudaStream_t stream, bool accumulate = true) {
  TRELLIS_CHECK(rows >= 0 && cols >= 0 && ld >= cols, "column_sums: bad shape rows=", rows, " cols=", cols, " ld=", ld);
  TRELLIS_CHECK(workspace_bytes >= column_sums_workspace_bytes(rows, cols), "column_sums: workspace of ",
                workspace_bytes, " bytes, needs ", column_sums_workspace_bytes(rows, cols));
  detail::launch_column_sums(rows, cols, device::MatrixElement<T>{x, ld}, sums, accumulate,
                             static_cast<float*>(workspace), stream);
}

}  // namespace trellis::kernels::cuda
