// LayerNorm over the feature dimension (kernels/norms_host.hpp), weights replicated over tp.
// It runs on the norm-region rows: all rows, or with sequence parallelism this rank's sequence
// shard, in which case backward_weight sums the weight gradients over tp (each rank saw only its
// rows); without sp every tp rank computes the same full gradient.
#pragma once

#include <string>
#include <vector>

#include "trellis/kernels/norms_host.hpp"
#include "trellis/nn/parameter.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

template <comm::Communicator C>
class LayerNorm {
 public:
  LayerNorm(std::string name, index_t dim, TensorParallel<C> tp, float eps = 1e-5f) : dim_(dim), eps_(eps), tp_(tp) {
    tp_.check();
    TRELLIS_CHECK(dim > 0, name, ": LayerNorm width must be positive");
    weight_ = make_parameter(name + ".weight", {dim});
    bias_ = make_parameter(name + ".bias", {dim});
    init_constant(weight_, 1.0f);
  }

  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }
  template <class F> void for_each_parameter(F&& f) {
    f(weight_);
    f(bias_);
  }

  // x, y: (local_rows, dim).
  void forward(int mb, const TokenShape& shape, const float* x, float* y) {
    Saved& s = store_.create(mb);
    s.rows = tp_.local_rows(shape);
    s.x.assign(x, x + s.rows * dim_);
    s.mean.resize(static_cast<std::size_t>(s.rows));
    s.rstd.resize(static_cast<std::size_t>(s.rows));
    kernels::host::layernorm_forward(s.rows, dim_, s.x.data(), weight_.value.data(), bias_.value.data(), y,
                                     s.mean.data(), s.rstd.data(), eps_);
  }

  // dy -> dx (local_rows, dim); the weight-gradient terms are kept for backward_weight.
  void backward_input(int mb, const TokenShape& shape, const float* dy, float* dx) {
    Saved& s = store_.at(mb, "LayerNorm::backward_input");
    TRELLIS_CHECK(s.rows == tp_.local_rows(shape), "LayerNorm::backward_input: token shape differs from forward");
    s.dwb.assign(static_cast<std::size_t>(2 * dim_), 0.0f);
    kernels::host::layernorm_backward(s.rows, dim_, dy, s.x.data(), weight_.value.data(), s.mean.data(),
                                      s.rstd.data(), dx, s.dwb.data(), s.dwb.data() + dim_);
  }

  void backward_weight(int mb) {
    Saved& s = store_.at(mb, "LayerNorm::backward_weight");
    TRELLIS_CHECK(!s.dwb.empty(), "LayerNorm::backward_weight before backward_input (microbatch ", mb, ")");
    if (tp_.sequence_parallel && tp_.size() > 1)
      tp_.comm->all_reduce(s.dwb.data(), s.dwb.data(), s.dwb.size(), comm::ReduceOp::sum);
    for (index_t j = 0; j < dim_; ++j) {
      weight_.grad[j] += s.dwb[j];
      bias_.grad[j] += s.dwb[dim_ + j];
    }
    store_.erase(mb);
  }
  void release(int mb) { store_.erase(mb); }
  std::size_t saved_microbatches() const { return store_.size(); }

 private:
  struct Saved {
    index_t rows = 0;
    std::vector<float> x, mean, rstd;
    std::vector<float> dwb;  // (2, dim): this microbatch's weight and bias gradients
  };
  index_t dim_;
  float eps_;
  TensorParallel<C> tp_;
  Parameter weight_, bias_;
  MicrobatchStore<Saved> store_;
};

}  // namespace trellis::nn
