// redistribute on a 2 x 2 mesh of thread ranks: every pair of layouts over {S0, S1, R, P} for a
// rank-2 tensor (P = sum for fp32, max for bf16), even and uneven shapes (empty shards included);
// and on a 2 x 3 mesh every pair over {S0, S0 one level down, S1, R} (sharding orders).
#include <catch2/catch.hpp>

#include "redistribute_properties.hpp"
#include "trellis/comm/threads.hpp"

using namespace shard_test;
using trellis::bfloat16;
using trellis::comm::ThreadWorld;

template <class T, class P>
void run_2d() {
  using Layouts = all_layouts<2, Shard<0>, Shard<1>, Replicate, P>;
  Failures failures;
  std::atomic<int> pairs{0};
  ThreadWorld(4).run([&](auto& world) {
    auto mesh = trellis::make_mesh<trellis::dp, trellis::tp>(world, {2, 2});
    int n = run_all_pairs<T, 2, Layouts>(mesh, {{4, 8}, {5, 3}, {1, 3}}, failures);
    if (world.rank() == 0) pairs = n;
  });
  INFO((failures.first.empty() ? std::string() : failures.first.front()));
  REQUIRE(failures.count == 0);
  REQUIRE(pairs == 3 * 16 * 16);
}

TEST_CASE("2-D mesh, fp32: every pair of layouts", "[shard][redistribute]") { run_2d<float, Partial<>>(); }
TEST_CASE("2-D mesh, bf16: every pair of layouts", "[shard][redistribute]") {
  run_2d<bfloat16, Partial<ReduceOp::max>>();
}

TEST_CASE("2-D mesh, fp32: sharding orders of one dimension", "[shard][redistribute]") {
  // Shard<0, 1> sits one nesting level down: [S0, S0'] nests axis 0 outside axis 1 (as [S0, S0]),
  // [S0', S0] nests axis 1 outside axis 0.
  using Layouts = all_layouts<2, Shard<0>, Shard<0, 1>, Shard<1>, Replicate>;
  Failures failures;
  std::atomic<int> pairs{0};
  ThreadWorld(6).run([&](auto& world) {
    auto mesh = trellis::make_mesh<trellis::dp, trellis::tp>(world, {2, 3});
    int n = run_all_pairs<float, 2, Layouts>(mesh, {{12, 6}, {11, 5}, {4, 2}}, failures);
    if (world.rank() == 0) pairs = n;
  });
  INFO((failures.first.empty() ? std::string() : failures.first.front()));
  REQUIRE(failures.count == 0);
  REQUIRE(pairs == 3 * 16 * 16);
}
