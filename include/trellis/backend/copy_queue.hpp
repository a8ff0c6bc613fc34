// A copy queue: copies between a backend's memory and host memory that run beside the compute,
// each one a ticket the compute waits on only when it needs the copy's result (offloaded saved
// activations: nn/activation_arena.hpp). One interface, one implementation per memory space:
//   - backend::HostCopyQueue (here; host-memory backends: Host<float>, Host<bfloat16>,
//     DeviceChecked): one worker thread and a FIFO of copy jobs. enqueue() returns a ticket at
//     once, wait(ticket) blocks the caller until that job is done (jobs finish in FIFO order) and
//     rethrows an exception the job (or an earlier one nobody waited for) threw; the destructor
//     drains the FIFO and joins. A job runs the backend's own upload/download (DeviceChecked's
//     checks apply on the worker). Optionally a SIMULATED link: each copy is held until
//     latency + bytes / bandwidth has passed since it started, so host tests and benches can make
//     copies take real time; and a record of every job's (start, end), so tests measure overlap.
//   - backend::CudaCopyQueue (backend/cuda_copy_queue.hpp): a non-blocking copy stream;
//     cudaMemcpyAsync between pinned host memory (cudaHostAlloc) and device memory, each copy
//     after an event recorded on the compute stream when it was enqueued, its end an event the
//     compute stream waits on (cudaStreamWaitEvent): wait() does not block the host there.
// What a user of the queue calls (copy_queue_t<B> is the queue for backend B):
//   q.to_host(be, host_dst, dev_src, bytes) / q.to_device(be, dev_dst, host_src, bytes) -> ticket
//     (after everything already issued on be's compute stream);
//   q.wait(be, ticket): compute issued on be from now on runs after that copy;
//   q.drain(): every copy issued so far has finished (host-blocking);
//   Q::host_memory Q::allocate_host(bytes): host memory the copies run from (pinned on CUDA).
// Why our own (docs/backend.md): header-only, no dependency, and on the host a thread and a FIFO
// are all the ordering the arena needs.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "trellis/core/error.hpp"

namespace trellis::backend {

// A SIMULATED host link (tests, benches): each copy takes at least latency + bytes / bandwidth
// seconds from its start. bandwidth 0: no hold (memcpy speed).
struct SimulatedCopyLink {
  double bandwidth = 0;  // bytes per second
  double latency = 0;    // seconds
};

// One finished job of a recording queue: steady_clock seconds since the queue was made.
struct CopyRecord {
  std::uint64_t ticket = 0;
  std::size_t bytes = 0;
  double start = 0, end = 0;
};

// Host memory the copies run from, owned (pageable host memory; the CUDA queue's is pinned).
class HostBytes {
 public:
  HostBytes() = default;
  explicit HostBytes(std::size_t n) : data_(n ? std::make_unique<std::uint8_t[]>(n) : nullptr), size_(n) {}
  std::uint8_t* data() { return data_.get(); }
  const std::uint8_t* data() const { return data_.get(); }
  std::size_t size() const { return size_; }

 private:
  std::unique_ptr<std::uint8_t[]> data_;
  std::size_t size_ = 0;
};

class HostCopyQueue {
 public:
  using ticket = std::uint64_t;  // 0: no copy (waiting on it returns at once)
  using host_memory = HostBytes;

  explicit HostCopyQueue(SimulatedCopyLink link = {}) : link_(link), epoch_(std::chrono::steady_clock::now()) {
    TRELLIS_CHECK(link.bandwidth >= 0 && link.latency >= 0, "HostCopyQueue: a simulated link needs bandwidth >= 0 and "
                  "latency >= 0 (got ", link.bandwidth, " B/s, ", link.latency, " s)");
    worker_ = std::thread([this] { run(); });
  }
  HostCopyQueue(const HostCopyQueue&) = delete;
  HostCopyQueue& operator=(const HostCopyQueue&) = delete;
  // Drains: every job enqueued runs (its error, if any, is dropped), then the worker joins.
  ~HostCopyQueue() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    wake_.notify_all();
    worker_.join();
  }

  static host_memory allocate_host(std::size_t bytes) { return host_memory(bytes); }

  // A job of `bytes` (what the simulated link charges) after every job enqueued before it.
  ticket enqueue(std::function<void()> job, std::size_t bytes = 0) {
    std::lock_guard lock(mu_);
    jobs_.push_back(Job{++issued_, bytes, std::move(job)});
    wake_.notify_all();
    return issued_;
  }
  ticket enqueue_copy(void* dst, const void* src, std::size_t bytes) {
    return enqueue([dst, src, bytes] { if (bytes) std::memcpy(dst, src, bytes); }, bytes);
  }
  // The backend-generic calls (see above): the copy through be's own upload / download.
  template <class B>
  ticket to_host(const B& be, void* dst, const void* src, std::size_t bytes) {
    return enqueue([be, dst, src, bytes] { be.download(static_cast<std::uint8_t*>(dst), static_cast<const std::uint8_t*>(src), bytes); },
                   bytes);
  }
  template <class B>
  ticket to_device(const B& be, void* dst, const void* src, std::size_t bytes) {
    return enqueue([be, dst, src, bytes] { be.upload(static_cast<std::uint8_t*>(dst), static_cast<const std::uint8_t*>(src), bytes); },
                   bytes);
  }
  template <class B>
  void wait(const B&, ticket t) { wait(t); }

  // Blocks until job t (and so every job before it) is done; rethrows the first error of a job up
  // to t that no wait has rethrown yet.
  void wait(ticket t) {
    std::unique_lock lock(mu_);
    TRELLIS_CHECK(t <= issued_, "HostCopyQueue: wait on ticket ", t, " of ", issued_, " issued");
    done_cv_.wait(lock, [&] { return completed_ >= t; });
    if (!errors_.empty() && errors_.begin()->first <= t) {
      std::exception_ptr e = errors_.begin()->second;
      errors_.erase(errors_.begin());
      std::rethrow_exception(e);
    }
  }
  bool done(ticket t) const {
    std::lock_guard lock(mu_);
    return completed_ >= t;
  }
  void drain() { wait(issued()); }
  ticket issued() const {
    std::lock_guard lock(mu_);
    return issued_;
  }

  // Tests and benches: the SIMULATED link's settings from the next job on, and a record of
  // every job run from now on (start and end seconds since the queue was made).
  void set_simulated_link(SimulatedCopyLink link) {
    std::lock_guard lock(mu_);
    link_ = link;
  }
  void set_recording(bool on) {
    std::lock_guard lock(mu_);
    recording_ = on;
  }
  std::vector<CopyRecord> records() const {
    std::lock_guard lock(mu_);
    return records_;
  }
  double seconds_since_start() const { return seconds(std::chrono::steady_clock::now()); }

 private:
  struct Job {
    ticket id;
    std::size_t bytes;
    std::function<void()> run;
  };
  double seconds(std::chrono::steady_clock::time_point t) const {
    return std::chrono::duration<double>(t - epoch_).count();
  }
  void run() {
    std::unique_lock lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stop_ and drained
      Job job = std::move(jobs_.front());
      jobs_.pop_front();
      const SimulatedCopyLink link = link_;
      lock.unlock();
      const auto start = std::chrono::steady_clock::now();
      std::exception_ptr error;
      try {
        job.run();
      } catch (...) {
        error = std::current_exception();
      }
      if (link.bandwidth > 0 || link.latency > 0) {  // SIMULATED: held until the modelled time has passed
        const double hold = link.latency + (link.bandwidth > 0 ? static_cast<double>(job.bytes) / link.bandwidth : 0.0);
        std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                  std::chrono::duration<double>(hold)));
      }
      const auto end = std::chrono::steady_clock::now();
      lock.lock();
      if (error) errors_.emplace(job.id, error);
      if (recording_) records_.push_back(CopyRecord{job.id, job.bytes, seconds(start), seconds(end)});
      completed_ = job.id;
      done_cv_.notify_all();
    }
  }

  mutable std::mutex mu_;
  std::condition_variable wake_, done_cv_;
  std::deque<Job> jobs_;
  std::map<ticket, std::exception_ptr> errors_;  // by ticket, until a wait rethrows them
  ticket issued_ = 0, completed_ = 0;
  bool stop_ = false, recording_ = false;
  SimulatedCopyLink link_;
  std::vector<CopyRecord> records_;
  std::chrono::steady_clock::time_point epoch_;
  std::thread worker_;  // last: starts after every member it reads is made
};

// The copy queue of backend B: the host one for every host-memory backend; backend::Cuda's is
// declared in backend/cuda_copy_queue.hpp (which backend/cuda.cuh includes).
template <class B>
struct copy_queue_of {
  using type = HostCopyQueue;
};
template <class B>
using copy_queue_t = typename copy_queue_of<B>::type;

}  // namespace trellis::backend
