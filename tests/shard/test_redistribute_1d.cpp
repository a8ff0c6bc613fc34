// redistribute on a 1-D mesh of 3 thread ranks: every pair of placements over {S0, S1, S2, R,
// P(sum), P(avg), P(max), P(min)} for a rank-3 tensor (every dimension), even and uneven shapes
// (parts of different sizes, empty parts, an empty tensor), fp32 and bf16.
#include <catch2/catch.hpp>

#include "redistribute_properties.hpp"
#include "trellis/comm/threads.hpp"

using namespace shard_test;
using trellis::bfloat16;
using trellis::comm::ThreadWorld;

template <class T>
void run_1d() {
  using Layouts = all_layouts<1, Shard<0>, Shard<1>, Shard<2>, Replicate, Partial<ReduceOp::sum>,
                              Partial<ReduceOp::avg>, Partial<ReduceOp::max>, Partial<ReduceOp::min>>;
  Failures failures;
  std::atomic<int> pairs{0};
  ThreadWorld(3).run([&](auto& world) {
    auto mesh = trellis::make_mesh<trellis::tp>(world, {3});
    int n = run_all_pairs<T, 3, Layouts>(mesh, {{3, 6, 9}, {4, 5, 2}, {2, 7, 1}, {0, 3, 4}}, failures);
    if (world.rank() == 0) pairs = n;
  });
  INFO((failures.first.empty() ? std::string() : failures.first.front()));
  REQUIRE(failures.count == 0);
  REQUIRE(pairs == 4 * 8 * 8);
}

TEST_CASE("1-D mesh, fp32: every pair of placements, every dimension", "[shard][redistribute]") { run_1d<float>(); }
TEST_CASE("1-D mesh, bf16: every pair of placements, every dimension", "[shard][redistribute]") { run_1d<bfloat16>(); }
