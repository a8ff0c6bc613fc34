// Vocab-parallel token embedding (Megatron) plus GPT-2's learned position embedding.
//   wte: (vocab, width), rows split over tp (rank r holds ids chunk(vocab, tp, r));
//   wpe: (positions, width), replicated.
// Forward: each rank looks up the ids it owns (zeros elsewhere), the partial rows are all-reduced
// (with sequence parallelism reduce-scattered into this rank's sequence shard), then wpe[t] is
// added. Backward: the full output gradient (all-gathered under sp) is scatter-added into this
// rank's wte rows and into wpe, so wpe's gradient is complete on every tp rank.
// Token rows go through kernels/embedding_host.hpp (vocab-sharded lookup / scatter-add) with the
// ids permuted to the layers' sequence-major row order; positions are added here by row.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trellis/kernels/embedding_host.hpp"
#include "trellis/nn/parameter.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

template <comm::Communicator C>
class VocabParallelEmbedding {
 public:
  VocabParallelEmbedding(index_t vocab, index_t positions, index_t width, TensorParallel<C> tp)
      : vocab_(vocab), positions_(positions), width_(width), tp_(tp) {
    tp_.check();
    TRELLIS_CHECK(vocab >= tp_.size() && positions > 0 && width > 0, "VocabParallelEmbedding: vocab ", vocab,
                  " positions ", positions, " width ", width, " with tp ", tp_.size());
    rows_ = shard::chunk(vocab, tp_.size(), tp_.rank());
    wte_ = make_parameter("wte.weight", {vocab, width}, {}, 0, rows_.offset, rows_.size);
    wpe_ = make_parameter("wpe.weight", {positions, width});
  }

  Parameter& wte() { return wte_; }
  Parameter& wpe() { return wpe_; }
  shard::Chunk vocab_range() const { return rows_; }
  template <class F> void for_each_parameter(F&& f) {
    f(wte_);
    f(wpe_);
  }

  // tokens: (batch, seq) row-major ids -> y: (local_rows, width), row = t * batch + b.
  void forward(int mb, const TokenShape& shape, const std::int32_t* tokens, float* y) {
    TRELLIS_CHECK(shape.seq <= positions_, "embedding: sequence length ", shape.seq, " exceeds the ", positions_,
                  " learned positions");
    const index_t B = shape.batch, T = shape.seq, local = tp_.local_rows(shape);
    for (index_t i = 0; i < B * T; ++i)
      TRELLIS_CHECK(tokens[i] >= 0 && tokens[i] < vocab_, "embedding: token id ", tokens[i], " at index ", i,
                    " outside the vocabulary 0..", vocab_ - 1);
    Saved& s = store_.create(mb);
    s.row_tokens.resize(static_cast<std::size_t>(B * T));
    for (index_t r = 0; r < B * T; ++r) s.row_tokens[r] = tokens[(r % B) * T + r / B];
    auto produce = [&](index_t row0, index_t n, float* dst) {
      kernels::host::embedding_forward(token_args(n), s.row_tokens.data() + row0, wte_.value.data(),
                                       static_cast<const float*>(nullptr), dst);
    };
    if (tp_.sequence_parallel) detail::produce_then_reduce_scatter(tp_, local, width_, y, produce);
    else detail::produce_then_all_reduce(tp_, B * T, width_, y, produce);
    const index_t first = tp_.sequence_parallel ? tp_.rank() * local : 0;
    for (index_t i = 0; i < local; ++i) {
      const index_t t = (first + i) / B;
      for (index_t j = 0; j < width_; ++j) y[i * width_ + j] += wpe_.value[t * width_ + j];
    }
  }

  // dy: (local_rows, width). Gathers the full gradient (sp) for backward_weight.
  void backward_input(int mb, const TokenShape& shape, const float* dy) {
    Saved& s = store_.at(mb, "VocabParallelEmbedding::backward_input");
    const index_t local = tp_.local_rows(shape);
    s.batch = shape.batch;
    s.seq = shape.seq;
    s.dy.resize(static_cast<std::size_t>(shape.rows() * width_));
    if (tp_.sequence_parallel) detail::gather_rows_then(tp_, dy, local, width_, s.dy.data(), [](index_t, index_t) {});
    else std::copy(dy, dy + shape.rows() * width_, s.dy.data());
  }

  void backward_weight(int mb) {
    Saved& s = store_.at(mb, "VocabParallelEmbedding::backward_weight");
    TRELLIS_CHECK(!s.dy.empty(), "VocabParallelEmbedding::backward_weight before backward_input (microbatch ", mb, ")");
    const index_t B = s.batch, T = s.seq;
    kernels::host::embedding_backward(token_args(B * T), s.row_tokens.data(), s.dy.data(), wte_.grad.data(),
                                      static_cast<float*>(nullptr));
    for (index_t r = 0; r < B * T; ++r) {
      const float* g = s.dy.data() + r * width_;
      float* gp = wpe_.grad.data() + (r / B) * width_;
      for (index_t j = 0; j < width_; ++j) gp[j] += g[j];
    }
    store_.erase(mb);
  }
  void release(int mb) { store_.erase(mb); }
  std::size_t saved_microbatches() const { return store_.size(); }

 private:
  // Lookup of `rows` ids (sequence-major) in this rank's wte rows, without positions.
  kernels::EmbeddingArgs token_args(index_t rows) const {
    kernels::EmbeddingArgs a;
    a.batch = 1;
    a.seq = rows;
    a.dim = width_;
    a.vocab_rows = rows_.size;
    a.vocab_start = rows_.offset;
    a.sharded = true;
    return a;
  }

  struct Saved {
    std::vector<std::int32_t> row_tokens;  // ids in row order (row = t * batch + b)
    index_t batch = 0, seq = 0;
    std::vector<float> dy;  // (rows, width): full output gradient
  };
  index_t vocab_, positions_, width_;
  TensorParallel<C> tp_;
  shard::Chunk rows_;
  Parameter wte_, wpe_;
  MicrobatchStore<Saved> store_;
};

}  // namespace trellis::nn
