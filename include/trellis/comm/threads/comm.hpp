// ThreadComm: one rank's handle on a group of thread ranks -- the Communicator of the thread
// backend (part of comm/threads.hpp).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <source_location>
#include <span>
#include <string>
#include <utility>

#include "trellis/comm/communicator.hpp"
#include "trellis/comm/recorder.hpp"
#include "trellis/comm/threads/group.hpp"
#include "trellis/comm/threads/rank_state.hpp"
#include "trellis/comm/threads/request.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/space.hpp"

namespace trellis::comm {

// One rank's handle on a group of thread ranks. Created by ThreadWorld::run (the world) and
// split(). Movable, not copyable; used by its own rank's thread.
class ThreadComm {
 public:
  using request_type = ThreadRequest;
  using space = Host;  // buffers are host memory

  // Sends of at most this many bytes are copied and complete at once (no rendezvous).
  static constexpr std::size_t eager_limit = 64 * 1024;

  ThreadComm(ThreadComm&&) noexcept = default;
  ThreadComm& operator=(ThreadComm&&) noexcept = default;
  ThreadComm(const ThreadComm&) = delete;
  ThreadComm& operator=(const ThreadComm&) = delete;
  ~ThreadComm() = default;

  int rank() const { return state_->rank(); }
  int size() const { return state_->size(); }
  // This rank's index in the ThreadWorld (equal to rank() on the world communicator).
  int world_rank() const { return state_->world_rank(); }
  const std::string& label() const { return state_->group().label; }

  void set_timeout(std::chrono::milliseconds timeout) { state_->set_timeout(timeout); }
  std::chrono::milliseconds timeout() const { return state_->timeout(); }
  // Fingerprints are compared before every collective regardless (free with shared memory).
  void set_debug(bool on) { state_->set_debug(on); }
  bool debug() const { return state_->debug(); }
  // A copy of this communicator's flight recorder (last TRELLIS_RECORDER_DEPTH calls).
  FlightRecorder recorder() const { return state_->recorder_copy(); }

  // ---- collectives ----------------------------------------------------------------------------
  template <Element T>
  void all_reduce(const T* in, T* out, std::size_t n, ReduceOp op = ReduceOp::sum,
                  std::source_location where = std::source_location::current()) {
    run(make(OpKind::all_reduce, dtype_v<T>, n, -1, op, where, in, out, 1));
  }
  template <Element T>
  void reduce(const T* in, T* out, std::size_t n, ReduceOp op, int root,
              std::source_location where = std::source_location::current()) {
    check_root(root, "reduce");
    TRELLIS_CHECK(rank() != root || out != nullptr || n == 0, "reduce: the root's output is null");
    run(make(OpKind::reduce, dtype_v<T>, n, root, op, where, in, out, 1, /*need_out=*/false));
  }
  template <Element T>
  void broadcast(T* buffer, std::size_t n, int root,
                 std::source_location where = std::source_location::current()) {
    check_root(root, "broadcast");
    run(make(OpKind::broadcast, dtype_v<T>, n, root, ReduceOp::sum, where, buffer, buffer, 1));
  }
  template <Element T>
  void all_gather(const T* in, T* out, std::size_t n,
                  std::source_location where = std::source_location::current()) {
    run(make(OpKind::all_gather, dtype_v<T>, n, -1, ReduceOp::sum, where, in, out, size()));
  }
  template <Element T>
  void reduce_scatter(const T* in, T* out, std::size_t n, ReduceOp op = ReduceOp::sum,
                      std::source_location where = std::source_location::current()) {
    run(make(OpKind::reduce_scatter, dtype_v<T>, n, -1, op, where, in, out, size()));
  }
  template <Element T>
  void all_to_all(const T* in, T* out, std::size_t n,
                  std::source_location where = std::source_location::current()) {
    run(make(OpKind::all_to_all, dtype_v<T>, n, -1, ReduceOp::sum, where, in, out, size()));
  }
  template <Element T>
  void all_to_allv(const T* in, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, T* out,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                   std::source_location where = std::source_location::current()) {
    const auto n = static_cast<std::size_t>(size());
    TRELLIS_CHECK(send_counts.size() == n && send_displs.size() == n && recv_counts.size() == n &&
                      recv_displs.size() == n,
                  "all_to_allv: counts and displacements need size() = ", n, " entries each (got ",
                  send_counts.size(), ", ", send_displs.size(), ", ", recv_counts.size(), ", ",
                  recv_displs.size(), ")");
    std::size_t total_sent = 0;
    for (std::size_t j = 0; j < n; ++j) {
      for (std::size_t c : {send_counts[j], recv_counts[j], send_displs[j], recv_displs[j]})
        TRELLIS_CHECK(c <= detail::max_count(dtype_v<T>), "all_to_allv: count or displacement ", c,
                      " is negative or too large");
      total_sent += send_counts[j];
      TRELLIS_CHECK((send_counts[j] == 0 || in) && (recv_counts[j] == 0 || out), "all_to_allv: null buffer");
    }
    auto a = make(OpKind::all_to_allv, dtype_v<T>, total_sent, -1, ReduceOp::sum, where, in, out, 1, false);
    a.send_counts = send_counts;
    a.send_displs = send_displs;
    a.recv_counts = recv_counts;
    a.recv_displs = recv_displs;
    run(a);
  }
  void barrier(std::source_location where = std::source_location::current()) {
    run(make<float>(OpKind::barrier, DType::f32, 0, -1, ReduceOp::sum, where, nullptr, nullptr, 1));
  }

  // ---- async collectives (run in order by this rank's progress thread) ---------------------------
  template <Element T>
  ThreadRequest all_reduce_async(const T* in, T* out, std::size_t n, ReduceOp op = ReduceOp::sum,
                                 std::source_location where = std::source_location::current()) {
    return submit(make(OpKind::all_reduce, dtype_v<T>, n, -1, op, where, in, out, 1));
  }
  template <Element T>
  ThreadRequest all_gather_async(const T* in, T* out, std::size_t n,
                                 std::source_location where = std::source_location::current()) {
    return submit(make(OpKind::all_gather, dtype_v<T>, n, -1, ReduceOp::sum, where, in, out, size()));
  }
  template <Element T>
  ThreadRequest reduce_scatter_async(const T* in, T* out, std::size_t n, ReduceOp op = ReduceOp::sum,
                                     std::source_location where = std::source_location::current()) {
    return submit(make(OpKind::reduce_scatter, dtype_v<T>, n, -1, op, where, in, out, size()));
  }

  // ---- point to point ---------------------------------------------------------------------------
  template <Element T>
  void send(const T* buffer, std::size_t n, int peer, int tag = 0,
            std::source_location where = std::source_location::current()) {
    isend(buffer, n, peer, tag, where).wait();
  }
  template <Element T>
  void recv(T* buffer, std::size_t n, int peer, int tag = 0,
            std::source_location where = std::source_location::current()) {
    irecv(buffer, n, peer, tag, where).wait();
  }
  template <Element T>
  ThreadRequest isend(const T* buffer, std::size_t n, int peer, int tag = 0,
                      std::source_location where = std::source_location::current()) {
    P2POp op{P2POp::Kind::send, const_cast<T*>(buffer), n, dtype_v<T>, peer, tag};
    return start_p2p(std::span<const P2POp>(&op, 1), OpKind::send, where);
  }
  template <Element T>
  ThreadRequest irecv(T* buffer, std::size_t n, int peer, int tag = 0,
                      std::source_location where = std::source_location::current()) {
    P2POp op{P2POp::Kind::recv, buffer, n, dtype_v<T>, peer, tag};
    return start_p2p(std::span<const P2POp>(&op, 1), OpKind::recv, where);
  }
  // Starts every operation at once (no ordering deadlock between them); one request for all.
  ThreadRequest batch(std::span<const P2POp> ops, std::source_location where = std::source_location::current()) {
    return start_p2p(ops, OpKind::batch, where);
  }

  // MPI_Comm_split: the ranks with the same color form a communicator, ordered by (key, rank).
  // color must be >= 0; split_or_none() lets ranks opt out.
  ThreadComm split(int color, int key, std::source_location where = std::source_location::current()) {
    TRELLIS_CHECK(color >= 0, "split: color must be >= 0 (got ", color,
                  "); use split_or_none() for ranks that take part without joining a communicator");
    return *split_or_none(color, key, where);
  }
  // As split(), and a negative color (MPI_UNDEFINED) takes part in the collective but joins no
  // communicator: those ranks get std::nullopt. Every rank of this communicator must call it.
  std::optional<ThreadComm> split_or_none(int color, int key,
                                          std::source_location where = std::source_location::current()) {
    auto a = make<float>(OpKind::split, DType::f32, 0, -1, ReduceOp::sum, where, nullptr, nullptr, 1);
    a.color = color < 0 ? -1 : color;
    a.key = key;
    run(a);
    int new_rank = 0;
    auto group = state_->take_split(new_rank);
    if (!group) return std::nullopt;
    return ThreadComm(std::move(group), new_rank, state_->timeout(), state_->debug());
  }

 private:
  friend class ThreadWorld;

  ThreadComm(std::shared_ptr<detail::ThreadGroup> group, int rank, std::chrono::milliseconds timeout, bool debug)
      : state_(std::make_shared<detail::ThreadRankState>(std::move(group), rank, timeout, debug)) {}

  void check_root(int root, const char* what) const {
    TRELLIS_CHECK(root >= 0 && root < size(), what, ": invalid root ", root, " for communicator '",
                  label(), "' of size ", size());
  }
  void check_peer(int peer) const {
    TRELLIS_CHECK(peer >= 0 && peer < size(), "invalid peer ", peer, " for communicator '", label(),
                  "' of size ", size());
  }

  // Validates local arguments, records the call, and returns its arguments.
  template <class T>
  detail::CollectiveArgs make(OpKind kind, DType dtype, std::size_t n, int root, ReduceOp op,
                              std::source_location where, const T* in, T* out, std::size_t blocks,
                              bool need_out = true) {
    TRELLIS_CHECK(n <= detail::max_count(dtype, blocks), op_kind_name(kind), ": count ", n,
                  " is negative or too large");
    if (n > 0 && kind != OpKind::all_to_allv) {
      TRELLIS_CHECK(in != nullptr, op_kind_name(kind), ": null input buffer with count ", n);
      TRELLIS_CHECK(!need_out || out != nullptr, op_kind_name(kind), ": null output buffer with count ", n);
    }
    detail::CollectiveArgs a;
    a.fp = state_->record(kind, dtype, n, root, op, where, &a.call);
    a.in = reinterpret_cast<const std::byte*>(in);
    a.out = reinterpret_cast<std::byte*>(out);
    return a;
  }

  void run(const detail::CollectiveArgs& a) {
    state_->drain();
    try {
      state_->collective(a);
    } catch (...) {
      state_->mark(a.call, false);
      throw;
    }
    state_->mark(a.call, true);
  }

  ThreadRequest submit(detail::CollectiveArgs a) {
    ThreadRequest request;
    request.seq_ = a.call;
    request.collective_ = true;
    request.parts_.push_back(state_->submit(std::move(a)));
    request.owner_ = state_;
    return request;
  }

  ThreadRequest start_p2p(std::span<const P2POp> ops, OpKind kind, std::source_location where) {
    std::size_t total = 0;
    for (const P2POp& op : ops) {
      check_peer(op.peer);
      TRELLIS_CHECK(op.count <= detail::max_count(op.dtype), op_kind_name(kind), ": count ", op.count,
                    " is negative or too large");
      TRELLIS_CHECK(op.count == 0 || op.buffer != nullptr, op_kind_name(kind), ": null buffer");
      total += op.count;
    }
    const P2POp* first = ops.empty() ? nullptr : &ops[0];
    ThreadRequest request;
    state_->record(kind, first ? first->dtype : DType::f32, total,
                   kind == OpKind::batch ? -1 : (first ? first->peer : -1), ReduceOp::sum, where, &request.seq_);
    request.owner_ = state_;
    try {
      for (const P2POp& op : ops) {
        auto* bytes = static_cast<std::byte*>(op.buffer);
        request.parts_.push_back(op.kind == P2POp::Kind::send
                                     ? state_->post_send(bytes, op.count, op.dtype, op.peer, op.tag, eager_limit)
                                     : state_->post_recv(bytes, op.count, op.dtype, op.peer, op.tag));
      }
    } catch (...) {
      state_->mark(request.seq_, false);
      throw;
    }
    return request;
  }

  std::shared_ptr<detail::ThreadRankState> state_;
};

static_assert(Communicator<ThreadComm>);

}  // namespace trellis::comm
