// The redistribute property body (redistribute_properties.hpp) on MPI processes: a 2 x 2 mesh,
// every pair of layouts over {S0, S1, R, P} for a rank-2 tensor, even and uneven shapes, fp32
// (P = sum) and bf16 (P = max). Run under mpiexec -np 4.
#include <catch2/catch.hpp>

#include "redistribute_properties.hpp"
#include "trellis/comm/mpi.hpp"

using namespace shard_test;
using trellis::bfloat16;

template <class T, class P>
void run_mpi_2d() {
  using Layouts = all_layouts<2, Shard<0>, Shard<1>, Replicate, P>;
  trellis::comm::MpiWorld world;
  REQUIRE(world.size() == 4);
  Failures failures;
  int pairs = world.run([&](auto& comm) {
    auto mesh = trellis::make_mesh<trellis::dp, trellis::tp>(comm, {2, 2});
    return run_all_pairs<T, 2, Layouts>(mesh, {{4, 8}, {5, 3}, {1, 3}}, failures);
  });
  INFO((failures.first.empty() ? std::string() : failures.first.front()));
  REQUIRE(failures.count == 0);
  REQUIRE(pairs == 3 * 16 * 16);
}

TEST_CASE("MPI 2 x 2 mesh, fp32: every pair of layouts", "[shard][mpi]") { run_mpi_2d<float, Partial<>>(); }
TEST_CASE("MPI 2 x 2 mesh, bf16: every pair of layouts", "[shard][mpi]") {
  run_mpi_2d<bfloat16, Partial<ReduceOp::max>>();
}
