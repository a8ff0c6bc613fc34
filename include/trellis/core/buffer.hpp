// Owning host buffers: aligned to TRELLIS_HOST_ALIGNMENT, move-only, value-initialised on request.
// The CUDA specialisation (stream-ordered) lives in core/cuda_buffer.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <utility>

#include "trellis/core/config.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/space.hpp"

namespace trellis {

template <class T, class Space = Host>
class Buffer;

template <class T>
class Buffer<T, Host> {
  static_assert(std::is_trivially_copyable_v<T>, "Buffer holds trivially copyable elements");

 public:
  using value_type = T;
  using space = Host;

  Buffer() = default;
  // Allocates `count` elements; zero-filled unless `zero` is false.
  explicit Buffer(std::size_t count, bool zero = true) : count_(count) {
    if (count == 0) return;
    TRELLIS_CHECK(count <= SIZE_MAX / sizeof(T), "buffer of ", count, " elements overflows");
    std::size_t bytes = round_up(count * sizeof(T));
    data_ = static_cast<T*>(::operator new(bytes, std::align_val_t{TRELLIS_HOST_ALIGNMENT}));
    if (zero) std::memset(static_cast<void*>(data_), 0, count * sizeof(T));
  }
  Buffer(Buffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      count_ = std::exchange(other.count_, 0);
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
  T& operator[](std::size_t i) noexcept { return data_[i]; }
  const T& operator[](std::size_t i) const noexcept { return data_[i]; }
  T* begin() noexcept { return data_; }
  T* end() noexcept { return data_ + count_; }
  const T* begin() const noexcept { return data_; }
  const T* end() const noexcept { return data_ + count_; }
  std::span<T> span() noexcept { return {data_, count_}; }
  std::span<const T> span() const noexcept { return {data_, count_}; }

 private:
  static std::size_t round_up(std::size_t bytes) {
    constexpr std::size_t a = TRELLIS_HOST_ALIGNMENT;
    return (bytes + a - 1) / a * a;
  }
  void release() noexcept {
    if (data_) ::operator delete(static_cast<void*>(data_), std::align_val_t{TRELLIS_HOST_ALIGNMENT});
    data_ = nullptr;
    count_ = 0;
  }

  T* data_ = nullptr;
  std::size_t count_ = 0;
};

}  // namespace trellis
