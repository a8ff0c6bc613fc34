// Waiting for the thread backend: a short spin, then a futex sleep on a word that every state
// change bumps, so that ranks outnumbering cores sleep instead of burning the cores the running
// ranks need (part of comm/threads.hpp).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ctime>
#endif

namespace trellis::comm {

namespace detail {

// ------------------------------------------------------------------------------------------------
// Waiting: spin briefly, then sleep on a futex word that every state change bumps.

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A futex word plus a count of sleepers, so that notify() costs a syscall only when someone sleeps.
struct alignas(64) WakeWord {
  std::atomic<std::uint32_t> word{0};
  std::atomic<std::uint32_t> sleepers{0};

  void notify() {
    word.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) != 0) {
#if defined(__linux__)
      syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX,
              nullptr, nullptr, 0);
#endif
    }
  }

  // Sleeps while word == seen, at most `limit`.
  void sleep(std::uint32_t seen, std::chrono::nanoseconds limit) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
#if defined(__linux__)
    if (limit.count() < 1000) limit = std::chrono::nanoseconds(1000);
    timespec ts{};
    ts.tv_sec = static_cast<time_t>(limit.count() / 1000000000);
    ts.tv_nsec = static_cast<long>(limit.count() % 1000000000);
    if (word.load(std::memory_order_seq_cst) == seen) {
      syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, seen, &ts,
              nullptr, 0);
    }
#else
    if (word.load(std::memory_order_seq_cst) == seen)
      std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(limit, std::chrono::microseconds(100)));
#endif
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
};
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));

// Waits until done() holds: spins for spin_ns, then sleeps on `wake` in slices of at most 20 ms,
// calling check() (which throws on abort or deadline) between sleeps.
template <class Done, class Check>
void wait_until(WakeWord& wake, std::int64_t spin_ns, Done&& done, Check&& check) {
  if (done()) return;
  if (spin_ns > 0) {
    auto start = std::chrono::steady_clock::now();
    for (int i = 1;; ++i) {
      cpu_relax();
      if (done()) return;
      if ((i & 63) == 0 &&
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count() > spin_ns)
        break;
    }
  } else {
    std::this_thread::yield();
    if (done()) return;
  }
  for (;;) {
    std::uint32_t seen = wake.word.load(std::memory_order_seq_cst);
    if (done()) return;
    check();
    wake.sleep(seen, std::chrono::milliseconds(20));
  }
}

}  // namespace detail

}  // namespace trellis::comm
