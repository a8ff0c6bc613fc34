// MpiWorld the way a program uses it: it initialises MPI itself (MPI_THREAD_MULTIPLE), run() sets
// the rank for errors and hands out the world communicator, and the destructor finalises: every
// process exits 0. A rank that never joins is comm.mpi_fault.caught (test_mpi_fault.cpp): after a
// timeout MpiWorld ends the job instead of finalising.
// Own main (no Catch2): the Catch2 MPI main initialises MPI itself, which is what this test must not do.
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "trellis/comm/mpi.hpp"

using namespace std::chrono_literals;

int main(int argc, char** argv) {
  int failures = 0;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) {
      ++failures;
      std::fprintf(stderr, "FAILED: %s\n", what.c_str());
    }
  };
  int world_rank = -1;
  {
    trellis::comm::MpiWorld world(argc, argv);
    world_rank = world.rank();
    expect(world.owns_mpi(), "MpiWorld should have initialised MPI");
    expect(world.thread_level() == MPI_THREAD_MULTIPLE, "thread level is not MPI_THREAD_MULTIPLE");
    expect(world.size() >= 2, "needs at least 2 ranks");
    world.run([&](trellis::comm::MpiComm& comm) {
      expect(trellis::current_rank() == world.rank(), "run() did not set the rank for errors");
      expect(comm.rank() == world.rank() && comm.size() == world.size(), "run() did not give the world communicator");
      comm.set_timeout(20s);
      std::vector<float> a(100, static_cast<float>(comm.rank() + 1)), b(100);
      comm.all_reduce(a.data(), b.data(), a.size(), trellis::comm::ReduceOp::sum);
      const int n = comm.size();
      expect(b.front() == static_cast<float>(n * (n + 1) / 2) && b.back() == b.front(), "wrong all_reduce result");
    });
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  expect(finalized != 0, "MpiWorld did not finalise MPI");
  std::printf("rank %d: %s\n", world_rank, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
