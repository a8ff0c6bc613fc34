// LM head tied to the vocab-parallel embedding, and vocab-parallel softmax cross-entropy.
// logits_r = h wte_r^T holds only this rank's vocabulary columns; the full logits are never
// gathered: the per-row max, sum of exponentials and target logit are computed locally
// (kernels/xent_host.hpp) and reduced over tp (one all-reduce of the maxima, one of the sums and
// target logits together). The loss is the sum over this microbatch's tokens of
// lse - logit[target], divided by the caller's token count (the global number of tokens across
// data-parallel ranks and microbatches), so summing microbatch losses and gradients over data
// parallel ranks gives the global mean. Targets < 0 are ignored (no loss, no gradient).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "trellis/kernels/xent_host.hpp"
#include "trellis/nn/parameter.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

template <comm::Communicator C>
class VocabParallelLMHeadLoss {
 public:
  // wte: this rank's (vocab_local, width) rows of the tied embedding, starting at id vocab_start.
  VocabParallelLMHeadLoss(Parameter* wte, index_t vocab_start, index_t width, TensorParallel<C> tp)
      : wte_(wte), vocab_start_(vocab_start), width_(width), tp_(tp) {
    tp_.check();
    TRELLIS_CHECK(wte != nullptr && wte->numel() % width == 0, "VocabParallelLMHeadLoss: bad tied weight");
    vocab_local_ = wte->numel() / width;
  }

  // h: (local_rows, width); targets: (batch, seq) row-major. Returns this microbatch's loss sum
  // divided by token_count (the same value on every tp rank).
  double forward(int mb, const TokenShape& shape, const float* h, const std::int32_t* targets, double token_count) {
    TRELLIS_CHECK(token_count > 0, "loss: token count must be positive, got ", token_count);
    Saved& s = store_.create(mb);
    const index_t B = shape.batch, T = shape.seq, rows = shape.rows(), V = vocab_local_;
    s.rows = rows;
    s.scale = static_cast<float>(1.0 / token_count);
    s.targets.resize(static_cast<std::size_t>(rows));
    for (index_t r = 0; r < rows; ++r) s.targets[r] = targets[(r % B) * T + r / B];
    s.h.resize(static_cast<std::size_t>(rows * width_));
    s.logits.resize(static_cast<std::size_t>(rows * V));
    auto compute = [&](index_t row0, index_t n) {
      detail::matmul_bt(n, V, width_, s.h.data() + row0 * width_, wte_->value.data(), s.logits.data() + row0 * V);
    };
    if (tp_.sequence_parallel) {
      detail::gather_rows_then(tp_, h, tp_.local_rows(shape), width_, s.h.data(), compute);
      if (tp_.size() > 1) {  // keep this rank's rows only; re-gathered in backward_input
        s.h_local.assign(h, h + tp_.local_rows(shape) * width_);
        s.h = {};
      }
    } else {
      std::copy(h, h + rows * width_, s.h.data());
      compute(0, rows);
    }
    std::vector<float> row_max(static_cast<std::size_t>(rows)), stats(static_cast<std::size_t>(2 * rows));
    kernels::host::xent_partial_max(rows, V, V, s.logits.data(), row_max.data());
    if (tp_.size() > 1) tp_.comm->all_reduce(row_max.data(), row_max.data(), row_max.size(), comm::ReduceOp::max);
    kernels::host::xent_partial_sumexp(rows, V, V, s.logits.data(), row_max.data(), stats.data());
    kernels::host::xent_partial_target(rows, V, V, s.logits.data(), s.targets.data(), vocab_start_, stats.data() + rows);
    if (tp_.size() > 1) tp_.comm->all_reduce(stats.data(), stats.data(), stats.size(), comm::ReduceOp::sum);
    std::vector<float> loss(static_cast<std::size_t>(rows));
    s.lse.resize(static_cast<std::size_t>(rows));
    kernels::host::xent_finish(rows, row_max.data(), stats.data(), stats.data() + rows, s.targets.data(), loss.data(),
                               s.lse.data());
    double total = 0.0;
    for (float l : loss) total += l;
    return total / token_count;
  }

  // -> dh: (local_rows, width), summed over tp.
  void backward_input(int mb, const TokenShape& shape, float* dh) {
    Saved& s = store_.at(mb, "VocabParallelLMHeadLoss::backward_input");
    const index_t rows = s.rows, V = vocab_local_;
    kernels::host::xent_backward_sharded(rows, V, V, s.logits.data(), s.targets.data(), vocab_start_, s.lse.data(),
                                         s.scale, s.logits.data(), V);  // logits become d logits
    s.backward_done = true;
    auto produce = [&](index_t row0, index_t n, float* dst) {
      detail::matmul(n, width_, V, s.logits.data() + row0 * V, wte_->value.data(), dst);
    };
    if (!s.h_local.empty()) {
      s.h.resize(static_cast<std::size_t>(rows * width_));
      auto regather = tp_.comm->all_gather_async(s.h_local.data(), s.h.data(), s.h_local.size());
      detail::produce_then_reduce_scatter(tp_, tp_.local_rows(shape), width_, dh, produce);
      regather.wait();
      s.h_local = {};
    } else if (tp_.sequence_parallel) {
      detail::produce_then_reduce_scatter(tp_, tp_.local_rows(shape), width_, dh, produce);
    } else {
      detail::produce_then_all_reduce(tp_, rows, width_, dh, produce);
    }
  }

  // d wte_r += d logits^T h.
  void backward_weight(int mb) {
    Saved& s = store_.at(mb, "VocabParallelLMHeadLoss::backward_weight");
    TRELLIS_CHECK(s.backward_done, "VocabParallelLMHeadLoss::backward_weight before backward_input (microbatch ", mb, ")");
    detail::matmul_at_acc(vocab_local_, width_, s.rows, s.logits.data(), s.h.data(), wte_->grad.data());
    store_.erase(mb);
  }
  void release(int mb) { store_.erase(mb); }
  std::size_t saved_microbatches() const { return store_.size(); }

 private:
  struct Saved {
    index_t rows = 0;
    float scale = 0.0f;
    bool backward_done = false;
    std::vector<std::int32_t> targets;  // (rows) in row order
    std::vector<float> h;               // (rows, width): gathered input (sp: from backward_input on)
    std::vector<float> h_local;         // (local_rows, width): sp, until backward_input
    std::vector<float> logits;          // (rows, vocab_local): logits, then d logits
    std::vector<float> lse;             // (rows)
  };
  Parameter* wte_;
  index_t vocab_start_, width_, vocab_local_ = 0;
  TensorParallel<C> tp_;
  MicrobatchStore<Saved> store_;
};

}  // namespace trellis::nn
