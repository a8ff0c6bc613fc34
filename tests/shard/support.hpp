// Test support for shard/: a counting mock communicator (one rank) that satisfies the
// Communicator concept, so trellis::comm::Mesh and redistribute run on it unchanged.
#pragma once

#include <array>
#include <cstddef>
#include <cstring>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace shard_test {

// One rank; every collective copies (that is its meaning on one rank) and is counted.
struct CountingRequest {
  void wait() {}
  bool test() { return true; }
};

struct CountingComm {
  using request_type = CountingRequest;
  using space = trellis::Host;
  struct Counts {
    int all_reduce = 0, all_gather = 0, reduce_scatter = 0, all_to_all = 0, broadcast = 0, other = 0;
    int total() const { return all_reduce + all_gather + reduce_scatter + all_to_all + broadcast + other; }
  };
  Counts* counts;

  int rank() const { return 0; }
  int size() const { return 1; }
  template <class T> static void copy(const T* in, T* out, std::size_t n) {
    if (n && in != out) std::memcpy(static_cast<void*>(out), static_cast<const void*>(in), n * sizeof(T));
  }
  template <class T> void all_reduce(const T* in, T* out, std::size_t n, trellis::comm::ReduceOp) { ++counts->all_reduce; copy(in, out, n); }
  template <class T> void reduce(const T* in, T* out, std::size_t n, trellis::comm::ReduceOp, int) { ++counts->other; copy(in, out, n); }
  template <class T> void broadcast(T*, std::size_t, int) { ++counts->broadcast; }
  template <class T> void all_gather(const T* in, T* out, std::size_t n) { ++counts->all_gather; copy(in, out, n); }
  template <class T> void reduce_scatter(const T* in, T* out, std::size_t n, trellis::comm::ReduceOp) { ++counts->reduce_scatter; copy(in, out, n); }
  template <class T> void all_to_all(const T* in, T* out, std::size_t n) { ++counts->all_to_all; copy(in, out, n); }
  template <class T>
  void all_to_allv(const T* in, std::span<const std::size_t> sc, std::span<const std::size_t> sd, T* out,
                   std::span<const std::size_t>, std::span<const std::size_t> rd) {
    ++counts->all_to_all;
    copy(in + sd[0], out + rd[0], sc[0]);
  }
  template <class T> void send(const T*, std::size_t, int, int) { ++counts->other; }
  template <class T> void recv(T*, std::size_t, int, int) { ++counts->other; }
  void barrier() { ++counts->other; }
  template <class T> CountingRequest all_reduce_async(const T* in, T* out, std::size_t n, trellis::comm::ReduceOp op) { all_reduce(in, out, n, op); return {}; }
  template <class T> CountingRequest all_gather_async(const T* in, T* out, std::size_t n) { all_gather(in, out, n); return {}; }
  template <class T> CountingRequest reduce_scatter_async(const T* in, T* out, std::size_t n, trellis::comm::ReduceOp op) { reduce_scatter(in, out, n, op); return {}; }
  template <class T> CountingRequest isend(const T*, std::size_t, int, int) { ++counts->other; return {}; }
  template <class T> CountingRequest irecv(T*, std::size_t, int, int) { ++counts->other; return {}; }
  CountingRequest batch(std::span<const trellis::comm::P2POp>) { ++counts->other; return {}; }
  CountingComm split(int, int) { return CountingComm{counts}; }
  void set_timeout(std::chrono::milliseconds) {}
};
static_assert(trellis::comm::Communicator<CountingComm>);

}  // namespace shard_test
