// Context parallelism (long sequences): the sequence of every sample is split over the cp ranks,
// and attention, the only layer that mixes positions, exchanges what it needs.
//
// Split (TokenShape): the full sequence is cut into 2 cp chunks of L tokens; rank r holds chunks r
// and 2 cp - 1 - r (zig-zag). Under a causal mask each rank then does the same attention work:
// per ring step, two full L x L blocks, except step 0 (two diagonal blocks and one full block).
//
// Ring attention (nn/ring_attention.hpp): the local K and V travel round the cp ring while each
// rank's two chunks attend to them.
//
// This header: the mode, the layer's ContextParallel (communicator), the chunked document ids the
// ring's masks read.
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
template <comm::Communicator C>
struct ContextParallel {
  C* comm = nullptr;
  CpMode mode = CpMode::ring;
  int size() const { return comm ? comm->size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
  bool active() const { return size() > 1; }
  // The shape's split must be this communicator's (the trainer sets both from the mesh).
  void check(const TokenShape& s, const char* who) const {
    TRELLIS_CHECK(s.cp_size == size() && s.cp_rank == rank(), who, ": the microbatch is split for cp rank ", s.cp_rank,
                  " of ", s.cp_size, " but the layer's cp communicator is rank ", rank(), " of ", size());
    TRELLIS_CHECK(s.cp_size == 1 || s.seq % 2 == 0, who, ": a context-parallel rank holds two equal chunks, so its ",
                  "local sequence must be even, got ", s.seq);
  }
};

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

}  // namespace trellis::nn
