// ZeRO-1 helpers: parameters packed into one flat buffer, the buffer split over the dp ranks by
// the project's uneven rule (shard::chunk), and the pieces of each tensor a rank owns.
//   FlatLayout layout = pack_flat(sizes);                   // offsets of each tensor
//   shard::Chunk mine = zero1_partition(layout.total, dp, r); // this rank's [offset, offset+size)
//   for (FlatPiece p : pieces_in(layout, mine)) ...          // tensor p.tensor, elements
//                                                             // [p.tensor_begin, +p.size), held at
//                                                             // p.partition_begin of the partition
// Each rank keeps AdamW m/v only for its partition, updates those elements, and an all-gather
// rebuilds the full parameters. For equal-count collectives, pad each rank's part to
// shard::max_chunk(total, dp) elements (rank r's part at r * max_chunk). Checkpoint the pieces
// with CheckpointWriter::add_flat_range(name, global_shape, local_box, p.tensor_begin, data).
#pragma once

#include <algorithm>
#include <span>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/shard/layout.hpp"

namespace trellis::optim {

struct FlatLayout {
  std::vector<index_t> offsets;  // start of each tensor in the flat buffer
  std::vector<index_t> sizes;
  index_t total = 0;
};

inline FlatLayout pack_flat(std::span<const index_t> sizes) {
  FlatLayout l;
  for (index_t n : sizes) {
    TRELLIS_CHECK(n >= 0, "pack_flat: negative tensor size ", n);
    l.offsets.push_back(l.total);
    l.sizes.push_back(n);
    l.total += n;
  }
  return l;
}

inline shard::Chunk zero1_partition(index_t total, int dp_size, int dp_rank) {
  TRELLIS_CHECK(dp_size > 0 && dp_rank >= 0 && dp_rank < dp_size, "zero1_partition: dp rank ", dp_rank, " of ", dp_size);
  TRELLIS_CHECK(total >= 0, "zero1_partition: negative size ", total);
  return shard::chunk(total, dp_size, dp_rank);
}

struct FlatPiece {
  std::size_t tensor = 0;       // index into the layout
  index_t tensor_begin = 0;     // first element within that tensor
  index_t partition_begin = 0;  // where it sits in the rank's partition
  index_t size = 0;
  bool operator==(const FlatPiece&) const = default;
};

// The non-empty intersections of `partition` with each tensor, in flat order.
inline std::vector<FlatPiece> pieces_in(const FlatLayout& layout, shard::Chunk partition) {
  TRELLIS_CHECK(partition.offset >= 0 && partition.size >= 0 && partition.offset + partition.size <= layout.total,
                "pieces_in: partition [", partition.offset, ", +", partition.size, ") outside a buffer of ", layout.total);
  std::vector<FlatPiece> out;
  const index_t lo = partition.offset, hi = partition.offset + partition.size;
  for (std::size_t t = 0; t < layout.sizes.size(); ++t) {
    const index_t b = std::max(lo, layout.offsets[t]);
    const index_t e = std::min(hi, layout.offsets[t] + layout.sizes[t]);
    if (b < e) out.push_back({t, b - layout.offsets[t], b - lo, e - b});
  }
  return out;
}

}  // namespace trellis::optim
