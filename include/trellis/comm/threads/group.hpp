// The thread backend's shared state: the world (failure, timeouts), each group's published slots,
// barrier counters, task counters and mailboxes, and the arguments of one collective (part of
// comm/threads.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "trellis/comm/recorder.hpp"
#include "trellis/comm/threads/wait.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

namespace detail {

// ------------------------------------------------------------------------------------------------
// Shared state of one ThreadWorld and of each group (the world and every split of it).

struct ThreadGroup;

struct ThreadWorldState {
  explicit ThreadWorldState(int n) : size(n), exited(new std::atomic<bool>[static_cast<std::size_t>(n)]) {
    for (int i = 0; i < n; ++i) exited[i].store(false);
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    spin_ns = static_cast<unsigned>(n) <= cores ? 20000 : 0;  // oversubscribed: sleep at once
    if (const char* env = std::getenv("TRELLIS_COMM_TIMEOUT_MS")) {
      long long ms = std::atoll(env);
      if (ms > 0) default_timeout = std::chrono::milliseconds(ms);
    }
    if (const char* env = std::getenv("TRELLIS_COMM_DEBUG")) default_debug = env[0] == '1';
  }

  // Marks the world failed by `rank` (the first failure wins) and wakes every waiter.
  void abort(int rank, const std::string& what) {
    {
      std::lock_guard lock(mutex);
      if (!aborted.load()) {
        failed_rank = rank;
        failure = what;
        aborted.store(true);
      }
    }
    wake_all();
  }
  inline void wake_all();
  inline void add_group(const std::shared_ptr<ThreadGroup>& g);

  [[noreturn]] void throw_aborted() {
    std::string what;
    int rank;
    {
      std::lock_guard lock(mutex);
      what = failure;
      rank = failed_rank;
    }
    throw Error(concat_failure(rank, what));
  }
  static std::string concat_failure(int rank, const std::string& what) {
    return trellis::detail::concat("rank ", rank, " failed: ", what);
  }

  const int size;
  std::unique_ptr<std::atomic<bool>[]> exited;  // per world rank: returned from its function
  std::int64_t spin_ns = 0;
  std::chrono::milliseconds default_timeout{60000};
  bool default_debug = false;
  std::atomic<bool> aborted{false};
  std::mutex mutex;  // guards failure, failed_rank, groups
  int failed_rank = -1;
  std::string failure;
  std::vector<std::weak_ptr<ThreadGroup>> groups;
};

// What each rank publishes for the collective in progress.
struct alignas(64) ThreadSlot {
  OpFingerprint fp;
  const std::byte* in = nullptr;
  std::byte* out = nullptr;
  // all_to_allv: copies (the caller's arrays may be gone while a slow peer still validates)
  std::vector<std::size_t> send_counts, send_displs, recv_counts, recv_displs;
  int color = 0;
  int key = 0;
  std::shared_ptr<ThreadGroup> new_group;  // split: set by each new group's leader
};

struct alignas(64) ThreadProgress {
  std::atomic<std::uint64_t> arrived{0};  // barriers this rank has reached
  std::atomic<std::uint64_t> calls{0};    // collectives this rank has entered
};

// State shared by a pending send or receive and the side that completes it.
struct OpState {
  std::atomic<std::uint32_t> done{0};
  std::exception_ptr error;  // written before done is set
  std::string failure;       // p2p: raised as an Error on the waiting rank's own thread
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::string what;  // "recv of 10 float from rank 1 (tag 0)", for timeout messages
  int mailbox = -1;  // p2p: destination rank whose mailbox holds the envelope until matched
};

struct alignas(64) TaskCounter {
  std::atomic<std::uint64_t> next{0};
};

struct Envelope {
  int source = 0;  // sending rank (group rank)
  int tag = 0;
  DType dtype = DType::f32;
  std::size_t count = 0;
  const std::byte* send_data = nullptr;  // sends
  std::byte* recv_data = nullptr;        // receives
  std::vector<std::byte> eager;          // copy of a small send, which has completed already
  std::shared_ptr<OpState> state;
};

struct Mailbox {
  std::mutex mutex;
  std::deque<Envelope> unexpected;  // sends that arrived before their receive
  std::deque<Envelope> posted;      // receives waiting for their send
};

struct ThreadGroup {
  ThreadGroup(std::shared_ptr<ThreadWorldState> w, std::string name, std::vector<int> ranks)
      : world(std::move(w)),
        label(std::move(name)),
        size(static_cast<int>(ranks.size())),
        world_ranks(std::move(ranks)),
        slots(new ThreadSlot[2 * world_ranks.size()]),
        progress(new ThreadProgress[world_ranks.size()]),
        region_next(new TaskCounter[world_ranks.size()]),
        mailboxes(new Mailbox[world_ranks.size()]) {}

  std::shared_ptr<ThreadWorldState> world;
  const std::string label;
  const int size;
  const std::vector<int> world_ranks;  // group rank -> world rank
  std::unique_ptr<ThreadSlot[]> slots;  // two per rank: [2 * rank + collective parity]
  std::unique_ptr<ThreadProgress[]> progress;
  // Work sharing: a collective's tasks are cut into one contiguous region per rank; each rank
  // claims from its own region first (a sequential stream per core), then from the others'.
  // Each region's counter numbers that region's tasks of all collectives so far consecutively.
  std::unique_ptr<TaskCounter[]> region_next;  // next task to claim, per region
  alignas(64) std::atomic<std::uint64_t> done_tasks{0};  // tasks finished, all collectives
  std::unique_ptr<Mailbox[]> mailboxes;
  WakeWord wake;
  std::atomic<bool> broken{false};  // a timeout left the barriers out of step
  std::mutex broken_mutex;
  std::string broken_reason;
};

inline void ThreadWorldState::wake_all() {
  std::vector<std::shared_ptr<ThreadGroup>> alive;
  {
    std::lock_guard lock(mutex);
    for (auto& g : groups)
      if (auto p = g.lock()) alive.push_back(std::move(p));
  }
  for (auto& g : alive) g->wake.notify();
}
inline void ThreadWorldState::add_group(const std::shared_ptr<ThreadGroup>& g) {
  std::lock_guard lock(mutex);
  std::erase_if(groups, [](const std::weak_ptr<ThreadGroup>& w) { return w.expired(); });
  groups.push_back(g);
}

// Arguments of one collective, as the calling rank sees them.
struct CollectiveArgs {
  OpFingerprint fp;       // fp.seq counts collectives only (what every rank must agree on)
  std::uint64_t call = 0;  // this call's number in the flight recorder (all operations)
  const std::byte* in = nullptr;
  std::byte* out = nullptr;
  std::span<const std::size_t> send_counts, send_displs, recv_counts, recv_displs;
  int color = 0, key = 0;
};

inline std::size_t max_count(DType dtype, std::size_t blocks = 1) {
  return static_cast<std::size_t>(PTRDIFF_MAX) / dtype_size(dtype) / std::max<std::size_t>(blocks, 1);
}

}  // namespace detail

}  // namespace trellis::comm
