// Causal self-attention with heads split over tp (Megatron): c_attn is column-parallel over whole
// heads (q, k and v columns of this rank's heads), the core runs the backend's flash attention
// on the local heads only, c_proj is row-parallel. GPT-2 math: scale 1/sqrt(head_dim), causal.
// Token rows are sequence-major (row = t * batch + b); the core works in [batch, heads, seq, dim].
// Packed documents (TokenShape::segments): the ids go to the kernel, which masks across documents.
// Context parallelism (nn/context_parallel.hpp): the rank's two sequence chunks attend to every
// rank's keys through a ring (mode ring, nn/ring_attention.hpp), or an all-to-all gives this rank
// the whole sequence of heads / cp of its heads (mode ulysses, nn/ulysses.hpp), or both (mode
// hybrid: Ulysses in groups of u ranks, a ring over the groups); everything else is per token.
// The saved q, k, v, o and lse have the same size in every mode (heads x sequence is constant).
#pragma once

#include <string>

#include "trellis/kernels/heads.hpp"
#include "trellis/nn/context_parallel.hpp"
#include "trellis/nn/ring_attention.hpp"
#include "trellis/nn/ulysses.hpp"
#include "trellis/nn/activation_arena.hpp"
#include "trellis/nn/kv_cache.hpp"
#include "trellis/nn/linear.hpp"

namespace trellis::nn {

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class CausalSelfAttention {
 public:
  using act_t = typename B::act_t;

  // name: e.g. "h.0.attn"; width = n_head * head_dim.
  CausalSelfAttention(const std::string& name, index_t width, index_t heads, TensorParallel<C> tp, B be = {},
                      ContextParallel<C> cp = {})
      : width_(width),
        heads_(heads),
        head_dim_(heads > 0 ? width / heads : 0),
        be_(be),
        c_attn_(name + ".c_attn", LinearConfig{width, 3 * width, true, head_dim_, 3}, tp, be),
        c_proj_(name + ".c_proj", LinearConfig{width, width, true, head_dim_, 1}, tp, be),
        tp_(tp),
        cp_(cp) {
    TRELLIS_CHECK(heads > 0 && width % heads == 0, name, ": width ", width, " is not a multiple of heads ", heads);
    TRELLIS_CHECK(heads >= tp.size(), name, ": ", heads, " heads cannot be split over ", tp.size(), " ranks");
    local_heads_ = shard::chunk(heads, tp.size(), tp.rank()).size;
    check_cp_heads(name);
  }

  ColumnParallelLinear<C, B>& c_attn() { return c_attn_; }
  RowParallelLinear<C, B>& c_proj() { return c_proj_; }
  index_t local_heads() const { return local_heads_; }
  template <class F> void for_each_parameter(F&& f) {
    c_attn_.for_each_parameter(f);
    c_proj_.for_each_parameter(f);
  }

  // Incremental forward for decoding (nn/kv_cache.hpp), no saved state: x, y (step.rows(), width)
  // are the rows of the new positions [step.start, step.end()) of every sample (whole rows, whatever
  // the sequence-parallel option). Their K and V (this rank's heads) are appended to `cache` rows,
  // then the new queries attend over positions [0, step.end()): the backend's attention with
  // q_len = count < kv_len = end, whose bottom-right causal mask lets new row i see keys
  // <= start + i. The cached rows are permuted into the kernel's [batch, heads, kv_len, head_dim]
  // on each call (O(end * width) copies, the order of the attention's own reads). c_proj reduces
  // over tp as in forward.
  void decode(const DecodeStep& step, KvBuffers<B>& cache, const act_t* x, act_t* y) {
    const index_t rows = step.rows(), cl = local_heads_ * head_dim_, Bt = step.batch;
    TRELLIS_CHECK(cache.k.size() >= static_cast<std::size_t>(step.end() * Bt * cl) && cache.v.size() == cache.k.size(),
                  "CausalSelfAttention::decode: the cache holds fewer than ", step.end(), " positions of ", Bt,
                  " samples x ", cl, " columns");
    auto qkv = allocate<act_t>(rows * 3 * cl);  // (rows, [q | k | v] of the local heads)
    c_attn_.infer(rows, x, qkv.data());
    // k and v columns of the new rows -> cache rows start * batch..: a column block of qkv is one
    // "head" of cl columns to the permute.
    const kernels::HeadsLayout block{1, rows, 1, cl};
    be_.rows_to_heads(block, qkv.data() + cl, 3 * cl, cache.k.data() + step.start * Bt * cl);
    be_.rows_to_heads(block, qkv.data() + 2 * cl, 3 * cl, cache.v.data() + step.start * Bt * cl);
    kernels::AttentionArgs args = attention_args(Bt, local_heads_, step.count);
    args.kv_len = step.end();
    const auto new_heads = heads_layout({Bt, step.count}), all_heads = heads_layout({Bt, step.end()});
    auto q = allocate<act_t>(args.q_elements()), o = allocate<act_t>(args.q_elements());
    auto k = allocate<act_t>(args.kv_elements()), v = allocate<act_t>(args.kv_elements());
    auto lse = allocate<float>(args.lse_elements());
    be_.rows_to_heads(new_heads, qkv.data(), 3 * cl, q.data());
    be_.rows_to_heads(all_heads, cache.k.data(), cl, k.data());
    be_.rows_to_heads(all_heads, cache.v.data(), cl, v.data());
    be_.attention_forward(args, q.data(), k.data(), v.data(), o.data(), lse.data());
    auto a = allocate<act_t>(rows * cl);
    be_.heads_to_rows(new_heads, o.data(), a.data(), cl);
    c_proj_.infer(rows, a.data(), y);
  }

  // x, y: (local_rows, width).
  void forward(int mb, const TokenShape& shape, const act_t* x, act_t* y) {
    cp_.check(shape, "CausalSelfAttention");
    Saved& s = store_.create(mb);
    const index_t rows = shape.rows(), cl = local_heads_ * head_dim_;
    auto qkv = allocate<act_t>(rows * 3 * cl);
    c_attn_.forward(mb, shape, x, qkv.data());
    const index_t ids = shape.batch * shape.full_seq();
    s.segments = saved_.template take<std::int32_t>(be_, mb, ids, "attention document ids");
    if (shape.packed() && uses_ring()) {
      // The ring's kernels read ids per chunk of the sequence.
      const auto chunked = chunked_segments(shape);
      be_.upload(s.segments.data(), chunked.data(), chunked.size());
    } else if (shape.packed()) {  // one call over the whole sequence reads its ids as they come
      be_.upload(s.segments.data(), shape.segments, static_cast<std::size_t>(ids));
    }
    const auto args = attention_args(shape, s);
    const index_t n = args.q_elements() * chunks(shape);
    s.q = saved_.template take<act_t>(be_, mb, n, "attention q");
    s.k = saved_.template take<act_t>(be_, mb, n, "attention k");
    s.v = saved_.template take<act_t>(be_, mb, n, "attention v");
    s.o = saved_.template take<act_t>(be_, mb, n, "attention output");
    s.lse = saved_.template take<float>(be_, mb, args.lse_elements() * chunks(shape), "attention lse");
    act_t* parts[3] = {s.q.data(), s.k.data(), s.v.data()};
    if (uses_ulysses()) {
      ulysses(shape).scatter(qkv.data(), 3 * cl, 3, parts);
    } else {
      for (int g = 0; g < 3; ++g) to_heads(shape, qkv.data() + g * cl, 3 * cl, parts[g]);
    }
    if (uses_ring()) {
      ring(shape, args, s).forward(s.q.data(), s.k.data(), s.v.data(), s.o.data(), s.lse.data());
    } else {
      be_.attention_forward(args, s.q.data(), s.k.data(), s.v.data(), s.o.data(), s.lse.data());
    }
    auto a = allocate<act_t>(rows * cl);
    if (uses_ulysses()) {
      const act_t* o = s.o.data();
      ulysses(shape).gather(&o, 1, a.data(), cl);
    } else {
      to_rows(shape, s.o.data(), a.data(), cl);
    }
    c_proj_.forward(mb, shape, a.data(), y);
  }

  void backward_input(int mb, const TokenShape& shape, const act_t* dy, act_t* dx) {
    Saved& s = store_.at(mb, "CausalSelfAttention::backward_input");
    const index_t rows = shape.rows(), cl = local_heads_ * head_dim_;
    auto da = allocate<act_t>(rows * cl);
    c_proj_.backward_input(mb, shape, dy, da.data());
    const auto args = attention_args(shape, s);
    const index_t n = args.q_elements() * chunks(shape);
    auto d_o = allocate<act_t>(n), dq = allocate<act_t>(n), dk = allocate<act_t>(n), dv = allocate<act_t>(n);
    act_t* d_o_ptr = d_o.data();
    if (uses_ulysses()) {
      ulysses(shape).scatter(da.data(), cl, 1, &d_o_ptr);
    } else {
      to_heads(shape, da.data(), cl, d_o_ptr);
    }
    if (uses_ring()) {
      ring(shape, args, s).backward(s.q.data(), s.k.data(), s.v.data(), s.o.data(), d_o.data(), s.lse.data(), dq.data(),
                                    dk.data(), dv.data());
    } else {
      be_.attention_backward(args, s.q.data(), s.k.data(), s.v.data(), s.o.data(), d_o.data(), s.lse.data(), dq.data(),
                             dk.data(), dv.data());
    }
    auto dqkv = allocate<act_t>(rows * 3 * cl);
    const act_t* parts[3] = {dq.data(), dk.data(), dv.data()};
    if (uses_ulysses()) {
      ulysses(shape).gather(parts, 3, dqkv.data(), 3 * cl);
    } else {
      for (int g = 0; g < 3; ++g) to_rows(shape, parts[g], dqkv.data() + g * cl, 3 * cl);
    }
    c_attn_.backward_input(mb, shape, dqkv.data(), dx);
    // The core has no weights: its saved tensors are not needed by backward_weight.
    s = Saved{};
  }

  void backward_weight(int mb) {
    store_.at(mb, "CausalSelfAttention::backward_weight");
    c_attn_.backward_weight(mb);
    c_proj_.backward_weight(mb);
    store_.erase(mb);
  }
  void release(int mb) {
    c_attn_.release(mb);
    c_proj_.release(mb);
    store_.erase(mb);
  }
  std::size_t saved_microbatches() const { return store_.size() + c_attn_.saved_microbatches() + c_proj_.saved_microbatches(); }

  void set_saved_memory(SavedMemory<B> m) {
    saved_ = m;
    c_attn_.set_saved_memory(m);
    c_proj_.set_saved_memory(m);
  }
  // The attention kernel's arguments of one call (for the backend's workspace): a chunk pair
  // (ring, hybrid), the whole sequence (ulysses, no cp).
  kernels::AttentionArgs attention_call(const TokenShape& shape) const { return attention_args(shape); }

  std::size_t saved_bytes(const TokenShape& shape) const {
    const auto args = attention_args(shape);
    // The document ids (of the full sequence) are counted whether or not a microbatch is packed:
    // the arena is sized once.
    return 4 * saved_size<act_t>(args.q_elements() * chunks(shape)) +
           saved_size<float>(args.lse_elements() * chunks(shape)) +
           saved_size<std::int32_t>(shape.batch * shape.full_seq()) + c_attn_.saved_bytes(shape) +
           c_proj_.saved_bytes(shape);
  }

 private:
  struct Saved {
    SavedTensor<B, act_t> q, k, v, o;  // (batch, local_heads, seq, head_dim)
    SavedTensor<B, float> lse;         // (batch, local_heads, seq)
    SavedTensor<B, std::int32_t> segments;  // (batch, seq) packed documents' ids (read when packed)
  };

  // Temporaries of one call, written in full before they are read: not zeroed.
  template <class T>
  typename B::template buffer<T> allocate(index_t n) const {
    return be_.template scratch<T>(static_cast<std::size_t>(n));
  }
  // Which exchanges the mode makes (none without cp).
  bool uses_ring() const { return cp_.active() && cp_.mode != CpMode::ulysses; }
  bool uses_ulysses() const { return cp_.active() && cp_.mode != CpMode::ring; }
  // Ulysses and hybrid split every tp rank's heads over the all-to-all's ranks. Checked for every tp
  // rank's share, not only this one's, so that all ranks refuse together before any collective.
  void check_cp_heads(const std::string& name) const {
    cp_.check_mode(name);
    const int u = cp_.ulysses_size(), tp = tp_.size();
    for (int t = 0; t < tp; ++t) {
      const index_t local = shard::chunk(heads_, tp, t).size;
      TRELLIS_CHECK(local % u == 0, name, ": context-parallel mode ", to_string(cp_.mode), " splits each rank's heads over ",
                    u, " ranks (cp ", cp_.size(), "), but ", heads_, " heads over tp ", tp, " leave ", local,
                    " heads on tp rank ", t, ", not a multiple of ", u);
    }
  }
  // One attention call: without cp the whole local sequence; ring: a chunk pair ([2][batch, heads,
  // L, head_dim] tensors); ulysses: the whole sequence of heads / cp heads; hybrid: a chunk pair of
  // heads / u heads ([2u][...] tensors).
  kernels::AttentionArgs attention_args(const TokenShape& shape) const {
    return attention_args(shape.batch, local_heads_ / cp_.ulysses_size(),
                          uses_ring() ? shape.cp_chunk() : shape.full_seq());
  }
  kernels::AttentionArgs attention_args(index_t batch, index_t heads, index_t len) const {
    kernels::AttentionArgs a;
    a.batch = batch;
    a.q_heads = a.kv_heads = heads;
    a.q_len = a.kv_len = len;
    a.head_dim = head_dim_;
    a.causal = true;
    return a;
  }
  // With packed documents the mask also keeps each token inside its document (the ring sets the
  // ids per chunk pair).
  kernels::AttentionArgs attention_args(const TokenShape& shape, Saved& s) const {
    auto a = attention_args(shape);
    if (shape.packed() && !uses_ring()) a.q_segments = a.kv_segments = s.segments.data();
    return a;
  }
  // The chunks of the saved tensors: [chunks][batch, heads, len, head_dim].
  index_t chunks(const TokenShape& shape) const {
    if (!uses_ring()) return 1;
    return shape.cp_size > 1 ? 2 * cp_.ulysses_size() : 1;
  }
  UlyssesExchange<C, B> ulysses(const TokenShape& shape) const {
    const int u = cp_.ulysses_size();
    const bool whole = cp_.mode == CpMode::ulysses;
    return {cp_.ulysses_comm(), be_, shape.batch, shape.cp_chunk(), local_heads_, head_dim_,
            whole ? ulysses_slots(u) : hybrid_slots(u), whole};
  }
  RingAttention<C, B> ring(const TokenShape& shape, const kernels::AttentionArgs& args, Saved& s) const {
    const std::int32_t* segments = shape.packed() ? s.segments.data() : nullptr;
    if (cp_.mode == CpMode::ring) return {*cp_.comm, be_, args, segments};
    return {cp_.ring_comm(), be_, args, segments, hybrid_chunks(cp_.size(), cp_.ulysses_size())};
  }
  kernels::HeadsLayout heads_layout(const TokenShape& shape) const {
    return {shape.batch, shape.cp_chunk(), local_heads_, head_dim_};
  }
  // Token rows (sequence-major) <-> heads tensors, chunk by chunk: a chunk's rows are contiguous.
  void to_heads(const TokenShape& shape, const act_t* rows, index_t ld, act_t* heads) const {
    const auto l = heads_layout(shape);
    const index_t chunk_rows = l.batch * l.seq, chunk_elems = chunk_rows * local_heads_ * head_dim_;
    for (index_t c = 0; c < chunks(shape); ++c) be_.rows_to_heads(l, rows + c * chunk_rows * ld, ld, heads + c * chunk_elems);
  }
  void to_rows(const TokenShape& shape, const act_t* heads, act_t* rows, index_t ld) const {
    const auto l = heads_layout(shape);
    const index_t chunk_rows = l.batch * l.seq, chunk_elems = chunk_rows * local_heads_ * head_dim_;
    for (index_t c = 0; c < chunks(shape); ++c) be_.heads_to_rows(l, heads + c * chunk_elems, rows + c * chunk_rows * ld, ld);
  }

  index_t width_, heads_, head_dim_, local_heads_ = 0;
  B be_;
  ColumnParallelLinear<C, B> c_attn_;
  RowParallelLinear<C, B> c_proj_;
  TensorParallel<C> tp_;
  ContextParallel<C> cp_;
  SavedMemory<B> saved_;
  MicrobatchStore<Saved> store_;
};

}  // namespace trellis::nn
