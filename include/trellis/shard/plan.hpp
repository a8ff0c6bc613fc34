// The transition table, resolved at compile time. A redistribution from one layout to another is
// a short list of steps, each on one mesh axis:
//   S(d) -> R     all_gather        along d                   (gather)
//   P    -> R     all_reduce                                  (reduce)
//   P    -> S(e)  reduce_scatter    along e                   (reduce_scatter)
//   R    -> S(e)  local slice, no communication                (slice)
//   S(d) -> S(e)  all_to_all        d gathered, e scattered    (all_to_all)
//   S(d,K)->S(d,K') through R (a new nesting level of the same dimension)
//   R    -> P     keep on coordinate 0, zero elsewhere (sum); keep everywhere (avg/max/min)
//   same          nothing: the plan is empty
// Multi-axis transitions: a step on axis a that gathers, slices or scatters dimension d is only
// correct when no axis nested inside a's position on d (shard/placement.hpp: nesting_key) shards
// d at that moment, because inner axes split the piece chosen by outer ones. The planner picks,
// as long as the layout differs from the target:
//   1. a reducing/gathering step (S->R, S->S, P->R, P->S), last mesh axis first, that is valid now
//      and does not split a dimension where an outer axis still has to change;
//   2. else a local step (R->S, R->P), first mesh axis first, under the same conditions;
//   3. else, for the first axis blocked by an inner axis on a dimension it touches, an
//      all_gather on the innermost axis sharding that dimension (always valid);
//   4. else an all_gather of a shard that still has to change (last mesh axis first) when nothing
//      is nested inside it: two axes waiting for each other (each would split a dimension the
//      other has to leave) are untangled through Replicate;
//   5. else an all_reduce on the last axis still Partial (always valid).
// The planner runs in constexpr evaluation only: the steps are template arguments of the executor.
#pragma once

#include <array>
#include <cstddef>

#include "trellis/shard/placement.hpp"

namespace trellis::shard {

enum class StepKind : std::uint8_t { all_gather, all_reduce, reduce_scatter, all_to_all, slice, make_partial };

constexpr const char* step_kind_name(StepKind k) {
  switch (k) {
    case StepKind::all_gather: return "all_gather";
    case StepKind::all_reduce: return "all_reduce";
    case StepKind::reduce_scatter: return "reduce_scatter";
    case StepKind::all_to_all: return "all_to_all";
    case StepKind::slice: return "slice";
    case StepKind::make_partial: return "make_partial";
  }
  return "?";
}

constexpr bool step_communicates(StepKind k) { return k != StepKind::slice && k != StepKind::make_partial; }

// One step on mesh axis `axis`. from_dim: the dimension gathered (all_gather, all_to_all);
// to_dim: the dimension split (reduce_scatter, all_to_all, slice); op: the reduction.
struct Step {
  StepKind kind = StepKind::slice;
  int axis = 0;
  int from_dim = -1;
  int to_dim = -1;
  ReduceOp op = ReduceOp::sum;
  int to_order = 0;  // the nesting level of the new shard
  constexpr bool operator==(const Step&) const = default;
};

// Enough for any plan: each axis changes at most twice, plus one unblocking gather per axis.
constexpr std::size_t max_plan_steps(std::size_t axes) { return 4 * axes + 2; }

template <std::size_t N>
struct Plan {
  using Layout = std::array<PlacementCode, N>;
  std::array<Step, max_plan_steps(N)> steps{};
  std::array<Layout, max_plan_steps(N) + 1> states{};  // states[i]: the layout before steps[i]
  int count = 0;
  bool ok = true;  // false when the planner failed (never expected; checked by static_assert)

  constexpr int communication_steps() const {
    int n = 0;
    for (int i = 0; i < count; ++i) n += step_communicates(steps[i].kind) ? 1 : 0;
    return n;
  }
};

namespace plan_detail {

// True when an axis other than `axis` shards `dim` nested inside position `key` (a larger
// nesting_key): a step on `axis` at that position would split or gather the wrong piece.
template <std::size_t N>
constexpr bool inner_axis_shards(const std::array<PlacementCode, N>& layout, int axis, long key, int dim) {
  for (int b = 0; b < static_cast<int>(N); ++b)
    if (b != axis && layout[b].is_shard(dim) && nesting_key(layout[b], b) > key) return true;
  return false;
}

// True when another axis that still has to change sits (now or in the target) outside position
// `key` on `dim`: splitting `dim` at `key` now would block it.
template <std::size_t N>
constexpr bool outer_pending_on(const std::array<PlacementCode, N>& cur, const std::array<PlacementCode, N>& tgt,
                                int axis, long key, int dim) {
  for (int b = 0; b < static_cast<int>(N); ++b) {
    if (b == axis || cur[b] == tgt[b]) continue;
    if (cur[b].is_shard(dim) && nesting_key(cur[b], b) < key) return true;
    if (tgt[b].is_shard(dim) && nesting_key(tgt[b], b) < key) return true;
  }
  return false;
}

// Can `axis` split dimension `t.dim` at its target level now, without breaking the nesting or
// blocking another axis?
template <std::size_t N>
constexpr bool can_split(const std::array<PlacementCode, N>& cur, const std::array<PlacementCode, N>& tgt, int axis,
                         const PlacementCode& t) {
  const long key = nesting_key(t, axis);
  return !inner_axis_shards(cur, axis, key, t.dim) && !outer_pending_on(cur, tgt, axis, key, t.dim);
}

// Can `axis` gather its current shard now (nothing nested inside it)?
template <std::size_t N>
constexpr bool can_gather(const std::array<PlacementCode, N>& cur, int axis) {
  return !inner_axis_shards(cur, axis, nesting_key(cur[axis], axis), cur[axis].dim);
}

// Step 1 of the rule: the reducing/gathering step for axis a, if valid now.
template <std::size_t N>
constexpr bool gathering_step(const std::array<PlacementCode, N>& cur, const std::array<PlacementCode, N>& tgt,
                              int a, Step& out) {
  const PlacementCode c = cur[a], t = tgt[a];
  if (c == t) return false;
  if (c.is_shard()) {
    if (!can_gather(cur, a)) return false;
    if (t.is_shard() && t.dim != c.dim) {
      if (!can_split(cur, tgt, a, t)) return false;
      out = {StepKind::all_to_all, a, c.dim, t.dim, ReduceOp::sum, t.order};
      return true;
    }
    out = {StepKind::all_gather, a, c.dim, -1, ReduceOp::sum, 0};  // to R; to P or a new level via R
    return true;
  }
  if (c.is_partial()) {
    if (t.is_shard() && can_split(cur, tgt, a, t)) {
      out = {StepKind::reduce_scatter, a, -1, t.dim, c.op, t.order};
      return true;
    }
    if (t.is_shard()) return false;  // blocked: an unblocking gather comes first
    out = {StepKind::all_reduce, a, -1, -1, c.op, 0};  // to R, or to another P via R
    return true;
  }
  return false;
}

// Step 2 of the rule: the local step for axis a (from Replicate), if valid now.
template <std::size_t N>
constexpr bool slicing_step(const std::array<PlacementCode, N>& cur, const std::array<PlacementCode, N>& tgt,
                            int a, Step& out) {
  const PlacementCode c = cur[a], t = tgt[a];
  if (c == t || !c.is_replicate()) return false;
  if (t.is_shard()) {
    if (!can_split(cur, tgt, a, t)) return false;
    out = {StepKind::slice, a, -1, t.dim, ReduceOp::sum, t.order};
    return true;
  }
  out = {StepKind::make_partial, a, -1, -1, t.op, 0};
  return true;
}

// Step 3 of the rule: the first axis that still has to change and is blocked by an axis nested
// inside it on a dimension it touches; gather the innermost axis sharding that dimension (valid:
// nothing is nested inside it). It is not re-split while the blocked axis is pending
// (outer_pending_on), so the planner does not cycle.
template <std::size_t N>
constexpr bool unblocking_gather(const std::array<PlacementCode, N>& cur, const std::array<PlacementCode, N>& tgt,
                                 Step& out) {
  const int axes = static_cast<int>(N);
  for (int a = 0; a < axes; ++a) {
    if (cur[a] == tgt[a]) continue;
    struct Touch { int dim; long key; };
    const Touch touches[2] = {{cur[a].is_shard() ? cur[a].dim : -1, nesting_key(cur[a], a)},
                              {tgt[a].is_shard() ? tgt[a].dim : -1, nesting_key(tgt[a], a)}};
    for (const Touch& t : touches) {
      if (t.dim < 0 || !inner_axis_shards(cur, a, t.key, t.dim)) continue;
      int innermost = -1;
      for (int b = 0; b < axes; ++b)
        if (cur[b].is_shard(t.dim) && (innermost < 0 || nesting_key(cur[b], b) > nesting_key(cur[innermost], innermost)))
          innermost = b;
      out = {StepKind::all_gather, innermost, t.dim, -1, ReduceOp::sum, 0};
      return true;
    }
  }
  return false;
}

template <std::size_t N>
constexpr std::array<PlacementCode, N> apply(std::array<PlacementCode, N> layout, const Step& s) {
  switch (s.kind) {
    case StepKind::all_gather:
    case StepKind::all_reduce: layout[s.axis] = replicate_code(); break;
    case StepKind::reduce_scatter:
    case StepKind::all_to_all:
    case StepKind::slice: layout[s.axis] = shard_code(s.to_dim, s.to_order); break;
    case StepKind::make_partial: layout[s.axis] = partial_code(s.op); break;
  }
  return layout;
}

}  // namespace plan_detail

// The steps that take layout `from` to layout `to`.
template <std::size_t N>
constexpr Plan<N> make_plan(const std::array<PlacementCode, N>& from, const std::array<PlacementCode, N>& to) {
  Plan<N> plan{};
  auto cur = from;
  const int axes = static_cast<int>(N);
  while (cur != to) {
    if (plan.count == static_cast<int>(max_plan_steps(N))) {
      plan.ok = false;
      return plan;
    }
    Step step{};
    bool found = false;
    for (int a = axes - 1; a >= 0 && !found; --a) found = plan_detail::gathering_step(cur, to, a, step);
    for (int a = 0; a < axes && !found; ++a) found = plan_detail::slicing_step(cur, to, a, step);
    if (!found) found = plan_detail::unblocking_gather(cur, to, step);
    for (int a = axes - 1; a >= 0 && !found; --a) {
      if (cur[a] != to[a] && cur[a].is_shard() && plan_detail::can_gather(cur, a)) {
        step = {StepKind::all_gather, a, cur[a].dim, -1, ReduceOp::sum, 0};
        found = true;
      }
    }
    for (int a = axes - 1; a >= 0 && !found; --a) {
      if (cur[a].is_partial() && cur[a] != to[a]) {
        step = {StepKind::all_reduce, a, -1, -1, cur[a].op, 0};
        found = true;
      }
    }
    if (!found) {
      plan.ok = false;
      return plan;
    }
    plan.states[plan.count] = cur;
    plan.steps[plan.count] = step;
    ++plan.count;
    cur = plan_detail::apply(cur, step);
  }
  plan.states[plan.count] = cur;
  return plan;
}

// The plan between two Placements<...> types, as a constant.
template <class From, class To>
  requires(is_placements<From>::value && is_placements<To>::value && From::size == To::size)
inline constexpr Plan<static_cast<std::size_t>(From::size)> plan_v = make_plan(From::codes, To::codes);

// The single step of a one-axis transition (for tables and static checks); plan_v<...>.count == 0
// for identical placements.
template <Placement From, Placement To>
constexpr Plan<1> transition_plan() {
  return make_plan(std::array<PlacementCode, 1>{From::code}, std::array<PlacementCode, 1>{To::code});
}

}  // namespace trellis::shard
