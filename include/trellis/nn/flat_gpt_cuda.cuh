// nn::CudaOps: the CUDA backend of nn::FlatGpt / train::FlatTrainer (nn/flat_gpt.hpp). Mixed
// precision as in llm.c: bf16 activations and GEMM operands, fp32 accumulation (cuBLASLt with fused
// bias / GELU / dGELU epilogues), our flash attention (bf16, head_dim 64 or 128), fp32 LayerNorm
// statistics and weights, fp32 master weights, gradients and AdamW moments.
//
//   nn::CudaOps ops(stream);                 // one stream: every kernel and copy is ordered on it
//   train::FlatTrainer<nn::CudaOps> trainer(cfg, ops);
//
// Each kernel here is tested against its host twin in tests/gpu; the model code is shared with
// HostOps, so the whole model is compared with the host GptModel in tests/gpu/test_flat_gpt_cuda.cu.
// A CudaOps is cheap to copy (its cuBLASLt handle and workspace are shared).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <span>
#include <vector>

#include "trellis/core/buffer.hpp"
#include "trellis/core/check_cuda.hpp"
#include "trellis/core/cuda_buffer.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/adamw_cuda.cuh"
#include "trellis/kernels/attention_cuda.cuh"
#include "trellis/kernels/cuda_common.cuh"
#include "trellis/kernels/elementwise_cuda.cuh"
#include "trellis/kernels/embedding_cuda.cuh"
#include "trellis/kernels/gemm_cuda.hpp"
#include "trellis/kernels/norms_cuda.cuh"
#include "trellis/kernels/xent_cuda.cuh"
#include "trellis/nn/flat_gpt.hpp"

namespace trellis::nn {

namespace flat_cuda_detail {

template <class T>
__global__ void convert_kernel(std::int64_t n, const float* __restrict__ src, T* __restrict__ dst) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = kernels::cuda::device::from_float<T>(src[i]);
}

// One thread per element of the [B, H, T, D] side; ToHeads: rows -> heads, else heads -> rows.
template <class T, bool ToHeads>
__global__ void permute_heads_kernel(std::int64_t batch, std::int64_t heads, std::int64_t seq, std::int64_t head_dim,
                                     const T* __restrict__ src, T* __restrict__ dst, std::int64_t ld) {
  const std::int64_t n = batch * heads * seq * head_dim;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t d = i % head_dim, t = (i / head_dim) % seq, h = (i / (head_dim * seq)) % heads;
    const std::int64_t b = i / (head_dim * seq * heads);
    const std::int64_t r = (b * seq + t) * ld + h * head_dim + d;
    if constexpr (ToHeads) dst[i] = src[r];
    else dst[r] = src[i];
  }
}

}  // namespace flat_cuda_detail

struct CudaOps {
  using act_t = bfloat16;
  template <class T> using buffer = Buffer<T, Cuda>;

  explicit CudaOps(cudaStream_t s = nullptr)
      : stream(s), gemm_handle(std::make_shared<kernels::cuda::GemmHandle>()),
        workspace(std::make_shared<Buffer<std::byte, Cuda>>()) {}

  cudaStream_t stream = nullptr;
  std::shared_ptr<kernels::cuda::GemmHandle> gemm_handle;
  std::shared_ptr<Buffer<std::byte, Cuda>> workspace;  // grown on demand, stream-ordered
  std::shared_ptr<bool> dgelu_unfused = std::make_shared<bool>(false);

  template <class T> buffer<T> allocate(std::size_t n) { return buffer<T>(n, stream, true); }
  template <class T> void upload(T* dst, const T* src, std::size_t n) {
    if (n == 0) return;
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyHostToDevice, stream));
    TRELLIS_CHECK_CUDA(cudaStreamSynchronize(stream));  // the caller may free src at once
  }
  template <class T> void download(T* dst, const T* src, std::size_t n) {
    if (n == 0) return;
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToHost, stream));
    TRELLIS_CHECK_CUDA(cudaStreamSynchronize(stream));
  }
  template <class T> void fill_zero(T* p, std::size_t n) {
    if (n) TRELLIS_CHECK_CUDA(cudaMemsetAsync(p, 0, n * sizeof(T), stream));
  }
  void synchronize() { TRELLIS_CHECK_CUDA(cudaStreamSynchronize(stream)); }

  void convert(std::size_t n, const float* src, act_t* dst) {
    if (n == 0) return;
    const auto count = static_cast<std::int64_t>(n);
    flat_cuda_detail::convert_kernel<act_t><<<kernels::cuda::detail::grid_for(count, 256), 256, 0, stream>>>(count, src, dst);
    TRELLIS_CHECK_CUDA(cudaGetLastError());
  }
  template <class TC, class E = kernels::epilogue::None>
  void gemm(const kernels::GemmArgs& args, const act_t* a, const act_t* b, TC* c, E ep = {}) {
    if constexpr (std::is_same_v<E, kernels::epilogue::DGelu<act_t>>) {
      // cuBLASLt offers DGELU only for some layout/transpose combinations (it refused BGRADA/B for
      // column-major problems on an H200): if the fused plan is refused once, run the product and
      // then the GELU gradient as its own pass from then on.
      if (!*dgelu_unfused) {
        try {
          kernels::cuda::gemm(*gemm_handle, args, a, b, c, stream, ep);
          return;
        } catch (const Error&) {
          *dgelu_unfused = true;
          (void)cudaGetLastError();
        }
      }
      TRELLIS_CHECK(args.batch == 1 && args.ldc_or_packed() == args.n && ep.ld_pre == 0,
                    "CudaOps: unfused DGelu needs a packed, unbatched C");
      kernels::cuda::gemm(*gemm_handle, args, a, b, c, stream);
      kernels::cuda::gelu_backward(args.m * args.n, ep.pre_activation, c, c, stream);
    } else {
      kernels::cuda::gemm(*gemm_handle, args, a, b, c, stream, ep);
    }
  }
  bool dgelu_fused() const { return !*dgelu_unfused; }
  void layernorm_forward(index_t rows, index_t dim, const act_t* x, const float* w, const float* b, act_t* out,
                         float* mean, float* rstd, float eps, const act_t* residual = nullptr,
                         act_t* sum_out = nullptr) {
    kernels::cuda::layernorm_forward(rows, dim, x, w, b, out, mean, rstd, eps, stream, residual, sum_out);
  }
  void layernorm_backward(index_t rows, index_t dim, const act_t* dout, const act_t* input, const float* w,
                          const float* mean, const float* rstd, act_t* dinput, float* dw, float* db, bool accumulate) {
    const std::size_t bytes = kernels::cuda::norm_backward_workspace_bytes(rows, dim);
    kernels::cuda::layernorm_backward(rows, dim, dout, input, w, mean, rstd, dinput, dw, db, scratch(bytes), bytes,
                                      stream, accumulate);
  }
  void attention_forward(const kernels::AttentionArgs& a, const act_t* q, const act_t* k, const act_t* v, act_t* o,
                         float* lse) {
    kernels::cuda::attention_forward(a, q, k, v, o, lse, stream);
  }
  void attention_backward(const kernels::AttentionArgs& a, const act_t* q, const act_t* k, const act_t* v,
                          const act_t* o, const act_t* d_o, const float* lse, act_t* dq, act_t* dk, act_t* dv) {
    const std::size_t bytes = kernels::cuda::attention_backward_workspace_bytes(a);
    kernels::cuda::attention_backward(a, q, k, v, o, d_o, lse, dq, dk, dv, scratch(bytes), bytes, stream);
  }
  void rows_to_heads(const FlatShape& s, index_t heads, index_t head_dim, const act_t* rows, index_t ld, act_t* out) {
    permute<true>(s, heads, head_dim, rows, out, ld);
  }
  void heads_to_rows(const FlatShape& s, index_t heads, index_t head_dim, const act_t* in, act_t* rows, index_t ld) {
    permute<false>(s, heads, head_dim, in, rows, ld);
  }
  void xent_forward_backward(index_t rows, index_t vocab, index_t ld, act_t* logits, const std::int32_t* targets,
                             float* loss, float grad_scale) {
    kernels::cuda::softmax_xent_forward_backward(rows, vocab, ld, logits, targets, loss, grad_scale, logits, ld, stream);
  }
  void xent_forward(index_t rows, index_t vocab, index_t ld, const act_t* logits, const std::int32_t* targets,
                    float* loss) {
    kernels::cuda::softmax_xent_forward(rows, vocab, ld, logits, targets, loss, static_cast<float*>(nullptr), stream);
  }
  void embedding_forward(const kernels::host::EmbeddingArgs& a, const std::int32_t* tokens, const float* wte,
                         const float* wpe, act_t* out) {
    kernels::cuda::embedding_forward(a, tokens, wte, wpe, out, stream);
  }
  void embedding_backward(const kernels::host::EmbeddingArgs& a, const std::int32_t* tokens, const act_t* dout,
                          float* dwte, float* dwpe) {
    kernels::cuda::embedding_backward(a, tokens, dout, dwte, dwpe, stream);
  }
  void column_sums(index_t rows, index_t cols, index_t ld, const act_t* x, float* sums) {
    const std::size_t bytes = kernels::cuda::column_sums_workspace_bytes(rows, cols);
    kernels::cuda::column_sums(rows, cols, ld, x, sums, scratch(bytes), bytes, stream, true);
  }
  double sum_of_squares(std::span<const std::span<const float>> grads) {
    const std::size_t bytes = kernels::cuda::grad_norm_workspace_bytes(grads) + 256;
    std::byte* ws = scratch(bytes);
    auto* out = reinterpret_cast<double*>(ws);  // first 256 bytes: the result; then the partials
    kernels::cuda::grad_norm_squared(grads, out, ws + 256, bytes - 256, stream);
    double host = 0;
    download(&host, out, 1);
    return host;
  }
  double sum(const float* x, std::size_t n) {
    std::vector<float> host(n);
    download(host.data(), x, n);
    double s = 0;
    for (float v : host) s += v;
    return s;
  }
  void adamw(std::span<const kernels::host::AdamWTensor<float>> tensors, const kernels::host::AdamWConfig& cfg,
             std::int64_t step, float grad_scale) {
    kernels::cuda::adamw_step<float>(tensors, cfg, step, grad_scale, stream);
  }

 private:
  // Device scratch of at least `bytes`, valid until the next scratch() call (all use is on `stream`).
  std::byte* scratch(std::size_t bytes) {
    if (workspace->size() < bytes) *workspace = Buffer<std::byte, Cuda>(bytes + bytes / 4, stream, false);
    return workspace->data();
  }
  template <bool ToHeads>
  void permute(const FlatShape& s, index_t heads, index_t head_dim, const act_t* src, act_t* dst, index_t ld) {
    const std::int64_t n = s.batch * heads * s.seq * head_dim;
    if (n == 0) return;
    flat_cuda_detail::permute_heads_kernel<act_t, ToHeads>
        <<<kernels::cuda::detail::grid_for(n, 256), 256, 0, stream>>>(s.batch, heads, s.seq, head_dim, src, dst, ld);
    TRELLIS_CHECK_CUDA(cudaGetLastError());
  }
};

}  // namespace trellis::nn
