// The process-wide MPI fault record (part of comm/mpi.hpp): set once an operation was abandoned
// while MPI may still be working on it -- a timeout, or a pending request destroyed by an
// exception. From then on MPI may complete that operation into memory the program has freed since
// (a gradient bucket freed by the unwinding), and a peer may never come back (a stopped rank). So
// after a fault the backend's clean-up makes no MPI call (every call may drive MPI's progress
// engine), and MpiWorld ends the job with MPI_Abort instead of MPI_Finalize (which drives that
// progress and waits for every rank, forever for a stopped one).
// Needs MPI (under comm/mpi/: built only with trellis::mpi).
#pragma once

#include <atomic>
#include <mutex>
#include <string>

namespace trellis::comm {

namespace detail {

struct MpiFault {
  std::atomic<bool> set{false};
  std::mutex mutex;
  std::string first;  // the first fault's description, one line
};

// Never destroyed: communicators destroyed during static destruction still read it.
inline MpiFault& mpi_fault_record() {
  static MpiFault* fault = new MpiFault;
  return *fault;
}

inline bool mpi_faulted() noexcept { return mpi_fault_record().set.load(std::memory_order_acquire); }

// Records a fault (the first description is kept; only its first line).
inline void mpi_record_fault(const std::string& what) noexcept {
  auto& f = mpi_fault_record();
  try {
    std::lock_guard lock(f.mutex);
    if (f.first.empty()) f.first = what.substr(0, what.find('\n'));
  } catch (...) {  // out of memory for the text: the flag below still matters
  }
  f.set.store(true, std::memory_order_release);
}

inline std::string mpi_fault_description() {
  auto& f = mpi_fault_record();
  std::lock_guard lock(f.mutex);
  return f.first;
}

}  // namespace detail

}  // namespace trellis::comm
