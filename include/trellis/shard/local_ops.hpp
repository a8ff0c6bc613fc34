// Local (no communication) data movement used by redistribute: strided copies between views of
// equal extents, scratch buffers and zero fill. One specialisation per memory space; the host one
// is here.
// CUDA seam: a LocalOps<Cuda> specialisation (shard/local_ops_cuda.cuh, nvcc) provides the same
// three functions as kernels on a stream, and Collectives<Cuda> (shard/redistribute.hpp) passes
// that stream to the NCCL communicator, so no step of a plan changes.
#pragma once

#include <cstddef>
#include <cstring>
#include <type_traits>

#include "trellis/core/buffer.hpp"
#include "trellis/core/space.hpp"
#include "trellis/core/tensor.hpp"

namespace trellis::shard {

template <class Space>
struct LocalOps;  // specialised per memory space

template <>
struct LocalOps<Host> {
  // dst = src, element by element; extents must match (callers guarantee it).
  template <class U, class E1, class T, class E2>
  static void copy(const TensorView<U, E1, Host>& src, const TensorView<T, E2, Host>& dst) {
    static_assert(std::is_same_v<std::remove_const_t<U>, T>, "copy between views of one element type");
    static_assert(E1::rank == E2::rank, "copy between views of one rank");
    if (src.size() == 0) return;
    if constexpr (E1::rank == 0) {
      *dst.data() = *src.data();
      return;
    }
    if (src.is_contiguous() && dst.is_contiguous()) {
      std::memcpy(static_cast<void*>(dst.data()), static_cast<const void*>(src.data()),
                  static_cast<std::size_t>(src.size()) * sizeof(T));
      return;
    }
    copy_dims<0>(src.data(), dst.data(), src, dst);
  }

  // Packing space for the collectives; zero-filled when asked (padding that gets reduced).
  template <class T>
  static Buffer<T, Host> scratch(std::size_t count, bool zero) {
    return Buffer<T, Host>(count, zero);
  }

  template <class T>
  static void zero(T* data, std::size_t count) {
    if (count) std::memset(static_cast<void*>(data), 0, count * sizeof(T));
  }

 private:
  // Recurse over dimensions; the last one is a memcpy when both sides are dense along it.
  template <int D, class U, class E1, class T, class E2>
  static void copy_dims(U* s, T* d, const TensorView<U, E1, Host>& src, const TensorView<T, E2, Host>& dst) {
    const index_t n = src.extent(D);
    if constexpr (D == E1::rank - 1) {
      if (src.stride(D) == 1 && dst.stride(D) == 1) {
        std::memcpy(static_cast<void*>(d), static_cast<const void*>(s), static_cast<std::size_t>(n) * sizeof(T));
      } else {
        for (index_t i = 0; i < n; ++i) d[i * dst.stride(D)] = s[i * src.stride(D)];
      }
    } else {
      for (index_t i = 0; i < n; ++i)
        copy_dims<D + 1>(s + i * src.stride(D), d + i * dst.stride(D), src, dst);
    }
  }
};

}  // namespace trellis::shard
