// ThreadWorld: runs a function once per thread rank and reports the rank that failed first
// (part of comm/threads.hpp).
#pragma once

#include <cstddef>
#include <exception>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "trellis/comm/threads/comm.hpp"
#include "trellis/comm/threads/group.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

// Runs a function once per rank, each on its own thread.
class ThreadWorld {
 public:
  explicit ThreadWorld(int size) : size_(size) {
    TRELLIS_CHECK(size >= 1, "ThreadWorld needs at least one rank (got ", size, ")");
  }
  int size() const { return size_; }

  // Calls fn(ThreadComm&) on `size` threads, joins them all, and then rethrows the exception of
  // the rank that failed first (a trellis::Error naming that rank). When a rank throws, the
  // others fail at their current or next operation with "rank k failed: ..." instead of hanging.
  template <class Fn>
  void run(Fn&& fn) {
    auto world = std::make_shared<detail::ThreadWorldState>(size_);
    std::vector<int> ranks(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) ranks[r] = r;
    auto group = std::make_shared<detail::ThreadGroup>(world, "world", std::move(ranks));
    world->add_group(group);
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size_));
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      threads.emplace_back([&, r] {
        RankScope scope(r);
        try {
          ThreadComm comm(group, r, world->default_timeout, world->default_debug);
          fn(comm);
        } catch (const std::exception& e) {
          errors[r] = std::current_exception();
          world->abort(r, e.what());
        } catch (...) {
          errors[r] = std::current_exception();
          world->abort(r, "unknown exception");
        }
        world->exited[r].store(true);
        world->wake_all();
      });
    }
    for (auto& t : threads) t.join();
    if (!world->aborted.load()) return;
    const int origin = world->failed_rank;
    try {
      std::rethrow_exception(errors[origin]);
    } catch (const Error& e) {
      if (e.rank() == origin) throw;
      throw Error(detail::ThreadWorldState::concat_failure(origin, e.what()), "", 0, origin);
    } catch (const std::exception& e) {
      throw Error(detail::ThreadWorldState::concat_failure(origin, e.what()), "", 0, origin);
    } catch (...) {
      throw Error(detail::ThreadWorldState::concat_failure(origin, "unknown exception"), "", 0, origin);
    }
  }

 private:
  int size_;
};

}  // namespace trellis::comm
