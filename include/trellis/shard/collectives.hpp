// The communicator calls of shard/, per memory space: the collectives on tensor data, and two
// helpers for small host-side metadata (shapes, layout fingerprints). The host versions call the
// communicator directly; shard/cuda.cuh adds the Cuda versions (the tensor's stream, device
// staging of metadata for NCCL).
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/space.hpp"

namespace trellis::shard {

template <class Space>
struct Collectives;  // specialised per memory space

template <>
struct Collectives<Host> {
  template <class C, class T>
  static void all_gather(C& c, const T* in, T* out, std::size_t n) { c.all_gather(in, out, n); }
  template <class C, class T>
  static void all_reduce(C& c, const T* in, T* out, std::size_t n, comm::ReduceOp op) {
    c.all_reduce(in, out, n, op);
  }
  template <class C, class T>
  static void reduce_scatter(C& c, const T* in, T* out, std::size_t n, comm::ReduceOp op) {
    c.reduce_scatter(in, out, n, op);
  }
  template <class C, class T>
  static void all_to_allv(C& c, const T* in, const std::vector<std::size_t>& send_counts,
                          const std::vector<std::size_t>& send_displs, T* out,
                          const std::vector<std::size_t>& recv_counts, const std::vector<std::size_t>& recv_displs) {
    c.all_to_allv(in, std::span<const std::size_t>(send_counts), std::span<const std::size_t>(send_displs), out,
                  std::span<const std::size_t>(recv_counts), std::span<const std::size_t>(recv_displs));
  }
  template <class C, class T>
  static void broadcast(C& c, T* buffer, std::size_t n, int root) { c.broadcast(buffer, n, root); }

  // Metadata living in host memory whatever the tensor's space.
  template <class C, class T>
  static void host_all_gather(C& c, const T* in, T* out, std::size_t n) { c.all_gather(in, out, n); }
  template <class C, class T>
  static void host_broadcast(C& c, T* buffer, std::size_t n, int root) { c.broadcast(buffer, n, root); }
};

}  // namespace trellis::shard
