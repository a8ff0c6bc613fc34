// backend::CudaCopyQueue: backend::Cuda's copy queue (the interface: backend/copy_queue.hpp). A
// non-blocking stream of its own for the copies; each copy waits on an event recorded on the
// compute stream when it is enqueued (so it reads, or overwrites, device memory only after the
// compute issued before it), runs as cudaMemcpyAsync between pinned host memory (PinnedBytes,
// cudaHostAlloc: asynchronous DMA, no staging) and device memory, and ends with an event that
// wait() makes the compute stream wait on (cudaStreamWaitEvent; the host does not block). The
// copies keep FIFO order on their stream. Host code only: compiles with g++ and the toolkit.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <type_traits>
#include <utility>

#include "trellis/backend/copy_queue.hpp"
#include "trellis/core/check_cuda.hpp"
#include "trellis/core/error.hpp"

namespace trellis::backend {

class Cuda;

// Pinned (page-locked) host memory, RAII: cudaHostAlloc / cudaFreeHost.
class PinnedBytes {
 public:
  PinnedBytes() = default;
  explicit PinnedBytes(std::size_t n) : size_(n) {
    if (n == 0) return;
    void* p = nullptr;
    TRELLIS_CHECK_CUDA(cudaHostAlloc(&p, n, cudaHostAllocDefault));
    data_.reset(static_cast<std::uint8_t*>(p));
  }
  std::uint8_t* data() { return data_.get(); }
  const std::uint8_t* data() const { return data_.get(); }
  std::size_t size() const { return size_; }

 private:
  struct Free {
    void operator()(std::uint8_t* p) const { (void)cudaFreeHost(p); }
  };
  std::unique_ptr<std::uint8_t, Free> data_;
  std::size_t size_ = 0;
};

class CudaCopyQueue {
 public:
  using ticket = std::uint64_t;  // 0: no copy
  using host_memory = PinnedBytes;

  // The simulated link is a host-backend seam: a GPU's copies take the time they take.
  explicit CudaCopyQueue(SimulatedCopyLink link = {}) {
    TRELLIS_CHECK(link.bandwidth == 0 && link.latency == 0,
                  "CudaCopyQueue: a simulated copy link is for host backends only (the GPU copies for real)");
    TRELLIS_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  CudaCopyQueue(const CudaCopyQueue&) = delete;
  CudaCopyQueue& operator=(const CudaCopyQueue&) = delete;
  // Drains (the host memory and device frames the copies use are freed after the queue).
  ~CudaCopyQueue() {
    if (!stream_) return;
    (void)cudaStreamSynchronize(stream_);
    for (auto& [t, e] : done_) (void)cudaEventDestroy(e);
    (void)cudaStreamDestroy(stream_);
  }

  static host_memory allocate_host(std::size_t bytes) { return host_memory(bytes); }
  cudaStream_t stream() const { return stream_; }

  template <class B>
  ticket to_host(const B& be, void* dst, const void* src, std::size_t bytes) {
    return copy(be.stream(), dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  template <class B>
  ticket to_device(const B& be, void* dst, const void* src, std::size_t bytes) {
    return copy(be.stream(), dst, src, bytes, cudaMemcpyHostToDevice);
  }
  // Work issued on be's stream from now on runs after copy t (a no-op once it is known done).
  template <class B>
  void wait(const B& be, ticket t) {
    for (auto& [id, e] : done_)
      if (id == t) {
        TRELLIS_CHECK_CUDA(cudaStreamWaitEvent(be.stream(), e, 0));
        return;
      }
  }
  // Host-blocking: every copy issued so far has finished.
  void drain() { TRELLIS_CHECK_CUDA(cudaStreamSynchronize(stream_)); }

 private:
  ticket copy(cudaStream_t compute, void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    retire();
    cudaEvent_t after_compute = nullptr, done = nullptr;
    TRELLIS_CHECK_CUDA(cudaEventCreateWithFlags(&after_compute, cudaEventDisableTiming));
    TRELLIS_CHECK_CUDA(cudaEventRecord(after_compute, compute));
    TRELLIS_CHECK_CUDA(cudaStreamWaitEvent(stream_, after_compute, 0));
    (void)cudaEventDestroy(after_compute);  // released once the wait above has been satisfied
    if (bytes) TRELLIS_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, kind, stream_));
    TRELLIS_CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    TRELLIS_CHECK_CUDA(cudaEventRecord(done, stream_));
    done_.emplace_back(++issued_, done);
    return issued_;
  }
  // Copies finish in FIFO order: drop the events of those known done (their waits are no-ops).
  void retire() {
    while (!done_.empty()) {
      const cudaError_t s = cudaEventQuery(done_.front().second);
      if (s == cudaErrorNotReady) return;
      TRELLIS_CHECK_CUDA(s);
      (void)cudaEventDestroy(done_.front().second);
      done_.pop_front();
    }
  }

  cudaStream_t stream_ = nullptr;
  std::deque<std::pair<ticket, cudaEvent_t>> done_;  // copies not known done yet, oldest first
  ticket issued_ = 0;
};

template <>
struct copy_queue_of<Cuda> {
  using type = CudaCopyQueue;
};

}  // namespace trellis::backend
