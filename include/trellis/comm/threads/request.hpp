// ThreadRequest: a pending thread-backend operation (point to point, batch or async collective)
// (part of comm/threads.hpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "trellis/comm/threads/group.hpp"
#include "trellis/comm/threads/rank_state.hpp"
#include "trellis/core/space.hpp"

namespace trellis::comm {

// A pending thread-backend operation (point to point, batch, or async collective). wait() blocks
// until it completes and rethrows its error; test() polls (and also rethrows). The communicator
// that started it must outlive it.
class ThreadRequest {
 public:
  ThreadRequest() = default;
  ThreadRequest(ThreadRequest&&) noexcept = default;
  ThreadRequest& operator=(ThreadRequest&&) noexcept = default;
  ThreadRequest(const ThreadRequest&) = delete;
  ThreadRequest& operator=(const ThreadRequest&) = delete;
  ~ThreadRequest() = default;

  void wait() {
    if (!owner_) return;
    std::exception_ptr first;
    for (auto& part : parts_) {
      try {
        if (collective_) owner_->wait_collective(*part);
        else owner_->wait_p2p(*part);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    owner_->mark(seq_, !first);
    parts_.clear();
    owner_.reset();
    if (first) std::rethrow_exception(first);
  }

  // The host has one implicit stream: waiting "on" it is waiting.
  void wait_on(HostStream) { wait(); }

  bool test() {
    if (!owner_) return true;
    for (auto& part : parts_)
      if (part->done.load(std::memory_order_acquire) == 0) return false;
    wait();
    return true;
  }

 private:
  friend class ThreadComm;
  std::shared_ptr<detail::ThreadRankState> owner_;
  std::vector<std::shared_ptr<detail::OpState>> parts_;
  std::uint64_t seq_ = 0;
  bool collective_ = false;
};

}  // namespace trellis::comm
