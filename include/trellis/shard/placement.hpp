// Placements: how a tensor is laid out along one mesh axis, as types.
//   Shard<D>       tensor dimension D is split over the axis (uneven sizes: shard/layout.hpp)
//   Replicate      every coordinate of the axis holds the same values
//   Partial<Op>    every coordinate holds a term; the value is Op over the axis (pending reduction)
// A layout is one placement per mesh axis, in mesh-axis order: Placements<Shard<0>, Replicate>.
// When several mesh axes shard the same tensor dimension, the earlier mesh axis splits first
// (outermost) and each later one splits the piece it is given (see docs/shard.md).
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

  constexpr bool operator==(const PlacementCode&) const = default;
  constexpr bool is_shard() const { return kind == PlacementKind::shard; }
  constexpr bool is_shard(int d) const { return kind == PlacementKind::shard && dim == d; }
  constexpr bool is_replicate() const { return kind == PlacementKind::replicate; }
  constexpr bool is_partial() const { return kind == PlacementKind::partial; }
};

constexpr PlacementCode replicate_code() { return {PlacementKind::replicate, -1, ReduceOp::sum}; }
constexpr PlacementCode shard_code(int dim) { return {PlacementKind::shard, dim, ReduceOp::sum}; }
constexpr PlacementCode partial_code(ReduceOp op) { return {PlacementKind::partial, -1, op}; }

// Reductions a Partial placement may wait for (prod is not offered: it overflows/underflows too
// easily to be a layout, and no training program needs it).
constexpr bool is_partial_reduce_op(ReduceOp op) {
  return op == ReduceOp::sum || op == ReduceOp::avg || op == ReduceOp::max || op == ReduceOp::min;
}

template <int D>
  requires(D >= 0)
struct Shard {
  static constexpr int dim = D;
  static constexpr PlacementCode code = shard_code(D);
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
template <int D> struct is_placement<Shard<D>> : std::true_type {};
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
