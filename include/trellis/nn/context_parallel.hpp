// Context parallelism (long sequences): the sequence of every sample is split over the cp ranks,
// and attention, the only layer that mixes positions, exchanges what it needs.
//
// Split (TokenShape): the full sequence is cut into 2 cp chunks of L tokens; rank r holds chunks r
// and 2 cp - 1 - r (zig-zag), whatever the mode, so every other layer is the same in all three.
//
// Modes (CausalSelfAttention picks the exchange; docs/nn.md compares their bytes):
//  ring     K/V blocks travel round the cp ring (nn/ring_attention.hpp); every rank keeps all of
//           its heads and its two chunks.
//  ulysses  (DeepSpeed-Ulysses) an all-to-all turns "my chunks, all my heads" into "the whole
//           sequence, heads/cp of my heads"; plain full-sequence attention; the inverse
//           all-to-all brings the output back (nn/ulysses.hpp).
//  hybrid   (USP / LoongTrain 2-D) cp = u x g: Ulysses inside groups of u consecutive cp ranks,
//           then a ring over the g groups between the ranks that hold the same heads.
//
// Packed documents under a causal mask: the zig-zag balances the row, not its documents (a short
// document's work lands on whichever rank holds it). Balanced documents (ring and hybrid) store
// every row with its documents reordered so each rank's causal work is near-equal
// (balanced_document_order: a packing decision, nothing the layers see).
//
// This header: the mode, the layer's ContextParallel (communicators), the hybrid's two
// sub-communicators, the chunked document ids the masks read, the balanced document order.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

enum class CpMode : std::uint8_t { ring, ulysses, hybrid };

inline const char* to_string(CpMode m) {
  switch (m) {
    case CpMode::ring: return "ring";
    case CpMode::ulysses: return "ulysses";
    case CpMode::hybrid: return "hybrid";
  }
  return "?";
}
inline CpMode parse_cp_mode(std::string_view s) {
  if (s == "ring") return CpMode::ring;
  if (s == "ulysses") return CpMode::ulysses;
  if (s == "hybrid") return CpMode::hybrid;
  TRELLIS_THROW("unknown context-parallel mode '", s, "' (ring, ulysses or hybrid)");
}

// The context-parallel communicator of a layer (the ranks that differ only in their cp
// coordinate) and the mode. A null or size-1 communicator: no context parallelism.
// hybrid: `ulysses` and `ring` are the two sub-communicators of `comm` (make_hybrid_comms).
template <comm::Communicator C>
struct ContextParallel {
  C* comm = nullptr;
  CpMode mode = CpMode::ring;
  C* ulysses = nullptr;  // hybrid: this rank's group of u consecutive cp ranks (the all-to-all)
  C* ring = nullptr;     // hybrid: the ranks at the same place of every group (the ring)
  int size() const { return comm ? comm->size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
  bool active() const { return size() > 1; }
  // The ranks one all-to-all spans (each gets heads / ulysses_size() of a rank's heads): 1 for
  // the ring, cp for ulysses, u for hybrid.
  int ulysses_size() const {
    if (!active() || mode == CpMode::ring) return 1;
    if (mode == CpMode::ulysses) return size();
    return ulysses ? ulysses->size() : 1;
  }
  C& ulysses_comm() const { return mode == CpMode::hybrid ? *ulysses : *comm; }
  C& ring_comm() const { return mode == CpMode::hybrid ? *ring : *comm; }
  // The layer's construction check, rank-independent so that every rank refuses together (before
  // any collective): the sub-communicators of a hybrid are cp's groups.
  void check_mode(const std::string& who) const {
    if (!active() || mode != CpMode::hybrid) return;
    TRELLIS_CHECK(ulysses && ring, who, ": context-parallel mode hybrid needs the ulysses and ring sub-communicators ",
                  "(make_hybrid_comms)");
    const int u = ulysses->size();
    TRELLIS_CHECK(u * ring->size() == size() && ulysses->rank() == rank() % u && ring->rank() == rank() / u, who,
                  ": the hybrid's sub-communicators (ulysses ", u, ", ring ", ring->size(),
                  ") are not the groups of consecutive ranks of cp ", size());
  }
  // The shape's split must be this communicator's (the trainer sets both from the mesh).
  void check(const TokenShape& s, const char* who) const {
    TRELLIS_CHECK(s.cp_size == size() && s.cp_rank == rank(), who, ": the microbatch is split for cp rank ", s.cp_rank,
                  " of ", s.cp_size, " but the layer's cp communicator is rank ", rank(), " of ", size());
    TRELLIS_CHECK(s.cp_size == 1 || s.seq % 2 == 0, who, ": a context-parallel rank holds two equal chunks, so its ",
                  "local sequence must be even, got ", s.seq);
  }
};

// The hybrid's sub-communicators, owned by the caller: ulysses = cp ranks [k u, (k + 1) u) (rank
// r % u there), ring = cp ranks r % u, r % u + u, ... (rank r / u there).
template <comm::Communicator C>
struct HybridComms {
  C ulysses, ring;
};
template <comm::Communicator C>
HybridComms<C> make_hybrid_comms(C& cp, int u) {
  TRELLIS_CHECK(u >= 1 && cp.size() % u == 0, "hybrid context parallelism: the ulysses size ", u,
                " does not divide cp ", cp.size());
  const int r = cp.rank();
  return HybridComms<C>{cp.split(r / u, r % u), cp.split(r % u, r / u)};  // braces: evaluated in order
}
template <comm::Communicator C>
ContextParallel<C> hybrid_context(C& cp, HybridComms<C>& sub) {
  return {&cp, CpMode::hybrid, &sub.ulysses, &sub.ring};
}

// The document ids of every global chunk, [chunks][batch, L], from the full (batch, full_seq)
// ids: what the ring's masks read (host vector; the caller uploads it).
inline std::vector<std::int32_t> chunked_segments(const TokenShape& s) {
  const index_t L = s.cp_chunk(), n = s.full_seq(), chunks = n / L;
  std::vector<std::int32_t> out(static_cast<std::size_t>(s.batch * n));
  for (index_t c = 0; c < chunks; ++c)
    for (index_t b = 0; b < s.batch; ++b)
      for (index_t i = 0; i < L; ++i)
        out[static_cast<std::size_t>((c * s.batch + b) * L + i)] = s.segments[b * n + c * L + i];
  return out;
}

// Balanced documents: the order of the documents of one packed row (out[stored] = original
// position) that evens out the cp ranks' causal attention work. Under the zig-zag split rank r
// holds chunks r and 2 cp - 1 - r of L = n / (2 cp) tokens; a document's query at position p of
// the document costs p + 1 (query, key) pairs, so the work depends on where the documents sit.
// Documents stay whole and contiguous (so the kernels' tiles stay as full as in the packed row,
// and positions, masks and the loss are those of the row): only their order changes. Hill
// climbing from the packed order: the swap of two documents (among the 32 longest) that lowers
// the most-worked rank's pairs most, until none does (at most 64 swaps).
inline std::vector<double> cp_rank_work(const std::vector<index_t>& lengths, index_t n, int cp) {
  const index_t parts = 2 * static_cast<index_t>(cp), L = n / parts;
  std::vector<double> work(static_cast<std::size_t>(cp), 0.0);
  index_t s = 0;
  for (index_t len : lengths) {
    for (index_t p = s; p < s + len;) {  // the document's tokens chunk by chunk
      const index_t c = p / L, end = std::min(s + len, (c + 1) * L);
      const auto a = static_cast<double>(p - s), b = static_cast<double>(end - s);
      work[static_cast<std::size_t>(c < cp ? c : parts - 1 - c)] += (b * (b + 1) - a * (a + 1)) / 2;
      p = end;
    }
    s += len;
  }
  return work;
}
inline std::vector<index_t> balanced_document_order(const std::int32_t* ids, index_t n, int cp) {
  TRELLIS_CHECK(cp >= 1 && n > 0 && n % (2 * cp) == 0, "balanced documents: a row of ", n, " tokens in 2 cp = ",
                2 * cp, " chunks");
  std::vector<index_t> start, length;
  for (index_t s = 0, e = 0; s < n; s = e) {
    for (e = s + 1; e < n && ids[e] == ids[s];) ++e;
    start.push_back(s), length.push_back(e - s);
  }
  const std::size_t D = start.size();
  std::vector<std::size_t> order(D), by_length(D);
  for (std::size_t d = 0; d < D; ++d) order[d] = by_length[d] = d;
  std::stable_sort(by_length.begin(), by_length.end(), [&](std::size_t a, std::size_t b) { return length[a] > length[b]; });
  std::vector<bool> movable(D, false);
  for (std::size_t k = 0; k < std::min<std::size_t>(D, 32); ++k) movable[by_length[k]] = true;
  auto cost = [&](const std::vector<std::size_t>& o) {
    std::vector<index_t> lens(D);
    for (std::size_t i = 0; i < D; ++i) lens[i] = length[o[i]];
    const auto w = cp_rank_work(lens, n, cp);
    return *std::max_element(w.begin(), w.end());
  };
  double current = cost(order);
  for (int round = 0; round < 64; ++round) {
    double best = current;
    std::size_t bi = 0, bj = 0;
    for (std::size_t i = 0; i < D; ++i)
      for (std::size_t j = i + 1; j < D; ++j) {
        if (!movable[order[i]] || !movable[order[j]] || length[order[i]] == length[order[j]]) continue;
        std::swap(order[i], order[j]);
        if (const double c = cost(order); c < best) best = c, bi = i, bj = j;
        std::swap(order[i], order[j]);
      }
    if (!(best < current * (1 - 1e-9))) break;
    std::swap(order[bi], order[bj]);
    current = best;
  }
  std::vector<index_t> out;
  out.reserve(static_cast<std::size_t>(n));
  for (std::size_t d : order)
    for (index_t i = 0; i < length[d]; ++i) out.push_back(start[d] + i);
  return out;
}

// Each row's documents (`ids`, (rows, n), non-decreasing along each row) in balanced order: every
// vector of `values` (tokens, targets: (rows, n) each) reordered in place, and the ids returned in
// the new order, renumbered 0, 1, ... along each row (the kernels need them non-decreasing).
inline std::vector<std::int32_t> balance_documents(const std::vector<std::int32_t>& ids, index_t n, int cp,
                                                   std::initializer_list<std::vector<std::int32_t>*> values = {}) {
  TRELLIS_CHECK(n > 0 && ids.size() % static_cast<std::size_t>(n) == 0, "balance_documents: ", ids.size(),
                " ids in rows of ", n);
  for (const auto* v : values)
    TRELLIS_CHECK(v->size() == ids.size(), "balance_documents: ", v->size(), " values for ", ids.size(), " ids");
  std::vector<std::int32_t> out(ids.size()), row(static_cast<std::size_t>(n));
  for (std::size_t r0 = 0; r0 < ids.size(); r0 += static_cast<std::size_t>(n)) {
    const auto order = balanced_document_order(ids.data() + r0, n, cp);
    for (auto* v : values) {
      for (std::size_t t = 0; t < order.size(); ++t) row[t] = (*v)[r0 + static_cast<std::size_t>(order[t])];
      std::copy(row.begin(), row.end(), v->begin() + static_cast<std::ptrdiff_t>(r0));
    }
    std::int32_t id = 0;
    for (std::size_t t = 0; t < order.size(); ++t) {
      if (t > 0 && ids[r0 + static_cast<std::size_t>(order[t])] != ids[r0 + static_cast<std::size_t>(order[t - 1])]) ++id;
      out[r0 + t] = id;
    }
  }
  return out;
}

}  // namespace trellis::nn
