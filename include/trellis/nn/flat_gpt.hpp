// nn::FlatGpt<Ops>: a whole GPT-2 on one device, llm.c-style. All parameters live in one flat
// fp32 buffer (the master weights), all gradients in one flat fp32 buffer, and the GEMM operands
// (weights, biases, activations) in Ops::act_t: fp32 on the host, bf16 on CUDA (mixed precision:
// bf16 compute, fp32 accumulation, fp32 master weights, fp32 gradients).
//
// Why a second GPT next to nn::GptModel: GptModel is the tensor/sequence/pipeline-parallel model
// (per-layer objects, per-microbatch saved state, collectives inside the layers). FlatGpt is the
// single-device fast path a GPU wants: a handful of big buffers, no per-layer allocation, weights
// converted to bf16 once per step. Its math is GptModel's exactly (same names, shapes and init
// rule: a FlatGpt and a single-rank GptModel built from the same GptConfig/GptOptions hold the same
// values), which tests/nn/test_flat_gpt.cpp checks on the host, fp32 and bf16.
//
// The model is written once against an Ops backend (the concept below); HostOps<Act> (here) runs
// the host kernels, CudaOps (nn/flat_gpt_cuda.cuh) the CUDA ones. The kernels of both backends share
// their contracts and are tested against each other; so the layer plumbing (layouts, transposes,
// accumulation flags, residual order) is verified on any machine, and a GPU adds only kernels.
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

#include "trellis/core/buffer.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/adamw_host.hpp"
#include "trellis/kernels/attention_host.hpp"
#include "trellis/kernels/elementwise_host.hpp"
#include "trellis/kernels/embedding_host.hpp"
#include "trellis/kernels/gemm_host.hpp"
#include "trellis/kernels/norms_host.hpp"
#include "trellis/kernels/xent_host.hpp"
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

// [B, T] rows x (H * D) columns (row stride ld) <-> [B, H, T, D]: the reference loops of the
// permutes attention needs; CudaOps runs the same index map on the device.
template <class T>
void rows_to_heads_host(const FlatShape& s, index_t heads, index_t head_dim, const T* rows, index_t ld, T* out) {
  for (index_t b = 0; b < s.batch; ++b)
    for (index_t t = 0; t < s.seq; ++t) {
      const T* row = rows + (b * s.seq + t) * ld;
      for (index_t h = 0; h < heads; ++h)
        std::copy(row + h * head_dim, row + (h + 1) * head_dim, out + ((b * heads + h) * s.seq + t) * head_dim);
    }
}
template <class T>
void heads_to_rows_host(const FlatShape& s, index_t heads, index_t head_dim, const T* in, T* rows, index_t ld) {
  for (index_t b = 0; b < s.batch; ++b)
    for (index_t t = 0; t < s.seq; ++t) {
      T* row = rows + (b * s.seq + t) * ld;
      for (index_t h = 0; h < heads; ++h) {
        const T* src = in + ((b * heads + h) * s.seq + t) * head_dim;
        std::copy(src, src + head_dim, row + h * head_dim);
      }
    }
}

// The host backend: host kernels, host memory. Act = float (the fp32 reference) or bfloat16 (the
// same rounding points as the CUDA mixed-precision path, for checking its tolerances).
template <class Act = float>
struct HostOps {
  using act_t = Act;
  template <class T> using buffer = Buffer<T, Host>;

  template <class T> buffer<T> allocate(std::size_t n) { return buffer<T>(n); }  // zeroed
  template <class T> void upload(T* dst, const T* src, std::size_t n) { std::copy_n(src, n, dst); }
  template <class T> void download(T* dst, const T* src, std::size_t n) { std::copy_n(src, n, dst); }
  template <class T> void fill_zero(T* p, std::size_t n) { std::fill_n(p, n, T{}); }
  void synchronize() {}

  void convert(std::size_t n, const float* src, Act* dst) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<Act>(src[i]);
  }
  template <class TC, class E = kernels::epilogue::None>
  void gemm(const kernels::GemmArgs& args, const Act* a, const Act* b, TC* c, E ep = {}) {
    kernels::host::gemm(args, a, b, c, ep);
  }
  void layernorm_forward(index_t rows, index_t dim, const Act* x, const float* w, const float* b, Act* out,
                         float* mean, float* rstd, float eps, const Act* residual = nullptr, Act* sum_out = nullptr) {
    kernels::host::layernorm_forward(rows, dim, x, w, b, out, mean, rstd, eps, residual, sum_out);
  }
  void layernorm_backward(index_t rows, index_t dim, const Act* dout, const Act* input, const float* w,
                          const float* mean, const float* rstd, Act* dinput, float* dw, float* db, bool accumulate) {
    kernels::host::layernorm_backward(rows, dim, dout, input, w, mean, rstd, dinput, dw, db, accumulate);
  }
  void attention_forward(const kernels::AttentionArgs& a, const Act* q, const Act* k, const Act* v, Act* o,
                         float* lse) {
    kernels::host::attention_forward(a, q, k, v, o, lse);
  }
  void attention_backward(const kernels::AttentionArgs& a, const Act* q, const Act* k, const Act* v, const Act* o,
                          const Act* d_o, const float* lse, Act* dq, Act* dk, Act* dv) {
    kernels::host::attention_backward(a, q, k, v, o, d_o, lse, dq, dk, dv);
  }
  void rows_to_heads(const FlatShape& s, index_t heads, index_t head_dim, const Act* rows, index_t ld, Act* out) {
    rows_to_heads_host(s, heads, head_dim, rows, ld, out);
  }
  void heads_to_rows(const FlatShape& s, index_t heads, index_t head_dim, const Act* in, Act* rows, index_t ld) {
    heads_to_rows_host(s, heads, head_dim, in, rows, ld);
  }
  void xent_forward_backward(index_t rows, index_t vocab, index_t ld, Act* logits, const std::int32_t* targets,
                             float* loss, float grad_scale) {
    kernels::host::softmax_xent_forward_backward(rows, vocab, ld, logits, targets, loss, grad_scale, logits, ld);
  }
  void xent_forward(index_t rows, index_t vocab, index_t ld, const Act* logits, const std::int32_t* targets,
                    float* loss) {
    kernels::host::softmax_xent_forward(rows, vocab, ld, logits, targets, loss, static_cast<float*>(nullptr));
  }
  void embedding_forward(const kernels::host::EmbeddingArgs& a, const std::int32_t* tokens, const float* wte,
                         const float* wpe, Act* out) {
    kernels::host::embedding_forward(a, tokens, wte, wpe, out);
  }
  void embedding_backward(const kernels::host::EmbeddingArgs& a, const std::int32_t* tokens, const Act* dout,
                          float* dwte, float* dwpe) {
    kernels::host::embedding_backward(a, tokens, dout, dwte, dwpe);
  }
  // sums[j] += sum_i x[i, j]
  void column_sums(index_t rows, index_t cols, index_t ld, const Act* x, float* sums) {
    kernels::host::column_sums(rows, cols, ld, x, sums, true);
  }
  double sum_of_squares(std::span<const std::span<const float>> grads) {
    return kernels::host::grad_norm_squared<float>(grads);
  }
  double sum(const float* x, std::size_t n) {
    double s = 0;
    for (std::size_t i = 0; i < n; ++i) s += x[i];
    return s;
  }
  void adamw(std::span<const kernels::host::AdamWTensor<float>> tensors, const kernels::host::AdamWConfig& cfg,
             std::int64_t step, float grad_scale) {
    kernels::host::adamw_step<float>(tensors, cfg, step, grad_scale);
  }
};

// The default of FlatGpt::forward_backward's block hook: nothing to do.
struct NoBlockHook {
  void operator()(index_t, index_t) const {}
};

template <class Ops>
class FlatGpt {
 public:
  using act_t = typename Ops::act_t;
  template <class T> using buffer = typename Ops::template buffer<T>;

  // Parameters are initialised on the host (GptModel's rule: a pure function of the seed, name and
  // element) and uploaded. opt.dropout must be 0; sequence parallelism, overlap and recompute do not
  // apply to one device (recompute is refused rather than ignored).
  FlatGpt(const GptConfig& cfg, const GptOptions& opt = {}, Ops ops = {})
      : cfg_(cfg), ops_(std::move(ops)), tensors_(flat_gpt_tensors(cfg, opt)) {
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
    params_ = ops_.template allocate<float>(size_);
    grads_ = ops_.template allocate<float>(size_);
    ops_.upload(params_.data(), init.data(), init.size());
    if constexpr (!std::is_same_v<act_t, float>) low_ = ops_.template allocate<act_t>(size_);
    refresh_low_precision();
  }

  const GptConfig& config() const { return cfg_; }
  Ops& ops() { return ops_; }
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
    ops_.upload(params_.data() + t.offset, v.data(), v.size());
  }

  void zero_grad() { ops_.fill_zero(grads_.data(), static_cast<std::size_t>(size_)); }
  // After the master weights changed (optimizer step, load): refresh the act_t copy.
  void refresh_low_precision() {
    if constexpr (!std::is_same_v<act_t, float>) ops_.convert(static_cast<std::size_t>(size_), params_.data(), low_.data());
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
    ops_.xent_forward_backward(R, cfg_.vocab, vocab_ld(), logits_.data(), targets_.data(), losses_.data(),
                               static_cast<float>(1.0 / token_count));
    run_backward(s, on_block_done);
    return ops_.sum(losses_.data(), static_cast<std::size_t>(R)) / token_count;
  }

  // Sum of token losses / token_count without gradients.
  double evaluate(const FlatShape& s, const std::int32_t* tokens, const std::int32_t* targets, double token_count) {
    TRELLIS_CHECK(token_count > 0, "FlatGpt: token_count must be > 0");
    run_forward(s, tokens, targets);
    ops_.xent_forward(s.rows(), cfg_.vocab, vocab_ld(), logits_.data(), targets_.data(), losses_.data());
    return ops_.sum(losses_.data(), static_cast<std::size_t>(s.rows())) / token_count;
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
    ops_.download(out.data(), base + t.offset, out.size());
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
    auto act = [&](std::size_t n) { return ops_.template allocate<act_t>(n); };
    auto f32 = [&](std::size_t n) { return ops_.template allocate<float>(n); };
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
    tokens_ = ops_.template allocate<std::int32_t>(R), targets_ = ops_.template allocate<std::int32_t>(R);
    dresid_ = act(R * C), dtmp_ = act(R * C), dfch_ = act(R * 4 * C), dqkv_ = act(R * 3 * C);
    dq_ = act(R * C), dk_ = act(R * C), dv_ = act(R * C), do_ = act(R * C);
  }

  kernels::AttentionArgs attention_args() const {
    kernels::AttentionArgs a;
    a.batch = shape_.batch, a.q_heads = a.kv_heads = cfg_.heads, a.q_len = a.kv_len = shape_.seq;
    a.head_dim = cfg_.width / cfg_.heads, a.causal = true;
    return a;
  }
  kernels::host::EmbeddingArgs embedding_args() const {
    kernels::host::EmbeddingArgs a;
    a.batch = shape_.batch, a.seq = shape_.seq, a.dim = cfg_.width, a.vocab_rows = cfg_.vocab, a.positions = cfg_.positions;
    return a;
  }
  // y (R x n) = x (R x k) W (k x n) [+ epilogue]: a GPT-2 Conv1D forward.
  template <class E>
  void linear(index_t R, index_t k, index_t n, const act_t* x, const act_t* weight, act_t* y, E ep) {
    ops_.gemm(kernels::gemm_args(R, n, k), x, weight, y, ep);
  }
  // dx (R x k) = dy (R x n) W^T, W stored k x n.
  template <class E = kernels::epilogue::None>
  void linear_dx(index_t R, index_t k, index_t n, const act_t* dy, const act_t* weight, act_t* dx, E ep = {}) {
    ops_.gemm(kernels::gemm_args(R, k, n, kernels::Op::none, kernels::Op::transpose), dy, weight, dx, ep);
  }
  // dW (k x n) += x^T (k x R) dy (R x n), fp32.
  void linear_dw(index_t R, index_t k, index_t n, const act_t* x, const act_t* dy, float* dw) {
    ops_.gemm(kernels::gemm_args(k, n, R, kernels::Op::transpose, kernels::Op::none, 1.0f, 1.0f), x, dy, dw);
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
    ops_.upload(tokens_.data(), tokens, static_cast<std::size_t>(R));
    ops_.upload(targets_.data(), targets, static_cast<std::size_t>(R));
    ops_.embedding_forward(embedding_args(), tokens_.data(), master(0), master(1), layers_[0].resid.data());
    const auto attn = attention_args();
    namespace ep = kernels::epilogue;
    for (index_t l = 0; l < cfg_.layers; ++l) {
      Layer& L = layers_[static_cast<std::size_t>(l)];
      if (l == 0) {
        ops_.layernorm_forward(R, C, L.resid.data(), master(at(l, 0)), master(at(l, 1)), L.ln1.data(),
                               L.ln1_mean.data(), L.ln1_rstd.data(), cfg_.ln_eps);
      } else {  // resid = previous resid2 + previous fcproj, fused into ln_1
        Layer& P = layers_[static_cast<std::size_t>(l - 1)];
        ops_.layernorm_forward(R, C, P.fcproj.data(), master(at(l, 0)), master(at(l, 1)), L.ln1.data(),
                               L.ln1_mean.data(), L.ln1_rstd.data(), cfg_.ln_eps, P.resid2.data(), L.resid.data());
      }
      linear(R, C, 3 * C, L.ln1.data(), lowp(at(l, 2)), L.qkv.data(), ep::Bias<act_t>{lowp(at(l, 3))});
      ops_.rows_to_heads(s, H, D, L.qkv.data(), 3 * C, L.q.data());
      ops_.rows_to_heads(s, H, D, L.qkv.data() + C, 3 * C, L.k.data());
      ops_.rows_to_heads(s, H, D, L.qkv.data() + 2 * C, 3 * C, L.v.data());
      ops_.attention_forward(attn, L.q.data(), L.k.data(), L.v.data(), L.o.data(), L.lse.data());
      ops_.heads_to_rows(s, H, D, L.o.data(), L.atty.data(), C);
      linear(R, C, C, L.atty.data(), lowp(at(l, 4)), L.attproj.data(), ep::Bias<act_t>{lowp(at(l, 5))});
      ops_.layernorm_forward(R, C, L.attproj.data(), master(at(l, 6)), master(at(l, 7)), L.ln2.data(),
                             L.ln2_mean.data(), L.ln2_rstd.data(), cfg_.ln_eps, L.resid.data(), L.resid2.data());
      linear(R, C, 4 * C, L.ln2.data(), lowp(at(l, 8)), L.fch.data(),
             ep::BiasGelu<act_t>{lowp(at(l, 9)), L.fch_pre.data()});
      linear(R, 4 * C, C, L.fch.data(), lowp(at(l, 10)), L.fcproj.data(), ep::Bias<act_t>{lowp(at(l, 11))});
    }
    Layer& last = layers_.back();
    ops_.layernorm_forward(R, C, last.fcproj.data(), master(ln_f()), master(ln_f() + 1), lnf_.data(),
                           lnf_mean_.data(), lnf_rstd_.data(), cfg_.ln_eps, last.resid2.data(), resid_f_.data());
    // logits (R x V, row stride vocab_ld) = lnf (R x C) wte^T
    auto args = kernels::gemm_args(R, cfg_.vocab, C, kernels::Op::none, kernels::Op::transpose);
    args.ldc = vocab_ld();
    ops_.gemm(args, lnf_.data(), lowp(0), logits_.data());
  }

  // Expects logits_ to hold d loss / d logits (written in place by the fused cross-entropy).
  template <class OnBlockDone>
  void run_backward(const FlatShape& s, OnBlockDone& on_block_done) {
    const index_t R = s.rows(), C = cfg_.width, H = cfg_.heads, D = C / H, V = cfg_.vocab;
    // dlnf (R x C) = dlogits (R x V) wte (V x C);  dwte (V x C) += dlogits^T lnf
    auto dx = kernels::gemm_args(R, C, V);
    dx.lda = vocab_ld();
    ops_.gemm(dx, logits_.data(), lowp(0), dtmp_.data());
    auto dw = kernels::gemm_args(V, C, R, kernels::Op::transpose, kernels::Op::none, 1.0f, 1.0f);
    dw.lda = vocab_ld();
    ops_.gemm(dw, logits_.data(), lnf_.data(), dmaster(0));
    ops_.layernorm_backward(R, C, dtmp_.data(), resid_f_.data(), master(ln_f()), lnf_mean_.data(), lnf_rstd_.data(),
                            dresid_.data(), dmaster(ln_f()), dmaster(ln_f() + 1), false);
    const auto attn = attention_args();
    for (index_t l = cfg_.layers - 1; l >= 0; --l) {
      Layer& L = layers_[static_cast<std::size_t>(l)];
      // dresid: gradient of this block's output resid2 + fcproj.
      // MLP: fcproj = fch W_proj + b;  fch = gelu(fch_pre);  fch_pre = ln2 W_fc + b
      linear_dx(R, 4 * C, C, dresid_.data(), lowp(at(l, 10)), dfch_.data(),
                kernels::epilogue::DGelu<act_t>{L.fch_pre.data()});
      linear_dw(R, 4 * C, C, L.fch.data(), dresid_.data(), dmaster(at(l, 10)));
      ops_.column_sums(R, C, C, dresid_.data(), dmaster(at(l, 11)));
      linear_dw(R, C, 4 * C, L.ln2.data(), dfch_.data(), dmaster(at(l, 8)));
      ops_.column_sums(R, 4 * C, 4 * C, dfch_.data(), dmaster(at(l, 9)));
      linear_dx(R, C, 4 * C, dfch_.data(), lowp(at(l, 8)), dtmp_.data());
      ops_.layernorm_backward(R, C, dtmp_.data(), L.resid2.data(), master(at(l, 6)), L.ln2_mean.data(),
                              L.ln2_rstd.data(), dresid_.data(), dmaster(at(l, 6)), dmaster(at(l, 7)), true);
      // dresid: gradient of resid2 = resid + attproj.  attproj = atty W + b
      linear_dw(R, C, C, L.atty.data(), dresid_.data(), dmaster(at(l, 4)));
      ops_.column_sums(R, C, C, dresid_.data(), dmaster(at(l, 5)));
      linear_dx(R, C, C, dresid_.data(), lowp(at(l, 4)), dtmp_.data());
      ops_.rows_to_heads(s, H, D, dtmp_.data(), C, do_.data());
      ops_.attention_backward(attn, L.q.data(), L.k.data(), L.v.data(), L.o.data(), do_.data(), L.lse.data(),
                              dq_.data(), dk_.data(), dv_.data());
      ops_.heads_to_rows(s, H, D, dq_.data(), dqkv_.data(), 3 * C);
      ops_.heads_to_rows(s, H, D, dk_.data(), dqkv_.data() + C, 3 * C);
      ops_.heads_to_rows(s, H, D, dv_.data(), dqkv_.data() + 2 * C, 3 * C);
      linear_dw(R, C, 3 * C, L.ln1.data(), dqkv_.data(), dmaster(at(l, 2)));
      ops_.column_sums(R, 3 * C, 3 * C, dqkv_.data(), dmaster(at(l, 3)));
      linear_dx(R, C, 3 * C, dqkv_.data(), lowp(at(l, 2)), dtmp_.data());
      ops_.layernorm_backward(R, C, dtmp_.data(), L.resid.data(), master(at(l, 0)), L.ln1_mean.data(),
                              L.ln1_rstd.data(), dresid_.data(), dmaster(at(l, 0)), dmaster(at(l, 1)), true);
      // dresid: gradient of this block's input
      on_block_done(block_begin(l), block_begin(l + 1) - block_begin(l));
    }
    ops_.embedding_backward(embedding_args(), tokens_.data(), dresid_.data(), dmaster(0), dmaster(1));
  }

  GptConfig cfg_;
  Ops ops_;
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
