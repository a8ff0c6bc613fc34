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
// every row in per-document zig-zag order instead (document_zigzag_rows; TokenShape says what
// the layers read then): each document cut into 2 cp pieces, global chunk c holding piece c of
// every document, so each rank's work is the same from every document. The loader pads every
// document to a multiple of 2 cp (DataLoader::Options::pack_align) for this.
//
// This header: the mode, the layer's ContextParallel (communicators), the hybrid's two
// sub-communicators, the chunked document ids the masks read, the balanced-document order.
#pragma once

#include <cstdint>
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
    TRELLIS_CHECK(!s.document_zigzag || s.cp_size == 1 || mode != CpMode::ulysses, who,
                  ": balanced documents (per-document zig-zag) run with cp mode ring or hybrid; ulysses attends the ",
                  "whole sequence in one call and is balanced by heads already");
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

// Rows (rows, n) of `values` (tokens, targets, or the ids themselves) in per-document zig-zag
// order for cp ranks: row by row, global chunk c (of 2 cp, n / (2 cp) long) = piece c of each
// document of the row (its tokens [c l, (c + 1) l) for a document of 2 cp l tokens), documents in
// row order. `ids` (rows, n): the documents, non-decreasing along each row; a document whose length
// is not a multiple of 2 cp is refused, naming the row and the document.
inline std::vector<std::int32_t> document_zigzag_rows(const std::vector<std::int32_t>& values,
                                                      const std::vector<std::int32_t>& ids, index_t n, int cp) {
  TRELLIS_CHECK(values.size() == ids.size() && n > 0 && values.size() % static_cast<std::size_t>(n) == 0 &&
                    n % (2 * cp) == 0,
                "document_zigzag_rows: ", values.size(), " values, ", ids.size(), " ids, rows of ", n,
                " tokens for cp ", cp);
  const index_t parts = 2 * static_cast<index_t>(cp), L = n / parts, rows = static_cast<index_t>(values.size()) / n;
  std::vector<std::int32_t> out(values.size());
  for (index_t r = 0; r < rows; ++r) {
    const std::int32_t* id = ids.data() + r * n;
    index_t offset = 0;  // where the current document's pieces start in each chunk
    for (index_t s = 0, e = 0; s < n; s = e) {
      for (e = s + 1; e < n && id[e] == id[s];) ++e;
      TRELLIS_CHECK((e - s) % parts == 0, "balanced documents: row ", r, " document ", id[s], " (positions ", s, " to ",
                    e - 1, ") has ", e - s, " tokens, not a multiple of 2 cp = ", parts,
                    ": pack with DataLoader::Options::pack_align = ", parts);
      const index_t l = (e - s) / parts;
      for (index_t c = 0; c < parts; ++c)
        for (index_t i = 0; i < l; ++i)
          out[static_cast<std::size_t>(r * n + c * L + offset + i)] = values[static_cast<std::size_t>(r * n + s + c * l + i)];
      offset += l;
    }
  }
  return out;
}

}  // namespace trellis::nn
