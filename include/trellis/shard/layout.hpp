// The one rule for uneven sizes, and the local shapes/offsets that follow from it.
//
// Rule (balanced remainders): an extent N split into n parts gives part i
//     size(i)   = N / n + (i < N % n)
//     offset(i) = i * (N / n) + min(i, N % n)
// so sizes differ by at most one and the larger parts come first (N = 10, n = 4 -> 3 3 2 2;
// N = 5, n = 4 -> 2 1 1 1; N = 2, n = 4 -> 1 1 0 0). Why this and not torch.chunk's ceil-divide
// (3 3 3 1; 2 2 1 0; 1 1 0 0): the largest part, which sets the padding of equal-count
// collectives and the step time of the slowest rank, is ceil(N / n) under both rules, but the
// balanced rule never leaves a rank idle while another works twice as hard, and no part is empty
// unless N < n. Checkpoints store offsets, so files written under either rule load under this one.
//
// Every user of uneven sizes — local shapes, offsets, the collectives' padding, distribute/gather,
// checkpoints — calls chunk() below; nothing else divides extents.
//
// Nesting: when several mesh axes shard one dimension, the outermost (smallest (level, axis), see
// shard/placement.hpp) splits the global extent and each next one the piece chosen before it.
#pragma once

#include <array>
#include <cstddef>

#include "trellis/core/config.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/shard/placement.hpp"

namespace trellis::shard {

// A contiguous range [offset, offset + size) of one dimension.
struct Chunk {
  index_t offset = 0;
  index_t size = 0;
  constexpr bool operator==(const Chunk&) const = default;
};

// Part `index` of `extent` split into `parts` (the rule above). Requires parts >= 1 and
// 0 <= index < parts; callers check.
TRELLIS_HD constexpr Chunk chunk(index_t extent, int parts, int index) {
  const index_t q = extent / parts;
  const index_t r = extent % parts;
  const index_t i = index;
  return {i * q + (i < r ? i : r), q + (i < r ? 1 : 0)};
}

// The largest part of `extent` split into `parts` (always part 0): the padded size.
TRELLIS_HD constexpr index_t max_chunk(index_t extent, int parts) { return chunk(extent, parts, 0).size; }

// True when every part has the same size (no padding needed).
TRELLIS_HD constexpr bool chunks_even(index_t extent, int parts) { return extent % parts == 0; }

// The range of dimension `dim` held by a rank: nested chunking over the mesh axes that shard
// `dim`, outermost first (increasing nesting_key: Shard's level, then mesh axis). With
// `stop_axis` >= 0, only the axes outside that one are applied: the piece it splits.
// `sizes`/`coords` are the mesh's per-axis sizes and this rank's coordinates. With `unit` > 1
// the dimension splits in whole units of that many elements (attention heads: the head size), so
// the rule above applies to global_extent / unit units (the caller checks divisibility).
template <std::size_t N>
constexpr Chunk dim_range(index_t global_extent, int dim, const std::array<PlacementCode, N>& codes,
                          const std::array<int, N>& sizes, const std::array<int, N>& coords, int stop_axis = -1,
                          index_t unit = 1) {
  Chunk range{0, global_extent / unit};
  long last = -1;
  for (std::size_t step = 0; step < N; ++step) {
    int next = -1;  // the axis with the smallest key above `last`
    for (int a = 0; a < static_cast<int>(N); ++a) {
      if (!codes[a].is_shard(dim)) continue;
      const long key = nesting_key(codes[a], a);
      if (key > last && (next < 0 || key < nesting_key(codes[next], next))) next = a;
    }
    if (next < 0 || next == stop_axis) break;
    last = nesting_key(codes[next], next);
    const Chunk part = chunk(range.size, sizes[next], coords[next]);
    range = {range.offset + part.offset, part.size};
  }
  return {range.offset * unit, range.size * unit};
}

// Per-dimension ranges of a rank's local shard.
template <int R, std::size_t N>
constexpr std::array<Chunk, R> local_box(const std::array<index_t, R>& global_shape,
                                         const std::array<PlacementCode, N>& codes,
                                         const std::array<int, N>& sizes, const std::array<int, N>& coords) {
  std::array<Chunk, R> box{};
  for (int d = 0; d < R; ++d) box[d] = dim_range(global_shape[d], d, codes, sizes, coords);
  return box;
}

template <int R, std::size_t N>
constexpr std::array<index_t, R> local_shape(const std::array<index_t, R>& global_shape,
                                             const std::array<PlacementCode, N>& codes,
                                             const std::array<int, N>& sizes,
                                             const std::array<int, N>& coords) {
  std::array<index_t, R> shape{};
  const auto box = local_box<R>(global_shape, codes, sizes, coords);
  for (int d = 0; d < R; ++d) shape[d] = box[d].size;
  return shape;
}

template <int R, std::size_t N>
constexpr std::array<index_t, R> local_offsets(const std::array<index_t, R>& global_shape,
                                               const std::array<PlacementCode, N>& codes,
                                               const std::array<int, N>& sizes,
                                               const std::array<int, N>& coords) {
  std::array<index_t, R> offsets{};
  const auto box = local_box<R>(global_shape, codes, sizes, coords);
  for (int d = 0; d < R; ++d) offsets[d] = box[d].offset;
  return offsets;
}

}  // namespace trellis::shard
