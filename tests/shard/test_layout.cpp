// The uneven-size rule and local shapes/offsets, against sizes written out by hand and against a
// brute-force partition check (parts tile the extent, in order, sizes differ by at most one).
#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

#include "trellis/shard/layout.hpp"

using namespace trellis;
using namespace trellis::shard;

namespace {
constexpr Chunk operator+(Chunk a, Chunk b) { return {a.offset + b.offset, a.size + b.size}; }

template <int Parts>
std::array<index_t, Parts> sizes_of(index_t extent) {
  std::array<index_t, Parts> out{};
  for (int i = 0; i < Parts; ++i) out[i] = chunk(extent, Parts, i).size;
  return out;
}
}  // namespace

TEST_CASE("balanced remainders: sizes written out by hand", "[shard][layout]") {
  // (std::array, not std::vector: g++ 12.2 -O3 miscompiles const vector<int64_t>{1, 1, 0, 0}
  // initialisers here, which made this test fail on a correct rule.)
  REQUIRE(sizes_of<4>(10) == std::array<index_t, 4>{3, 3, 2, 2});
  REQUIRE(sizes_of<4>(5) == std::array<index_t, 4>{2, 1, 1, 1});
  REQUIRE(sizes_of<4>(2) == std::array<index_t, 4>{1, 1, 0, 0});
  REQUIRE(sizes_of<3>(0) == std::array<index_t, 3>{0, 0, 0});
  REQUIRE(sizes_of<4>(8) == std::array<index_t, 4>{2, 2, 2, 2});
  REQUIRE(chunk(10, 4, 2) == Chunk{6, 2});
  REQUIRE(chunk(10, 4, 3) == Chunk{8, 2});
  STATIC_REQUIRE(chunk(7, 3, 1) == Chunk{3, 2});
  STATIC_REQUIRE(max_chunk(7, 3) == 3);
  STATIC_REQUIRE(chunks_even(8, 4));
  STATIC_REQUIRE(!chunks_even(7, 4));
}

TEST_CASE("dim_range in whole units: attention heads over tp", "[shard][layout]") {
  // 5 heads of 8 columns over 2 ranks: 3 heads (24 columns) and 2 heads (16), never a split head.
  constexpr std::array<PlacementCode, 2> codes{replicate_code(), shard_code(1)};
  STATIC_REQUIRE(dim_range(40, 1, codes, std::array<int, 2>{2, 2}, std::array<int, 2>{1, 0}, -1, 8) == Chunk{0, 24});
  STATIC_REQUIRE(dim_range(40, 1, codes, std::array<int, 2>{2, 2}, std::array<int, 2>{1, 1}, -1, 8) == Chunk{24, 16});
  // a dimension no axis shards is whole, whatever the unit
  STATIC_REQUIRE(dim_range(40, 0, codes, std::array<int, 2>{2, 2}, std::array<int, 2>{0, 1}, -1, 8) == Chunk{0, 40});
  // unit 1 is the element rule: 40 over 3 -> 14 13 13
  STATIC_REQUIRE(dim_range(40, 1, codes, std::array<int, 2>{1, 3}, std::array<int, 2>{0, 2}) == Chunk{27, 13});
}

TEST_CASE("balanced remainders tile every extent", "[shard][layout]") {
  for (index_t extent = 0; extent <= 40; ++extent) {
    for (int parts = 1; parts <= 9; ++parts) {
      index_t next = 0, smallest = extent, largest = 0;
      for (int i = 0; i < parts; ++i) {
        Chunk c = chunk(extent, parts, i);
        REQUIRE(c.offset == next);
        next += c.size;
        smallest = std::min(smallest, c.size);
        largest = std::max(largest, c.size);
        if (i > 0) REQUIRE(c.size <= chunk(extent, parts, i - 1).size);
      }
      REQUIRE(next == extent);
      REQUIRE(largest - smallest <= 1);
      REQUIRE(max_chunk(extent, parts) == (extent + parts - 1) / parts);  // = ceil, as torch.chunk
    }
  }
}

TEST_CASE("local shapes and offsets, nested in mesh-axis order", "[shard][layout]") {
  // Global (10, 7) on a 2 x 3 mesh; axis 0 shards dim 0, axis 1 shards dim 0 too (nested), so
  // dim 0 is split in 2 (5, 5) and each half in 3 (2, 2, 1).
  using L = Placements<Shard<0>, Shard<0>>;
  std::array<index_t, 2> global{10, 7};
  std::array<int, 2> sizes{2, 3};
  index_t covered = 0;
  std::vector<index_t> starts;
  for (int c0 = 0; c0 < 2; ++c0) {
    for (int c1 = 0; c1 < 3; ++c1) {
      auto box = local_box<2>(global, L::codes, sizes, {c0, c1});
      REQUIRE(box[1] == Chunk{0, 7});
      index_t expect_size = (c1 < 2) ? 2 : 1;
      REQUIRE(box[0].size == expect_size);
      REQUIRE(box[0].offset == c0 * 5 + (c1 == 0 ? 0 : c1 == 1 ? 2 : 4));
      starts.push_back(box[0].offset);
      covered += box[0].size;
    }
  }
  REQUIRE(covered == 10);
  REQUIRE(std::is_sorted(starts.begin(), starts.end()));  // axis 0 outermost, then axis 1

  // The other nesting order: Shard<0, 1> on axis 0 puts it one level down, so axis 1 (3 parts:
  // 4 3 3) splits first and axis 0 halves each part.
  using O = Placements<Shard<0, 1>, Shard<0>>;
  for (int c0 = 0; c0 < 2; ++c0) {
    for (int c1 = 0; c1 < 3; ++c1) {
      auto box = local_box<2>(global, O::codes, sizes, {c0, c1});
      const index_t outer_offset = c1 == 0 ? 0 : c1 == 1 ? 4 : 7;
      const index_t outer_size = c1 == 0 ? 4 : 3;
      REQUIRE(box[0] == chunk(outer_size, 2, c0) + Chunk{outer_offset, 0});
    }
  }

  // Different dims on different axes; Partial and Replicate leave the shape alone.
  using M = Placements<Shard<1>, Partial<>, Shard<0>>;
  auto shape = local_shape<2>({9, 7}, M::codes, {2, 2, 4}, {1, 1, 3});
  REQUIRE(shape == std::array<index_t, 2>{2, 3});
  auto off = local_offsets<2>({9, 7}, M::codes, {2, 2, 4}, {1, 1, 3});
  REQUIRE(off == std::array<index_t, 2>{7, 4});
}
