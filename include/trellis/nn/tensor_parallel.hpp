// What every tensor-parallel layer shares: the tp communicator, the sequence-parallel and overlap
// options, the token-row geometry, and thin GEMM helpers over the layer's compute backend
// (backend/backend.hpp): activations are B::act_t, weight gradients fp32.
//
// Activations are 2-D: rows are tokens in sequence-major order, row = t * batch + b (Megatron's
// [s, b, h]), columns are features. With sequence parallelism (sp) the norm/residual regions hold
// only this rank's contiguous range of positions t (seq / tp of them, all batch entries), so a
// row shard is a sequence shard; column-parallel layers all-gather it first and row-parallel
// layers reduce-scatter back into it instead of all-reducing. Said as placements over tp
// (shard/placement.hpp): the norm region is S(0) of the rows under sp and R without it
// (region_placement); a tp region's partial sums are P(sum); leaving the region is the planner's
// step P(sum) -> region (shard/flat.hpp: a reduce-scatter, or an all-reduce), entering it the
// step region -> R (an all-gather, or nothing).
//
// Overlap (Oases-style, `overlap_chunks` > 1): a layer splits its rows into chunks and starts the
// collective of one chunk asynchronously while the GEMM of the next one runs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/backend/host.hpp"
#include "trellis/shard/flat.hpp"
#include "trellis/shard/layout.hpp"

namespace trellis::nn {

// One microbatch's token geometry, and what its dropout masks depend on (nn/dropout.hpp): the
// step's seed and the global batch index of the microbatch's sample b = 0, so that a token's mask
// is the same whatever dp rank or microbatch holds it. `train` = false (evaluation, generation)
// turns dropout off.
// Packed documents: `segments` gives the document id of every token ((batch, full_seq())
// row-major, host memory, ids non-decreasing along each sample): attention stays inside a document
// and positions restart at each document's first token. nullptr: every sample is one sequence.
// Context parallelism (nn/context_parallel.hpp): the full sequence is cut into 2 cp_size chunks and
// this rank holds chunks cp_rank and 2 cp_size - 1 - cp_rank (zig-zag, so causal attention work is
// the same on every rank); `seq` is the LOCAL length (full / cp_size), local positions [0, seq/2)
// the first chunk and [seq/2, seq) the second. Layers see local rows only; global_position()
// says where a local position sits (embedding positions, dropout masks, the ring's masks).
struct TokenShape {
  index_t batch = 1;
  index_t seq = 1;
  std::uint64_t seed = 0;    // the step's dropout seed; fixed across F/B/recompute
  index_t first_sample = 0;  // global batch index of sample b = 0 (sample b is first_sample + b)
  bool train = true;         // false: no dropout
  const std::int32_t* segments = nullptr;  // (batch, full_seq()) document ids, or nullptr
  int cp_rank = 0, cp_size = 1;
  index_t rows() const { return batch * seq; }
  bool packed() const { return segments != nullptr; }
  index_t full_seq() const { return seq * cp_size; }
  // Length of one zig-zag chunk (the whole local sequence without cp).
  index_t cp_chunk() const { return cp_size > 1 ? seq / 2 : seq; }
  // The global chunk index of local chunk c (0 or 1) of cp rank r.
  index_t global_chunk(int r, int c) const { return c == 0 ? r : 2 * cp_size - 1 - r; }
  index_t global_position(index_t p) const {
    if (cp_size == 1) return p;
    const index_t L = seq / 2;
    return global_chunk(cp_rank, p < L ? 0 : 1) * L + p % L;
  }

  // Refuses ids that decrease along a sample (a document split in two), naming where.
  void check_segments(const char* who) const {
    if (!segments) return;
    const index_t n = full_seq();
    for (index_t b = 0; b < batch; ++b)
      for (index_t t = 1; t < n; ++t)
        TRELLIS_CHECK(segments[b * n + t - 1] <= segments[b * n + t], who, ": document ids of sample ", b,
                      " decrease at position ", t, " (", segments[b * n + t - 1], " then ", segments[b * n + t],
                      "): a packed document must be contiguous");
  }
  // Position of every local token within its document, (batch, seq) row-major: the global
  // position without segments.
  std::vector<std::int32_t> positions() const {
    const index_t n = full_seq();
    std::vector<std::int32_t> full(static_cast<std::size_t>(n)), out(static_cast<std::size_t>(batch * seq));
    for (index_t b = 0; b < batch; ++b) {
      index_t start = 0;
      for (index_t t = 0; t < n; ++t) {
        if (segments && t > 0 && segments[b * n + t] != segments[b * n + t - 1]) start = t;
        full[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(t - start);
      }
      for (index_t p = 0; p < seq; ++p)
        out[static_cast<std::size_t>(b * seq + p)] = full[static_cast<std::size_t>(global_position(p))];
    }
    return out;
  }
};

template <comm::Communicator C>
struct TensorParallel {
  C* comm = nullptr;               // the tp communicator (size 1 is fine)
  bool sequence_parallel = false;  // shard norm/residual regions along the sequence
  int overlap_chunks = 1;          // > 1: chunked GEMM/collective overlap

  int size() const { return comm ? comm->size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
  // Rows of the replicated (full) activation and of this rank's norm-region activation.
  index_t full_rows(const TokenShape& s) const { return s.rows(); }
  index_t local_rows(const TokenShape& s) const {
    if (!sequence_parallel) return s.rows();
    TRELLIS_CHECK(s.seq % size() == 0, "sequence parallelism: sequence length ", s.seq,
                  " is not divisible by the tensor-parallel size ", size());
    return s.rows() / size();
  }
  // Where the norm/residual region's rows live over tp: this rank's sequence shard (S(0)) under
  // sp, all of them (R) otherwise.
  shard::PlacementCode region_placement() const {
    return sequence_parallel ? shard::shard_code(0) : shard::replicate_code();
  }
  // Global row index of this rank's first norm-region row.
  index_t first_local_row(const TokenShape& s) const { return sequence_parallel ? rank() * local_rows(s) : 0; }
  void check() const {
    TRELLIS_CHECK(comm != nullptr, "tensor-parallel layer without a communicator");
    TRELLIS_CHECK(overlap_chunks >= 1, "overlap_chunks must be >= 1, got ", overlap_chunks);
  }
};

// Per-microbatch saved state: created by forward, read by backward_input and backward_weight,
// freed after backward_weight.
template <class Ctx>
class MicrobatchStore {
 public:
  Ctx& create(int mb) {
    auto [it, fresh] = map_.try_emplace(mb);
    TRELLIS_CHECK(fresh, "forward of microbatch ", mb, " twice without backward_weight in between");
    return it->second;
  }
  Ctx& at(int mb, const char* what) {
    auto it = map_.find(mb);
    TRELLIS_CHECK(it != map_.end(), what, ": no saved forward state for microbatch ", mb);
    return it->second;
  }
  bool contains(int mb) const { return map_.count(mb) != 0; }
  void erase(int mb) { map_.erase(mb); }
  std::size_t size() const { return map_.size(); }

 private:
  std::unordered_map<int, Ctx> map_;
};

namespace detail {

// y (m, n) = x (m, k) . w (k, n), all row-major, with an epilogue; beta = 1 accumulates.
template <class B, class TC, class E = kernels::epilogue::None>
void matmul(const B& be, index_t m, index_t n, index_t k, const typename B::act_t* x, const typename B::act_t* w,
            TC* y, E ep = {}, float beta = 0.0f, index_t ldy = 0) {
  auto a = kernels::gemm_args(m, n, k, kernels::Op::none, kernels::Op::none, 1.0f, beta);
  a.ldc = ldy;
  be.gemm(a, x, w, y, ep);
}
// dx (m, k) = dy (m, n) . w^T, w stored (k, n).
template <class B>
void matmul_bt(const B& be, index_t m, index_t k, index_t n, const typename B::act_t* dy,
               const typename B::act_t* w, typename B::act_t* dx) {
  be.gemm(kernels::gemm_args(m, k, n, kernels::Op::none, kernels::Op::transpose), dy, w, dx);
}
// dw (k, n) += x^T (k, m) . dy (m, n), x stored (m, k); fp32 gradient.
template <class B>
void matmul_at_acc(const B& be, index_t k, index_t n, index_t m, const typename B::act_t* x,
                   const typename B::act_t* dy, float* dw) {
  be.gemm(kernels::gemm_args(k, n, m, kernels::Op::transpose, kernels::Op::none, 1.0f, 1.0f), x, dy, dw);
}

// The rows of chunk j of `local` rows split into `chunks` (the library's uneven rule).
inline shard::Chunk row_chunk(index_t local, int chunks, int j) { return shard::chunk(local, chunks, j); }

// ---- the three communication patterns of tensor-parallel layers, each with optional overlap ----
// Chunking never crosses ranks: chunk j of every rank's rows travels in collective j. T is the
// activation type; buffers are the backend's.
inline int effective_chunks(int requested, index_t rows) {
  return static_cast<int>(std::max<index_t>(1, std::min<index_t>(requested, rows)));
}

// all-gather of row shards (local: local_rows x width) into full (size*local_rows x width), then
// compute(row0, rows) on each arrived block of full rows. With overlap, block j+1 is in flight
// while compute runs on block j.
template <class C, class B, class T, class F>
void gather_rows_then(TensorParallel<C>& tp, const B& be, const T* local, index_t local_rows, index_t width, T* full,
                      F&& compute) {
  const int n = tp.size();
  if (n == 1) {
    if (full != local) be.copy(full, local, static_cast<std::size_t>(local_rows * width));
    compute(index_t{0}, local_rows);
    return;
  }
  const int chunks = effective_chunks(tp.overlap_chunks, local_rows);
  if (chunks == 1) {
    tp.comm->all_gather(local, full, static_cast<std::size_t>(local_rows * width));
    compute(index_t{0}, n * local_rows);
    return;
  }
  std::vector<typename B::template buffer<T>> staging;
  std::vector<typename C::request_type> inflight;
  staging.reserve(static_cast<std::size_t>(chunks));
  inflight.reserve(static_cast<std::size_t>(chunks));
  auto start = [&](int j) {
    const auto c = row_chunk(local_rows, chunks, j);
    staging.push_back(be.template scratch<T>(static_cast<std::size_t>(n * c.size * width)));
    inflight.push_back(tp.comm->all_gather_async(local + c.offset * width, staging.back().data(),
                                                 static_cast<std::size_t>(c.size * width)));
  };
  start(0);
  for (int j = 0; j < chunks; ++j) {
    if (j + 1 < chunks) start(j + 1);
    inflight[j].wait();
    const auto c = row_chunk(local_rows, chunks, j);
    for (int r = 0; r < n; ++r) {
      const index_t row0 = r * local_rows + c.offset;
      be.copy(full + row0 * width, staging[j].data() + r * c.size * width, static_cast<std::size_t>(c.size * width));
      compute(row0, c.size);
    }
  }
}

// produce(row0, rows, dst) writes this rank's partial sums of full rows [row0, row0 + rows)
// (dst: rows x width, contiguous); they are reduce-scattered so that `local` (local_rows x width)
// gets the sum of this rank's row shard. With overlap, chunk j is reduced while chunk j+1 computes.
template <class C, class B, class T, class F>
void produce_then_reduce_scatter(TensorParallel<C>& tp, const B& be, index_t local_rows, index_t width, T* local,
                                 F&& produce) {
  const int n = tp.size();
  if (n == 1) {
    produce(index_t{0}, local_rows, local);
    return;
  }
  const int chunks = effective_chunks(tp.overlap_chunks, local_rows);
  if (chunks == 1) {
    auto partial = be.template scratch<T>(static_cast<std::size_t>(n * local_rows * width));
    produce(index_t{0}, n * local_rows, partial.data());
    tp.comm->reduce_scatter(partial.data(), local, static_cast<std::size_t>(local_rows * width), comm::ReduceOp::sum);
    return;
  }
  std::vector<typename B::template buffer<T>> staging;
  std::vector<typename C::request_type> inflight;
  staging.reserve(static_cast<std::size_t>(chunks));
  inflight.reserve(static_cast<std::size_t>(chunks));
  for (int j = 0; j < chunks; ++j) {
    const auto c = row_chunk(local_rows, chunks, j);
    staging.push_back(be.template scratch<T>(static_cast<std::size_t>(n * c.size * width)));
    for (int r = 0; r < n; ++r) produce(r * local_rows + c.offset, c.size, staging[j].data() + r * c.size * width);
    inflight.push_back(tp.comm->reduce_scatter_async(staging[j].data(), local + c.offset * width,
                                                     static_cast<std::size_t>(c.size * width), comm::ReduceOp::sum));
  }
  for (auto& req : inflight) req.wait();
}

// produce(row0, rows, dst) writes partial sums of rows [row0, row0 + rows) of out (rows x width)
// in place; they are all-reduced over tp. With overlap, chunk j is reduced while chunk j+1 computes.
template <class C, class T, class F>
void produce_then_all_reduce(TensorParallel<C>& tp, index_t rows, index_t width, T* out, F&& produce) {
  const int n = tp.size();
  const int chunks = n == 1 ? 1 : effective_chunks(tp.overlap_chunks, rows);
  if (chunks == 1) {
    produce(index_t{0}, rows, out);
    if (n > 1) tp.comm->all_reduce(out, out, static_cast<std::size_t>(rows * width), comm::ReduceOp::sum);
    return;
  }
  std::vector<typename C::request_type> inflight;
  inflight.reserve(static_cast<std::size_t>(chunks));
  for (int j = 0; j < chunks; ++j) {
    const auto c = row_chunk(rows, chunks, j);
    T* dst = out + c.offset * width;
    produce(c.offset, c.size, dst);
    inflight.push_back(tp.comm->all_reduce_async(dst, dst, static_cast<std::size_t>(c.size * width), comm::ReduceOp::sum));
  }
  for (auto& req : inflight) req.wait();
}

// Leaves a tensor-parallel region: produce(row0, rows, dst) writes this rank's partial sums
// (P(sum) over tp) of full rows, which become the norm region's placement in `out` (local rows x
// width): the planner's step, a reduce-scatter into this rank's sequence shard under sp, an
// all-reduce of all rows otherwise (each chunked and overlapped as above).
template <class C, class B, class T, class F>
void produce_then_leave_region(TensorParallel<C>& tp, const B& be, const TokenShape& shape, index_t width, T* out,
                               F&& produce) {
  const shard::Plan<1> plan = shard::flat_plan(shard::partial_code(comm::ReduceOp::sum), tp.region_placement());
  switch (plan.steps[0].kind) {
    case shard::StepKind::reduce_scatter:
      produce_then_reduce_scatter(tp, be, tp.local_rows(shape), width, out, produce);
      return;
    case shard::StepKind::all_reduce:
      produce_then_all_reduce(tp, tp.full_rows(shape), width, out, produce);
      return;
    default: break;
  }
  TRELLIS_THROW("tensor-parallel region: no collective from P(sum) to ", shard::placement_string(tp.region_placement()));
}

}  // namespace detail
}  // namespace trellis::nn
