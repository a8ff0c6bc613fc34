// redistribute on a 2 x 2 x 2 mesh of thread ranks:
//  - rank-1 tensor, every pair of layouts over {S0, R, P(sum)} (27 x 27): the same dimension
//    sharded by up to three axes (nesting order), even (8, 16) and uneven (5, 3) sizes, fp32;
//  - bf16, every layout over {S0, R, P(max)} to and from the all-Replicate, all-Shard and
//    all-Partial layouts;
//  - rank-2 tensor, every pair among fourteen layouts mixing S0, S1, R and P(sum), two of them
//    with reversed sharding orders, even and uneven.
#include <catch2/catch.hpp>

#include "redistribute_properties.hpp"
#include "trellis/comm/threads.hpp"

using namespace shard_test;
using trellis::bfloat16;
using trellis::comm::ThreadWorld;

template <class T, int R, class From, class To>
void run_3d(const std::vector<std::array<index_t, R>>& shapes, int expect_pairs) {
  Failures failures;
  std::atomic<int> pairs{0};
  ThreadWorld(8).run([&](auto& world) {
    auto mesh = trellis::make_mesh<trellis::pp, trellis::dp, trellis::tp>(world, {2, 2, 2});
    using Mesh = std::remove_cvref_t<decltype(mesh)>;
    int n = 0, seed = 0;
    for (const auto& shape : shapes) n += pairs_impl<T, R, Mesh, From, To>::run(mesh, shape, ++seed, failures);
    if (world.rank() == 0) pairs = n;
  });
  INFO((failures.first.empty() ? std::string() : failures.first.front()));
  REQUIRE(failures.count == 0);
  REQUIRE(pairs == expect_pairs);
}

TEST_CASE("3-D mesh, rank-1 fp32: every pair of layouts", "[shard][redistribute]") {
  using L = all_layouts<3, Shard<0>, Replicate, Partial<>>;
  run_3d<float, 1, L, L>({{8}, {16}, {5}, {3}}, 4 * 27 * 27);
}

TEST_CASE("3-D mesh, rank-1 bf16: every layout to and from the uniform ones", "[shard][redistribute]") {
  using P = Partial<ReduceOp::max>;
  using L = all_layouts<3, Shard<0>, Replicate, P>;
  using U = list<Placements<Replicate, Replicate, Replicate>, Placements<Shard<0>, Shard<0>, Shard<0>>,
                 Placements<P, P, P>>;
  run_3d<bfloat16, 1, L, U>({{8}, {7}}, 2 * 27 * 3);
  run_3d<bfloat16, 1, U, L>({{8}, {7}}, 2 * 27 * 3);
}

TEST_CASE("3-D mesh, rank-2 fp32: mixed layouts and sharding orders", "[shard][redistribute]") {
  using P = Partial<>;
  using L = list<Placements<Shard<0>, Shard<1>, Replicate>, Placements<Shard<1>, Shard<0>, P>,
                 Placements<Shard<0>, Shard<0>, Shard<1>>, Placements<Shard<1>, Shard<1>, Shard<1>>,
                 Placements<Replicate, Shard<0>, Shard<0>>, Placements<P, P, Shard<1>>,
                 Placements<Shard<0>, P, Shard<0>>, Placements<Replicate, Replicate, Replicate>,
                 Placements<P, Replicate, P>, Placements<Shard<1>, Replicate, Shard<0>>,
                 Placements<Replicate, Shard<1>, P>, Placements<Shard<0>, Shard<1>, Shard<0>>,
                 Placements<Shard<0, 2>, Shard<0, 1>, Shard<0>>, Placements<Shard<1, 1>, P, Shard<1>>>;
  run_3d<float, 2, L, L>({{8, 8}, {5, 7}, {3, 1}}, 3 * 14 * 14);
}
