// The Ulysses exchange (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all over a group of u
// context-parallel ranks turns "my two zig-zag chunks, all my heads" into "the group's 2u chunks,
// heads / u of my heads" (member j gets heads group j: heads [j h/u, (j + 1) h/u)), and the
// inverse all-to-all turns results back. Attention between the two runs on whole heads, so it
// needs nothing else from the other ranks: plain causal attention over the full sequence when the
// group is all of cp (mode ulysses), a ring over the groups otherwise (mode hybrid).
//
// The layer's token rows (sequence-major, row = t batch + b, so each local chunk is a contiguous
// row range) are packed per destination as [tensors][2 L batch rows][h/u head_dim]: a column block
// of each tensor (q, k, v in one message). What arrives from member i is its two chunks in the same
// form; each chunk's rows are copied to its slot (slots[2 i + c]) of the group's sequence, and the
// rows are then permuted into the attention layout: [batch, h/u, 2u L, head_dim] over the whole
// slot-ordered sequence (full_sequence), or [2u][batch, h/u, L, head_dim] slot by slot.
//
// Bytes sent per rank per call: (u - 1) / u of its tensors' rows (the block to itself stays put).
//
// GQA: GPT-2 has kv_heads == q_heads, so k and v split like q. With grouped-query attention the
// kv heads would be split by kv_heads / u (each member keeping the kv heads its q heads read), or,
// when kv_heads < u, replicated so that every member holds the one its q heads group reads.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/heads.hpp"
#include "trellis/nn/context_parallel.hpp"

namespace trellis::nn {

// Where member i's local chunk c sits in the group's sequence: slots[2 i + c]. Mode ulysses
// (the group is all of cp): its global chunk, so the sequence is in global order.
inline std::vector<index_t> ulysses_slots(int u) {
  std::vector<index_t> out;
  for (int i = 0; i < u; ++i) out.insert(out.end(), {index_t{i}, index_t{2 * u - 1 - i}});
  return out;
}
// Mode hybrid: member by member, the order of hybrid_chunks (nn/ring_attention.hpp).
inline std::vector<index_t> hybrid_slots(int u) {
  std::vector<index_t> out;
  for (index_t s = 0; s < 2 * u; ++s) out.push_back(s);
  return out;
}

template <comm::Communicator C, backend::Backend B>
class UlyssesExchange {
 public:
  using act_t = typename B::act_t;

  // batch, L: the microbatch's samples and chunk length; heads, head_dim: this rank's heads
  // before the exchange (a multiple of comm.size()).
  UlyssesExchange(C& comm, const B& be, index_t batch, index_t L, index_t heads, index_t head_dim,
                  std::vector<index_t> slots, bool full_sequence)
      : comm_(comm), be_(be), u_(comm.size()), batch_(batch), L_(L), heads_(heads), head_dim_(head_dim),
        slots_(std::move(slots)), full_sequence_(full_sequence) {
    TRELLIS_CHECK(heads % u_ == 0, "UlyssesExchange: ", heads, " heads cannot be split over ", u_, " ranks");
    TRELLIS_CHECK(static_cast<int>(slots_.size()) == 2 * u_, "UlyssesExchange: ", slots_.size(), " slots for ",
                  2 * u_, " chunks");
  }

  // rows: this rank's 2 L batch token rows at stride ld, tensor t in columns [t heads head_dim,
  // (t + 1) heads head_dim); out[t]: the group's sequence of this rank's heads group (written).
  void scatter(const act_t* rows, index_t ld, int tensors, act_t* const* out) const {
    const index_t R = local_rows(), w = group_width(), block = tensors * R * w;
    auto send = scratch(u_ * block), recv = scratch(u_ * block);
    const kernels::HeadsLayout columns{1, R, 1, w};  // a column block as one "head": a strided gather
    for (int j = 0; j < u_; ++j)
      for (int t = 0; t < tensors; ++t)
        be_.rows_to_heads(columns, rows + t * heads_ * head_dim_ + j * w, ld, send.data() + j * block + t * R * w);
    comm_.all_to_all(send.data(), recv.data(), static_cast<std::size_t>(block));
    auto ordered = scratch(2 * u_ * chunk_rows() * w);
    for (int t = 0; t < tensors; ++t) {
      for (int i = 0; i < u_; ++i)
        for (int c = 0; c < 2; ++c)
          be_.copy(ordered.data() + slot(i, c) * chunk_rows() * w, recv.data() + i * block + t * R * w + c * chunk_rows() * w,
                   static_cast<std::size_t>(chunk_rows() * w));
      to_heads(ordered.data(), out[t]);
    }
  }

  // The inverse: in[t] in the group's layout -> this rank's rows (all of its heads), at stride ld.
  void gather(const act_t* const* in, int tensors, act_t* rows, index_t ld) const {
    const index_t R = local_rows(), w = group_width(), block = tensors * R * w;
    auto send = scratch(u_ * block), recv = scratch(u_ * block);
    auto ordered = scratch(2 * u_ * chunk_rows() * w);
    for (int t = 0; t < tensors; ++t) {
      to_rows(in[t], ordered.data());
      for (int i = 0; i < u_; ++i)
        for (int c = 0; c < 2; ++c)
          be_.copy(send.data() + i * block + t * R * w + c * chunk_rows() * w, ordered.data() + slot(i, c) * chunk_rows() * w,
                   static_cast<std::size_t>(chunk_rows() * w));
    }
    comm_.all_to_all(send.data(), recv.data(), static_cast<std::size_t>(block));
    const kernels::HeadsLayout columns{1, R, 1, w};
    for (int j = 0; j < u_; ++j)
      for (int t = 0; t < tensors; ++t)
        be_.heads_to_rows(columns, recv.data() + j * block + t * R * w, rows + t * heads_ * head_dim_ + j * w, ld);
  }

 private:
  index_t local_rows() const { return 2 * chunk_rows(); }
  index_t chunk_rows() const { return L_ * batch_; }
  index_t group_width() const { return heads_ / u_ * head_dim_; }
  index_t slot(int member, int c) const { return slots_[static_cast<std::size_t>(2 * member + c)]; }
  typename B::template buffer<act_t> scratch(index_t n) const {
    return be_.template scratch<act_t>(static_cast<std::size_t>(n));
  }
  // Slot-ordered rows (2u L batch, h/u head_dim) <-> the attention layout.
  void to_heads(const act_t* ordered, act_t* heads) const {
    const index_t w = group_width();
    if (full_sequence_) return be_.rows_to_heads({batch_, 2 * u_ * L_, heads_ / u_, head_dim_}, ordered, w, heads);
    const kernels::HeadsLayout chunk{batch_, L_, heads_ / u_, head_dim_};
    for (index_t s = 0; s < 2 * u_; ++s)
      be_.rows_to_heads(chunk, ordered + s * chunk_rows() * w, w, heads + s * chunk.elements());
  }
  void to_rows(const act_t* heads, act_t* ordered) const {
    const index_t w = group_width();
    if (full_sequence_) return be_.heads_to_rows({batch_, 2 * u_ * L_, heads_ / u_, head_dim_}, heads, ordered, w);
    const kernels::HeadsLayout chunk{batch_, L_, heads_ / u_, head_dim_};
    for (index_t s = 0; s < 2 * u_; ++s)
      be_.heads_to_rows(chunk, heads + s * chunk.elements(), ordered + s * chunk_rows() * w, w);
  }

  C& comm_;
  const B& be_;
  int u_;
  index_t batch_, L_, heads_, head_dim_;
  std::vector<index_t> slots_;
  bool full_sequence_;
};

}  // namespace trellis::nn
