// LM head tied to the vocab-parallel embedding, and vocab-parallel softmax cross-entropy, over a
// compute backend B (logits in B::act_t, statistics fp32).
// logits_r = h wte_r^T holds only this rank's vocabulary columns; the full logits are never
// gathered: the per-row max, sum of exponentials and target logit are computed locally
// (the backend's xent_partial_* kernels) and reduced over tp (one all-reduce of the maxima, one of
// the sums and target logits together). The loss is the sum over this microbatch's tokens of
// lse - logit[target], divided by the caller's token count (the global number of tokens across
// data-parallel ranks and microbatches), so summing microbatch losses and gradients over data
// parallel ranks gives the global mean. Targets < 0 are ignored (no loss, no gradient).
#pragma once

#include <cstdint>
#include <vector>

#include "trellis/backend/host.hpp"
#include "trellis/nn/activation_arena.hpp"
#include "trellis/nn/operand.hpp"
#include "trellis/nn/parameter.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class VocabParallelLMHeadLoss {
 public:
  using act_t = typename B::act_t;

  // wte: this rank's (vocab_local, width) rows of the tied embedding, starting at id vocab_start.
  VocabParallelLMHeadLoss(Parameter* wte, index_t vocab_start, index_t width, TensorParallel<C> tp, B be = {})
      : wte_(wte), vocab_start_(vocab_start), width_(width), tp_(tp), be_(std::move(be)) {
    tp_.check();
    TRELLIS_CHECK(wte != nullptr && wte->numel() % width == 0, "VocabParallelLMHeadLoss: bad tied weight");
    vocab_local_ = wte->numel() / width;
  }

  // Logits without a loss (generation): h (rows, width), whole rows, in B's memory -> out (rows,
  // vocab) of the FULL vocabulary, in B's memory. Each rank computes its shard h wte_r^T into a
  // block padded to the largest shard; one all-gather over tp and a copy per (rank, row) place the
  // shards at their vocabulary offsets (the library's uneven rule, as GptModel splits wte).
  void logits(const act_t* h, index_t rows, act_t* out) {
    const index_t vocab = wte_->global_numel() / width_, V = vocab_local_, n = tp_.size();
    const auto mine = shard::chunk(vocab, n, tp_.rank());
    TRELLIS_CHECK(mine.offset == vocab_start_ && mine.size == V, "VocabParallelLMHeadLoss::logits: this rank's rows [",
                  vocab_start_, ", ", vocab_start_ + V, ") are not shard ", tp_.rank(), " of ", vocab, " over ", n);
    const act_t* w = w_.of(be_, *wte_);
    if (n == 1) {
      detail::matmul_bt(be_, rows, V, width_, h, w, out);
      return;
    }
    const index_t padded = shard::chunk(vocab, n, 0).size;  // rank 0 holds a largest shard
    auto mine_padded = allocate<act_t>(rows * padded), all = allocate<act_t>(n * rows * padded);  // (rows, padded)
    auto args = kernels::gemm_args(rows, V, width_, kernels::Op::none, kernels::Op::transpose);
    args.ldc = padded;
    be_.gemm(args, h, w, mine_padded.data());
    tp_.comm->all_gather(mine_padded.data(), all.data(), mine_padded.size());  // (tp, rows, padded)
    for (int r = 0; r < n; ++r) {
      const auto c = shard::chunk(vocab, n, r);
      for (index_t i = 0; i < rows; ++i)
        be_.copy(out + i * vocab + c.offset, all.data() + (r * rows + i) * padded, static_cast<std::size_t>(c.size));
    }
  }

  // h: (local_rows, width); targets: (batch, seq) row-major host ids. Returns this microbatch's
  // loss sum divided by token_count (the same value on every tp rank).
  double forward(int mb, const TokenShape& shape, const act_t* h, const std::int32_t* targets, double token_count) {
    TRELLIS_CHECK(token_count > 0, "loss: token count must be positive, got ", token_count);
    Saved& s = store_.create(mb);
    const index_t Bt = shape.batch, T = shape.seq, rows = shape.rows(), V = vocab_local_;
    s.rows = rows;
    s.scale = static_cast<float>(1.0 / token_count);
    std::vector<std::int32_t> row_targets(static_cast<std::size_t>(rows));
    for (index_t r = 0; r < rows; ++r) row_targets[r] = targets[(r % Bt) * T + r / Bt];
    s.targets = saved_.template take<std::int32_t>(be_, mb, rows, "loss targets");
    be_.upload(s.targets.data(), row_targets.data(), row_targets.size());
    s.logits = saved_.template take<act_t>(be_, mb, rows * V, "logits");
    const act_t* w = w_.of(be_, *wte_);
    const act_t* input = nullptr;  // (rows, width): the (gathered) input
    auto compute = [&](index_t row0, index_t n) {
      detail::matmul_bt(be_, n, V, width_, input + row0 * width_, w, s.logits.data() + row0 * V);
    };
    if (gathers()) {  // keep this rank's rows only; the gathered input is scratch, re-gathered in backward_input
      const index_t local = tp_.local_rows(shape);
      s.h_local = saved_.template take<act_t>(be_, mb, local * width_, "LM head input shard");
      be_.copy(s.h_local.data(), h, s.h_local.size());
      auto full = allocate<act_t>(rows * width_);
      input = full.data();
      detail::gather_rows_then(tp_, be_, h, local, width_, full.data(), compute);
    } else {
      s.h = saved_.template take<act_t>(be_, mb, rows * width_, "LM head input");
      be_.copy(s.h.data(), h, s.h.size());
      input = s.h.data();
      compute(0, rows);
    }
    auto row_max = allocate<float>(rows), stats = allocate<float>(2 * rows);
    be_.xent_partial_max(rows, V, V, s.logits.data(), row_max.data());
    if (tp_.size() > 1) tp_.comm->all_reduce(row_max.data(), row_max.data(), row_max.size(), comm::ReduceOp::max);
    be_.xent_partial_sumexp(rows, V, V, s.logits.data(), row_max.data(), stats.data());
    be_.xent_partial_target(rows, V, V, s.logits.data(), s.targets.data(), vocab_start_, stats.data() + rows);
    if (tp_.size() > 1) tp_.comm->all_reduce(stats.data(), stats.data(), stats.size(), comm::ReduceOp::sum);
    auto loss = allocate<float>(rows);
    s.lse = saved_.template take<float>(be_, mb, rows, "loss lse");
    be_.xent_finish(rows, row_max.data(), stats.data(), stats.data() + rows, s.targets.data(), loss.data(),
                    s.lse.data());
    return be_.sum(loss.data(), loss.size()) / token_count;
  }

  // -> dh: (local_rows, width), summed over tp.
  void backward_input(int mb, const TokenShape& shape, act_t* dh) {
    Saved& s = store_.at(mb, "VocabParallelLMHeadLoss::backward_input");
    const index_t rows = s.rows, V = vocab_local_;
    be_.xent_backward_sharded(rows, V, V, s.logits.data(), s.targets.data(), vocab_start_, s.lse.data(), s.scale,
                              s.logits.data(), V);  // logits become d logits
    s.backward_done = true;
    const act_t* w = w_.of(be_, *wte_);
    auto produce = [&](index_t row0, index_t n, act_t* dst) {
      detail::matmul(be_, n, width_, V, s.logits.data() + row0 * V, w, dst);
    };
    if (!s.h_local.empty()) {
      s.h = saved_.template take<act_t>(be_, mb, rows * width_, "LM head gathered input");
      auto regather = tp_.comm->all_gather_async(s.h_local.data(), s.h.data(), s.h_local.size());
      detail::produce_then_reduce_scatter(tp_, be_, tp_.local_rows(shape), width_, dh, produce);
      regather.wait();
      s.h_local = {};
    } else {
      detail::produce_then_leave_region(tp_, be_, shape, width_, dh, produce);
    }
  }

  // d wte_r += d logits^T h (fp32).
  void backward_weight(int mb) {
    Saved& s = store_.at(mb, "VocabParallelLMHeadLoss::backward_weight");
    TRELLIS_CHECK(s.backward_done, "VocabParallelLMHeadLoss::backward_weight before backward_input (microbatch ", mb, ")");
    detail::matmul_at_acc(be_, vocab_local_, width_, s.rows, s.logits.data(), s.h.data(), wte_->grad.data());
    store_.erase(mb);
  }
  void release(int mb) { store_.erase(mb); }
  std::size_t saved_microbatches() const { return store_.size(); }

  // Where saved tensors go (nn/activation_arena.hpp), and the bytes one microbatch saves: the
  // logits (turned into their gradient in place), the input rows, targets and lse.
  void set_saved_memory(SavedMemory<B> m) { saved_ = m; }
  std::size_t saved_bytes(const TokenShape& shape) const {
    const index_t rows = shape.rows();
    std::size_t bytes = saved_size<std::int32_t>(rows) + saved_size<act_t>(rows * vocab_local_) +
                        saved_size<act_t>(rows * width_) + saved_size<float>(rows);
    if (gathers()) bytes += saved_size<act_t>(tp_.local_rows(shape) * width_);
    return bytes;
  }

 private:
  bool gathers() const { return tp_.sequence_parallel && tp_.size() > 1; }

  // Temporaries of one call, written in full before they are read (the padding columns of
  // logits()'s blocks travel unset and are never copied out): not zeroed.
  template <class T>
  typename B::template buffer<T> allocate(index_t n) const {
    return be_.template scratch<T>(static_cast<std::size_t>(n));
  }

  struct Saved {
    index_t rows = 0;
    float scale = 0.0f;
    bool backward_done = false;
    SavedTensor<B, std::int32_t> targets;  // (rows) in row order
    SavedTensor<B, act_t> h;        // (rows, width): the input (sp over tp > 1: gathered again at backward_input)
    SavedTensor<B, act_t> h_local;  // (local_rows, width): sp, until backward_input
    SavedTensor<B, act_t> logits;   // (rows, vocab_local): logits, then d logits
    SavedTensor<B, float> lse;      // (rows)
  };
  Parameter* wte_;
  index_t vocab_start_, width_, vocab_local_ = 0;
  TensorParallel<C> tp_;
  B be_;
  Operand<B> w_;
  SavedMemory<B> saved_;
  MicrobatchStore<Saved> store_;
};

}  // namespace trellis::nn
