// Pre-norm transformer block (GPT-2):  x2 = x + attn(ln_1(x));  y = x2 + mlp(ln_2(x2)), where mlp is
// the dense GPT-2 MLP or, with BlockConfig::moe, a Mixture-of-Experts MLP (nn/moe.hpp) whose
// experts are split over the expert-parallel group.
// With `dropout` > 0 the attention and MLP outputs are dropped before the residual add (masks in
// nn/dropout.hpp: TokenShape's seed and first_sample pick the masks; TokenShape::train = false
// turns dropout off).
// Residual and norms run on the norm-region rows (with sequence parallelism, this rank's sequence
// shard). Options: sequence parallelism and overlap come with the TensorParallel handle; with
// `recompute` the forward keeps only the block input and backward_input runs the forward again.
// Over a compute backend B: activations, residual adds and dropout masks are B::act_t in B's
// memory (the residual stream rounds to act_t after each add, as llm.c's bf16 residual).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "trellis/nn/activation_arena.hpp"
#include "trellis/nn/attention.hpp"
#include "trellis/nn/dropout.hpp"
#include "trellis/nn/layernorm.hpp"
#include "trellis/nn/mlp.hpp"
#include "trellis/nn/moe.hpp"
#include "trellis/nn/ranges.hpp"

namespace trellis::nn {

struct BlockConfig {
  index_t width = 0;
  index_t heads = 0;
  index_t hidden = 0;  // 0: 4 * width
  float ln_eps = 1e-5f;
  bool recompute = false;
  float dropout = 0.0f;  // residual dropout after attn and mlp (GPT-2 resid_pdrop); 0: none
  std::optional<MoeConfig> moe{};  // a Mixture-of-Experts MLP instead of the dense one
};

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class TransformerBlock {
 public:
  using act_t = typename B::act_t;

  // name: e.g. "h.3".
  // cp: the context-parallel communicator (attention's ring); ep: the expert-parallel group of an
  // MoE block's experts; default: none.
  TransformerBlock(const std::string& name, const BlockConfig& cfg, TensorParallel<C> tp, B be = {},
                   ContextParallel<C> cp = {}, ExpertParallel<C> ep = {})
      : cfg_(cfg),
        tp_(tp),
        be_(be),
        ln_1_(name + ".ln_1", cfg.width, tp, cfg.ln_eps, be),
        attn_(name + ".attn", cfg.width, cfg.heads, tp, be, cp),
        ln_2_(name + ".ln_2", cfg.width, tp, cfg.ln_eps, be),
        drop_attn_(cfg.dropout, name + ".attn"),
        drop_mlp_(cfg.dropout, name + ".mlp"),
        names_(name),
        attn_names_(name + ".attn"),
        mlp_names_(name + ".mlp") {
    const index_t hidden = cfg.hidden ? cfg.hidden : 4 * cfg.width;
    if (cfg.moe) moe_ = std::make_unique<MoeMlp<C, B>>(name + ".mlp", cfg.width, hidden, *cfg.moe, tp, ep, be);
    else mlp_ = std::make_unique<Mlp<C, B>>(name + ".mlp", cfg.width, hidden, tp, be);
  }

  LayerNorm<C, B>& ln_1() { return ln_1_; }
  CausalSelfAttention<C, B>& attn() { return attn_; }
  LayerNorm<C, B>& ln_2() { return ln_2_; }
  Mlp<C, B>& mlp() {
    TRELLIS_CHECK(mlp_ != nullptr, names_.forward, ": a Mixture-of-Experts block has no dense MLP");
    return *mlp_;
  }
  MoeMlp<C, B>* moe() { return moe_.get(); }
  bool recompute() const { return cfg_.recompute; }
  template <class F> void for_each_parameter(F&& f) {
    ln_1_.for_each_parameter(f);
    attn_.for_each_parameter(f);
    ln_2_.for_each_parameter(f);
    feed_forward([&](auto& m) { m.for_each_parameter(f); });
  }

  // Incremental forward for decoding (nn/kv_cache.hpp): the rows of the new positions of `step`
  // (whole rows), attention through this block's cache; inference, so no dropout and no saved state.
  void decode(const DecodeStep& step, KvBuffers<B>& cache, const act_t* x, act_t* y) {
    const index_t rows = step.rows(), n = rows * cfg_.width;
    auto h = allocate(n), x2 = allocate(n);
    ln_1_.infer(rows, x, h.data());
    attn_.decode(step, cache, h.data(), x2.data());
    be_.add(n, x2.data(), x, x2.data());  // x2 = x + attn(ln_1(x))
    ln_2_.infer(rows, x2.data(), h.data());
    feed_forward([&](auto& m) { m.infer(rows, h.data(), y); });
    be_.add(n, y, x2.data(), y);          // y = x2 + mlp(ln_2(x2))
  }

  // x, y: (local_rows, width) in B's memory.
  void forward(int mb, const TokenShape& shape, const act_t* x, act_t* y) {
    auto range = be_.range(names_.forward.c_str());
    Saved& s = store_.create(mb);
    s.rows = tp_.local_rows(shape);
    if (cfg_.recompute) {
      s.input = saved_.template take<act_t>(be_, mb, s.rows * cfg_.width, "TransformerBlock input (recompute)");
      be_.copy(s.input.data(), x, s.input.size());
      run_forward(mb, shape, x, y);
      release_sublayers(mb);
    } else {
      run_forward(mb, shape, x, y);
    }
  }

  void backward_input(int mb, const TokenShape& shape, const act_t* dy, act_t* dx) {
    auto range = be_.range(names_.backward_input.c_str());
    Saved& s = store_.at(mb, "TransformerBlock::backward_input");
    const index_t n = s.rows * cfg_.width;
    if (cfg_.recompute) {
      auto y = allocate(n);
      auto again = be_.range(names_.forward.c_str());  // the recomputed forward, inside the backward
      run_forward(mb, shape, s.input.data(), y.data());
      s.input = {};
    }
    auto dh = allocate(n), dx2 = allocate(n);
    const index_t row0 = tp_.first_local_row(shape), rows = s.rows;
    typename B::template buffer<act_t> dropped;  // gradient through a dropout mask
    const act_t* dmlp = dy;
    if (drop_mlp_.active() && shape.train) {
      dropped = allocate(n);
      be_.copy(dropped.data(), dy, dropped.size());
      drop_mlp_.apply(be_, shape, row0, rows, cfg_.width, dropped.data());
      dmlp = dropped.data();
    }
    {
      auto r = be_.range(mlp_names_.backward_input.c_str());
      feed_forward([&](auto& m) { m.backward_input(mb, shape, dmlp, dh.data()); });
    }
    ln_2_.backward_input(mb, shape, dh.data(), dx2.data());
    be_.add(n, dx2.data(), dy, dx2.data());
    const act_t* dattn = dx2.data();
    if (drop_attn_.active() && shape.train) {
      if (dropped.empty()) dropped = allocate(n);
      be_.copy(dropped.data(), dx2.data(), dropped.size());
      drop_attn_.apply(be_, shape, row0, rows, cfg_.width, dropped.data());
      dattn = dropped.data();
    }
    {
      auto r = be_.range(attn_names_.backward_input.c_str());
      attn_.backward_input(mb, shape, dattn, dh.data());
    }
    ln_1_.backward_input(mb, shape, dh.data(), dx);
    be_.add(n, dx, dx2.data(), dx);
  }

  void backward_weight(int mb) {
    store_.at(mb, "TransformerBlock::backward_weight");
    auto range = be_.range(names_.backward_weight.c_str());
    ln_1_.backward_weight(mb);
    {
      auto r = be_.range(attn_names_.backward_weight.c_str());
      attn_.backward_weight(mb);
    }
    ln_2_.backward_weight(mb);
    {
      auto r = be_.range(mlp_names_.backward_weight.c_str());
      feed_forward([&](auto& m) { m.backward_weight(mb); });
    }
    store_.erase(mb);
  }
  // Drops microbatch mb's saved state without gradients (forward-only evaluation).
  void release(int mb) {
    release_sublayers(mb);
    store_.erase(mb);
  }
  // Microbatches with saved state anywhere in the block (for leak checks).
  std::size_t saved_microbatches() const {
    return store_.size() + ln_1_.saved_microbatches() + attn_.saved_microbatches() + ln_2_.saved_microbatches() +
           feed_forward([](const auto& m) { return m.saved_microbatches(); });
  }

  // Where saved tensors go (nn/activation_arena.hpp). With recompute only the block input is
  // saved there; the state the backward recomputes is the sublayers' own, held from this block's
  // B to its W (one block at a time in GptModel::backward).
  void set_saved_memory(SavedMemory<B> m) {
    saved_ = m;
    if (cfg_.recompute) return;
    ln_1_.set_saved_memory(m);
    attn_.set_saved_memory(m);
    ln_2_.set_saved_memory(m);
    feed_forward([&](auto& f) { f.set_saved_memory(m); });
  }
  // Bytes one microbatch saves in the arena (forward and backward_input together).
  std::size_t saved_bytes(const TokenShape& shape) const {
    if (cfg_.recompute) return saved_size<act_t>(tp_.local_rows(shape) * cfg_.width);
    return ln_1_.saved_bytes(shape) + attn_.saved_bytes(shape) + ln_2_.saved_bytes(shape) +
           feed_forward([&](const auto& m) { return m.saved_bytes(shape); });
  }

 private:
  struct Saved {
    index_t rows = 0;
    SavedTensor<B, act_t> input;  // with recompute: the block input
  };

  // f(the dense MLP or the MoE MLP): the one place that knows which this block has.
  template <class F>
  decltype(auto) feed_forward(F&& f) {
    return moe_ ? f(*moe_) : f(*mlp_);
  }
  template <class F>
  decltype(auto) feed_forward(F&& f) const {
    return moe_ ? f(std::as_const(*moe_)) : f(std::as_const(*mlp_));
  }

  // Temporaries of one call, written in full before they are read: not zeroed.
  typename B::template buffer<act_t> allocate(index_t n) const {
    return be_.template scratch<act_t>(static_cast<std::size_t>(n));
  }

  void run_forward(int mb, const TokenShape& shape, const act_t* x, act_t* y) {
    const index_t rows = tp_.local_rows(shape), n = rows * cfg_.width, row0 = tp_.first_local_row(shape);
    auto h = allocate(n), x2 = allocate(n);
    ln_1_.forward(mb, shape, x, h.data());
    {
      auto r = be_.range(attn_names_.forward.c_str());
      attn_.forward(mb, shape, h.data(), x2.data());
    }
    drop_attn_.apply(be_, shape, row0, rows, cfg_.width, x2.data());
    be_.add(n, x2.data(), x, x2.data());
    ln_2_.forward(mb, shape, x2.data(), h.data());
    {
      auto r = be_.range(mlp_names_.forward.c_str());
      feed_forward([&](auto& m) { m.forward(mb, shape, h.data(), y); });
    }
    drop_mlp_.apply(be_, shape, row0, rows, cfg_.width, y);
    be_.add(n, y, x2.data(), y);
  }
  void release_sublayers(int mb) {
    ln_1_.release(mb);
    attn_.release(mb);
    ln_2_.release(mb);
    feed_forward([&](auto& m) { m.release(mb); });
  }

  BlockConfig cfg_;
  TensorParallel<C> tp_;
  B be_;
  LayerNorm<C, B> ln_1_;
  CausalSelfAttention<C, B> attn_;
  LayerNorm<C, B> ln_2_;
  std::unique_ptr<Mlp<C, B>> mlp_;     // dense, or
  std::unique_ptr<MoeMlp<C, B>> moe_;  // Mixture of Experts
  Dropout drop_attn_, drop_mlp_;
  PassNames names_, attn_names_, mlp_names_;  // backend ranges (NVTX on CUDA)
  SavedMemory<B> saved_;
  MicrobatchStore<Saved> store_;
};

}  // namespace trellis::nn
