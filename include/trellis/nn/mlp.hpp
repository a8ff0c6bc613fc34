// GPT-2 MLP: c_fc (column-parallel, fused bias + tanh GELU) then c_proj (row-parallel). The hidden
// features are split over tp, so the only communication is c_proj's reduction (and, with sequence
// parallelism, c_fc's all-gather).
#pragma once

#include <string>
#include <vector>

#include "trellis/nn/linear.hpp"

namespace trellis::nn {

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class Mlp {
 public:
  using act_t = typename B::act_t;

  // name: e.g. "h.0.mlp"; hidden = 4 * width in GPT-2.
  Mlp(const std::string& name, index_t width, index_t hidden, TensorParallel<C> tp, B be = {})
      : be_(be),
        c_fc_(name + ".c_fc", LinearConfig{width, hidden, true, 1, 1, Activation::gelu_tanh}, tp, be),
        c_proj_(name + ".c_proj", LinearConfig{hidden, width, true, 1, 1}, tp, be) {}

  ColumnParallelLinear<C, B>& c_fc() { return c_fc_; }
  RowParallelLinear<C, B>& c_proj() { return c_proj_; }
  template <class F> void for_each_parameter(F&& f) {
    c_fc_.for_each_parameter(f);
    c_proj_.for_each_parameter(f);
  }

  // Inference (decoding): whole rows, nothing saved.
  void infer(index_t rows, const act_t* x, act_t* y) {
    auto h = be_.template scratch<act_t>(static_cast<std::size_t>(rows * c_fc_.local_out_features()));
    c_fc_.infer(rows, x, h.data());
    c_proj_.infer(rows, h.data(), y);
  }
  void forward(int mb, const TokenShape& shape, const act_t* x, act_t* y) {
    auto h = be_.template scratch<act_t>(static_cast<std::size_t>(shape.rows() * c_fc_.local_out_features()));
    c_fc_.forward(mb, shape, x, h.data());
    c_proj_.forward(mb, shape, h.data(), y);
  }
  void backward_input(int mb, const TokenShape& shape, const act_t* dy, act_t* dx) {
    auto dh = be_.template scratch<act_t>(static_cast<std::size_t>(shape.rows() * c_fc_.local_out_features()));
    c_proj_.backward_input(mb, shape, dy, dh.data());
    c_fc_.backward_input(mb, shape, dh.data(), dx);
  }
  void backward_weight(int mb) {
    c_fc_.backward_weight(mb);
    c_proj_.backward_weight(mb);
  }
  void release(int mb) {
    c_fc_.release(mb);
    c_proj_.release(mb);
  }
  std::size_t saved_microbatches() const { return c_fc_.saved_microbatches() + c_proj_.saved_microbatches(); }
  void set_saved_memory(SavedMemory<B> m) {
    c_fc_.set_saved_memory(m);
    c_proj_.set_saved_memory(m);
  }
  std::size_t saved_bytes(const TokenShape& shape) const { return c_fc_.saved_bytes(shape) + c_proj_.saved_bytes(shape); }

 private:
  B be_;
  ColumnParallelLinear<C, B> c_fc_;
  RowParallelLinear<C, B> c_proj_;
};

}  // namespace trellis::nn
