// backend::Host<Act>: the compute backend on the CPU. Act = float is the fp32 reference;
// Act = bfloat16 runs every GEMM operand and activation in bf16 with fp32 accumulation,
// statistics, master weights and moments: the rounding points of backend::Cuda, so the tolerances
// of mixed precision are checked on any machine.
//
// Host memory, one implicit in-order "stream" (every call has finished when it returns), so
// streams and events are empty types and every workspace query answers 0. Kernels come from
// kernels/*_host.hpp (OpenBLAS GEMM with fused epilogues, our flash attention, norms, ...).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>

#include "trellis/backend/backend.hpp"
#include "trellis/core/buffer.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/subnormals.hpp"
#include "trellis/kernels/adamw_host.hpp"
#include "trellis/kernels/attention_host.hpp"
#include "trellis/kernels/dropout_host.hpp"
#include "trellis/kernels/elementwise_host.hpp"
#include "trellis/kernels/embedding_host.hpp"
#include "trellis/kernels/gemm_host.hpp"
#include "trellis/kernels/heads.hpp"
#include "trellis/kernels/moe_host.hpp"
#include "trellis/kernels/norms_host.hpp"
#include "trellis/kernels/xent_host.hpp"

namespace trellis::backend {

template <class Act = float>
class Host {
  static_assert(std::is_same_v<Act, float> || std::is_same_v<Act, bfloat16>,
                "backend::Host runs fp32 or bf16 activations");

 public:
  using space = trellis::Host;
  using act_t = Act;
  using stream_type = HostStream;
  using event_type = HostEvent;
  template <class T> using buffer = Buffer<T, trellis::Host>;
  static constexpr bool host_readable = true;  // host code may touch its buffers' elements

  // Subnormals flush to zero on the thread that makes a backend (core/subnormals.hpp).
  Host() { flush_subnormals_on_this_thread(); }

  stream_type stream() const { return {}; }
  event_type record_event() const { return {}; }
  void wait_event(const event_type&) const {}
  void synchronize() const {}
  HostRange range(const char*) const { return {}; }

  // ---- memory ---------------------------------------------------------------------------------
  template <class T> buffer<T> allocate(std::size_t n) const { return buffer<T>(n); }  // zeroed
  template <class T> buffer<T> scratch(std::size_t n) const { return buffer<T>(n, false); }  // not zeroed
  template <class T> void upload(T* dst, const T* src, std::size_t n) const { std::copy_n(src, n, dst); }
  template <class T> void download(T* dst, const T* src, std::size_t n) const { std::copy_n(src, n, dst); }
  template <class T> void copy(T* dst, const T* src, std::size_t n) const { std::copy_n(src, n, dst); }
  template <class T> void fill_zero(T* p, std::size_t n) const { std::fill_n(p, n, T{}); }

  // ---- workspace (CUB style: queried at set-up, reserved once; the host needs none) ------------
  std::size_t layernorm_backward_workspace(index_t, index_t) const { return 0; }
  std::size_t attention_backward_workspace(const kernels::AttentionArgs&) const { return 0; }
  std::size_t column_sums_workspace(index_t, index_t) const { return 0; }
  std::size_t sum_of_squares_workspace(std::span<const std::span<const float>>) const { return 0; }
  std::size_t moe_dispatch_plan_workspace(index_t, int, index_t) const { return 0; }
  void reserve_workspace(std::size_t bytes) { reserved_ = std::max(reserved_, bytes); }
  std::size_t workspace_reserved() const { return reserved_; }

  // ---- kernels --------------------------------------------------------------------------------
  void convert(std::size_t n, const float* src, Act* dst) const {
    kernels::host::convert(static_cast<index_t>(n), src, dst);
  }
  template <class TC, class E = kernels::epilogue::None>
  void gemm(const kernels::GemmArgs& args, const Act* a, const Act* b, TC* c, E ep = {}) const {
    kernels::host::gemm(args, a, b, c, ep);
  }
  void layernorm_forward(index_t rows, index_t dim, const Act* x, const float* w, const float* b, Act* out,
                         float* mean, float* rstd, float eps, const Act* residual = nullptr,
                         Act* sum_out = nullptr) const {
    kernels::host::layernorm_forward(rows, dim, x, w, b, out, mean, rstd, eps, residual, sum_out);
  }
  void layernorm_backward(index_t rows, index_t dim, const Act* dout, const Act* input, const float* w,
                          const float* mean, const float* rstd, Act* dinput, float* dw, float* db,
                          bool accumulate) const {
    kernels::host::layernorm_backward(rows, dim, dout, input, w, mean, rstd, dinput, dw, db, accumulate);
  }
  void attention_forward(const kernels::AttentionArgs& a, const Act* q, const Act* k, const Act* v, Act* o,
                         float* lse) const {
    kernels::host::attention_forward(a, q, k, v, o, lse);
  }
  // accumulate: add into dq, dk, dv (ring attention over kv blocks, o and lse the merged ones).
  void attention_backward(const kernels::AttentionArgs& a, const Act* q, const Act* k, const Act* v, const Act* o,
                          const Act* d_o, const float* lse, Act* dq, Act* dk, Act* dv, bool accumulate = false) const {
    kernels::host::attention_backward(a, q, k, v, o, d_o, lse, dq, dk, dv, accumulate);
  }
  // (o_acc, lse_acc) becomes attention over the union of both key sets (kernels/attention.hpp).
  void merge_attention_partials(index_t rows, index_t head_dim, Act* o_acc, float* lse_acc, const Act* o_part,
                                const float* lse_part) const {
    kernels::host::merge_attention_partials(rows, head_dim, o_acc, lse_acc, o_part, lse_part);
  }
  // rows (ld >= heads * head_dim) -> [batch, heads, seq, head_dim], and back.
  void rows_to_heads(const kernels::HeadsLayout& l, const Act* rows, index_t ld, Act* heads) const {
    for_each_head_row(l, [&](std::int64_t i, std::int64_t r, std::int64_t col) {
      std::copy_n(rows + r * ld + col, l.head_dim, heads + i);
    });
  }
  void heads_to_rows(const kernels::HeadsLayout& l, const Act* heads, Act* rows, index_t ld) const {
    for_each_head_row(l, [&](std::int64_t i, std::int64_t r, std::int64_t col) {
      std::copy_n(heads + i, l.head_dim, rows + r * ld + col);
    });
  }
  // Vocab-parallel cross-entropy statistics (kernels/xent_host.hpp has the protocol).
  void xent_partial_max(index_t rows, index_t vocab_local, index_t ld, const Act* logits, float* row_max) const {
    kernels::host::xent_partial_max(rows, vocab_local, ld, logits, row_max);
  }
  void xent_partial_sumexp(index_t rows, index_t vocab_local, index_t ld, const Act* logits, const float* global_max,
                           float* sumexp) const {
    kernels::host::xent_partial_sumexp(rows, vocab_local, ld, logits, global_max, sumexp);
  }
  void xent_partial_target(index_t rows, index_t vocab_local, index_t ld, const Act* logits,
                           const std::int32_t* targets, index_t vocab_start, float* target_logit) const {
    kernels::host::xent_partial_target(rows, vocab_local, ld, logits, targets, vocab_start, target_logit);
  }
  void xent_finish(index_t rows, const float* global_max, const float* global_sumexp, const float* target_logit,
                   const std::int32_t* targets, float* loss, float* lse) const {
    kernels::host::xent_finish(rows, global_max, global_sumexp, target_logit, targets, loss, lse);
  }
  void xent_backward_sharded(index_t rows, index_t vocab_local, index_t ld, const Act* logits,
                             const std::int32_t* targets, index_t vocab_start, const float* lse, float grad_scale,
                             Act* dlogits, index_t ld_grad) const {
    kernels::host::xent_backward_sharded(rows, vocab_local, ld, logits, targets, vocab_start, lse, grad_scale,
                                         dlogits, ld_grad);
  }
  void embedding_forward(const kernels::EmbeddingArgs& a, const std::int32_t* tokens, const float* wte,
                         const float* wpe, Act* out) const {
    kernels::host::embedding_forward(a, tokens, wte, wpe, out);
  }
  void embedding_backward(const kernels::EmbeddingArgs& a, const std::int32_t* tokens, const Act* dout, float* dwte,
                          float* dwpe) const {
    kernels::host::embedding_backward(a, tokens, dout, dwte, dwpe);
  }
  void dropout(const kernels::DropoutArgs& a, Act* x) const { kernels::host::dropout_apply(a, x); }
  void gelu_forward(index_t n, const Act* x, Act* out) const { kernels::host::gelu_forward(n, x, out); }
  void gelu_backward(index_t n, const Act* x, const Act* dout, Act* dx) const {
    kernels::host::gelu_backward(n, x, dout, dx);
  }
  // out = a + b elementwise, in fp32: activations (Act), fp32 gradients, or mixed (an Act part
  // into an fp32 accumulator).
  template <class TA, class TB, class TO>
  void add(index_t n, const TA* a, const TB* b, TO* out) const {
    kernels::host::add(n, a, b, out);
  }
  // sums[j] += sum_i x[i, j]
  void column_sums(index_t rows, index_t cols, index_t ld, const Act* x, float* sums) const {
    kernels::host::column_sums(rows, cols, ld, x, sums, true);
  }
  // One call over many GEMMs (MoE experts), each as gemm() would compute it.
  template <class TC, class E>
  void grouped_gemm(std::span<const kernels::GemmGroup<Act, Act, TC, E>> groups) const {
    kernels::host::grouped_gemm(groups);
  }
  // Mixture-of-Experts routing (contract: kernels/moe.hpp).
  void moe_route_forward(const kernels::MoeRouteArgs& a, const float* logits, float* probs, float* lse,
                         std::int32_t* expert, float* gate, std::int32_t* routed, float* prob_sums) const {
    kernels::host::moe_route_forward(a, logits, probs, lse, expert, gate, routed, prob_sums);
  }
  void moe_dispatch_plan(index_t rows, int topk, index_t experts, index_t capacity, const std::int32_t* expert,
                         std::int32_t* slot, std::int32_t* source_row, std::int32_t* kept) const {
    kernels::host::moe_dispatch_plan(rows, topk, experts, capacity, expert, slot, source_row, kept);
  }
  void gather_rows(index_t rows, index_t cols, const Act* src, const std::int32_t* index, Act* dst) const {
    kernels::host::gather_rows(rows, cols, src, index, dst);
  }
  void moe_combine(index_t rows, int topk, index_t cols, const Act* y, const std::int32_t* slot, const float* gate,
                   Act* out, bool accumulate) const {
    kernels::host::moe_combine(rows, topk, cols, y, slot, gate, out, accumulate);
  }
  void moe_combine_backward(index_t rows, int topk, index_t cols, const Act* dout, const Act* y,
                            const std::int32_t* slot, const float* gate, float* dgate, Act* dy) const {
    kernels::host::moe_combine_backward(rows, topk, cols, dout, y, slot, gate, dgate, dy);
  }
  void moe_route_backward(const kernels::MoeRouteArgs& a, const float* probs, const float* lse,
                          const std::int32_t* expert, const float* gate, const float* dgate, const float* aux_grad,
                          float z_grad, float* dlogits) const {
    kernels::host::moe_route_backward(a, probs, lse, expert, gate, dgate, aux_grad, z_grad, dlogits);
  }
  double sum_of_squares(std::span<const std::span<const float>> grads) const {
    return kernels::host::grad_norm_squared<float>(grads);
  }
  double sum(const float* x, std::size_t n) const {
    double s = 0;
    for (std::size_t i = 0; i < n; ++i) s += x[i];
    return s;
  }
  void adamw(std::span<const kernels::AdamWTensor<float>> tensors, const kernels::AdamWConfig& cfg,
             std::int64_t step, float grad_scale) const {
    kernels::host::adamw_step<float>(tensors, cfg, step, grad_scale);
  }

 private:
  // f(first element of (b, h, t) on the heads side, token row of (b, t), first column of head h)
  // for every (b, h, t): the loop form of HeadsLayout::row_offset, a head_dim run at a time.
  template <class F>
  static void for_each_head_row(const kernels::HeadsLayout& l, F&& f) {
    for (std::int64_t b = 0; b < l.batch; ++b)
      for (std::int64_t h = 0; h < l.heads; ++h)
        for (std::int64_t t = 0; t < l.seq; ++t)
          f(((b * l.heads + h) * l.seq + t) * l.head_dim, l.row(b, t), h * l.head_dim);
  }
  std::size_t reserved_ = 0;
};

static_assert(Backend<Host<float>> && Backend<Host<bfloat16>>);

}  // namespace trellis::backend
