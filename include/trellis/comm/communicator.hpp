// The Communicator concept: the one set of collective and point-to-point operations that every
// engine (thread ranks, MPI, NCCL) implements with the same semantics. Layers above (shard, pipe,
// nn, train) are templates over a Communicator and never name a backend.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>

#include "trellis/core/dtype.hpp"
#include "trellis/core/space.hpp"

namespace trellis::comm {

enum class ReduceOp : std::uint8_t { sum, avg, min, max, prod };

constexpr const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::prod: return "prod";
  }
  return "?";
}

// A handle to an operation in flight: wait() blocks until it completes (and rethrows its error),
// test() polls. Each backend has its own concrete request type (no virtual calls).
template <class R>
concept Request = std::movable<R> && requires(R& r) {
  r.wait();
  { r.test() } -> std::convertible_to<bool>;
};

// One entry of a batched point-to-point exchange (all entries start together; NCCL: a group).
struct P2POp {
  enum class Kind : std::uint8_t { send, recv };
  Kind kind;
  void* buffer;        // const data for sends
  std::size_t count;   // elements
  DType dtype;
  int peer;
  int tag = 0;
};

// Semantics shared by every backend (n is always an element count):
//  all_reduce(in, out, n, op)      out = op over ranks of in; in == out is in place.
//  reduce(in, out, n, op, root)    as all_reduce, result only at root.
//  broadcast(buf, n, root)         root's buf to every rank.
//  all_gather(in, out, n)          out (size()*n) = concatenation of every rank's in (n), rank
//                                  order; in == out + rank()*n is in place.
//  reduce_scatter(in, out, n, op)  in holds size()*n; rank r gets block r of the reduction.
//  all_to_all(in, out, n)          block j of in (n elements) goes to rank j's block rank().
//  all_to_allv(in, send_counts, send_displs, out, recv_counts, recv_displs)  uneven version.
//  send/recv(buf, n, peer, tag)    blocking point to point; isend/irecv return a Request.
//  batch(ops)                      starts all P2P ops together, returns one Request.
//  barrier()
//  *_async(...)                    the collective started, a Request returned; buffers must stay
//                                  valid and untouched until wait().
//  split(color, key)               sub-communicator of the ranks with the same color, ordered
//                                  by key then rank (MPI_Comm_split semantics).
// avg divides the sum by size() after reducing (integers: truncating division).
// Every communicator names the memory space of the buffers it takes (C::space: Host for thread
// ranks and MPI, Cuda for NCCL), so a layer can check at compile time that its compute backend
// and its communicator agree (backend::CompatibleWith). Requests also have wait_on(stream): the
// stream waits for the operation (NCCL: an event; host: a plain wait on HostStream).
template <class C>
concept Communicator = MemorySpace<typename C::space> && requires(C& c, const C& cc, const float* in, float* out, std::size_t n,
                                int peer, ReduceOp op, std::span<const std::size_t> counts,
                                std::span<const P2POp> ops, std::chrono::milliseconds timeout) {
  typename C::request_type;
  requires Request<typename C::request_type>;
  { cc.rank() } -> std::same_as<int>;
  { cc.size() } -> std::same_as<int>;
  c.all_reduce(in, out, n, op);
  c.reduce(in, out, n, op, peer);
  c.broadcast(out, n, peer);
  c.all_gather(in, out, n);
  c.reduce_scatter(in, out, n, op);
  c.all_to_all(in, out, n);
  c.all_to_allv(in, counts, counts, out, counts, counts);
  c.send(in, n, peer, 0);
  c.recv(out, n, peer, 0);
  c.barrier();
  { c.all_reduce_async(in, out, n, op) } -> std::same_as<typename C::request_type>;
  { c.all_gather_async(in, out, n) } -> std::same_as<typename C::request_type>;
  { c.reduce_scatter_async(in, out, n, op) } -> std::same_as<typename C::request_type>;
  { c.isend(in, n, peer, 0) } -> std::same_as<typename C::request_type>;
  { c.irecv(out, n, peer, 0) } -> std::same_as<typename C::request_type>;
  { c.batch(ops) } -> std::same_as<typename C::request_type>;
  { c.split(peer, peer) } -> std::same_as<C>;
  c.set_timeout(timeout);
};

}  // namespace trellis::comm
