// Owning CUDA device buffers, stream-ordered: allocated with cudaMallocAsync on the stream given
// at construction and freed on that stream, so no device-wide synchronisation is implied.
// Needs the CUDA runtime (trellis::cuda); compiles with g++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "trellis/core/buffer.hpp"
#include "trellis/core/check_cuda.hpp"

namespace trellis {

template <class T>
class Buffer<T, Cuda> {
  static_assert(std::is_trivially_copyable_v<T>, "Buffer holds trivially copyable elements");

 public:
  using value_type = T;
  using space = Cuda;

  Buffer() = default;
  // Allocates `count` elements on `stream`; zero-filled (on the stream) unless `zero` is false.
  explicit Buffer(std::size_t count, cudaStream_t stream = nullptr, bool zero = true)
      : count_(count), stream_(stream) {
    if (count == 0) return;
    void* p = nullptr;
    TRELLIS_CHECK_CUDA(cudaMallocAsync(&p, count * sizeof(T), stream));
    data_ = static_cast<T*>(p);
    if (zero) TRELLIS_CHECK_CUDA(cudaMemsetAsync(p, 0, count * sizeof(T), stream));
  }
  Buffer(Buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        count_(std::exchange(other.count_, 0)),
        stream_(other.stream_) {}
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
      stream_ = other.stream_;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { release(); }

  T* data() noexcept { return data_; }
  const T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return count_; }
  bool empty() const noexcept { return count_ == 0; }
  cudaStream_t stream() const noexcept { return stream_; }

  // Host <-> device copies, ordered on the buffer's stream.
  void copy_from_host(const T* src, std::size_t count) {
    TRELLIS_CHECK_LE(count, count_, "copy_from_host larger than the buffer");
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(data_, src, count * sizeof(T), cudaMemcpyHostToDevice, stream_));
  }
  void copy_to_host(T* dst, std::size_t count) const {
    TRELLIS_CHECK_LE(count, count_, "copy_to_host larger than the buffer");
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(dst, data_, count * sizeof(T), cudaMemcpyDeviceToHost, stream_));
  }

 private:
  void release() noexcept {
    if (data_) (void)cudaFreeAsync(data_, stream_);  // destructor: never throws
    data_ = nullptr;
    count_ = 0;
  }

  T* data_ = nullptr;
  std::size_t count_ = 0;
  cudaStream_t stream_ = nullptr;
};

}  // namespace trellis
