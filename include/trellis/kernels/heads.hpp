// The head-permute contract shared by the host and CUDA backends: token rows (one row per token,
// heads * head_dim columns at row stride ld) <-> attention's [batch, heads, seq, head_dim].
// The index map is one TRELLIS_HD function, so the host loop and the CUDA kernel cannot disagree
// and the map is tested on the host.
//
// Rows are sequence-major (row = t * batch + b, Megatron's [s, b, h]), as the layers of nn/ keep
// them, so that a sequence-parallel shard is a contiguous row range.
#pragma once

#include <cstdint>

#include "trellis/core/config.hpp"

namespace trellis::kernels {

struct HeadsLayout {
  std::int64_t batch = 1;
  std::int64_t seq = 0;
  std::int64_t heads = 0;
  std::int64_t head_dim = 0;

  TRELLIS_HD std::int64_t elements() const { return batch * heads * seq * head_dim; }
  // Row of token (b, t).
  TRELLIS_HD std::int64_t row(std::int64_t b, std::int64_t t) const { return t * batch + b; }
  // Element i of the [batch, heads, seq, head_dim] side -> its offset on the row side.
  TRELLIS_HD std::int64_t row_offset(std::int64_t i, std::int64_t ld) const {
    const std::int64_t d = i % head_dim, t = (i / head_dim) % seq, h = (i / (head_dim * seq)) % heads;
    const std::int64_t b = i / (head_dim * seq * heads);
    return row(b, t) * ld + h * head_dim + d;
  }
};

}  // namespace trellis::kernels
