// LayerNorm over the feature dimension, weights replicated over tp (fp32 weights and statistics on
// every backend; activations B::act_t).
// It runs on the norm-region rows: all rows, or with sequence parallelism this rank's sequence
// shard. Without sp every tp rank computes the same full gradient (placement Replicate); with sp
// each rank's gradient covers its rows only, so the parameters say their gradient is Partial(sum)
// over tp, and whoever owns the step sums it once (nn::reduce_tp_partial_grads), not once per
// microbatch here.
#pragma once

#include <string>
#include <vector>

#include "trellis/backend/host.hpp"
#include "trellis/nn/activation_arena.hpp"
#include "trellis/nn/parameter.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class LayerNorm {
 public:
  using act_t = typename B::act_t;

  LayerNorm(std::string name, index_t dim, TensorParallel<C> tp, float eps = 1e-5f, B be = {})
      : dim_(dim), eps_(eps), tp_(tp), be_(std::move(be)) {
    tp_.check();
    TRELLIS_CHECK(dim > 0, name, ": LayerNorm width must be positive");
    const auto sharding = ParamSharding::replicated(/*tp_partial_grad=*/tp_.sequence_parallel);
    weight_ = make_parameter(name + ".weight", {dim}, {}, sharding, tp_.size(), tp_.rank());
    bias_ = make_parameter(name + ".bias", {dim}, {}, sharding, tp_.size(), tp_.rank());
    init_constant(weight_, 1.0f);
  }

  Parameter& weight() { return weight_; }
  Parameter& bias() { return bias_; }
  template <class F> void for_each_parameter(F&& f) {
    f(weight_);
    f(bias_);
  }

  // Inference (decoding): y = LayerNorm(x) on `rows` rows; nothing is saved.
  void infer(index_t rows, const act_t* x, act_t* y) const {
    auto stats = be_.template scratch<float>(static_cast<std::size_t>(2 * rows));  // mean, rstd
    be_.layernorm_forward(rows, dim_, x, weight_.value.data(), bias_.value.data(), y, stats.data(),
                          stats.data() + rows, eps_);
  }

  // x, y: (local_rows, dim).
  void forward(int mb, const TokenShape& shape, const act_t* x, act_t* y) {
    Saved& s = store_.create(mb);
    s.rows = tp_.local_rows(shape);
    s.x = saved_.template take<act_t>(be_, mb, s.rows * dim_, "LayerNorm input");
    be_.copy(s.x.data(), x, s.x.size());
    s.mean = saved_.template take<float>(be_, mb, s.rows, "LayerNorm mean");
    s.rstd = saved_.template take<float>(be_, mb, s.rows, "LayerNorm rstd");
    be_.layernorm_forward(s.rows, dim_, s.x.data(), weight_.value.data(), bias_.value.data(), y, s.mean.data(),
                          s.rstd.data(), eps_);
  }

  // dy -> dx (local_rows, dim); the weight-gradient terms are kept for backward_weight.
  void backward_input(int mb, const TokenShape& shape, const act_t* dy, act_t* dx) {
    Saved& s = store_.at(mb, "LayerNorm::backward_input");
    TRELLIS_CHECK(s.rows == tp_.local_rows(shape), "LayerNorm::backward_input: token shape differs from forward");
    s.dwb = saved_.template take<float>(be_, mb, 2 * dim_, "LayerNorm weight gradients");
    be_.fill_zero(s.dwb.data(), s.dwb.size());  // the kernel adds into dweight and dbias
    be_.layernorm_backward(s.rows, dim_, dy, s.x.data(), weight_.value.data(), s.mean.data(), s.rstd.data(), dx,
                           s.dwb.data(), s.dwb.data() + dim_, false);
  }

  void backward_weight(int mb) {
    Saved& s = store_.at(mb, "LayerNorm::backward_weight");
    TRELLIS_CHECK(!s.dwb.empty(), "LayerNorm::backward_weight before backward_input (microbatch ", mb, ")");
    be_.add(dim_, weight_.grad.data(), s.dwb.data(), weight_.grad.data());
    be_.add(dim_, bias_.grad.data(), s.dwb.data() + dim_, bias_.grad.data());
    store_.erase(mb);
  }
  void release(int mb) { store_.erase(mb); }
  std::size_t saved_microbatches() const { return store_.size(); }

  // Where saved tensors go (nn/activation_arena.hpp), and how many bytes one microbatch saves.
  void set_saved_memory(SavedMemory<B> m) { saved_ = m; }
  std::size_t saved_bytes(const TokenShape& shape) const {
    const index_t rows = tp_.local_rows(shape);
    return saved_size<act_t>(rows * dim_) + 2 * saved_size<float>(rows) + saved_size<float>(2 * dim_);
  }

 private:
  struct Saved {
    index_t rows = 0;
    SavedTensor<B, act_t> x;
    SavedTensor<B, float> mean, rstd;
    SavedTensor<B, float> dwb;  // (2, dim): this microbatch's weight and bias gradients
  };
  index_t dim_;
  float eps_;
  TensorParallel<C> tp_;
  B be_;
  Parameter weight_, bias_;
  SavedMemory<B> saved_;
  MicrobatchStore<Saved> store_;
};

}  // namespace trellis::nn
