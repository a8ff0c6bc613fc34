// MpiRequest: a handle to an MPI operation in flight (part of comm/mpi.hpp).
// Needs MPI (under comm/mpi/: built only with trellis::mpi).
#pragma once

#include <mpi.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <utility>

#include "trellis/comm/mpi/comm_state.hpp"
#include "trellis/comm/mpi/fault.hpp"
#include "trellis/comm/mpi/pending.hpp"
#include "trellis/core/space.hpp"

namespace trellis::comm {

// A handle to an MPI operation in flight. wait() blocks until it completes (with the
// communicator's timeout) and finishes it (16-bit narrowing, avg division); test() polls and
// finishes it when done. Destroying an unfinished request waits for it (errors are swallowed:
// call wait() to see them) -- except while an exception unwinds through it, or after a fault
// (fault.hpp): then the operation is abandoned without any MPI call and the fault recorded, since
// its buffers are about to be freed and its peers may never come (each wait would cost a timeout).
class MpiRequest {
 public:
  MpiRequest() = default;
  MpiRequest(MpiRequest&& other) noexcept : state_(std::move(other.state_)), pending_(std::move(other.pending_)) {}
  MpiRequest& operator=(MpiRequest&& other) noexcept {
    if (this != &other) {
      drain();
      state_ = std::move(other.state_);
      pending_ = std::move(other.pending_);
    }
    return *this;
  }
  MpiRequest(const MpiRequest&) = delete;
  MpiRequest& operator=(const MpiRequest&) = delete;
  ~MpiRequest() { drain(); }

  void wait() {
    if (!pending_) return;
    state_->finish(std::move(pending_));
  }

  // The host has one implicit stream: waiting "on" it is waiting.
  void wait_on(HostStream) { wait(); }

  bool test() {
    if (!pending_) return true;
    const std::uint64_t seq = pending_->call.seq;
    try {
      if (!pending_->test()) return false;
      pending_->complete();
    } catch (...) {
      state_->recorder.failed(seq);
      pending_.reset();
      throw;
    }
    state_->recorder.completed(seq);
    pending_.reset();
    return true;
  }

  // True until the operation completed and was finished by wait() or test().
  bool pending() const noexcept { return pending_ != nullptr; }

 private:
  friend class MpiComm;
  MpiRequest(std::shared_ptr<detail::MpiCommState> state, std::unique_ptr<detail::MpiPending> pending)
      : state_(std::move(state)), pending_(std::move(pending)) {}

  void drain() noexcept {
    if (!pending_) return;
    if (std::uncaught_exceptions() > exceptions_) {
      state_->abandon(std::move(pending_), "was abandoned in flight by an exception");
      return;
    }
    if (detail::mpi_faulted()) {
      state_->abandon(std::move(pending_), "was abandoned in flight after an earlier fault");
      return;
    }
    try {
      wait();
    } catch (...) {
    }
    pending_.reset();
  }

  std::shared_ptr<detail::MpiCommState> state_;
  std::unique_ptr<detail::MpiPending> pending_;
  int exceptions_ = std::uncaught_exceptions();  // at creation: more at destruction = unwinding
};

}  // namespace trellis::comm
