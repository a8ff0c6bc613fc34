// nn::FlatGpt<B>: a whole GPT-2 on one device, llm.c-style. All parameters live in one flat
// fp32 buffer (the master weights), all gradients in one flat fp32 buffer, and the GEMM operands
// (weights, biases, activations) in B::act_t: fp32 on the host, bf16 on CUDA (mixed precision:
// bf16 compute, fp32 accumulation, fp32 master weights, fp32 gradients).
//
// Why a second GPT next to nn::GptModel: GptModel is the tensor/sequence/pipeline-parallel model
// (per-layer objects, per-microbatch saved state, collectives inside the layers). FlatGpt is the
// single-device fast path a GPU wants: a handful of big buffers, no per-layer allocation, weights
// converted to bf16 once per step. Its math is GptModel's exactly (same names, shapes and init
// rule: a FlatGpt and a single-rank GptModel built from the same GptConfig/GptOptions hold the same
// values), which tests/nn/test_flat_gpt.cpp checks on the host, fp32 and bf16.
//
// The model is written once against a compute backend (backend/backend.hpp): backend::Host<Act>
// runs the host kernels, backend::Cuda (backend/cuda.cuh) the CUDA ones. The kernels of both
// backends share their contracts and are tested against each other; so the layer plumbing
// (layouts, transposes, accumulation flags, residual order) is verified on any machine, and a GPU
// adds only kernels.
//
// Rows of the activations are batch-major (row = b * T + t), GEMM weights are GPT-2's Conv1D layout
// (in x out, y = x W + b); attention runs in [B, H, T, D].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "trellis/backend/host.hpp"
#include "trellis/core/buffer.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/nn/parameter.hpp"

namespace trellis::nn {

// One tensor of the flat parameter buffer.
struct FlatTensor {
  std::string name;                // GPT-2 name, as GptModel
  std::vector<index_t> shape;      // GPT-2 shape
  index_t offset = 0;              // first element in the flat buffers (a multiple of flat_alignment)
  index_t numel = 0;
  bool decay = false;              // weight decay applies (matrices only, as train::Trainer)
  float init_std = 0.0f;           // N(0, init_std) init; 0: constant init_value
  float init_value = 0.0f;
};

// Tensors start at multiples of 64 elements: every GEMM operand, bias and vector the kernels read
// is 256-byte aligned in fp32 and 128-byte aligned in bf16 (cuBLASLt picks kernels by alignment).
inline constexpr index_t flat_alignment = 64;

// Batch and sequence length of one microbatch (rows = batch * seq, batch-major).
struct FlatShape {
  index_t batch = 1, seq = 1;
  index_t rows() const { return batch * seq; }
};

// The parameter table of a whole GPT-2 in GptModel::parameters() order.
inline std::vector<FlatTensor> flat_gpt_tensors(const GptConfig& c, const GptOptions& opt = {}) {
  std::vector<FlatTensor> out;
  index_t offset = 0;
  const float proj_std = opt.init_std / std::sqrt(2.0f * static_cast<float>(c.layers));
  auto add = [&](std::string name, std::vector<index_t> shape, bool matrix, float std_dev, float value = 0.0f) {
    index_t n = 1;
    for (index_t s : shape) n *= s;
    out.push_back({std::move(name), std::move(shape), offset, n, matrix, std_dev, value});
    offset += (n + flat_alignment - 1) / flat_alignment * flat_alignment;
  };
  const index_t C = c.width;
  add("wte.weight", {c.vocab, C}, true, opt.init_std);
  add("wpe.weight", {c.positions, C}, true, opt.init_std);
  for (index_t l = 0; l < c.layers; ++l) {
    const std::string h = "h." + std::to_string(l);
    add(h + ".ln_1.weight", {C}, false, 0.0f, 1.0f);
    add(h + ".ln_1.bias", {C}, false, 0.0f);
    add(h + ".attn.c_attn.weight", {C, 3 * C}, true, opt.init_std);
    add(h + ".attn.c_attn.bias", {3 * C}, false, 0.0f);
    add(h + ".attn.c_proj.weight", {C, C}, true, proj_std);
    add(h + ".attn.c_proj.bias", {C}, false, 0.0f);
    add(h + ".ln_2.weight", {C}, false, 0.0f, 1.0f);
    add(h + ".ln_2.bias", {C}, false, 0.0f);
    add(h + ".mlp.c_fc.weight", {C, 4 * C}, true, opt.init_std);
    add(h + ".mlp.c_fc.bias", {4 * C}, false, 0.0f);
    add(h + ".mlp.c_proj.weight", {4 * C, C}, true, proj_std);
    add(h + ".mlp.c_proj.bias", {C}, false, 0.0f);
  }
  add("ln_f.weight", {C}, false, 0.0f, 1.0f);
  add("ln_f.bias", {C}, false, 0.0f);
  return out;
}

inline index_t flat_gpt_size(const std::vector<FlatTensor>& tensors) {
  if (tensors.empty()) return 0;
  const FlatTensor& last = tensors.back();
  return last.offset + (last.numel + flat_alignment - 1) / flat_alignment * flat_alignment;
}

// The default of FlatGpt::forward_backward's block hook: nothing to do.
struct NoBlockHook {
  void operator()(index_t, index_t) const {}
};

template <backend::Backend B>
class FlatGpt {
 public:
  using act_t = typename B::act_t;
  template <class T> using buffer = typename B::template buffer<T>;

  // Parameters are initialised on the host (GptModel's rule: a pure function of the seed, name and
  // element) and uploaded. opt.dropout must be 0; sequence parallelism, overlap and recompute do not
  // apply to one device (recompute is refused rather than ignored).
  FlatGpt(const GptConfig& cfg, const GptOptions& opt = {}, B be = {})
      : cfg_(cfg), be_(std::move(be)), tensors_(flat_gpt_tensors(cfg, opt)) {
    TRELLIS_CHECK(cfg.layers >= 1 && cfg.heads >= 1 && cfg.width >= 1 && cfg.vocab >= 1 && cfg.positions >= 1,
                  "FlatGpt: bad model shape");
    TRELLIS_CHECK(cfg.width % cfg.heads == 0, "FlatGpt: width ", cfg.width, " not divisible by heads ", cfg.heads);
    TRELLIS_CHECK(opt.dropout == 0.0f, "FlatGpt: dropout is not supported (got ", opt.dropout, ")");
    TRELLIS_CHECK(!opt.recompute && !opt.sequence_parallel && opt.overlap_chunks == 1,
                  "FlatGpt: recompute, sequence parallelism and overlap are GptModel options (one device here)");
    size_ = flat_gpt_size(tensors_);
    std::vector<float> init(static_cast<std::size_t>(size_), 0.0f);
    for (const FlatTensor& t : tensors_)
      for (index_t i = 0; i < t.numel; ++i)
        init[t.offset + i] = t.init_std > 0 ? t.init_std * counter_normal(opt.seed, t.name, i) : t.init_value;
    params_ = be_.template allocate<float>(size_);
    grads_ = be_.template allocate<float>(size_);
    be_.upload(params_.data(), init.data(), init.size());
    if constexpr (!std::is_same_v<act_t, float>) low_ = be_.template allocate<act_t>(size_);
    refresh_low_precision();
  }

  const GptConfig& config() const { return cfg_; }
  B& backend() { return be_; }
  const std::vector<FlatTensor>& tensors() const { return tensors_; }
  index_t flat_size() const { return size_; }
  float* params() { return params_.data(); }
  float* grads() { return grads_.data(); }
  index_t parameter_count() const {
    index_t n = 0;
    for (const FlatTensor& t : tensors_) n += t.numel;
    return n;
  }
  const FlatTensor& tensor(const std::string& name) const {
    for (const FlatTensor& t : tensors_)
      if (t.name == name) return t;
    TRELLIS_THROW("FlatGpt: no parameter named '", name, "'");
  }
  // Host copies of one parameter or its gradient (tests, checkpoints).
  std::vector<float> value(const std::string& name) { return download(params_.data(), tensor(name)); }
  std::vector<float> grad(const std::string& name) { return download(grads_.data(), tensor(name)); }
  void set_value(const std::string& name, std::span<const float> v) {
    const FlatTensor& t = tensor(name);
    TRELLIS_CHECK(static_cast<index_t>(v.size()) == t.numel, "FlatGpt::set_value: ", name, " has ", t.numel,
                  " elements, got ", v.size());
    be_.upload(params_.data() + t.offset, v.data(), v.size());
  }

  // Every gradient tensor as a span of backend memory (the global-norm input).
  std::vector<std::span<const float>> grad_tensors() const {
    std::vector<std::span<const float>> out;
    for (const FlatTensor& t : tensors_)
      out.emplace_back(grads_.data() + t.offset, static_cast<std::size_t>(t.numel));
    return out;
  }

  void zero_grad() { be_.fill_zero(grads_.data(), static_cast<std::size_t>(size_)); }
  // After the master weights changed (optimizer step, load): refresh the act_t copy.
  void refresh_low_precision() {
    if constexpr (!std::is_same_v<act_t, float>) be_.convert(static_cast<std::size_t>(size_), params_.data(), low_.data());
  }

  // Forward and backward of one microbatch: gradients of sum(token losses) / token_count are ADDED
  // to grads(). tokens, targets: (batch, seq) on the host (int32; target < 0 is ignored). Returns the
  // microbatch's sum of token losses / token_count (fp64, downloaded: one synchronisation).
  //
  // on_block_done(offset, count), when given, is called as soon as block l's backward is done (l
  // from last to first) with the flat range of that block's gradients (its 12 tensors, contiguous):
  // after the last microbatch those gradients are final, so a data-parallel reduction of the range
  // can start while the earlier blocks' backward runs. wte, wpe and ln_f (the ranges before block 0
  // and after the last block) are final only when this call returns.
  template <class OnBlockDone = NoBlockHook>
  double forward_backward(const FlatShape& s, const std::int32_t* tokens, const std::int32_t* targets,
                          double token_count, OnBlockDone&& on_block_done = {}) {
    TRELLIS_CHECK(token_count > 0, "FlatGpt: token_count must be > 0");
    run_forward(s, tokens, targets);
    const index_t R = s.rows();
    be_.xent_forward_backward(R, cfg_.vocab, vocab_ld(), logits_.data(), targets_.data(), losses_.data(),
                               static_cast<float>(1.0 / token_count));
    run_backward(s, on_block_done);
    return be_.sum(losses_.data(), static_cast<std::size_t>(R)) / token_count;
  }

  // Sum of token losses / token_count without gradients.
  double evaluate(const FlatShape& s, const std::int32_t* tokens, const std::int32_t* targets, double token_count) {
    TRELLIS_CHECK(token_count > 0, "FlatGpt: token_count must be > 0");
    run_forward(s, tokens, targets);
    be_.xent_forward(s.rows(), cfg_.vocab, vocab_ld(), logits_.data(), targets_.data(), losses_.data());
    return be_.sum(losses_.data(), static_cast<std::size_t>(s.rows())) / token_count;
  }

  // Flat offset of block l's first tensor (l == layers: ln_f's offset): block l owns
  // [block_begin(l), block_begin(l + 1)).
  index_t block_begin(index_t l) const {
    return l < cfg_.layers ? tensors_[at(l, 0)].offset : tensors_[ln_f()].offset;
  }

  // Logits of the last forward (rows x vocab, row stride vocab_ld()), valid after evaluate().
  const act_t* logits() const { return logits_.data(); }
  index_t vocab_ld() const { return (cfg_.vocab + 63) / 64 * 64; }

 private:
  // Pointers into the flat buffers by tensor index.
  const float* master(std::size_t i) const { return params_.data() + tensors_[i].offset; }
  float* dmaster(std::size_t i) { return grads_.data() + tensors_[i].offset; }
  const act_t* lowp(std::size_t i) const {
    if constexpr (std::is_same_v<act_t, float>) return params_.data() + tensors_[i].offset;
    else return low_.data() + tensors_[i].offset;
  }
  // Index of h.l's tensor k (0 ln_1.w, 1 ln_1.b, 2 c_attn.w, 3 c_attn.b, 4 attn.c_proj.w, 5 .b, 6 ln_2.w,
  // 7 ln_2.b, 8 c_fc.w, 9 c_fc.b, 10 mlp.c_proj.w, 11 .b); wte 0, wpe 1, ln_f after the blocks.
  static std::size_t at(index_t layer, int k) { return static_cast<std::size_t>(2 + layer * 12 + k); }
  std::size_t ln_f() const { return static_cast<std::size_t>(2 + cfg_.layers * 12); }

  std::vector<float> download(const float* base, const FlatTensor& t) {
    std::vector<float> out(static_cast<std::size_t>(t.numel));
    be_.download(out.data(), base + t.offset, out.size());
    return out;
  }

  struct Layer {  // saved activations of one block (act_t unless noted)
    buffer<act_t> resid, ln1, qkv, q, k, v, o, atty, attproj, resid2, ln2, fch_pre, fch, fcproj;
    buffer<float> ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, lse;
  };

  void ensure_buffers(const FlatShape& s) {
    TRELLIS_CHECK(s.batch >= 1 && s.seq >= 1 && s.seq <= cfg_.positions, "FlatGpt: microbatch ", s.batch, " x ",
                  s.seq, " (sequence must be in 1..", cfg_.positions, ")");
    if (s.batch == shape_.batch && s.seq == shape_.seq && !layers_.empty()) return;
    shape_ = s;
    const auto R = static_cast<std::size_t>(s.rows()), C = static_cast<std::size_t>(cfg_.width);
    const auto H = static_cast<std::size_t>(cfg_.heads);
    auto act = [&](std::size_t n) { return be_.template allocate<act_t>(n); };
    auto f32 = [&](std::size_t n) { return be_.template allocate<float>(n); };
    layers_.clear();
    for (index_t l = 0; l < cfg_.layers; ++l) {
      Layer L{act(R * C), act(R * C), act(R * 3 * C), act(R * C), act(R * C), act(R * C), act(R * C), act(R * C),
              act(R * C), act(R * C), act(R * C), act(R * 4 * C), act(R * 4 * C), act(R * C),
              f32(R), f32(R), f32(R), f32(R), f32(R * H)};
      layers_.push_back(std::move(L));
    }
    resid_f_ = act(R * C), lnf_ = act(R * C), lnf_mean_ = f32(R), lnf_rstd_ = f32(R);
    logits_ = act(R * static_cast<std::size_t>(vocab_ld()));
    losses_ = f32(R);
    tokens_ = be_.template allocate<std::int32_t>(R), targets_ = be_.template allocate<std::int32_t>(R);
    dresid_ = act(R * C), dtmp_ = act(R * C), dfch_ = act(R * 4 * C), dqkv_ = act(R * 3 * C);
    dq_ = act(R * C), dk_ = act(R * C), dv_ = act(R * C), do_ = act(R * C);
    // Scratch for the largest call of each kernel, reserved now rather than grown mid-step.
    const auto rows = static_cast<index_t>(R), width = static_cast<index_t>(C);
    const auto all_grads = grad_tensors();
    be_.reserve_workspace(std::max({be_.layernorm_backward_workspace(rows, width),
                                    be_.attention_backward_workspace(attention_args()),
                                    be_.column_sums_workspace(rows, 4 * width),
                                    be_.sum_of_squares_workspace(all_grads)}));
  }

  kernels::AttentionArgs attention_args() const {
    kernels::AttentionArgs a;
    a.batch = shape_.batch, a.q_heads = a.kv_heads = cfg_.heads, a.q_len = a.kv_len = shape_.seq;
    a.head_dim = cfg_.width / cfg_.heads, a.causal = true;
    return a;
  }
  kernels::EmbeddingArgs embedding_args() const {
    kernels::EmbeddingArgs a;
    a.batch = shape_.batch, a.seq = shape_.seq, a.dim = cfg_.width, a.vocab_rows = cfg_.vocab, a.positions = cfg_.positions;
    return a;
  }
  // y (R x n) = x (R x k) W (k x n) [+ epilogue]: a GPT-2 Conv1D forward.
  template <class E>
  void linear(index_t R, index_t k, index_t n, const act_t* x, const act_t* weight, act_t* y, E ep) {
    be_.gemm(kernels::gemm_args(R, n, k), x, weight, y, ep);
  }
  // dx (R x k) = dy (R x n) W^T, W stored k x n.
  template <class E = kernels::epilogue::None>
  void linear_dx(index_t R, index_t k, index_t n, const act_t* dy, const act_t* weight, act_t* dx, E ep = {}) {
    be_.gemm(kernels::gemm_args(R, k, n, kernels::Op::none, kernels::Op::transpose), dy, weight, dx, ep);
  }
  // dW (k x n) += x^T (k x R) dy (R x n), fp32.
  void linear_dw(index_t R, index_t k, index_t n, const act_t* x, const act_t* dy, float* dw) {
    be_.gemm(kernels::gemm_args(k, n, R, kernels::Op::transpose, kernels::Op::none, 1.0f, 1.0f), x, dy, dw);
  }

  void run_forward(const FlatShape& s, const std::int32_t* tokens, const std::int32_t* targets) {
    ensure_buffers(s);
    const index_t R = s.rows(), C = cfg_.width, H = cfg_.heads, D = C / H;
    for (index_t i = 0; i < R; ++i) {
      TRELLIS_CHECK(tokens[i] >= 0 && tokens[i] < cfg_.vocab, "FlatGpt: token ", tokens[i], " at position ", i,
                    " outside the vocabulary 0..", cfg_.vocab - 1);
      TRELLIS_CHECK(targets[i] < cfg_.vocab, "FlatGpt: target ", targets[i], " at position ", i,
                    " outside the vocabulary 0..", cfg_.vocab - 1);
    }
    be_.upload(tokens_.data(), tokens, static_cast<std::size_t>(R));
    be_.upload(targets_.data(), targets, static_cast<std::size_t>(R));
    be_.embedding_forward(embedding_args(), tokens_.data(), master(0), master(1), layers_[0].resid.data());
    const auto attn = attention_args();
    const kernels::HeadsLayout heads{s.batch, s.seq, H, D, kernels::RowOrder::batch_major};
    namespace ep = kernels::epilogue;
    for (index_t l = 0; l < cfg_.layers; ++l) {
      Layer& L = layers_[static_cast<std::size_t>(l)];
      if (l == 0) {
        be_.layernorm_forward(R, C, L.resid.data(), master(at(l, 0)), master(at(l, 1)), L.ln1.data(),
                               L.ln1_mean.data(), L.ln1_rstd.data(), cfg_.ln_eps);
      } else {  // resid = previous resid2 + previous fcproj, fused into ln_1
        Layer& P = layers_[static_cast<std::size_t>(l - 1)];
        be_.layernorm_forward(R, C, P.fcproj.data(), master(at(l, 0)), master(at(l, 1)), L.ln1.data(),
                               L.ln1_mean.data(), L.ln1_rstd.data(), cfg_.ln_eps, P.resid2.data(), L.resid.data());
      }
      linear(R, C, 3 * C, L.ln1.data(), lowp(at(l, 2)), L.qkv.data(), ep::Bias<act_t>{lowp(at(l, 3))});
      be_.rows_to_heads(heads, L.qkv.data(), 3 * C, L.q.data());
      be_.rows_to_heads(heads, L.qkv.data() + C, 3 * C, L.k.data());
      be_.rows_to_heads(heads, L.qkv.data() + 2 * C, 3 * C, L.v.data());
      be_.attention_forward(attn, L.q.data(), L.k.data(), L.v.data(), L.o.data(), L.lse.data());
      be_.heads_to_rows(heads, L.o.data(), L.atty.data(), C);
      linear(R, C, C, L.atty.data(), lowp(at(l, 4)), L.attproj.data(), ep::Bias<act_t>{lowp(at(l, 5))});
      be_.layernorm_forward(R, C, L.attproj.data(), master(at(l, 6)), master(at(l, 7)), L.ln2.data(),
                             L.ln2_mean.data(), L.ln2_rstd.data(), cfg_.ln_eps, L.resid.data(), L.resid2.data());
      linear(R, C, 4 * C, L.ln2.data(), lowp(at(l, 8)), L.fch.data(),
             ep::BiasGelu<act_t>{lowp(at(l, 9)), L.fch_pre.data()});
      linear(R, 4 * C, C, L.fch.data(), lowp(at(l, 10)), L.fcproj.data(), ep::Bias<act_t>{lowp(at(l, 11))});
    }
    Layer& last = layers_.back();
    be_.layernorm_forward(R, C, last.fcproj.data(), master(ln_f()), master(ln_f() + 1), lnf_.data(),
                           lnf_mean_.data(), lnf_rstd_.data(), cfg_.ln_eps, last.resid2.data(), resid_f_.data());
    // logits (R x V, row stride vocab_ld) = lnf (R x C) wte^T
    auto args = kernels::gemm_args(R, cfg_.vocab, C, kernels::Op::none, kernels::Op::transpose);
    args.ldc = vocab_ld();
    be_.gemm(args, lnf_.data(), lowp(0), logits_.data());
  }

  // Expects logits_ to hold d loss / d logits (written in place by the fused cross-entropy).
  template <class OnBlockDone>
  void run_backward(const FlatShape& s, OnBlockDone& on_block_done) {
    const index_t R = s.rows(), C = cfg_.width, H = cfg_.heads, D = C / H, V = cfg_.vocab;
    // dlnf (R x C) = dlogits (R x V) wte (V x C);  dwte (V x C) += dlogits^T lnf
    auto dx = kernels::gemm_args(R, C, V);
    dx.lda = vocab_ld();
    be_.gemm(dx, logits_.data(), lowp(0), dtmp_.data());
    auto dw = kernels::gemm_args(V, C, R, kernels::Op::transpose, kernels::Op::none, 1.0f, 1.0f);
    dw.lda = vocab_ld();
    be_.gemm(dw, logits_.data(), lnf_.data(), dmaster(0));
    be_.layernorm_backward(R, C, dtmp_.data(), resid_f_.data(), master(ln_f()), lnf_mean_.data(), lnf_rstd_.data(),
                            dresid_.data(), dmaster(ln_f()), dmaster(ln_f() + 1), false);
    const auto attn = attention_args();
    const kernels::HeadsLayout heads{s.batch, s.seq, H, D, kernels::RowOrder::batch_major};
    for (index_t l = cfg_.layers - 1; l >= 0; --l) {
      Layer& L = layers_[static_cast<std::size_t>(l)];
      // dresid: gradient of this block's output resid2 + fcproj.
      // MLP: fcproj = fch W_proj + b;  fch = gelu(fch_pre);  fch_pre = ln2 W_fc + b
      linear_dx(R, 4 * C, C, dresid_.data(), lowp(at(l, 10)), dfch_.data(),
                kernels::epilogue::DGelu<act_t>{L.fch_pre.data()});
      linear_dw(R, 4 * C, C, L.fch.data(), dresid_.data(), dmaster(at(l, 10)));
      be_.column_sums(R, C, C, dresid_.data(), dmaster(at(l, 11)));
      linear_dw(R, C, 4 * C, L.ln2.data(), dfch_.data(), dmaster(at(l, 8)));
      be_.column_sums(R, 4 * C, 4 * C, dfch_.data(), dmaster(at(l, 9)));
      linear_dx(R, C, 4 * C, dfch_.data(), lowp(at(l, 8)), dtmp_.data());
      be_.layernorm_backward(R, C, dtmp_.data(), L.resid2.data(), master(at(l, 6)), L.ln2_mean.data(),
                              L.ln2_rstd.data(), dresid_.data(), dmaster(at(l, 6)), dmaster(at(l, 7)), true);
      // dresid: gradient of resid2 = resid + attproj.  attproj = atty W + b
      linear_dw(R, C, C, L.atty.data(), dresid_.data(), dmaster(at(l, 4)));
      be_.column_sums(R, C, C, dresid_.data(), dmaster(at(l, 5)));
      linear_dx(R, C, C, dresid_.data(), lowp(at(l, 4)), dtmp_.data());
      be_.rows_to_heads(heads, dtmp_.data(), C, do_.data());
      be_.attention_backward(attn, L.q.data(), L.k.data(), L.v.data(), L.o.data(), do_.data(), L.lse.data(),
                              dq_.data(), dk_.data(), dv_.data());
      be_.heads_to_rows(heads, dq_.data(), dqkv_.data(), 3 * C);
      be_.heads_to_rows(heads, dk_.data(), dqkv_.data() + C, 3 * C);
      be_.heads_to_rows(heads, dv_.data(), dqkv_.data() + 2 * C, 3 * C);
      linear_dw(R, C, 3 * C, L.ln1.data(), dqkv_.data(), dmaster(at(l, 2)));
      be_.column_sums(R, 3 * C, 3 * C, dqkv_.data(), dmaster(at(l, 3)));
      linear_dx(R, C, 3 * C, dqkv_.data(), lowp(at(l, 2)), dtmp_.data());
      be_.layernorm_backward(R, C, dtmp_.data(), L.resid.data(), master(at(l, 0)), L.ln1_mean.data(),
                              L.ln1_rstd.data(), dresid_.data(), dmaster(at(l, 0)), dmaster(at(l, 1)), true);
      // dresid: gradient of this block's input
      on_block_done(block_begin(l), block_begin(l + 1) - block_begin(l));
    }
    be_.embedding_backward(embedding_args(), tokens_.data(), dresid_.data(), dmaster(0), dmaster(1));
  }

  GptConfig cfg_;
  B be_;
  std::vector<FlatTensor> tensors_;
  index_t size_ = 0;
  buffer<float> params_, grads_;
  buffer<act_t> low_;
  FlatShape shape_{0, 0};
  std::vector<Layer> layers_;
  buffer<act_t> resid_f_, lnf_, logits_, dresid_, dtmp_, dfch_, dqkv_, dq_, dk_, dv_, do_;
  buffer<float> lnf_mean_, lnf_rstd_, losses_;
  buffer<std::int32_t> tokens_, targets_;
};

}  // namespace trellis::nn
