// Causal self-attention with heads split over tp (Megatron): c_attn is column-parallel over whole
// heads (q, k and v columns of this rank's heads), the core runs the host flash-attention kernel
// on the local heads only, c_proj is row-parallel. GPT-2 math: scale 1/sqrt(head_dim), causal.
#pragma once

#include <string>
#include <vector>

#include "trellis/kernels/attention_host.hpp"
#include "trellis/nn/linear.hpp"

namespace trellis::nn {

template <comm::Communicator C>
class CausalSelfAttention {
 public:
  // name: e.g. "h.0.attn"; width = n_head * head_dim.
  CausalSelfAttention(const std::string& name, index_t width, index_t heads, TensorParallel<C> tp)
      : width_(width),
        heads_(heads),
        head_dim_(heads > 0 ? width / heads : 0),
        c_attn_(name + ".c_attn", LinearConfig{width, 3 * width, true, head_dim_, 3}, tp),
        c_proj_(name + ".c_proj", LinearConfig{width, width, true, head_dim_, 1}, tp),
        tp_(tp) {
    TRELLIS_CHECK(heads > 0 && width % heads == 0, name, ": width ", width, " is not a multiple of heads ", heads);
    TRELLIS_CHECK(heads >= tp.size(), name, ": ", heads, " heads cannot be split over ", tp.size(), " ranks");
    local_heads_ = shard::chunk(heads, tp.size(), tp.rank()).size;
  }

  ColumnParallelLinear<C>& c_attn() { return c_attn_; }
  RowParallelLinear<C>& c_proj() { return c_proj_; }
  index_t local_heads() const { return local_heads_; }
  template <class F> void for_each_parameter(F&& f) {
    c_attn_.for_each_parameter(f);
    c_proj_.for_each_parameter(f);
  }

  // x, y: (local_rows, width).
  void forward(int mb, const TokenShape& shape, const float* x, float* y) {
    Saved& s = store_.create(mb);
    const index_t rows = shape.rows(), cl = local_heads_ * head_dim_;
    std::vector<float> qkv(static_cast<std::size_t>(rows * 3 * cl));
    c_attn_.forward(mb, shape, x, qkv.data());
    const auto args = attention_args(shape);
    const index_t n = args.q_elements();
    s.q.resize(n), s.k.resize(n), s.v.resize(n), s.o.resize(n);
    s.lse.resize(static_cast<std::size_t>(args.lse_elements()));
    float* parts[3] = {s.q.data(), s.k.data(), s.v.data()};
    for (int g = 0; g < 3; ++g) rows_to_heads(shape, qkv.data() + g * cl, 3 * cl, parts[g]);
    kernels::host::attention_forward(args, s.q.data(), s.k.data(), s.v.data(), s.o.data(), s.lse.data());
    std::vector<float> a(static_cast<std::size_t>(rows * cl));
    heads_to_rows(shape, s.o.data(), a.data(), cl);
    c_proj_.forward(mb, shape, a.data(), y);
  }

  void backward_input(int mb, const TokenShape& shape, const float* dy, float* dx) {
    Saved& s = store_.at(mb, "CausalSelfAttention::backward_input");
    const index_t rows = shape.rows(), cl = local_heads_ * head_dim_;
    std::vector<float> da(static_cast<std::size_t>(rows * cl));
    c_proj_.backward_input(mb, shape, dy, da.data());
    const auto args = attention_args(shape);
    const index_t n = args.q_elements();
    std::vector<float> d_o(n), dq(n), dk(n), dv(n);
    rows_to_heads(shape, da.data(), cl, d_o.data());
    kernels::host::attention_backward(args, s.q.data(), s.k.data(), s.v.data(), s.o.data(), d_o.data(),
                                      s.lse.data(), dq.data(), dk.data(), dv.data());
    std::vector<float> dqkv(static_cast<std::size_t>(rows * 3 * cl));
    const float* parts[3] = {dq.data(), dk.data(), dv.data()};
    for (int g = 0; g < 3; ++g) heads_to_rows(shape, parts[g], dqkv.data() + g * cl, 3 * cl);
    c_attn_.backward_input(mb, shape, dqkv.data(), dx);
    // The core has no weights: its saved tensors are not needed by backward_weight.
    s = Saved{};
  }

  void backward_weight(int mb) {
    store_.at(mb, "CausalSelfAttention::backward_weight");
    c_attn_.backward_weight(mb);
    c_proj_.backward_weight(mb);
    store_.erase(mb);
  }
  void release(int mb) {
    c_attn_.release(mb);
    c_proj_.release(mb);
    store_.erase(mb);
  }
  std::size_t saved_microbatches() const { return store_.size() + c_attn_.saved_microbatches() + c_proj_.saved_microbatches(); }

 private:
  struct Saved {
    std::vector<float> q, k, v, o;  // (batch, local_heads, seq, head_dim)
    std::vector<float> lse;         // (batch, local_heads, seq)
  };

  kernels::AttentionArgs attention_args(const TokenShape& shape) const {
    kernels::AttentionArgs a;
    a.batch = shape.batch;
    a.q_heads = a.kv_heads = local_heads_;
    a.q_len = a.kv_len = shape.seq;
    a.head_dim = head_dim_;
    a.causal = true;
    return a;
  }
  // src rows (row = t * batch + b, row stride ld, local_heads * head_dim columns) -> (b, h, t, d).
  void rows_to_heads(const TokenShape& shape, const float* src, index_t ld, float* dst) const {
    const index_t B = shape.batch, T = shape.seq, H = local_heads_, D = head_dim_;
    for (index_t t = 0; t < T; ++t)
      for (index_t b = 0; b < B; ++b) {
        const float* row = src + (t * B + b) * ld;
        for (index_t h = 0; h < H; ++h) std::copy(row + h * D, row + (h + 1) * D, dst + ((b * H + h) * T + t) * D);
      }
  }
  // (b, h, t, d) -> rows with stride ld.
  void heads_to_rows(const TokenShape& shape, const float* src, float* dst, index_t ld) const {
    const index_t B = shape.batch, T = shape.seq, H = local_heads_, D = head_dim_;
    for (index_t t = 0; t < T; ++t)
      for (index_t b = 0; b < B; ++b) {
        float* row = dst + (t * B + b) * ld;
        for (index_t h = 0; h < H; ++h) {
          const float* s = src + ((b * H + h) * T + t) * D;
          std::copy(s, s + D, row + h * D);
        }
      }
  }

  index_t width_, heads_, head_dim_, local_heads_ = 0;
  ColumnParallelLinear<C> c_attn_;
  RowParallelLinear<C> c_proj_;
  TensorParallel<C> tp_;
  MicrobatchStore<Saved> store_;
};

}  // namespace trellis::nn
