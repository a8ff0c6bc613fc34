// Column- and row-parallel linear layers (Megatron), with GPT-2's Conv1D weight layout
// (weight: in x out, y = x W + b), over a compute backend B (activations B::act_t, fp32 weights
// and gradients).
//
//   ColumnParallelLinear  W split by output columns. Forward: (sp: all-gather rows) then
//                         y = x W_r + b_r [+ GELU]. backward_input: dx = dy W_r^T, all-reduced
//                         (sp: reduce-scattered) over tp.
//   RowParallelLinear     W split by input rows; input arrives split by columns (the output of a
//                         column-parallel layer). Forward: y = all-reduce(x_r W_r + [b on tp rank
//                         0]) (sp: reduce-scatter): the bias enters the sum once, in the GEMM's
//                         epilogue. backward_input: (sp: all-gather dy) dx_r = dy W_r^T.
// Each layer exposes forward / backward_input / backward_weight with per-microbatch saved state;
// backward_weight accumulates into Parameter::grad and frees the microbatch's state.
//
// Output columns (or input rows) are split in units of `unit` elements (a head's width for the
// attention projections) and, for the fused q/k/v projection, within each of `groups` equal
// column groups: rank r holds units chunk(units, tp, r) of every group.
#pragma once

#include <string>
#include <type_traits>
#include <vector>

#include "trellis/backend/host.hpp"
#include "trellis/kernels/epilogue.hpp"
#include "trellis/nn/activation_arena.hpp"
#include "trellis/nn/operand.hpp"
#include "trellis/nn/parameter.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

enum class Activation { none, gelu_tanh };

struct LinearConfig {
  index_t in = 0;            // global input features
  index_t out = 0;           // global output features
  bool bias = true;
  index_t unit = 1;          // split granularity (features)
  int groups = 1;            // column groups split separately (3 for a fused q/k/v projection)
  Activation activation = Activation::none;  // column-parallel only: fused GELU (GPT-2 MLP)
};

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class ColumnParallelLinear {
 public:
  using act_t = typename B::act_t;

  ColumnParallelLinear(std::string name, const LinearConfig& cfg, TensorParallel<C> tp, B be = {})
      : cfg_(cfg), tp_(tp), be_(std::move(be)) {
    tp_.check();
    TRELLIS_CHECK(cfg.in > 0 && cfg.out > 0 && cfg.unit > 0 && cfg.groups > 0, name,
                  ": bad linear sizes in=", cfg.in, " out=", cfg.out);
    TRELLIS_CHECK(cfg.out % (cfg.groups * cfg.unit) == 0, name, ": out ", cfg.out, " is not a multiple of groups ",
                  cfg.groups, " x unit ", cfg.unit);
    TRELLIS_CHECK(cfg.activation == Activation::none || cfg.bias, name, ": fused GELU needs a bias");
    // Output columns over tp in whole units; with groups (fused q/k/v) the columns are viewed as
    // (groups, group width) and each group's width is split, so a rank's heads are one box.
    const index_t group_width = cfg.out / cfg.groups;
    const bool grouped = cfg.groups > 1;
    const std::vector<index_t> w_view = grouped ? std::vector<index_t>{cfg.in, cfg.groups, group_width} : std::vector<index_t>{};
    const std::vector<index_t> b_view = grouped ? std::vector<index_t>{cfg.groups, group_width} : std::vector<index_t>{};
    weight_ = make_parameter(name + ".weight", {cfg.in, cfg.out}, w_view, ParamSharding::tp_sharded(grouped ? 2 : 1, cfg.unit),
                             tp_.size(), tp_.rank());
    if (cfg.bias)
      bias_ = make_parameter(name + ".bias", {cfg.out}, b_view, ParamSharding::tp_sharded(grouped ? 1 : 0, cfg.unit),
                             tp_.size(), tp_.rank());
    group_local_ = weight_.shard_shape.back();
    out_local_ = group_local_ * cfg.groups;
  }

  index_t in_features() const { return cfg_.in; }
  index_t local_out_features() const { return out_local_; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }
  const LinearConfig& config() const { return cfg_; }
  TensorParallel<C>& tp() { return tp_; }
  template <class F> void for_each_parameter(F&& f) {
    f(weight_);
    if (cfg_.bias) f(bias_);
  }

  // Inference (decoding, nn/kv_cache.hpp): y (rows, local_out) = x (rows, in) W_r + b_r [+ GELU]
  // on whole rows, whatever the sequence-parallel option; nothing is saved.
  void infer(index_t rows, const act_t* x, act_t* y) {
    const act_t* w = w_.of(be_, weight_);
    const act_t* b = cfg_.bias ? b_.of(be_, bias_) : nullptr;
    using namespace kernels::epilogue;
    const index_t m = rows, n = out_local_, k = cfg_.in;
    if (cfg_.activation == Activation::gelu_tanh) detail::matmul(be_, m, n, k, x, w, y, BiasGelu<act_t>{b});
    else if (b) detail::matmul(be_, m, n, k, x, w, y, Bias<act_t>{b});
    else detail::matmul(be_, m, n, k, x, w, y);
  }

  // x: (local_rows, in) (sp: this rank's sequence shard; else all rows) -> y: (rows, local_out).
  void forward(int mb, const TokenShape& shape, const act_t* x, act_t* y) {
    Saved& s = store_.create(mb);
    const index_t rows = tp_.full_rows(shape), local = tp_.local_rows(shape), in = cfg_.in;
    s.rows = rows;
    if (cfg_.activation == Activation::gelu_tanh)
      s.pre = saved_.template take<act_t>(be_, mb, rows * out_local_, "ColumnParallelLinear pre-activation");
    const act_t* w = w_.of(be_, weight_);
    const act_t* b = cfg_.bias ? b_.of(be_, bias_) : nullptr;
    const act_t* input = nullptr;  // (rows, in): the (gathered) input
    auto compute = [&](index_t row0, index_t n) {
      const act_t* xr = input + row0 * in;
      act_t* yr = y + row0 * out_local_;
      if (cfg_.activation == Activation::gelu_tanh) {
        kernels::epilogue::BiasGelu<act_t> ep{b, s.pre.data() + row0 * out_local_};
        detail::matmul(be_, n, out_local_, in, xr, w, yr, ep);
      } else if (cfg_.bias) {
        detail::matmul(be_, n, out_local_, in, xr, w, yr, kernels::epilogue::Bias<act_t>{b});
      } else {
        detail::matmul(be_, n, out_local_, in, xr, w, yr);
      }
    };
    if (gathers()) {
      // Megatron: keep only this rank's rows; the gathered input is scratch, and backward_input
      // gathers it again, overlapped with its dX product.
      s.x_local = saved_.template take<act_t>(be_, mb, local * in, "ColumnParallelLinear input shard");
      be_.copy(s.x_local.data(), x, s.x_local.size());
      auto full = be_.template scratch<act_t>(static_cast<std::size_t>(rows * in));
      input = full.data();
      detail::gather_rows_then(tp_, be_, x, local, in, full.data(), compute);
    } else {
      s.x = saved_.template take<act_t>(be_, mb, rows * in, "ColumnParallelLinear input");
      be_.copy(s.x.data(), x, static_cast<std::size_t>(rows * in));
      input = s.x.data();
      compute(0, rows);
    }
  }

  // dy: (rows, local_out) -> dx: (local_rows, in), summed over tp.
  void backward_input(int mb, const TokenShape& shape, const act_t* dy, act_t* dx) {
    Saved& s = store_.at(mb, "ColumnParallelLinear::backward_input");
    const index_t rows = s.rows, local = tp_.local_rows(shape), in = cfg_.in;
    TRELLIS_CHECK(rows == tp_.full_rows(shape), "ColumnParallelLinear::backward_input: token shape differs from forward");
    if (cfg_.activation == Activation::gelu_tanh) {  // in place: dz overwrites the pre-activation (llm.c)
      be_.gelu_backward(rows * out_local_, s.pre.data(), dy, s.pre.data());
      s.dz = std::move(s.pre);
    } else {
      s.dz = saved_.template take<act_t>(be_, mb, rows * out_local_, "ColumnParallelLinear output gradient");
      be_.copy(s.dz.data(), dy, s.dz.size());
    }
    s.backward_done = true;
    const act_t* w = w_.of(be_, weight_);
    auto produce = [&](index_t row0, index_t n, act_t* dst) {
      detail::matmul_bt(be_, n, in, out_local_, s.dz.data() + row0 * out_local_, w, dst);
    };
    if (!s.x_local.empty()) {
      s.x = saved_.template take<act_t>(be_, mb, rows * in, "ColumnParallelLinear gathered input");
      auto regather = tp_.comm->all_gather_async(s.x_local.data(), s.x.data(), s.x_local.size());
      detail::produce_then_reduce_scatter(tp_, be_, local, in, dx, produce);
      regather.wait();
      s.x_local = {};
    } else {
      detail::produce_then_leave_region(tp_, be_, shape, in, dx, produce);
    }
  }

  // dW += x^T dz, db += column sums of dz (fp32); frees the microbatch's state.
  void backward_weight(int mb) {
    Saved& s = store_.at(mb, "ColumnParallelLinear::backward_weight");
    TRELLIS_CHECK(s.backward_done, "ColumnParallelLinear::backward_weight before backward_input (microbatch ", mb, ")");
    detail::matmul_at_acc(be_, cfg_.in, out_local_, s.rows, s.x.data(), s.dz.data(), weight_.grad.data());
    if (cfg_.bias) be_.column_sums(s.rows, out_local_, out_local_, s.dz.data(), bias_.grad.data());
    store_.erase(mb);
  }
  // Drops a microbatch's state without gradients (activation recompute discards forward state).
  void release(int mb) { store_.erase(mb); }
  std::size_t saved_microbatches() const { return store_.size(); }

  // Where saved tensors go (nn/activation_arena.hpp), and how many bytes one microbatch saves
  // (forward and backward_input together).
  void set_saved_memory(SavedMemory<B> m) { saved_ = m; }
  std::size_t saved_bytes(const TokenShape& shape) const {
    const index_t rows = tp_.full_rows(shape), in = cfg_.in;
    std::size_t bytes = saved_size<act_t>(rows * out_local_);               // pre (GELU), else dz
    if (gathers()) bytes += saved_size<act_t>(tp_.local_rows(shape) * in);  // x_local, then x at B
    return bytes + saved_size<act_t>(rows * in);
  }

 private:
  // Sequence parallel over more than one rank: the input arrives as row shards.
  bool gathers() const { return tp_.sequence_parallel && tp_.size() > 1; }

  struct Saved {
    index_t rows = 0;
    bool backward_done = false;
    SavedTensor<B, act_t> x;        // (rows, in): the input; under sp (gathers()) from backward_input on
    SavedTensor<B, act_t> x_local;  // (local_rows, in): under sp, this rank's input rows
    SavedTensor<B, act_t> pre;      // (rows, local_out): pre-activation, with GELU
    SavedTensor<B, act_t> dz;       // (rows, local_out): grad of the pre-activation output (GELU: in pre's memory)
  };
  LinearConfig cfg_;
  TensorParallel<C> tp_;
  B be_;
  index_t group_local_ = 0, out_local_ = 0;
  Parameter weight_, bias_;
  Operand<B> w_, b_;
  SavedMemory<B> saved_;
  MicrobatchStore<Saved> store_;
};

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class RowParallelLinear {
 public:
  using act_t = typename B::act_t;

  RowParallelLinear(std::string name, const LinearConfig& cfg, TensorParallel<C> tp, B be = {})
      : cfg_(cfg), tp_(tp), be_(std::move(be)) {
    tp_.check();
    TRELLIS_CHECK(cfg.in > 0 && cfg.out > 0 && cfg.unit > 0 && cfg.in % cfg.unit == 0, name,
                  ": bad linear sizes in=", cfg.in, " out=", cfg.out, " unit=", cfg.unit);
    TRELLIS_CHECK(cfg.groups == 1 && cfg.activation == Activation::none, name,
                  ": row-parallel layers have one group and no activation");
    // Input rows over tp in whole units; the bias is whole, and so is its gradient (every tp rank
    // sums the full output gradient).
    weight_ = make_parameter(name + ".weight", {cfg.in, cfg.out}, {}, ParamSharding::tp_sharded(0, cfg.unit), tp_.size(),
                             tp_.rank());
    in_local_ = weight_.shard_shape[0];
    if (cfg.bias) bias_ = make_parameter(name + ".bias", {cfg.out});
  }

  index_t local_in_features() const { return in_local_; }
  index_t out_features() const { return cfg_.out; }
  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }
  TensorParallel<C>& tp() { return tp_; }
  template <class F> void for_each_parameter(F&& f) {
    f(weight_);
    if (cfg_.bias) f(bias_);
  }

  // Inference (decoding): y (rows, out) = all-reduce over tp of x (rows, local_in) W_r, plus bias,
  // on whole rows, whatever the sequence-parallel option; nothing is saved.
  void infer(index_t rows, const act_t* x, act_t* y) {
    const act_t* w = w_.of(be_, weight_);
    const act_t* b = cfg_.bias && tp_.rank() == 0 ? b_.of(be_, bias_) : nullptr;  // enters the sum once
    detail::produce_then_all_reduce(tp_, rows, cfg_.out, y, [&](index_t row0, index_t n, act_t* dst) {
      const act_t* xr = x + row0 * in_local_;
      if (b) detail::matmul(be_, n, cfg_.out, in_local_, xr, w, dst, kernels::epilogue::Bias<act_t>{b});
      else detail::matmul(be_, n, cfg_.out, in_local_, xr, w, dst);
    });
  }

  // x: (rows, local_in) -> y: (local_rows, out), reduced over tp, plus bias.
  void forward(int mb, const TokenShape& shape, const act_t* x, act_t* y) {
    Saved& s = store_.create(mb);
    const index_t rows = tp_.full_rows(shape), out = cfg_.out;
    s.rows = rows;
    s.x = saved_.template take<act_t>(be_, mb, rows * in_local_, "RowParallelLinear input");
    be_.copy(s.x.data(), x, s.x.size());
    const act_t* w = w_.of(be_, weight_);
    // The bias joins tp rank 0's partial sums, so the reduction adds it exactly once.
    const act_t* b = cfg_.bias && tp_.rank() == 0 ? b_.of(be_, bias_) : nullptr;
    auto produce = [&](index_t row0, index_t n, act_t* dst) {
      const act_t* xr = s.x.data() + row0 * in_local_;
      if (b) detail::matmul(be_, n, out, in_local_, xr, w, dst, kernels::epilogue::Bias<act_t>{b});
      else detail::matmul(be_, n, out, in_local_, xr, w, dst);
    };
    detail::produce_then_leave_region(tp_, be_, shape, out, y, produce);
  }

  // dy: (local_rows, out) -> dx: (rows, local_in).
  void backward_input(int mb, const TokenShape& shape, const act_t* dy, act_t* dx) {
    Saved& s = store_.at(mb, "RowParallelLinear::backward_input");
    const index_t rows = s.rows, local = tp_.local_rows(shape), out = cfg_.out;
    TRELLIS_CHECK(rows == tp_.full_rows(shape), "RowParallelLinear::backward_input: token shape differs from forward");
    s.dy = saved_.template take<act_t>(be_, mb, rows * out, "RowParallelLinear output gradient");
    s.backward_done = true;
    const act_t* w = w_.of(be_, weight_);
    auto compute = [&](index_t row0, index_t n) {
      detail::matmul_bt(be_, n, in_local_, out, s.dy.data() + row0 * out, w, dx + row0 * in_local_);
    };
    if (tp_.sequence_parallel) {
      detail::gather_rows_then(tp_, be_, dy, local, out, s.dy.data(), compute);
    } else {
      be_.copy(s.dy.data(), dy, s.dy.size());
      compute(0, rows);
    }
  }

  void backward_weight(int mb) {
    Saved& s = store_.at(mb, "RowParallelLinear::backward_weight");
    TRELLIS_CHECK(s.backward_done, "RowParallelLinear::backward_weight before backward_input (microbatch ", mb, ")");
    detail::matmul_at_acc(be_, in_local_, cfg_.out, s.rows, s.x.data(), s.dy.data(), weight_.grad.data());
    if (cfg_.bias) be_.column_sums(s.rows, cfg_.out, cfg_.out, s.dy.data(), bias_.grad.data());
    store_.erase(mb);
  }
  void release(int mb) { store_.erase(mb); }
  std::size_t saved_microbatches() const { return store_.size(); }

  void set_saved_memory(SavedMemory<B> m) { saved_ = m; }
  std::size_t saved_bytes(const TokenShape& shape) const {
    const index_t rows = tp_.full_rows(shape);
    return saved_size<act_t>(rows * in_local_) + saved_size<act_t>(rows * cfg_.out);
  }

 private:
  struct Saved {
    index_t rows = 0;
    bool backward_done = false;
    SavedTensor<B, act_t> x;   // (rows, local_in)
    SavedTensor<B, act_t> dy;  // (rows, out): the full (gathered) output gradient
  };
  LinearConfig cfg_;
  TensorParallel<C> tp_;
  B be_;
  index_t in_local_ = 0;
  Parameter weight_, bias_;
  Operand<B> w_, b_;
  SavedMemory<B> saved_;
  MicrobatchStore<Saved> store_;
};

}  // namespace trellis::nn
