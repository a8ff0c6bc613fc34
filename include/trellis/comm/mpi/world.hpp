// MpiWorld: MPI's lifetime for a program (init, finalize) and run(fn), shaped like ThreadWorld
// (part of comm/mpi.hpp).
// Needs MPI (under comm/mpi/: built only with trellis::mpi).
#pragma once

#include <mpi.h>

#include <functional>
#include <string>
#include <utility>

#include "trellis/comm/mpi/comm.hpp"
#include "trellis/core/check_mpi.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

// MPI's lifetime for a program: initialises MPI (MPI_THREAD_MULTIPLE) unless it already is, and
// finalises it on destruction only if it initialised it. run(fn) calls fn(comm) with an MpiComm
// over MPI_COMM_WORLD, with this process's rank set for error messages (trellis::RankScope).
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
    if (!finalized) MPI_Finalize();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The thread support MPI gave (MPI_THREAD_MULTIPLE unless someone else initialised MPI lower).
  int thread_level() const { return thread_level_; }
  // True when this object initialised MPI (and so finalises it).
  bool owns_mpi() const { return owns_; }

  // A fresh communicator over MPI_COMM_WORLD (collective).
  MpiComm communicator(std::string label = "world") const { return MpiComm(MPI_COMM_WORLD, std::move(label)); }

  // Calls fn(comm) once in this process, as this process's rank; returns what fn returns.
  template <class Fn>
  decltype(auto) run(Fn&& fn) const {
    RankScope scope(rank_);
    MpiComm comm = communicator();
    return std::invoke(std::forward<Fn>(fn), comm);
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

  bool owns_ = false;
  int thread_level_ = 0;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace trellis::comm
