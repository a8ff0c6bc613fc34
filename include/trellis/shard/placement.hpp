// Placements: how a tensor is laid out along one mesh axis, as types.
//   Shard<D>       tensor dimension D is split over the axis (uneven sizes: shard/layout.hpp)
//   Shard<D, K>    the same, at nesting level K (below)
//   Replicate      every coordinate of the axis holds the same values
//   Partial<Op>    every coordinate holds a term; the value is Op over the axis (pending reduction)
// A layout is one placement per mesh axis, in mesh-axis order: Placements<Shard<0>, Replicate>.
// Sharding order: when several mesh axes shard the same tensor dimension, they split it one
// inside the other, in increasing (K, mesh axis) order: the first splits the whole extent, the
// next the piece chosen by the first, and so on. K defaults to 0, so by default the earlier mesh
// axis is outermost (DTensor's default); Placements<Shard<0, 1>, Shard<0, 0>> nests the other way
// (axis 1 outermost). See docs/shard.md.
// Every placement also has a constexpr value form (PlacementCode) so that the transition planner
// (shard/plan.hpp) is an ordinary constexpr function.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "trellis/comm/communicator.hpp"

namespace trellis::shard {

using comm::ReduceOp;

enum class PlacementKind : std::uint8_t { replicate, shard, partial };

// The value form of a placement. `dim` is meaningful for shard, `op` for partial; the unused
// field is kept at a fixed value so that == compares placements, not leftovers.
struct PlacementCode {
  PlacementKind kind = PlacementKind::replicate;
  int dim = -1;
  ReduceOp op = ReduceOp::sum;
  int order = 0;  // shard: nesting level K

  constexpr bool operator==(const PlacementCode&) const = default;
  constexpr bool is_shard() const { return kind == PlacementKind::shard; }
  constexpr bool is_shard(int d) const { return kind == PlacementKind::shard && dim == d; }
  constexpr bool is_replicate() const { return kind == PlacementKind::replicate; }
  constexpr bool is_partial() const { return kind == PlacementKind::partial; }
};

constexpr PlacementCode replicate_code() { return {PlacementKind::replicate, -1, ReduceOp::sum, 0}; }
constexpr PlacementCode shard_code(int dim, int order = 0) { return {PlacementKind::shard, dim, ReduceOp::sum, order}; }
constexpr PlacementCode partial_code(ReduceOp op) { return {PlacementKind::partial, -1, op, 0}; }

// Where mesh axis `axis` with placement `c` sits in the nesting of its dimension: smaller is
// outer. Compares (order, axis) lexicographically.
constexpr long nesting_key(const PlacementCode& c, int axis) { return static_cast<long>(c.order) * 4096 + axis; }

// Reductions a Partial placement may wait for (prod is not offered: it overflows/underflows too
// easily to be a layout, and no training program needs it).
constexpr bool is_partial_reduce_op(ReduceOp op) {
  return op == ReduceOp::sum || op == ReduceOp::avg || op == ReduceOp::max || op == ReduceOp::min;
}

template <int D, int K = 0>
  requires(D >= 0 && K >= 0 && K < 1024)
struct Shard {
  static constexpr int dim = D;
  static constexpr int order = K;
  static constexpr PlacementCode code = shard_code(D, K);
};

struct Replicate {
  static constexpr PlacementCode code = replicate_code();
};

template <ReduceOp Op = ReduceOp::sum>
  requires(is_partial_reduce_op(Op))
struct Partial {
  static constexpr ReduceOp op = Op;
  static constexpr PlacementCode code = partial_code(Op);
};

template <class P> struct is_placement : std::false_type {};
template <int D, int K> struct is_placement<Shard<D, K>> : std::true_type {};
template <> struct is_placement<Replicate> : std::true_type {};
template <ReduceOp Op> struct is_placement<Partial<Op>> : std::true_type {};

template <class P>
concept Placement = is_placement<P>::value;

// A layout: one placement per mesh axis, in the mesh's axis order.
template <Placement... P>
struct Placements {
  static constexpr int size = static_cast<int>(sizeof...(P));
  static constexpr std::array<PlacementCode, sizeof...(P)> codes{P::code...};
};

template <class L> struct is_placements : std::false_type {};
template <class... P> struct is_placements<Placements<P...>> : std::true_type {};

// True when every Shard names a dimension below `rank` and all Partial placements wait for the
// same reduction (mixing e.g. sum on one axis with max on another has no order-free meaning).
template <std::size_t N>
constexpr bool codes_valid_for_rank(const std::array<PlacementCode, N>& codes, int rank) {
  bool have_partial = false;
  ReduceOp partial_op = ReduceOp::sum;
  for (const auto& c : codes) {
    if (c.is_shard() && (c.dim < 0 || c.dim >= rank)) return false;
    if (c.is_partial()) {
      if (!is_partial_reduce_op(c.op)) return false;
      if (have_partial && c.op != partial_op) return false;
      have_partial = true;
      partial_op = c.op;
    }
  }
  return true;
}

// A layout usable for a rank-`Rank` tensor on a mesh with `Axes` axes.
template <class L, int Rank, int Axes>
concept LayoutFor = is_placements<L>::value && L::size == Axes && codes_valid_for_rank(L::codes, Rank);

template <std::size_t N>
constexpr bool any_partial(const std::array<PlacementCode, N>& codes) {
  for (const auto& c : codes)
    if (c.is_partial()) return true;
  return false;
}

}  // namespace trellis::shard
