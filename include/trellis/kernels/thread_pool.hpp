// A small fixed-size thread pool for the host kernels, so the kernel headers need nothing but the
// standard library (no OpenMP). parallel_for(n, fn) runs fn(i) for i in [0, n) on the pool's
// workers and the calling thread. Results never depend on the number of threads: kernels give
// each task disjoint outputs and reduce partial results in task order.
//
// Concurrent callers (e.g. several ranks of a ThreadWorld calling kernels at once) and nested
// calls do not wait for each other: whoever finds the pool busy runs its tasks inline.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "trellis/core/subnormals.hpp"

namespace trellis::kernels::host {

class ThreadPool {
 public:
  // How long a worker keeps polling for the next call, and the caller for the workers' last tasks,
  // before sleeping on a condition variable. Sleeping at once costs two futex wake-ups per call
  // (measured: 45 us per parallel_for on this VM, against ~1 us when both sides poll), and a
  // training step makes hundreds of kernel calls; polling longer would take cores from other
  // threads (rank threads outnumbering cores) the way OpenBLAS' 0.1 s spin does.
  static constexpr std::chrono::microseconds poll_time{50};

  explicit ThreadPool(int threads) : threads_(std::max(1, threads)) {
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { worker_loop(); });
  }
  ~ThreadPool() {
    {
      std::lock_guard lock(mutex_);
      stop_.store(true);
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return threads_; }

  // Runs fn(i) for every i in [0, count); rethrows the first exception a task threw.
  template <class Fn>
  void parallel_for(std::int64_t count, Fn&& fn) {
    if (count <= 0) return;
    std::unique_lock busy(busy_, std::try_to_lock);
    if (count == 1 || threads_ == 1 || !busy.owns_lock()) {
      for (std::int64_t i = 0; i < count; ++i) fn(i);
      return;
    }
    std::function<void(std::int64_t)> task = [&fn](std::int64_t i) { fn(i); };
    {
      std::lock_guard lock(mutex_);
      task_ = &task;
      count_ = count;
      next_.store(0);
      error_ = nullptr;
      active_.store(static_cast<int>(workers_.size()));
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    run_tasks();
    if (!poll_until([this] { return active_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock lock(mutex_);
      done_.wait(lock, [this] { return active_.load(std::memory_order_acquire) == 0; });
    }
    task_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  // Polls `ready` for up to poll_time; true once it holds.
  template <class Ready>
  static bool poll_until(Ready&& ready) {
    const auto until = std::chrono::steady_clock::now() + poll_time;
    for (int spins = 0;; ++spins) {
      if (ready()) return true;
      if ((spins & 63) == 63 && std::chrono::steady_clock::now() >= until) return ready();
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
      __builtin_ia32_pause();
#endif
    }
  }
  void run_tasks() {
    for (;;) {
      std::int64_t i = next_.fetch_add(1);
      if (i >= count_) return;
      try {
        (*task_)(i);
      } catch (...) {
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_.store(count_);
      }
    }
  }
  void worker_loop() {
    flush_subnormals_on_this_thread();  // as the backend's threads (core/subnormals.hpp)
    std::uint64_t seen = 0;
    for (;;) {
      auto called = [&] { return stop_.load() || generation_.load(std::memory_order_acquire) != seen; };
      if (!poll_until(called)) {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, called);
      }
      if (stop_.load()) return;
      seen = generation_.load(std::memory_order_acquire);
      run_tasks();
      if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard lock(mutex_);  // the caller tests active_ under the mutex before it sleeps
        done_.notify_one();
      }
    }
  }

  int threads_;
  std::vector<std::thread> workers_;
  std::mutex busy_;  // held by the one caller that owns the workers
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::function<void(std::int64_t)>* task_ = nullptr;
  std::int64_t count_ = 0;
  std::atomic<std::int64_t> next_{0};
  std::exception_ptr error_;
  std::atomic<int> active_{0};
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
};

// Threads the host kernels use: the hardware concurrency unless set_num_threads() said otherwise
// before the first kernel call.
inline int& kernel_thread_count() {
  static int count = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return count;
}
inline void set_num_threads(int threads) { kernel_thread_count() = std::max(1, threads); }

inline ThreadPool& kernel_pool() {
  static ThreadPool pool(kernel_thread_count());
  return pool;
}

template <class Fn>
void parallel_for(std::int64_t count, Fn&& fn) {
  kernel_pool().parallel_for(count, std::forward<Fn>(fn));
}

}  // namespace trellis::kernels::host
