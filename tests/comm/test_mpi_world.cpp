// MpiWorld the way a program uses it: it initialises MPI itself (MPI_THREAD_MULTIPLE) and
// finalises it. Rank 1 never joins a collective; the others must get a trellis::Error naming it
// (debug mode) within the timeout, with their own rank attached by run(); then every process
// leaves run() and finalises: exit 0 everywhere, no MPI_Abort, no hang (ctest's timeout guards).
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
      comm.set_debug(true);
      comm.set_timeout(300ms);
      if (comm.rank() == 1) return;  // never joins
      std::vector<float> a(100, 1.0f), b(100);
      const auto t0 = std::chrono::steady_clock::now();
      try {
        comm.all_reduce(a.data(), b.data(), a.size(), trellis::comm::ReduceOp::sum);
        expect(false, "the missing rank was not detected");
      } catch (const trellis::Error& e) {
        const std::string what = e.what();
        const auto elapsed = std::chrono::steady_clock::now() - t0;
        expect(e.rank() == world.rank(), "error does not carry this rank: " + what);
        expect(what.find("[rank " + std::to_string(world.rank()) + "]") != std::string::npos, "no [rank] in: " + what);
        expect(what.find("rank 1 did not arrive") != std::string::npos, "missing rank not named: " + what);
        expect(elapsed >= 300ms && elapsed < 10s, "timeout not honoured");
      }
    });
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  expect(finalized != 0, "MpiWorld did not finalise MPI");
  std::printf("rank %d: %s\n", world_rank, failures ? "FAILED" : "ok");
  return failures ? 1 : 0;
}
