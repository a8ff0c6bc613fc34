// backend::Cuda: the compute backend on one GPU, mixed precision as in llm.c: bf16 activations
// and GEMM operands with fp32 accumulation (cuBLASLt with fused bias / GELU / dGELU epilogues),
// our flash attention (bf16, head_dim 64 or 128), fp32 LayerNorm statistics and weights, fp32
// master weights, gradients and AdamW moments; Mixture-of-Experts routing and dispatch (CUB radix
// sort, histogram and scans) with grouped GEMMs over the experts.
//
//   backend::Cuda be(stream);                  // every kernel and copy is ordered on `stream`
//   be.reserve_workspace(max of be.*_workspace(...) at the largest shapes);   // once, at set-up
//
// Each kernel here is tested against its host twin in tests/gpu (the host twins are what
// backend::Host<bfloat16> runs). A Cuda backend is cheap to copy: copies share the cuBLASLt
// handle and the workspace. Copies beside the compute (offloaded activations) go through
// copy_queue_t<Cuda> = CudaCopyQueue (backend/cuda_copy_queue.hpp): a copy stream, pinned memory.
#pragma once

#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/backend/cuda_copy_queue.hpp"  // defines: CudaCopyQueue, copy_queue_t<Cuda>
#include "trellis/core/buffer.hpp"
#include "trellis/core/check_cuda.hpp"
#include "trellis/core/cuda_buffer.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/adamw_cuda.cuh"
#include "trellis/kernels/attention_cuda.cuh"
#include "trellis/kernels/attention_merge_cuda.cuh"
#include "trellis/kernels/dropout_cuda.cuh"
#include "trellis/kernels/cuda_common.cuh"
#include "trellis/kernels/elementwise_cuda.cuh"
#include "trellis/kernels/embedding_cuda.cuh"
#include "trellis/kernels/gemm_cuda.hpp"
#include "trellis/kernels/heads.hpp"
#include "trellis/kernels/moe_cuda.cuh"
#include "trellis/kernels/norms_cuda.cuh"
#include "trellis/kernels/xent_cuda.cuh"

namespace trellis::backend {

namespace cuda_detail {

template <class T>
__global__ void convert_kernel(std::int64_t n, const float* __restrict__ src, T* __restrict__ dst) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = kernels::cuda::device::from_float<T>(src[i]);
}

// One thread per element of the [batch, heads, seq, head_dim] side; ToHeads: rows -> heads.
template <class T, bool ToHeads>
__global__ void permute_heads_kernel(kernels::HeadsLayout l, const T* __restrict__ src, T* __restrict__ dst,
                                     std::int64_t ld) {
  const std::int64_t n = l.elements();
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t r = l.row_offset(i, ld);
    if constexpr (ToHeads) dst[i] = src[r];
    else dst[r] = src[i];
  }
}

}  // namespace cuda_detail

// A CUDA event, created on first use and destroyed with its last copy.
class CudaEvent {
 public:
  CudaEvent() = default;
  explicit CudaEvent(cudaStream_t recorded_on) : event_(make(), destroy) {
    TRELLIS_CHECK_CUDA(cudaEventRecord(event_.get(), recorded_on));
  }
  cudaEvent_t get() const { return event_.get(); }

 private:
  static cudaEvent_t make() {
    cudaEvent_t e = nullptr;
    TRELLIS_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  static void destroy(cudaEvent_t e) { (void)cudaEventDestroy(e); }
  std::shared_ptr<std::remove_pointer_t<cudaEvent_t>> event_;
};

// A pushed NVTX range, popped when it goes out of scope (returned by value: copy elision).
class NvtxRange {
 public:
  explicit NvtxRange(const char* name) { nvtxRangePushA(name); }
  ~NvtxRange() { nvtxRangePop(); }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

class Cuda {
 public:
  using space = trellis::Cuda;
  using act_t = bfloat16;
  using stream_type = cudaStream_t;
  using event_type = CudaEvent;
  template <class T> using buffer = Buffer<T, trellis::Cuda>;
  static constexpr bool host_readable = false;

  explicit Cuda(cudaStream_t s = nullptr) : stream_(s), state_(std::make_shared<Shared>()) { keep_pool_memory(); }

  stream_type stream() const { return stream_; }
  event_type record_event() const { return CudaEvent(stream_); }
  void wait_event(const event_type& e) const { TRELLIS_CHECK_CUDA(cudaStreamWaitEvent(stream_, e.get(), 0)); }
  void synchronize() const { TRELLIS_CHECK_CUDA(cudaStreamSynchronize(stream_)); }
  // An NVTX range (nvtxRangePushA/Pop) for Nsight Systems: the layers name each pass with it.
  NvtxRange range(const char* name) const { return NvtxRange(name); }

  // ---- memory ---------------------------------------------------------------------------------
  // Buffers come from the current device's default stream-ordered pool (cudaMallocAsync). Its
  // release threshold is 0 by default: at every stream synchronisation (each upload, download and
  // loss read does one) the pool hands its free memory back to the driver, and the next step's
  // temporaries map it again. Keeping it (threshold: unlimited), as PyTorch's caching allocator
  // does, makes a steady-state step allocate nothing from the driver. Best effort: without a
  // device the calls fail and nothing changes.
  static void keep_pool_memory() {
    int device = 0;
    cudaMemPool_t pool = nullptr;
    if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetDefaultMemPool(&pool, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    std::uint64_t keep_all = UINT64_MAX;
    if (cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all) != cudaSuccess) (void)cudaGetLastError();
  }
  template <class T> buffer<T> allocate(std::size_t n) const { return buffer<T>(n, stream_, true); }
  template <class T> buffer<T> scratch(std::size_t n) const { return buffer<T>(n, stream_, false); }  // no memset
  // Host -> device; returns when `src` may be reused.
  template <class T> void upload(T* dst, const T* src, std::size_t n) const {
    if (n == 0) return;
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyHostToDevice, stream_));
    synchronize();
  }
  template <class T> void download(T* dst, const T* src, std::size_t n) const {
    if (n == 0) return;
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToHost, stream_));
    synchronize();
  }
  template <class T> void copy(T* dst, const T* src, std::size_t n) const {
    if (n) TRELLIS_CHECK_CUDA(cudaMemcpyAsync(dst, src, n * sizeof(T), cudaMemcpyDeviceToDevice, stream_));
  }
  template <class T> void fill_zero(T* p, std::size_t n) const {
    if (n) TRELLIS_CHECK_CUDA(cudaMemsetAsync(p, 0, n * sizeof(T), stream_));
  }

  // ---- workspace: queried at set-up, reserved once ---------------------------------------------
  std::size_t layernorm_backward_workspace(index_t rows, index_t dim) const {
    return kernels::cuda::norm_backward_workspace_bytes(rows, dim);
  }
  std::size_t attention_backward_workspace(const kernels::AttentionArgs& a) const {
    return kernels::cuda::attention_backward_workspace_bytes(a);
  }
  std::size_t column_sums_workspace(index_t rows, index_t cols) const {
    return kernels::cuda::column_sums_workspace_bytes(rows, cols);
  }
  // The result (one double, 256-byte slot) and the partial sums.
  std::size_t sum_of_squares_workspace(std::span<const std::span<const float>> grads) const {
    return kernels::cuda::grad_norm_workspace_bytes(grads) + 256;
  }
  // The MoE dispatch plan's radix sort, histogram and scans (CUB's size queries) and sort buffers.
  std::size_t moe_dispatch_plan_workspace(index_t rows, int topk, index_t experts) const {
    return kernels::cuda::moe_dispatch_plan_workspace_bytes(rows, topk, experts);
  }
  // Grows the shared workspace to at least `bytes` (stream-ordered); call before the first step.
  void reserve_workspace(std::size_t bytes) {
    if (state_->workspace.size() < bytes) state_->workspace = Buffer<std::byte, trellis::Cuda>(bytes, stream_, false);
  }
  std::size_t workspace_reserved() const { return state_->workspace.size(); }

  // ---- kernels --------------------------------------------------------------------------------
  void convert(std::size_t n, const float* src, act_t* dst) const {
    if (n == 0) return;
    const auto count = static_cast<std::int64_t>(n);
    cuda_detail::convert_kernel<act_t><<<kernels::cuda::detail::grid_for(count, 256), 256, 0, stream_>>>(count, src, dst);
    TRELLIS_CHECK_CUDA(cudaGetLastError());
  }
  template <class TC, class E = kernels::epilogue::None>
  void gemm(const kernels::GemmArgs& args, const act_t* a, const act_t* b, TC* c, E ep = {}) const {
    if constexpr (std::is_same_v<E, kernels::epilogue::DGelu<act_t>>) {
      // cuBLASLt offers DGELU only for some layout/transpose combinations (it refused BGRADA/B for
      // column-major problems on an H200): if the fused plan is refused once, run the product and
      // then the GELU gradient as its own pass from then on.
      if (!state_->dgelu_unfused) {
        try {
          kernels::cuda::gemm(state_->gemm, args, a, b, c, stream_, ep);
          return;
        } catch (const Error&) {
          state_->dgelu_unfused = true;
          (void)cudaGetLastError();
        }
      }
      TRELLIS_CHECK(args.batch == 1 && args.ldc_or_packed() == args.n && ep.ld_pre == 0,
                    "backend::Cuda: unfused DGelu needs a packed, unbatched C");
      kernels::cuda::gemm(state_->gemm, args, a, b, c, stream_);
      kernels::cuda::gelu_backward(args.m * args.n, ep.pre_activation, c, c, stream_);
    } else {
      kernels::cuda::gemm(state_->gemm, args, a, b, c, stream_, ep);
    }
  }
  bool dgelu_fused() const { return !state_->dgelu_unfused; }
  void layernorm_forward(index_t rows, index_t dim, const act_t* x, const float* w, const float* b, act_t* out,
                         float* mean, float* rstd, float eps, const act_t* residual = nullptr,
                         act_t* sum_out = nullptr) const {
    kernels::cuda::layernorm_forward(rows, dim, x, w, b, out, mean, rstd, eps, stream_, residual, sum_out);
  }
  void layernorm_backward(index_t rows, index_t dim, const act_t* dout, const act_t* input, const float* w,
                          const float* mean, const float* rstd, act_t* dinput, float* dw, float* db,
                          bool accumulate) const {
    const std::size_t bytes = layernorm_backward_workspace(rows, dim);
    kernels::cuda::layernorm_backward(rows, dim, dout, input, w, mean, rstd, dinput, dw, db,
                                      workspace(bytes, "layernorm_backward"), bytes, stream_, accumulate);
  }
  void attention_forward(const kernels::AttentionArgs& a, const act_t* q, const act_t* k, const act_t* v, act_t* o,
                         float* lse) const {
    kernels::cuda::attention_forward(a, q, k, v, o, lse, stream_);
  }
  void attention_backward(const kernels::AttentionArgs& a, const act_t* q, const act_t* k, const act_t* v,
                          const act_t* o, const act_t* d_o, const float* lse, act_t* dq, act_t* dk,
                          act_t* dv, bool accumulate = false) const {
    const std::size_t bytes = attention_backward_workspace(a);
    kernels::cuda::attention_backward(a, q, k, v, o, d_o, lse, dq, dk, dv, workspace(bytes, "attention_backward"),
                                      bytes, stream_, accumulate);
  }
  void merge_attention_partials(index_t rows, index_t head_dim, act_t* o_acc, float* lse_acc, const act_t* o_part,
                                const float* lse_part) const {
    kernels::cuda::merge_attention_partials(rows, head_dim, o_acc, lse_acc, o_part, lse_part, stream_);
  }
  void rows_to_heads(const kernels::HeadsLayout& l, const act_t* rows, index_t ld, act_t* heads) const {
    permute<true>(l, rows, heads, ld);
  }
  void heads_to_rows(const kernels::HeadsLayout& l, const act_t* heads, act_t* rows, index_t ld) const {
    permute<false>(l, heads, rows, ld);
  }
  void xent_partial_max(index_t rows, index_t vocab_local, index_t ld, const act_t* logits, float* row_max) const {
    kernels::cuda::xent_partial_max(rows, vocab_local, ld, logits, row_max, stream_);
  }
  void xent_partial_sumexp(index_t rows, index_t vocab_local, index_t ld, const act_t* logits,
                           const float* global_max, float* sumexp) const {
    kernels::cuda::xent_partial_sumexp(rows, vocab_local, ld, logits, global_max, sumexp, stream_);
  }
  void xent_partial_target(index_t rows, index_t vocab_local, index_t ld, const act_t* logits,
                           const std::int32_t* targets, index_t vocab_start, float* target_logit) const {
    kernels::cuda::xent_partial_target(rows, vocab_local, ld, logits, targets, vocab_start, target_logit, stream_);
  }
  void xent_finish(index_t rows, const float* global_max, const float* global_sumexp, const float* target_logit,
                   const std::int32_t* targets, float* loss, float* lse) const {
    kernels::cuda::xent_finish(rows, global_max, global_sumexp, target_logit, targets, loss, lse, stream_);
  }
  void xent_backward_sharded(index_t rows, index_t vocab_local, index_t ld, const act_t* logits,
                             const std::int32_t* targets, index_t vocab_start, const float* lse, float grad_scale,
                             act_t* dlogits, index_t ld_grad) const {
    kernels::cuda::xent_backward_sharded(rows, vocab_local, ld, logits, targets, vocab_start, lse, grad_scale,
                                         dlogits, ld_grad, stream_);
  }
  void embedding_forward(const kernels::EmbeddingArgs& a, const std::int32_t* tokens, const float* wte,
                         const float* wpe, act_t* out) const {
    kernels::cuda::embedding_forward(a, tokens, wte, wpe, out, stream_);
  }
  void embedding_backward(const kernels::EmbeddingArgs& a, const std::int32_t* tokens, const act_t* dout,
                          float* dwte, float* dwpe) const {
    kernels::cuda::embedding_backward(a, tokens, dout, dwte, dwpe, stream_);
  }
  void dropout(const kernels::DropoutArgs& a, act_t* x) const { kernels::cuda::dropout_apply(a, x, stream_); }
  void gelu_forward(index_t n, const act_t* x, act_t* out) const { kernels::cuda::gelu_forward(n, x, out, stream_); }
  void gelu_backward(index_t n, const act_t* x, const act_t* dout, act_t* dx) const {
    kernels::cuda::gelu_backward(n, x, dout, dx, stream_);
  }
  // out = a + b elementwise, in fp32: activations (bf16), fp32 gradients, or mixed (a bf16 part
  // into an fp32 accumulator).
  template <class TA, class TB, class TO>
  void add(index_t n, const TA* a, const TB* b, TO* out) const {
    kernels::cuda::add(n, a, b, out, stream_);
  }
  void column_sums(index_t rows, index_t cols, index_t ld, const act_t* x, float* sums) const {
    const std::size_t bytes = column_sums_workspace(rows, cols);
    kernels::cuda::column_sums(rows, cols, ld, x, sums, workspace(bytes, "column_sums"), bytes, stream_, true);
  }
  // One call over many GEMMs (MoE experts), each as gemm() would compute it: one cuBLASLt call
  // per non-empty group (kernels::cuda::grouped_gemm), k = 0 groups by a device pass. DGelu groups
  // go one by one through gemm() above, which keeps its unfused fallback.
  template <class TC, class E>
  void grouped_gemm(std::span<const kernels::GemmGroup<act_t, act_t, TC, E>> groups) const {
    auto zero_k = [this](const kernels::GemmGroup<act_t, act_t, TC, E>& g) {
      kernels::cuda::gemm_without_product(g.args, g.c, g.ep, stream_);
    };
    if constexpr (std::is_same_v<E, kernels::epilogue::DGelu<act_t>>) {
      kernels::cuda::detail::for_each_gemm_group(
          groups, stream_, [this](const kernels::GemmGroup<act_t, act_t, TC, E>& g) { gemm(g.args, g.a, g.b, g.c, g.ep); },
          zero_k);
    } else {
      kernels::cuda::grouped_gemm(state_->gemm, groups, stream_, zero_k);
    }
  }
  // Mixture-of-Experts routing (contract: kernels/moe.hpp; kernels: kernels/moe_cuda.cuh).
  // prob_sums' summation order is not fixed here (float atomics): it feeds only the reported
  // load-balancing loss value.
  void moe_route_forward(const kernels::MoeRouteArgs& a, const float* logits, float* probs, float* lse,
                         std::int32_t* expert, float* gate, std::int32_t* routed, float* prob_sums) const {
    kernels::cuda::moe_route_forward(a, logits, probs, lse, expert, gate, routed, prob_sums, stream_);
  }
  // Workspace: moe_dispatch_plan_workspace(rows, topk, experts), reserved at set-up.
  void moe_dispatch_plan(index_t rows, int topk, index_t experts, index_t capacity, const std::int32_t* expert,
                         std::int32_t* slot, std::int32_t* source_row, std::int32_t* kept) const {
    const std::size_t bytes = moe_dispatch_plan_workspace(rows, topk, experts);
    kernels::cuda::moe_dispatch_plan(rows, topk, experts, capacity, expert, slot, source_row, kept,
                                     bytes ? workspace(bytes, "moe_dispatch_plan") : nullptr, bytes, stream_);
  }
  void gather_rows(index_t rows, index_t cols, const act_t* src, const std::int32_t* index, act_t* dst) const {
    kernels::cuda::gather_rows(rows, cols, src, index, dst, stream_);
  }
  void moe_combine(index_t rows, int topk, index_t cols, const act_t* y, const std::int32_t* slot, const float* gate,
                   act_t* out, bool accumulate) const {
    kernels::cuda::moe_combine(rows, topk, cols, y, slot, gate, out, accumulate, stream_);
  }
  void moe_combine_backward(index_t rows, int topk, index_t cols, const act_t* dout, const act_t* y,
                            const std::int32_t* slot, const float* gate, float* dgate, act_t* dy) const {
    kernels::cuda::moe_combine_backward(rows, topk, cols, dout, y, slot, gate, dgate, dy, stream_);
  }
  void moe_route_backward(const kernels::MoeRouteArgs& a, const float* probs, const float* lse,
                          const std::int32_t* expert, const float* gate, const float* dgate, const float* aux_grad,
                          float z_grad, float* dlogits) const {
    kernels::cuda::moe_route_backward(a, probs, lse, expert, gate, dgate, aux_grad, z_grad, dlogits, stream_);
  }
  double sum_of_squares(std::span<const std::span<const float>> grads) const {
    const std::size_t bytes = sum_of_squares_workspace(grads);
    std::byte* ws = workspace(bytes, "sum_of_squares");
    auto* out = reinterpret_cast<double*>(ws);  // first 256 bytes: the result; then the partials
    kernels::cuda::grad_norm_squared(grads, out, ws + 256, bytes - 256, stream_);
    double host = 0;
    download(&host, out, 1);
    return host;
  }
  double sum(const float* x, std::size_t n) const {
    std::vector<float> host(n);
    download(host.data(), x, n);
    double s = 0;
    for (float v : host) s += v;
    return s;
  }
  void adamw(std::span<const kernels::AdamWTensor<float>> tensors, const kernels::AdamWConfig& cfg,
             std::int64_t step, float grad_scale) const {
    kernels::cuda::adamw_step<float>(tensors, cfg, step, grad_scale, stream_);
  }

 private:
  struct Shared {
    kernels::cuda::GemmHandle gemm;
    Buffer<std::byte, trellis::Cuda> workspace;
    bool dgelu_unfused = false;
  };

  // The reserved workspace; a kernel needing more than set-up reserved is a set-up bug, reported
  // rather than papered over by an allocation in the middle of a step.
  std::byte* workspace(std::size_t bytes, const char* what) const {
    TRELLIS_CHECK(state_->workspace.size() >= bytes, "backend::Cuda: ", what, " needs ", bytes,
                  " bytes of workspace but ", state_->workspace.size(),
                  " are reserved: call reserve_workspace() with the largest *_workspace() query at set-up");
    return state_->workspace.data();
  }
  template <bool ToHeads>
  void permute(const kernels::HeadsLayout& l, const act_t* src, act_t* dst, index_t ld) const {
    const std::int64_t n = l.elements();
    if (n == 0) return;
    cuda_detail::permute_heads_kernel<act_t, ToHeads>
        <<<kernels::cuda::detail::grid_for(n, 256), 256, 0, stream_>>>(l, src, dst, ld);
    TRELLIS_CHECK_CUDA(cudaGetLastError());
  }

  cudaStream_t stream_ = nullptr;
  std::shared_ptr<Shared> state_;
};

static_assert(Backend<Cuda>);

}  // namespace trellis::backend
