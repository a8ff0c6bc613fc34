// MpiWorld: MPI's lifetime for a program (init, finalize) and run(fn), shaped like ThreadWorld
// (part of comm/mpi.hpp).
// Needs MPI (under comm/mpi/: built only with trellis::mpi).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include "trellis/comm/mpi/comm.hpp"
#include "trellis/comm/mpi/fault.hpp"
#include "trellis/core/check_mpi.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

// MPI's lifetime for a program: initialises MPI (MPI_THREAD_MULTIPLE) unless it already is, and
// finalises it on destruction only if it initialised it. run(fn) calls fn(comm) with an MpiComm
// over MPI_COMM_WORLD, with this process's rank set for error messages (trellis::RankScope).
//
// Failures, when this object owns MPI in a job of several processes (docs/comm_mpi_nccl.md):
//  - an exception that leaves fn is written to stderr and ends the whole job at once
//    (MPI_Abort(MPI_COMM_WORLD, 1)): the peers could not learn of it otherwise and would wait for
//    this rank until their timeout, and MPI_Finalize cannot complete while they do. Catch inside
//    fn to handle an error yourself.
//  - after a fault (fault.hpp: a timeout, or a request abandoned by an exception) the destructor
//    does not finalise -- MPI_Finalize would progress the abandoned operation into memory freed
//    since and wait for a stopped rank forever -- but says why on stderr and calls MPI_Abort.
// Without a fault the destructor finalises once every rank has reached it (see there).
// A world that does not own MPI leaves all this to whoever initialised it: run() rethrows.
class MpiWorld {
 public:
  MpiWorld() : MpiWorld(nullptr, nullptr) {}
  MpiWorld(int& argc, char**& argv) : MpiWorld(&argc, &argv) {}

  MpiWorld(const MpiWorld&) = delete;
  MpiWorld& operator=(const MpiWorld&) = delete;

  ~MpiWorld() {
    if (!owns_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    if (detail::mpi_faulted())
      abort_job(trellis::detail::concat(
          "trellis: [rank ", rank_, "] MpiWorld: not finalising MPI after a communication fault (",
          detail::mpi_fault_description(),
          "): an operation abandoned in flight could complete into freed memory, and MPI_Finalize could wait "
          "forever for a rank that stopped"));
    // Nobody enters MPI_Finalize before every rank came this far: with one rank inside it while
    // another called MPI_Abort, OpenMPI 4.1's mpirun crashed or hung in its own teardown (6 of 54
    // runs of comm.mpi_fault.caught under load). Polled, so that a peer's abort ends this process
    // here; no deadline, as MPI_Finalize has none.
    MPI_Request all_here = MPI_REQUEST_NULL;
    if (MPI_Ibarrier(MPI_COMM_WORLD, &all_here) == MPI_SUCCESS) {
      for (int done = 0; MPI_Test(&all_here, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done;)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    MPI_Finalize();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The thread support MPI gave (MPI_THREAD_MULTIPLE unless someone else initialised MPI lower).
  int thread_level() const { return thread_level_; }
  // True when this object initialised MPI (and so finalises it).
  bool owns_mpi() const { return owns_; }

  // A fresh communicator over MPI_COMM_WORLD (collective).
  MpiComm communicator(std::string label = "world") const { return MpiComm(MPI_COMM_WORLD, std::move(label)); }

  // Calls fn(comm) once in this process, as this process's rank; returns what fn returns. An
  // exception from fn ends the job (above) when this world owns MPI and has several processes.
  template <class Fn>
  decltype(auto) run(Fn&& fn) const {
    RankScope scope(rank_);
    try {
      MpiComm comm = communicator();
      return std::invoke(std::forward<Fn>(fn), comm);
    } catch (const Error& e) {
      if (!owns_ || size_ == 1) throw;
      abort_job(e.what());
    } catch (const std::exception& e) {
      if (!owns_ || size_ == 1) throw;
      abort_job(trellis::detail::concat("trellis: [rank ", rank_, "] ", e.what()));
    } catch (...) {
      if (!owns_ || size_ == 1) throw;
      abort_job(trellis::detail::concat("trellis: [rank ", rank_, "] an exception that is not a std::exception "
                                        "left run()"));
    }
  }

 private:
  MpiWorld(int* argc, char*** argv) {
    int initialized = 0;
    TRELLIS_CHECK_MPI(MPI_Initialized(&initialized));
    if (!initialized) {
      TRELLIS_CHECK_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &thread_level_));
      owns_ = true;
    } else {
      TRELLIS_CHECK_MPI(MPI_Query_thread(&thread_level_));
    }
    TRELLIS_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    TRELLIS_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size_));
  }

  // Writes `what` and how the job ends to stderr (flushed: MPI_Abort kills this process), then
  // ends every process of the job.
  [[noreturn]] void abort_job(const std::string& what) const {
    std::fprintf(stderr, "%s\n(MpiWorld: rank %d ends the job of %d processes: MPI_Abort(MPI_COMM_WORLD, 1))\n",
                 what.c_str(), rank_, size_);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    std::abort();  // MPI_Abort does not return
  }

  bool owns_ = false;
  int thread_level_ = 0;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace trellis::comm
