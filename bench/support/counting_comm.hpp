// CountingComm<C>: a Communicator that forwards every call to C and counts, per communicator, the
// calls and the bytes this rank puts on the wire under the usual algorithms (ring collectives,
// p = size()): all_reduce 2(p-1)/p x payload, reduce_scatter and all_gather (p-1) x the per-rank
// block, all_to_all (p-1)/p x the send buffer, broadcast/reduce the payload, send/isend and a
// batch's sends their payload, receives nothing. Copies made by split() get their own counters,
// so a Mesh's dp, tp and pp communicators can be read separately after a step. The counters are
// plain integers updated by the rank's own thread (async operations are counted when started).
// A bench tool, not library API.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>

#include "trellis/comm/communicator.hpp"

namespace trellis::bench {

struct CommCounters {
  std::uint64_t calls = 0;
  double bytes = 0;  // bytes this rank sends under the ring model above
};

template <class C>
class CountingComm {
 public:
  using request_type = typename C::request_type;
  using space = typename C::space;

  explicit CountingComm(C inner) : inner_(std::move(inner)), counters_(std::make_shared<CommCounters>()) {}

  const CommCounters& counters() const { return *counters_; }
  void reset_counters() { *counters_ = {}; }
  C& inner() { return inner_; }

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  void set_timeout(std::chrono::milliseconds t) { inner_.set_timeout(t); }

  template <class T>
  void all_reduce(const T* in, T* out, std::size_t n, comm::ReduceOp op = comm::ReduceOp::sum) {
    count_ring_all_reduce<T>(n);
    inner_.all_reduce(in, out, n, op);
  }
  template <class T>
  void reduce(const T* in, T* out, std::size_t n, comm::ReduceOp op, int root) {
    count<T>(n);
    inner_.reduce(in, out, n, op, root);
  }
  template <class T>
  void broadcast(T* buffer, std::size_t n, int root) {
    count<T>(rank() == root ? n : 0);
    inner_.broadcast(buffer, n, root);
  }
  template <class T>
  void all_gather(const T* in, T* out, std::size_t n) {
    count<T>(n * static_cast<std::size_t>(size() - 1));
    inner_.all_gather(in, out, n);
  }
  template <class T>
  void reduce_scatter(const T* in, T* out, std::size_t n, comm::ReduceOp op = comm::ReduceOp::sum) {
    count<T>(n * static_cast<std::size_t>(size() - 1));
    inner_.reduce_scatter(in, out, n, op);
  }
  template <class T>
  void all_to_all(const T* in, T* out, std::size_t n) {
    count<T>(n * static_cast<std::size_t>(size() - 1));
    inner_.all_to_all(in, out, n);
  }
  template <class T>
  void all_to_allv(const T* in, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                   T* out, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs) {
    std::size_t n = 0;
    for (std::size_t j = 0; j < send_counts.size(); ++j)
      if (static_cast<int>(j) != rank()) n += send_counts[j];
    count<T>(n);
    inner_.all_to_allv(in, send_counts, send_displs, out, recv_counts, recv_displs);
  }
  template <class T>
  void send(const T* buffer, std::size_t n, int peer, int tag = 0) {
    count<T>(n);
    inner_.send(buffer, n, peer, tag);
  }
  template <class T>
  void recv(T* buffer, std::size_t n, int peer, int tag = 0) {
    count<T>(0);
    inner_.recv(buffer, n, peer, tag);
  }
  void barrier() {
    ++counters_->calls;
    inner_.barrier();
  }
  template <class T>
  request_type all_reduce_async(const T* in, T* out, std::size_t n, comm::ReduceOp op = comm::ReduceOp::sum) {
    count_ring_all_reduce<T>(n);
    return inner_.all_reduce_async(in, out, n, op);
  }
  template <class T>
  request_type all_gather_async(const T* in, T* out, std::size_t n) {
    count<T>(n * static_cast<std::size_t>(size() - 1));
    return inner_.all_gather_async(in, out, n);
  }
  template <class T>
  request_type reduce_scatter_async(const T* in, T* out, std::size_t n, comm::ReduceOp op = comm::ReduceOp::sum) {
    count<T>(n * static_cast<std::size_t>(size() - 1));
    return inner_.reduce_scatter_async(in, out, n, op);
  }
  template <class T>
  request_type isend(const T* buffer, std::size_t n, int peer, int tag = 0) {
    count<T>(n);
    return inner_.isend(buffer, n, peer, tag);
  }
  template <class T>
  request_type irecv(T* buffer, std::size_t n, int peer, int tag = 0) {
    count<T>(0);
    return inner_.irecv(buffer, n, peer, tag);
  }
  request_type batch(std::span<const comm::P2POp> ops) {
    ++counters_->calls;
    for (const auto& op : ops)
      if (op.kind == comm::P2POp::Kind::send) counters_->bytes += static_cast<double>(op.count * dtype_size(op.dtype));
    return inner_.batch(ops);
  }
  CountingComm split(int color, int key) { return CountingComm(inner_.split(color, key)); }

 private:
  template <class T>
  void count(std::size_t elements) {
    ++counters_->calls;
    counters_->bytes += static_cast<double>(elements * sizeof(T));
  }
  template <class T>
  void count_ring_all_reduce(std::size_t n) {
    ++counters_->calls;
    const double p = size();
    counters_->bytes += 2.0 * (p - 1) / p * static_cast<double>(n * sizeof(T));
  }

  C inner_;
  std::shared_ptr<CommCounters> counters_;
};

}  // namespace trellis::bench
