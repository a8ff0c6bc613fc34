// train::UpdateWorker: one thread that runs jobs in the order they were submitted (the offloaded
// optimizer's CPU updates, ZeRO-Offload style: a weight unit's AdamW runs on the CPU while the
// compute thread goes on with the backward). submit() returns at once; wait(job) blocks until
// that job ran and rethrows what it threw. A probe (tests) runs on the worker before each job.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace trellis::train {

class UpdateWorker {
 public:
  UpdateWorker() : thread_([this] { loop(); }) {}
  UpdateWorker(const UpdateWorker&) = delete;
  UpdateWorker& operator=(const UpdateWorker&) = delete;
  ~UpdateWorker() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    thread_.join();  // runs what is queued first: the jobs' buffers outlive them
  }

  // Queues fn; returns its job number (0, 1, ...).
  std::size_t submit(std::function<void()> fn) {
    std::size_t job;
    {
      std::lock_guard lock(mutex_);
      job = submitted_++;
      queue_.push_back(std::move(fn));
    }
    wake_.notify_all();
    return job;
  }
  // Blocks until job `job` ran; rethrows the first error any job threw (once).
  void wait(std::size_t job) {
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return done_ > job || error_; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }
  std::size_t submitted() const {
    std::lock_guard lock(mutex_);
    return submitted_;
  }
  // Runs on the worker before each job, with the job's number (tests: hold a job back).
  void set_probe(std::function<void(std::size_t)> probe) {
    std::lock_guard lock(mutex_);
    probe_ = std::move(probe);
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> fn;
      std::function<void(std::size_t)> probe;
      std::size_t job;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, nothing left
        fn = std::move(queue_.front());
        queue_.pop_front();
        job = done_;
        probe = probe_;
      }
      std::exception_ptr err;
      try {
        if (probe) probe(job);
        fn();
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard lock(mutex_);
        ++done_;
        if (err && !error_) error_ = err;
      }
      done_cv_.notify_all();
    }
  }

  mutable std::mutex mutex_;
  std::condition_variable wake_, done_cv_;
  std::deque<std::function<void()>> queue_;
  std::function<void(std::size_t)> probe_;
  std::size_t submitted_ = 0, done_ = 0;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it reads
};

}  // namespace trellis::train
