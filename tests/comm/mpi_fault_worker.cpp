// The MPI program the fault tests (test_mpi_fault.cpp) start under mpirun: MpiWorld owning MPI, as
// a trainer uses it. Each step reduces a 4 MiB "gradient bucket" that lives only in that step
// (all_reduce_async, then wait), so an exception frees it while MPI may still write into it. The
// last rank injects the fault of the scenario (argv[1]) at step 3, right after starting its
// reduction, and prints `fault <scenario> at <ns>` (monotonic clock) just before:
//   none    no fault: every rank prints `rank R: done` and exits 0
//   stop    raise(SIGSTOP): the rank stops mid-collective (its first fragments may be out)
//   kill    raise(SIGKILL)
//   throw   throws a trellis::Error out of MpiWorld::run
//   caught  (at step 0) never joins the reduction; the others catch the timeout inside run() and
//           return normally, so ~MpiWorld must end the job (an operation was abandoned in flight)
//   late_dup  (before step 0) stops (SIGSTOP) instead of constructing a second communicator over
//           MPI_COMM_WORLD, which the others construct: its MPI_Comm_dup must time out
//   stop_in_split  (before step 0) every rank calls split(0, rank); the last stops (SIGSTOP) after
//           the timed gather of colors, just before MPI_Comm_split (the test seam
//           detail::mpi_split_test_hook): the others' split must end the job
// The timeout comes from TRELLIS_COMM_TIMEOUT_MS. Own main: MpiWorld must initialise MPI itself;
// errors are caught around it and printed, as train_gpt's main does.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "support/mpi_job.hpp"
#include "trellis/comm/mpi.hpp"

using trellis::comm::MpiComm;
using trellis::comm::ReduceOp;

int main(int argc, char** argv) try {
  const std::string scenario = argc > 1 ? argv[1] : "none";
  trellis::comm::MpiWorld world(argc, argv);
  world.run([&](MpiComm& comm) {
    const int faulty = comm.size() - 1;
    const bool inject = comm.rank() == faulty && scenario != "none";
    const auto fault_now = [&] {
      std::printf("rank %d: fault %s at %lld ns\n", comm.rank(), scenario.c_str(), test_support::monotonic_ns());
      std::fflush(stdout);
    };
    if (scenario == "late_dup") {
      if (inject) {
        fault_now();
        ::raise(SIGSTOP);
      }
      MpiComm second(MPI_COMM_WORLD, "second");
      std::printf("rank %d: FAILED: constructed a communicator without rank %d\n", comm.rank(), faulty);
      return;
    }
    if (scenario == "stop_in_split") {
      if (inject)
        trellis::comm::detail::mpi_split_test_hook = [](int rank) {
          std::printf("rank %d: fault stop_in_split at %lld ns\n", rank, test_support::monotonic_ns());
          std::fflush(stdout);
          ::raise(SIGSTOP);
        };
      MpiComm sub = comm.split(0, comm.rank());
      std::printf("rank %d: FAILED: split returned without rank %d\n", comm.rank(), faulty);
      return;
    }
    if (scenario == "caught") {
      if (inject) {
        fault_now();
        return;  // never joins
      }
      std::vector<float> bucket(1 << 20, 1.0f);
      try {
        comm.all_reduce(bucket.data(), bucket.data(), bucket.size(), ReduceOp::sum);
        std::printf("rank %d: FAILED: the missing rank was not detected\n", comm.rank());
      } catch (const trellis::Error& e) {
        std::printf("rank %d: caught: %s\n", comm.rank(), e.what());
      }
      std::fflush(stdout);
      return;  // leaves run() normally; the bucket is freed here
    }
    const int n = comm.size();
    for (int step = 0; step < 6; ++step) {
      std::vector<float> bucket(1 << 20, static_cast<float>(comm.rank() + 1));  // (4 MiB)
      auto request = comm.all_reduce_async(bucket.data(), bucket.data(), bucket.size(), ReduceOp::sum);
      if (inject && step == 3) {
        fault_now();
        if (scenario == "stop") ::raise(SIGSTOP);
        if (scenario == "kill") ::raise(SIGKILL);
        if (scenario == "throw") TRELLIS_THROW("injected fault at step ", step);
      }
      request.wait();
      const float want = static_cast<float>(n * (n + 1) / 2);
      TRELLIS_CHECK(bucket.front() == want && bucket.back() == want, "step ", step, ": reduced to ",
                    bucket.front(), ", expected ", want);
    }
    std::printf("rank %d: done\n", comm.rank());
    std::fflush(stdout);
  });
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "mpi_fault_worker: %s\n", e.what());
  return 1;
}
