// Flat buffers between placements along one mesh axis: the one-axis, one-dimension case of
// shard::redistribute for memory that is not a Sharded tensor, such as a packed gradient bucket
// or ZeRO's partitions of optimizer state. Where such a buffer goes is said as a placement
// (a data-parallel bucket: Partial(sum) -> Replicate; ZeRO: Partial(sum) -> Shard<0>, then the
// updated values Shard<0> -> Replicate), and the collective is the planner's step
// (shard/plan.hpp), the same table every Sharded tensor uses:
//   P -> R      all_reduce, in place in `full`
//   P -> S(0)   reduce_scatter of `full` into `part`
//   S(0) -> R   all_gather of `part` into `full` (`part` may be full's own block of this coordinate)
//   same        nothing
// A buffer that is scattered or gathered must split evenly over the axis (callers pad it:
// shard::chunks_even). A transition
// that is not one collective (R -> S: a slice; R -> P) is refused with the placements named.
#pragma once

#include <array>
#include <cstddef>
#include <optional>
#include <string>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"
#include "trellis/shard/layout.hpp"
#include "trellis/shard/placement.hpp"
#include "trellis/shard/plan.hpp"

namespace trellis::shard {

// "R", "S(d)" ("S(d,K)" at nesting level K), "P(sum)": how errors and tables name a placement.
inline std::string placement_string(const PlacementCode& c) {
  std::string out;
  if (c.is_replicate()) {
    out = "R";
  } else if (c.is_shard()) {
    out.append("S(").append(std::to_string(c.dim));
    if (c.order != 0) out.append(",").append(std::to_string(c.order));
    out.append(")");
  } else {
    out.append("P(").append(c.op == ReduceOp::sum ? "sum" : c.op == ReduceOp::avg ? "avg" : c.op == ReduceOp::max ? "max" : "min").append(")");
  }
  return out;
}

// The single step taking a one-axis placement `from` to `to`; count 0 when they are equal.
constexpr Plan<1> flat_plan(const PlacementCode& from, const PlacementCode& to) {
  return make_plan(std::array<PlacementCode, 1>{from}, std::array<PlacementCode, 1>{to});
}

// Starts the collective that takes a flat buffer of `n` elements from `from` to `to` over
// `comm`'s ranks; nullopt when nothing is to be done. `full`: the whole buffer (n elements);
// `part`: this rank's n / size elements. Both stay untouched until the request is waited on.
template <comm::Communicator C, class T>
std::optional<typename C::request_type> start_flat_redistribute(C& comm, const PlacementCode& from,
                                                                const PlacementCode& to, T* full, T* part,
                                                                std::size_t n) {
  const Plan<1> plan = flat_plan(from, to);
  if (plan.count == 0) return std::nullopt;
  const auto parts = static_cast<std::size_t>(comm.size());
  const Step& s = plan.steps[0];
  const bool one_collective = plan.count == 1 && step_communicates(s.kind) && s.kind != StepKind::all_to_all &&
                              (s.from_dim <= 0 && s.to_dim <= 0);
  TRELLIS_CHECK(one_collective, "flat redistribution ", placement_string(from), " -> ", placement_string(to),
                " (rank ", comm.rank(), "): not one collective over a flat buffer (supported: P -> R, P -> S(0), "
                "S(0) -> R)");
  TRELLIS_CHECK(s.kind == StepKind::all_reduce || n % parts == 0, "flat redistribution ", placement_string(from), " -> ", placement_string(to),
                " (rank ", comm.rank(), "): ", n, " elements do not split evenly over ", parts, " ranks (pad the buffer)");
  switch (s.kind) {
    case StepKind::all_reduce: return comm.all_reduce_async(full, full, n, s.op);
    case StepKind::reduce_scatter: return comm.reduce_scatter_async(full, part, n / parts, s.op);
    case StepKind::all_gather: return comm.all_gather_async(part, full, n / parts);
    default: break;
  }
  TRELLIS_THROW("flat redistribution: unexpected step ", step_kind_name(s.kind));
}

}  // namespace trellis::shard
