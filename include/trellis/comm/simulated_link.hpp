// comm::SimulatedLink<Inner>: a Communicator that makes every operation of an inner communicator
// take as long as it would on a link of a given bandwidth and latency -- so that, on the host,
// overlapping communication with compute is MEASURED (a faster step), not counted.
//
//   world.run([&](comm::ThreadComm& c) {
//     comm::SimulatedLink<comm::ThreadComm> link(c.split(0, c.rank()), {.bandwidth = 1e9, .latency = 20e-6});
//     train::Trainer<comm::SimulatedLink<comm::ThreadComm>> t(link, cfg);   // every sub-communicator too
//   });
//
// What it is: a simulation on the host. The data still moves through the inner communicator
// (results are exactly the inner communicator's); the wrapper only holds each operation back
// until its modelled transfer is over:
//   transfer time = latency + bytes_on_the_wire / bandwidth           (0 in a group of one rank)
// with bytes on the wire per rank the standard ring cost (the nccl-tests busbw factors, so
// `bandwidth` is a bus bandwidth in the literature's sense), for a message of S bytes:
//   all_reduce 2(n-1)/n S;  all_gather, reduce_scatter, all_to_all (n-1)/n S_total (S_total: the
//   gathered output / the full input, n blocks);  reduce, broadcast S;  all_to_allv: the larger
//   of what this rank sends to and receives from the others;  send / recv: S;  batch: the larger
//   of its sends and its receives (a full-duplex link);  barrier: latency only.
// Timing:
//  - blocking operations forward to the inner communicator, then sleep until the deadline;
//  - *_async, isend, irecv and batch forward and return at once: the request records the
//    deadline, and wait()/test() complete only when both the inner operation and the deadline
//    are done. Compute between start and wait() therefore overlaps the modelled transfer, as a
//    real link's DMA engine would; a caller that waits at once pays the full time.
//  - One link per communicator, and transfers on it are serialised: an operation's transfer
//    starts at max(now, end of the previous transfer on this communicator), so concurrent
//    operations queue rather than share bandwidth -- closer to one real link (NCCL also runs
//    the collectives of one communicator in order) than splitting bandwidth between them.
// What it does not model: contention between different communicators (a split() gets its own
// link, as if tp and dp used separate links); skew between ranks (each rank starts the clock
// when IT starts the operation, not when the last rank joins -- the inner collective still
// synchronises the data); the inner operation's own time (it runs inside the modelled time: an
// operation ends at the later of the two); bandwidth that depends on message size, protocol switches, or topology beyond the ring factor.
//
// Measured, per communicator: modelled_seconds() (transfer time booked) and blocked_seconds()
// (wall time this rank actually spent blocked in communication: what overlap did not hide).
//
// LinkModel::synchronous = true makes async operations hold the caller until their deadline
// (a link with no way to overlap): the negative control an overlap test must fail on.
//
// split() returns a SimulatedLink over the inner communicator's split with the same LinkModel,
// so the wrapper can be the world communicator of a Mesh or Trainer. The inner operations are
// called with a trailing std::source_location (as ThreadComm, MpiComm and NcclComm take), so the
// flight recorder names the caller's line, not this file's.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <source_location>
#include <span>
#include <thread>
#include <utility>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

struct LinkModel {
  double bandwidth = 10e9;  // bus bandwidth, bytes per second
  double latency = 10e-6;   // seconds per operation
  bool synchronous = false;  // async operations block until done (no overlap): a negative control

  // Seconds one operation holds the link: 0 in a group of one rank.
  double seconds(double wire_bytes, int ranks) const {
    return ranks <= 1 ? 0.0 : latency + wire_bytes / bandwidth;
  }
};

// Bytes each rank puts on the wire (the ring cost; nccl-tests busbw factors).
namespace wire {
inline double all_reduce(double bytes, int n) { return n <= 1 ? 0.0 : 2.0 * (n - 1) / n * bytes; }
// total: the gathered output (all_gather) / the full input (reduce_scatter), n blocks.
inline double all_gather(double total, int n) { return n <= 1 ? 0.0 : double(n - 1) / n * total; }
inline double reduce_scatter(double total, int n) { return all_gather(total, n); }
inline double all_to_all(double total, int n) { return all_gather(total, n); }
inline double rooted(double bytes, int n) { return n <= 1 ? 0.0 : bytes; }  // reduce, broadcast
}  // namespace wire

namespace detail {
// Runs op() (the inner operation or wait), sleeps until `deadline`, and adds the wall seconds
// all of it took to `blocked`.
template <class Op>
void blocked_until(std::chrono::steady_clock::time_point deadline, double& blocked, Op&& op) {
  const auto t0 = std::chrono::steady_clock::now();
  op();
  std::this_thread::sleep_until(deadline);
  blocked += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// `space` only where the inner communicator names one (the concept is gaining the requirement).
template <class Inner>
struct SpaceOf {};
template <class Inner>
  requires requires { typename Inner::space; }
struct SpaceOf<Inner> {
  using space = typename Inner::space;
};
}  // namespace detail

// A request of the inner communicator plus the deadline of its modelled transfer.
template <class InnerRequest>
class SimulatedRequest {
 public:
  using clock = std::chrono::steady_clock;

  SimulatedRequest() = default;
  SimulatedRequest(InnerRequest inner, clock::time_point deadline, std::shared_ptr<double> blocked)
      : inner_(std::move(inner)), deadline_(deadline), blocked_(std::move(blocked)) {}

  void wait() {
    block([&] {
      if (!inner_done_) inner_.wait();
      inner_done_ = true;
    });
  }
  bool test() {
    if (!inner_done_) inner_done_ = inner_.test();
    return inner_done_ && clock::now() >= deadline_;
  }
  // A stream wait (host streams: a plain wait) holds the calling thread until the deadline too.
  template <class Stream>
    requires requires(InnerRequest& r, Stream s) { r.wait_on(s); }
  void wait_on(Stream stream) {
    block([&] {
      if (!inner_done_) inner_.wait_on(stream);
    });
  }
  clock::time_point deadline() const { return deadline_; }

 private:
  template <class Op>
  void block(Op&& op) {
    double unused = 0;
    detail::blocked_until(deadline_, blocked_ ? *blocked_ : unused, op);
  }

  InnerRequest inner_{};
  clock::time_point deadline_{};
  std::shared_ptr<double> blocked_;  // the link's blocked_seconds
  bool inner_done_ = false;
};

template <Communicator Inner>
class SimulatedLink : public detail::SpaceOf<Inner> {
 public:
  using request_type = SimulatedRequest<typename Inner::request_type>;
  using clock = std::chrono::steady_clock;
  using where_t = std::source_location;

  SimulatedLink(Inner inner, LinkModel link) : inner_(std::move(inner)), link_(link) {
    TRELLIS_CHECK(link_.bandwidth > 0 && link_.latency >= 0, "SimulatedLink: bandwidth must be > 0 and latency >= 0 (got ",
                  link_.bandwidth, " B/s, ", link_.latency, " s)");
  }

  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }
  void set_timeout(std::chrono::milliseconds t) { inner_.set_timeout(t); }
  Inner& inner() { return inner_; }
  const LinkModel& link() const { return link_; }
  // Modelled transfer seconds booked on this communicator so far (busy time of its link).
  double modelled_seconds() const { return booked_s_; }
  // Wall seconds this rank spent blocked in this communicator -- in blocking operations, in
  // wait(), and at the start of async ones on a synchronous link -- including waits for slower
  // ranks: the exposed communication, measured. Without overlap it is >= modelled_seconds().
  double blocked_seconds() const { return *blocked_s_; }

  // ---- collectives ------------------------------------------------------------------------------
  template <Element T>
  void all_reduce(const T* in, T* out, std::size_t n, ReduceOp op = ReduceOp::sum, where_t w = where_t::current()) {
    hold(wire::all_reduce(bytes<T>(n), size()), [&] { inner_.all_reduce(in, out, n, op, w); });
  }
  template <Element T>
  void reduce(const T* in, T* out, std::size_t n, ReduceOp op, int root, where_t w = where_t::current()) {
    hold(wire::rooted(bytes<T>(n), size()), [&] { inner_.reduce(in, out, n, op, root, w); });
  }
  template <Element T>
  void broadcast(T* buffer, std::size_t n, int root, where_t w = where_t::current()) {
    hold(wire::rooted(bytes<T>(n), size()), [&] { inner_.broadcast(buffer, n, root, w); });
  }
  template <Element T>
  void all_gather(const T* in, T* out, std::size_t n, where_t w = where_t::current()) {
    hold(wire::all_gather(bytes<T>(n) * size(), size()), [&] { inner_.all_gather(in, out, n, w); });
  }
  template <Element T>
  void reduce_scatter(const T* in, T* out, std::size_t n, ReduceOp op = ReduceOp::sum, where_t w = where_t::current()) {
    hold(wire::reduce_scatter(bytes<T>(n) * size(), size()), [&] { inner_.reduce_scatter(in, out, n, op, w); });
  }
  template <Element T>
  void all_to_all(const T* in, T* out, std::size_t n, where_t w = where_t::current()) {
    hold(wire::all_to_all(bytes<T>(n) * size(), size()), [&] { inner_.all_to_all(in, out, n, w); });
  }
  template <Element T>
  void all_to_allv(const T* in, std::span<const std::size_t> send_counts, std::span<const std::size_t> send_displs,
                   T* out, std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                   where_t w = where_t::current()) {
    double sent = 0, received = 0;  // to and from the other ranks
    for (std::size_t j = 0; j < send_counts.size() && j < recv_counts.size(); ++j)
      if (static_cast<int>(j) != rank()) {
        sent += bytes<T>(send_counts[j]);
        received += bytes<T>(recv_counts[j]);
      }
    hold(size() <= 1 ? 0.0 : std::max(sent, received),
         [&] { inner_.all_to_allv(in, send_counts, send_displs, out, recv_counts, recv_displs, w); });
  }
  void barrier(where_t w = where_t::current()) {
    hold(0.0, [&] { inner_.barrier(w); });
  }

  // ---- async collectives: return at once, the request completes at the deadline ------------------
  template <Element T>
  request_type all_reduce_async(const T* in, T* out, std::size_t n, ReduceOp op = ReduceOp::sum,
                                where_t w = where_t::current()) {
    return start(wire::all_reduce(bytes<T>(n), size()), [&] { return inner_.all_reduce_async(in, out, n, op, w); });
  }
  template <Element T>
  request_type all_gather_async(const T* in, T* out, std::size_t n, where_t w = where_t::current()) {
    return start(wire::all_gather(bytes<T>(n) * size(), size()), [&] { return inner_.all_gather_async(in, out, n, w); });
  }
  template <Element T>
  request_type reduce_scatter_async(const T* in, T* out, std::size_t n, ReduceOp op = ReduceOp::sum,
                                    where_t w = where_t::current()) {
    return start(wire::reduce_scatter(bytes<T>(n) * size(), size()),
                 [&] { return inner_.reduce_scatter_async(in, out, n, op, w); });
  }

  // ---- point to point ---------------------------------------------------------------------------
  template <Element T>
  void send(const T* buffer, std::size_t n, int peer, int tag = 0, where_t w = where_t::current()) {
    isend(buffer, n, peer, tag, w).wait();
  }
  template <Element T>
  void recv(T* buffer, std::size_t n, int peer, int tag = 0, where_t w = where_t::current()) {
    irecv(buffer, n, peer, tag, w).wait();
  }
  template <Element T>
  request_type isend(const T* buffer, std::size_t n, int peer, int tag = 0, where_t w = where_t::current()) {
    return start(wire::rooted(bytes<T>(n), size()), [&] { return inner_.isend(buffer, n, peer, tag, w); });
  }
  template <Element T>
  request_type irecv(T* buffer, std::size_t n, int peer, int tag = 0, where_t w = where_t::current()) {
    return start(wire::rooted(bytes<T>(n), size()), [&] { return inner_.irecv(buffer, n, peer, tag, w); });
  }
  request_type batch(std::span<const P2POp> ops, where_t w = where_t::current()) {
    double sent = 0, received = 0;
    for (const P2POp& op : ops)
      (op.kind == P2POp::Kind::send ? sent : received) += static_cast<double>(op.count * dtype_size(op.dtype));
    return start(wire::rooted(std::max(sent, received), size()), [&] { return inner_.batch(ops, w); });
  }

  SimulatedLink split(int color, int key, where_t w = where_t::current()) {
    return SimulatedLink(inner_.split(color, key, w), link_);
  }

 private:
  template <class T>
  static double bytes(std::size_t n) {
    return static_cast<double>(n) * sizeof(T);
  }

  // Books the link for one transfer of `wire_bytes` starting no earlier than now; its deadline.
  clock::time_point book(double wire_bytes) {
    const double s = link_.seconds(wire_bytes, size());
    const auto now = clock::now();
    if (s <= 0) return now;
    booked_s_ += s;
    link_free_ = std::max(now, link_free_) + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(s));
    return link_free_;
  }
  template <class Op>
  void hold(double wire_bytes, Op&& op) {
    detail::blocked_until(book(wire_bytes), *blocked_s_, op);
  }
  template <class Op>
  request_type start(double wire_bytes, Op&& op) {
    const auto t0 = clock::now();
    const auto deadline = book(wire_bytes);
    request_type r(op(), deadline, blocked_s_);
    if (link_.synchronous) {
      std::this_thread::sleep_until(deadline);
      *blocked_s_ += std::chrono::duration<double>(clock::now() - t0).count();
    }
    return r;
  }

  Inner inner_;
  LinkModel link_;
  clock::time_point link_free_{};  // end of the last transfer booked on this link
  double booked_s_ = 0;
  std::shared_ptr<double> blocked_s_ = std::make_shared<double>(0.0);  // shared with its requests
};

}  // namespace trellis::comm
