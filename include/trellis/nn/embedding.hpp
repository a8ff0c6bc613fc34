// Vocab-parallel token embedding (Megatron) plus GPT-2's learned position embedding, over a
// compute backend B (fp32 tables and gradients, B::act_t output).
//   wte: (vocab, width), rows split over tp (rank r holds ids chunk(vocab, tp, r));
//   wpe: (positions, width), replicated.
// Forward: each rank looks up the ids it owns (zeros elsewhere), the partial rows are all-reduced
// (with sequence parallelism reduce-scattered into this rank's sequence shard), then wpe[t] is
// added. Backward: the full output gradient (all-gathered under sp) is scatter-added into this
// rank's wte rows and into wpe, so wpe's gradient is complete on every tp rank.
// Both lookups go through the backend's embedding kernel (vocab-sharded for wte; for wpe the ids
// are the rows' positions: t = row / batch in the layers' sequence-major row order, or with packed
// documents (TokenShape::segments) t minus the start of the token's document).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trellis/backend/host.hpp"
#include "trellis/nn/activation_arena.hpp"
#include "trellis/nn/kv_cache.hpp"
#include "trellis/nn/parameter.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class VocabParallelEmbedding {
 public:
  using act_t = typename B::act_t;

  VocabParallelEmbedding(index_t vocab, index_t positions, index_t width, TensorParallel<C> tp, B be = {})
      : vocab_(vocab), positions_(positions), width_(width), tp_(tp), be_(std::move(be)) {
    tp_.check();
    TRELLIS_CHECK(vocab >= tp_.size() && positions > 0 && width > 0, "VocabParallelEmbedding: vocab ", vocab,
                  " positions ", positions, " width ", width, " with tp ", tp_.size());
    wte_ = make_parameter("wte.weight", {vocab, width}, {}, ParamSharding::tp_sharded(0), tp_.size(), tp_.rank());
    rows_ = {wte_.shard_offsets[0], wte_.shard_shape[0]};
    wpe_ = make_parameter("wpe.weight", {positions, width});
  }

  Parameter& wte() { return wte_; }
  Parameter& wpe() { return wpe_; }
  shard::Chunk vocab_range() const { return rows_; }
  template <class F> void for_each_parameter(F&& f) {
    f(wte_);
    f(wpe_);
  }

  // Inference (decoding, nn/kv_cache.hpp): tokens (step.batch, step.count) row-major host ids at
  // positions [step.start, step.end()) -> y (step.rows(), width), whole rows; nothing is saved.
  void infer(const DecodeStep& step, const std::int32_t* tokens, act_t* y) {
    TRELLIS_CHECK(step.start >= 0 && step.end() <= positions_, "embedding: positions [", step.start, ", ", step.end(),
                  ") outside the ", positions_, " learned positions");
    const index_t rows = step.rows();
    std::vector<std::int32_t> row_tokens(static_cast<std::size_t>(rows));
    for (index_t r = 0; r < rows; ++r) {
      const std::int32_t id = tokens[(r % step.batch) * step.count + r / step.batch];
      TRELLIS_CHECK(id >= 0 && id < vocab_, "embedding: token id ", id, " outside the vocabulary 0..", vocab_ - 1);
      row_tokens[r] = id;
    }
    const auto ids = upload(row_tokens);
    detail::produce_then_all_reduce(tp_, rows, width_, y, [&](index_t row0, index_t n, act_t* dst) {
      be_.embedding_forward(token_args(n), ids.data() + row0, wte_.value.data(), static_cast<const float*>(nullptr),
                            dst);
    });
    const auto positions = upload(decode_position_ids(step.start * step.batch, rows, step.batch));
    auto pos = be_.template scratch<act_t>(static_cast<std::size_t>(rows * width_));
    be_.embedding_forward(position_args(rows), positions.data(), wpe_.value.data(), static_cast<const float*>(nullptr),
                          pos.data());
    be_.add(rows * width_, y, pos.data(), y);
  }

  // tokens: (batch, seq) row-major host ids -> y: (local_rows, width), row = t * batch + b.
  void forward(int mb, const TokenShape& shape, const std::int32_t* tokens, act_t* y) {
    TRELLIS_CHECK(shape.full_seq() <= positions_, "embedding: sequence length ", shape.full_seq(), " exceeds the ",
                  positions_, " learned positions");
    const index_t Bt = shape.batch, T = shape.seq, local = tp_.local_rows(shape);
    for (index_t i = 0; i < Bt * T; ++i)
      TRELLIS_CHECK(tokens[i] >= 0 && tokens[i] < vocab_, "embedding: token id ", tokens[i], " at index ", i,
                    " outside the vocabulary 0..", vocab_ - 1);
    Saved& s = store_.create(mb);
    std::vector<std::int32_t> row_tokens(static_cast<std::size_t>(Bt * T));
    for (index_t r = 0; r < Bt * T; ++r) row_tokens[r] = tokens[(r % Bt) * T + r / Bt];
    s.row_tokens = saved_.template take<std::int32_t>(be_, mb, Bt * T, "embedding token ids");
    be_.upload(s.row_tokens.data(), row_tokens.data(), row_tokens.size());
    auto produce = [&](index_t row0, index_t n, act_t* dst) {
      be_.embedding_forward(token_args(n), s.row_tokens.data() + row0, wte_.value.data(),
                            static_cast<const float*>(nullptr), dst);
    };
    detail::produce_then_leave_region(tp_, be_, shape, width_, y, produce);
    const index_t first = tp_.first_local_row(shape);
    s.positions = shape.positions();
    const auto positions = upload(position_ids(first, local, Bt, T, s.positions));
    auto pos = be_.template scratch<act_t>(static_cast<std::size_t>(local * width_));
    be_.embedding_forward(position_args(local), positions.data(), wpe_.value.data(),
                          static_cast<const float*>(nullptr), pos.data());
    be_.add(local * width_, y, pos.data(), y);
  }

  // dy: (local_rows, width). Gathers the full gradient (sp) for backward_weight.
  void backward_input(int mb, const TokenShape& shape, const act_t* dy) {
    Saved& s = store_.at(mb, "VocabParallelEmbedding::backward_input");
    const index_t local = tp_.local_rows(shape);
    s.batch = shape.batch;
    s.seq = shape.seq;
    s.dy = saved_.template take<act_t>(be_, mb, shape.rows() * width_, "embedding output gradient");
    if (tp_.sequence_parallel) detail::gather_rows_then(tp_, be_, dy, local, width_, s.dy.data(), [](index_t, index_t) {});
    else be_.copy(s.dy.data(), dy, s.dy.size());
  }

  void backward_weight(int mb) {
    Saved& s = store_.at(mb, "VocabParallelEmbedding::backward_weight");
    TRELLIS_CHECK(!s.dy.empty(), "VocabParallelEmbedding::backward_weight before backward_input (microbatch ", mb, ")");
    const index_t rows = s.batch * s.seq;
    be_.embedding_backward(token_args(rows), s.row_tokens.data(), s.dy.data(), wte_.grad.data(),
                           static_cast<float*>(nullptr));
    const auto positions = upload(position_ids(0, rows, s.batch, s.seq, s.positions));
    be_.embedding_backward(position_args(rows), positions.data(), s.dy.data(), wpe_.grad.data(),
                           static_cast<float*>(nullptr));
    store_.erase(mb);
  }
  void release(int mb) { store_.erase(mb); }
  std::size_t saved_microbatches() const { return store_.size(); }

  void set_saved_memory(SavedMemory<B> m) { saved_ = m; }
  std::size_t saved_bytes(const TokenShape& shape) const {
    return saved_size<std::int32_t>(shape.rows()) + saved_size<act_t>(shape.rows() * width_);
  }

 private:
  using ids = typename B::template buffer<std::int32_t>;

  ids upload(const std::vector<std::int32_t>& host) const {
    auto out = be_.template scratch<std::int32_t>(host.size());
    be_.upload(out.data(), host.data(), host.size());
    return out;
  }
  // Positions of `rows` consecutive sequence-major rows starting at global row `first`: row
  // t * batch + b reads sample_positions (TokenShape::positions, (batch, seq)) at (b, t).
  static std::vector<std::int32_t> position_ids(index_t first, index_t rows, index_t batch, index_t seq,
                                                const std::vector<std::int32_t>& sample_positions) {
    std::vector<std::int32_t> out(static_cast<std::size_t>(rows));
    for (index_t i = 0; i < rows; ++i) {
      const index_t r = first + i;
      out[i] = sample_positions[static_cast<std::size_t>((r % batch) * seq + r / batch)];
    }
    return out;
  }
  static std::vector<std::int32_t> decode_position_ids(index_t first, index_t rows, index_t batch) {
    std::vector<std::int32_t> out(static_cast<std::size_t>(rows));
    for (index_t i = 0; i < rows; ++i) out[i] = static_cast<std::int32_t>((first + i) / batch);
    return out;
  }
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
  // Lookup of `rows` position ids in the whole wpe table.
  kernels::EmbeddingArgs position_args(index_t rows) const {
    kernels::EmbeddingArgs a;
    a.batch = 1;
    a.seq = rows;
    a.dim = width_;
    a.vocab_rows = positions_;
    return a;
  }

  struct Saved {
    SavedTensor<B, std::int32_t> row_tokens;  // ids in row order (row = t * batch + b)
    index_t batch = 0, seq = 0;
    std::vector<std::int32_t> positions;  // (batch, seq) host: each token's position in its document
    SavedTensor<B, act_t> dy;  // (rows, width): full output gradient
  };
  index_t vocab_, positions_, width_;
  TensorParallel<C> tp_;
  B be_;
  shard::Chunk rows_;
  Parameter wte_, wpe_;
  SavedMemory<B> saved_;
  MicrobatchStore<Saved> store_;
};

}  // namespace trellis::nn
