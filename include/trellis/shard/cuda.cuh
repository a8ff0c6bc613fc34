// shard/ for tensors in CUDA memory (nvcc): LocalOps<Cuda> (strided copies as a kernel, scratch
// buffers, zero fill) and Collectives<Cuda>. Include this next to trellis/shard.hpp; nothing in
// the planner or the steps changes.
//
// Streams: a Tensor<T, R, Cuda> lives on the stream its buffer was made on (the default stream
// for Tensor's constructor), and every local step is enqueued there. A communicator that has a
// stream of its own (NcclComm: stream()/set_stream()) is pointed at that same stream for the
// duration of each call, so collectives and packing kernels are ordered on one stream and the
// host never waits, except for the small host metadata (shapes, fingerprints), which is staged
// through device memory and synchronised.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>
#include <vector>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/cuda_buffer.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/shard/collectives.hpp"
#include "trellis/shard/local_ops.hpp"

namespace trellis::shard {

namespace detail {
template <class T, int R>
struct StridedCopyArgs {
  const T* src;
  T* dst;
  index_t extents[R];
  index_t src_strides[R];
  index_t dst_strides[R];
  index_t total;
};

// One thread per element (grid-stride): the multi-index from the linear one, then both offsets.
template <class T, int R>
__global__ void strided_copy_kernel(StridedCopyArgs<T, R> a) {
  for (index_t i = static_cast<index_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.total;
       i += static_cast<index_t>(gridDim.x) * blockDim.x) {
    index_t rest = i, s = 0, d = 0;
    for (int k = R - 1; k >= 0; --k) {
      const index_t coord = rest % a.extents[k];
      rest /= a.extents[k];
      s += coord * a.src_strides[k];
      d += coord * a.dst_strides[k];
    }
    a.dst[d] = a.src[s];
  }
}
}  // namespace detail

template <>
struct LocalOps<Cuda> {
  // The stream the local steps run on: the default stream, where Tensor<T, R, Cuda> allocates.
  static cudaStream_t stream() { return nullptr; }

  template <class U, class E1, class T, class E2>
  static void copy(const TensorView<U, E1, Cuda>& src, const TensorView<T, E2, Cuda>& dst) {
    static_assert(std::is_same_v<std::remove_const_t<U>, T>, "copy between views of one element type");
    static_assert(E1::rank == E2::rank, "copy between views of one rank");
    constexpr int R = E1::rank;
    if (src.size() == 0) return;
    if (src.is_contiguous() && dst.is_contiguous()) {
      TRELLIS_CHECK_CUDA(cudaMemcpyAsync(dst.data(), src.data(), static_cast<std::size_t>(src.size()) * sizeof(T),
                                         cudaMemcpyDeviceToDevice, stream()));
      return;
    }
    detail::StridedCopyArgs<T, (R > 0 ? R : 1)> a{};
    a.src = src.data();
    a.dst = dst.data();
    a.total = src.size();
    for (int k = 0; k < R; ++k) {
      a.extents[k] = src.extent(k);
      a.src_strides[k] = src.stride(k);
      a.dst_strides[k] = dst.stride(k);
    }
    const int threads = 256;
    const index_t blocks = (a.total + threads - 1) / threads;
    detail::strided_copy_kernel<T, (R > 0 ? R : 1)>
        <<<static_cast<unsigned>(blocks < 65535 ? blocks : 65535), threads, 0, stream()>>>(a);
    TRELLIS_CHECK_CUDA(cudaGetLastError());
  }

  template <class T>
  static Buffer<T, Cuda> scratch(std::size_t count, bool zero) {
    return Buffer<T, Cuda>(count, stream(), zero);
  }

  template <class T>
  static void zero(T* data, std::size_t count) {
    if (count) TRELLIS_CHECK_CUDA(cudaMemsetAsync(data, 0, count * sizeof(T), stream()));
  }
};

template <>
struct Collectives<Cuda> {
  // Runs fn with the communicator on the tensors' stream (when it has a stream of its own).
  template <class C, class Fn>
  static void on_tensor_stream(C& c, Fn&& fn) {
    if constexpr (requires { c.stream(); c.set_stream(cudaStream_t{}); }) {
      const cudaStream_t previous = c.stream();
      c.set_stream(LocalOps<Cuda>::stream());
      try {
        fn();
      } catch (...) {
        c.set_stream(previous);
        throw;
      }
      c.set_stream(previous);
    } else {
      fn();
    }
  }

  template <class C, class T>
  static void all_gather(C& c, const T* in, T* out, std::size_t n) {
    on_tensor_stream(c, [&] { c.all_gather(in, out, n); });
  }
  template <class C, class T>
  static void all_reduce(C& c, const T* in, T* out, std::size_t n, comm::ReduceOp op) {
    on_tensor_stream(c, [&] { c.all_reduce(in, out, n, op); });
  }
  template <class C, class T>
  static void reduce_scatter(C& c, const T* in, T* out, std::size_t n, comm::ReduceOp op) {
    on_tensor_stream(c, [&] { c.reduce_scatter(in, out, n, op); });
  }
  template <class C, class T>
  static void all_to_allv(C& c, const T* in, const std::vector<std::size_t>& send_counts,
                          const std::vector<std::size_t>& send_displs, T* out,
                          const std::vector<std::size_t>& recv_counts, const std::vector<std::size_t>& recv_displs) {
    on_tensor_stream(c, [&] {
      c.all_to_allv(in, std::span<const std::size_t>(send_counts), std::span<const std::size_t>(send_displs), out,
                    std::span<const std::size_t>(recv_counts), std::span<const std::size_t>(recv_displs));
    });
  }
  template <class C, class T>
  static void broadcast(C& c, T* buffer, std::size_t n, int root) {
    on_tensor_stream(c, [&] { c.broadcast(buffer, n, root); });
  }

  // Host metadata: through device memory (device communicators move device buffers only).
  template <class C, class T>
  static void host_all_gather(C& c, const T* in, T* out, std::size_t n) {
    const auto size = static_cast<std::size_t>(c.size());
    Buffer<T, Cuda> dev(n * (size + 1), LocalOps<Cuda>::stream(), false);
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(dev.data(), in, n * sizeof(T), cudaMemcpyHostToDevice, LocalOps<Cuda>::stream()));
    all_gather(c, dev.data(), dev.data() + n, n);
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(out, dev.data() + n, n * size * sizeof(T), cudaMemcpyDeviceToHost,
                                       LocalOps<Cuda>::stream()));
    TRELLIS_CHECK_CUDA(cudaStreamSynchronize(LocalOps<Cuda>::stream()));
  }
  template <class C, class T>
  static void host_broadcast(C& c, T* buffer, std::size_t n, int root) {
    Buffer<T, Cuda> dev(n, LocalOps<Cuda>::stream(), false);
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(dev.data(), buffer, n * sizeof(T), cudaMemcpyHostToDevice, LocalOps<Cuda>::stream()));
    broadcast(c, dev.data(), n, root);
    TRELLIS_CHECK_CUDA(cudaMemcpyAsync(buffer, dev.data(), n * sizeof(T), cudaMemcpyDeviceToHost, LocalOps<Cuda>::stream()));
    TRELLIS_CHECK_CUDA(cudaStreamSynchronize(LocalOps<Cuda>::stream()));
  }
};

}  // namespace trellis::shard
