// The compile-time transition table: single-axis entries against the DTensor table, identical
// layouts against "no steps", and every pair of layouts on 1-, 2- and 3-axis meshes against an
// independent validity model (each step leaves the nesting intact; the plan ends at the target),
// sharding orders (nesting levels) included.
#include <catch2/catch.hpp>

#include <vector>

#include "trellis/shard/plan.hpp"

using namespace trellis;
using namespace trellis::shard;

// ---- the table, checked at compile time ------------------------------------------------------
template <class From, class To>
constexpr bool single_step(StepKind kind) {
  constexpr auto p = transition_plan<From, To>();
  return p.ok && p.count == 1 && p.steps[0].kind == kind;
}
static_assert(single_step<Shard<0>, Replicate>(StepKind::all_gather));
static_assert(single_step<Partial<>, Replicate>(StepKind::all_reduce));
static_assert(single_step<Partial<ReduceOp::max>, Shard<1>>(StepKind::reduce_scatter));
static_assert(single_step<Replicate, Shard<2>>(StepKind::slice));
static_assert(single_step<Shard<0>, Shard<1>>(StepKind::all_to_all));
static_assert(single_step<Replicate, Partial<ReduceOp::avg>>(StepKind::make_partial));
static_assert(transition_plan<Shard<1>, Shard<1>>().count == 0);
static_assert(transition_plan<Replicate, Replicate>().count == 0);
static_assert(transition_plan<Partial<>, Partial<>>().count == 0);
static_assert(plan_v<Placements<Shard<0>, Partial<>, Replicate>, Placements<Shard<0>, Partial<>, Replicate>>.count == 0);
// Shard -> Partial goes through Replicate: all_gather then make_partial.
static_assert(transition_plan<Shard<0>, Partial<>>().count == 2);
static_assert(transition_plan<Shard<0>, Partial<>>().communication_steps() == 1);

TEST_CASE("transition table entries", "[shard][plan]") {
  constexpr auto p = transition_plan<Shard<2>, Shard<0>>();
  STATIC_REQUIRE(p.steps[0].from_dim == 2);
  STATIC_REQUIRE(p.steps[0].to_dim == 0);
  constexpr auto q = transition_plan<Partial<ReduceOp::min>, Shard<1>>();
  STATIC_REQUIRE(q.steps[0].op == ReduceOp::min);
  STATIC_REQUIRE(q.steps[0].to_dim == 1);
}

TEST_CASE("multi-axis plans take the short route", "[shard][plan]") {
  // Independent axes: one step each.
  constexpr auto a = plan_v<Placements<Shard<0>, Partial<>>, Placements<Replicate, Shard<1>>>;
  STATIC_REQUIRE(a.count == 2);
  STATIC_REQUIRE(a.communication_steps() == 2);
  // [S0, S0] -> [R, S0]: the inner axis must be gathered before the outer one, then re-sliced.
  constexpr auto b = plan_v<Placements<Shard<0>, Shard<0>>, Placements<Replicate, Shard<0>>>;
  STATIC_REQUIRE(b.ok);
  STATIC_REQUIRE(b.count == 3);
  STATIC_REQUIRE(b.steps[0] == Step{StepKind::all_gather, 1, 0, -1, ReduceOp::sum});
  STATIC_REQUIRE(b.steps[1] == Step{StepKind::all_gather, 0, 0, -1, ReduceOp::sum});
  STATIC_REQUIRE(b.steps[2] == Step{StepKind::slice, 1, -1, 0, ReduceOp::sum});
  // Changing only the nesting order of dim 0: [S0, S0(level 1)] is the default order; levels
  // [S0(1), S0] put axis 1 outermost: everything gathered, then re-split.
  constexpr auto o = plan_v<Placements<Shard<0>, Shard<0>>, Placements<Shard<0, 1>, Shard<0>>>;
  STATIC_REQUIRE(o.ok);
  STATIC_REQUIRE(o.communication_steps() == 2);
  constexpr auto same = plan_v<Placements<Shard<0>, Shard<0>>, Placements<Shard<0>, Shard<0, 1>>>;
  STATIC_REQUIRE(same.count == 2);  // same nesting, but a different level is a different layout
  // [S0, S1] -> [S1, S0]: gather inner, all_to_all outer, slice inner (not two all_to_alls).
  constexpr auto c = plan_v<Placements<Shard<0>, Shard<1>>, Placements<Shard<1>, Shard<0>>>;
  STATIC_REQUIRE(c.count == 3);
  STATIC_REQUIRE(c.communication_steps() == 2);
  STATIC_REQUIRE(c.steps[1].kind == StepKind::all_to_all);
  // [S0, R] -> [R, S0]: gather then slice, never slice first.
  constexpr auto d = plan_v<Placements<Shard<0>, Replicate>, Placements<Replicate, Shard<0>>>;
  STATIC_REQUIRE(d.count == 2);
  STATIC_REQUIRE(d.steps[0].kind == StepKind::all_gather);
  STATIC_REQUIRE(d.steps[1].kind == StepKind::slice);
}

// ---- every pair, against a validity model written independently of the planner ---------------
namespace {
template <std::size_t N>
using Layout = std::array<PlacementCode, N>;

// The nesting model: the axes sharding one dimension split it in increasing (level, axis)
// order. A step touching dimension d on axis a at position p (its current position to gather,
// its new one to split) moves the data correctly only if no other axis shards d at a position
// after p in the layout the step starts from.
template <std::size_t N>
bool inner_shards(const Layout<N>& l, int axis, int level, int dim) {
  for (std::size_t b = 0; b < N; ++b) {
    if (static_cast<int>(b) == axis || l[b].kind != PlacementKind::shard || l[b].dim != dim) continue;
    const bool after = l[b].order > level || (l[b].order == level && static_cast<int>(b) > axis);
    if (after) return true;
  }
  return false;
}

template <std::size_t N>
bool step_valid(const Layout<N>& before, const Step& s, Layout<N>& after) {
  after = before;
  const PlacementCode c = before[s.axis];
  switch (s.kind) {
    case StepKind::all_gather:
      if (!(c.kind == PlacementKind::shard && c.dim == s.from_dim)) return false;
      if (inner_shards(before, s.axis, c.order, s.from_dim)) return false;
      after[s.axis] = replicate_code();
      return true;
    case StepKind::all_reduce:
      if (c.kind != PlacementKind::partial || c.op != s.op) return false;
      after[s.axis] = replicate_code();
      return true;
    case StepKind::reduce_scatter:
      if (c.kind != PlacementKind::partial || c.op != s.op) return false;
      if (inner_shards(before, s.axis, s.to_order, s.to_dim)) return false;
      after[s.axis] = shard_code(s.to_dim, s.to_order);
      return true;
    case StepKind::all_to_all:
      if (!(c.kind == PlacementKind::shard && c.dim == s.from_dim) || s.from_dim == s.to_dim) return false;
      if (inner_shards(before, s.axis, c.order, s.from_dim) || inner_shards(before, s.axis, s.to_order, s.to_dim))
        return false;
      after[s.axis] = shard_code(s.to_dim, s.to_order);
      return true;
    case StepKind::slice:
      if (c.kind != PlacementKind::replicate) return false;
      if (inner_shards(before, s.axis, s.to_order, s.to_dim)) return false;
      after[s.axis] = shard_code(s.to_dim, s.to_order);
      return true;
    case StepKind::make_partial:
      if (c.kind != PlacementKind::replicate) return false;
      after[s.axis] = partial_code(s.op);
      return true;
  }
  return false;
}

std::vector<PlacementCode> options(int rank) {
  std::vector<PlacementCode> out{replicate_code(), partial_code(ReduceOp::sum), partial_code(ReduceOp::max)};
  for (int d = 0; d < rank; ++d) {
    out.push_back(shard_code(d));
    out.push_back(shard_code(d, 1));  // nested the other way round
  }
  return out;
}

template <std::size_t N>
std::vector<Layout<N>> all_layouts(int rank) {
  std::vector<Layout<N>> out;
  auto opts = options(rank);
  std::size_t total = 1;
  for (std::size_t i = 0; i < N; ++i) total *= opts.size();
  for (std::size_t k = 0; k < total; ++k) {
    Layout<N> l{};
    std::size_t x = k;
    for (std::size_t i = 0; i < N; ++i) {
      l[i] = opts[x % opts.size()];
      x /= opts.size();
    }
    if (codes_valid_for_rank(l, rank)) out.push_back(l);
  }
  return out;
}

template <std::size_t N>
void check_all_pairs(int rank, int& pairs, int& max_comm) {
  auto layouts = all_layouts<N>(rank);
  for (const auto& from : layouts) {
    for (const auto& to : layouts) {
      Plan<N> plan = make_plan(from, to);
      INFO("axes " << N << " rank " << rank);
      REQUIRE(plan.ok);
      Layout<N> cur = from;
      for (int i = 0; i < plan.count; ++i) {
        REQUIRE(plan.states[i] == cur);
        Layout<N> next{};
        REQUIRE(step_valid(cur, plan.steps[i], next));
        cur = next;
      }
      REQUIRE(cur == to);
      if (from == to) REQUIRE(plan.count == 0);
      // Never more communication than "everything to Replicate, then slice": one per axis that
      // is not Replicate in `from`... plus at most one re-gather per axis.
      REQUIRE(plan.communication_steps() <= 2 * static_cast<int>(N));
      max_comm = std::max(max_comm, plan.communication_steps());
      ++pairs;
    }
  }
}
}  // namespace

TEST_CASE("every pair of layouts has a valid plan", "[shard][plan]") {
  int pairs = 0, max_comm = 0;
  for (int rank = 1; rank <= 3; ++rank) {
    check_all_pairs<1>(rank, pairs, max_comm);
    check_all_pairs<2>(rank, pairs, max_comm);
    check_all_pairs<3>(rank, pairs, max_comm);
  }
  REQUIRE(pairs > 100000);
  WARN("checked " << pairs << " layout pairs; most collectives in one plan: " << max_comm);
}
