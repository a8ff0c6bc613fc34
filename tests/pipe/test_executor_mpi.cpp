// The executor over MPI ranks (MpiComm): the same schedules and stages as on thread ranks must give
// the single-rank gradients; each process checks the layers it holds against its own serial run.
#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <vector>

#include "pipe/tanh_stage.hpp"
#include "trellis/comm/mpi.hpp"
#include "trellis/pipe/executor.hpp"
#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/simulate.hpp"

using namespace trellis::pipe;
using namespace pipe_test;

TEST_CASE("every generator on MPI ranks gives the single-rank gradients", "[pipe][executor][mpi]") {
  trellis::comm::MpiWorld world;
  world.run([&](trellis::comm::MpiComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(20000));
    const int p = comm.size();
    int runs = 0;
    for (const auto& name : schedule_names())
      for (int m : {1, 3, 2 * p, 4 * p}) {
        const int v = name == "interleaved_1f1b" ? 2 : 1;
        if (name == "interleaved_1f1b" && m % p != 0) continue;
        if (name == "dualpipe_v" && m < 2 * p) continue;
        INFO(name << " p=" << p << " m=" << m << " rank " << comm.rank());
        Schedule s = make_schedule(name, p, m, v);
        const int stages = s.virtual_stages();
        const auto bounds = split_layers(2 * stages + 1, stages);
        const Model model = make_model(2 * stages + 1, m);
        const Grads want = serial_gradients(model, bounds, s.local_learning);
        TanhStage stage(model, s, comm.rank(), bounds);
        auto result = execute(comm, s, stage);
        CHECK(stage.alive() == 0u);
        CHECK(result.peak_live_activations == simulate(s).peak_chunk_activations[comm.rank()]);
        for (int l : stage.layers()) {
          for (std::size_t i = 0; i < want.weight[l].size(); ++i)
            CHECK(stage.grads().weight[l][i] == Approx(want.weight[l][i]).epsilon(1e-5).margin(1e-5));
          for (std::size_t i = 0; i < want.bias[l].size(); ++i)
            CHECK(stage.grads().bias[l][i] == Approx(want.bias[l][i]).epsilon(1e-5).margin(1e-5));
        }
        comm.barrier();
        ++runs;
      }
    CHECK(runs >= 20);
  });
}
