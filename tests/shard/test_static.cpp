// Compile-time properties of redistribute: same placements generate no collective (a counting mock
// communicator satisfying the Communicator concept, plus constexpr checks of the chosen plan),
// each table entry makes exactly the collective the table names, and bad layouts (a dimension the
// tensor does not have, the wrong number of placements, mixed Partial ops) do not compile.
#include <catch2/catch.hpp>

#include "support.hpp"
#include "trellis/comm/mesh.hpp"
#include "trellis/shard.hpp"

using namespace trellis;
using namespace trellis::shard;
using shard_test::CountingComm;
using Mesh2 = comm::Mesh<CountingComm, dp, tp>;
template <class L>
using X = Sharded<float, 2, Mesh2, L>;

// ---- bad input is a compile error --------------------------------------------------------------
template <class L>
concept valid_sharded = requires { typename X<L>; };
static_assert(valid_sharded<Placements<Shard<1>, Replicate>>);
static_assert(!valid_sharded<Placements<Shard<2>, Replicate>>);           // no dimension 2
static_assert(!valid_sharded<Placements<Shard<0>>>);                      // 1 placement, 2 axes
static_assert(!valid_sharded<Placements<Replicate, Replicate, Replicate>>);  // 3 placements
static_assert(!valid_sharded<Placements<Partial<ReduceOp::sum>, Partial<ReduceOp::max>>>);  // mixed ops
static_assert(valid_sharded<Placements<Partial<ReduceOp::max>, Partial<ReduceOp::max>>>);

template <class From, class... To>
concept can_redistribute = requires(const X<From>& x) { redistribute<To...>(x); };
using S0R = Placements<Shard<0>, Replicate>;
static_assert(can_redistribute<S0R, Replicate, Shard<1>>);
static_assert(!can_redistribute<S0R, Replicate, Shard<2>>);  // no dimension 2
static_assert(!can_redistribute<S0R, Shard<0>>);             // too few placements
static_assert(!can_redistribute<S0R, Partial<>, Partial<ReduceOp::min>>);

// Shard<-1> and Partial<prod> are not placements at all.
template <int D>
concept shard_ok = requires { typename Shard<D>; Shard<D>::dim; };
static_assert(shard_ok<0> && !shard_ok<-1>);

// ---- the chosen plans, as constants --------------------------------------------------------------
static_assert(plan_v<S0R, S0R>.count == 0);
static_assert(plan_v<S0R, Placements<Replicate, Replicate>>.communication_steps() == 1);

template <class From, class... To>
CountingComm::Counts count_calls() {
  CountingComm::Counts counts;
  CountingComm world{&counts};
  auto mesh = make_mesh<dp, tp>(world, {1, 1});
  Tensor<float, 2> full({3, 4});
  for (index_t i = 0; i < full.size(); ++i) full.data()[i] = static_cast<float>(i);
  auto x = X<From>::from_local(mesh, Tensor<float, 2>(full.shape()), full.shape());
  counts = {};
  auto y = redistribute<To...>(x);
  auto result = counts;
  (void)y;
  return result;
}

TEST_CASE("same placements make no collective call", "[shard][static]") {
  auto c = count_calls<S0R, Shard<0>, Replicate>();
  REQUIRE(c.total() == 0);
  c = count_calls<Placements<Partial<>, Shard<1>>, Partial<>, Shard<1>>();
  REQUIRE(c.total() == 0);
  // Rvalue: not even a copy; the local buffer moves.
  CountingComm::Counts counts;
  CountingComm world{&counts};
  auto mesh = make_mesh<dp, tp>(world, {1, 1});
  auto x = X<S0R>::from_local(mesh, Tensor<float, 2>({3, 4}), {3, 4});
  const float* before = x.local().data();
  auto y = redistribute<Shard<0>, Replicate>(std::move(x));
  REQUIRE(y.local().data() == before);
}

TEST_CASE("each table entry makes the collective it names, once", "[shard][static]") {
  REQUIRE(count_calls<S0R, Replicate, Replicate>().all_gather == 1);
  REQUIRE(count_calls<S0R, Replicate, Replicate>().total() == 1);
  auto p = count_calls<Placements<Partial<>, Replicate>, Replicate, Replicate>();
  REQUIRE((p.all_reduce == 1 && p.total() == 1));
  auto rs = count_calls<Placements<Partial<>, Replicate>, Shard<1>, Replicate>();
  REQUIRE((rs.reduce_scatter == 1 && rs.total() == 1));
  REQUIRE(count_calls<Placements<Replicate, Replicate>, Shard<1>, Shard<0>>().total() == 0);  // slices
  auto a2a = count_calls<S0R, Shard<1>, Replicate>();
  REQUIRE((a2a.all_to_all == 1 && a2a.total() == 1));
  REQUIRE(count_calls<S0R, Shard<0>, Partial<>>().total() == 0);  // R -> P is local
  // Two axes changing: one collective each.
  auto two = count_calls<Placements<Shard<0>, Partial<>>, Replicate, Shard<1>>();
  REQUIRE((two.all_gather == 1 && two.reduce_scatter == 1 && two.total() == 2));
}

TEST_CASE("local shard of the wrong shape is a trellis::Error", "[shard][static]") {
  CountingComm::Counts counts;
  CountingComm world{&counts};
  auto mesh = make_mesh<dp, tp>(world, {1, 1});
  REQUIRE_THROWS_AS(X<S0R>::from_local(mesh, Tensor<float, 2>({3, 5}), {3, 4}), Error);
  REQUIRE_THROWS_WITH(X<S0R>::from_local(mesh, Tensor<float, 2>({3, 5}), {3, 4}),
                      Catch::Contains("local shard has shape (3, 5)"));
  REQUIRE_THROWS_AS(X<S0R>::from_local(mesh, Tensor<float, 2>({0, 4}), {-1, 4}), Error);
}
