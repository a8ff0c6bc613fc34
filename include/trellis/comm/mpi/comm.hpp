// MpiComm: the Communicator over an MPI communicator -- collectives (blocking and async),
// point to point, batch and split (part of comm/mpi.hpp, whose leading comment describes how it
// maps onto MPI).
// Needs MPI (under comm/mpi/: built only with trellis::mpi).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <source_location>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/comm/mpi/comm_state.hpp"
#include "trellis/comm/mpi/datatypes.hpp"
#include "trellis/comm/mpi/environment.hpp"
#include "trellis/comm/mpi/pending.hpp"
#include "trellis/comm/mpi/request.hpp"
#include "trellis/comm/recorder.hpp"
#include "trellis/core/buffer.hpp"
#include "trellis/core/check_mpi.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/space.hpp"

namespace trellis::comm {

namespace detail {

// Test seam (tests/comm/mpi_fault_worker.cpp, scenario stop_in_split): called by split() with the
// rank in the communicator being split, between the timed gather and MPI_Comm_split. Null
// outside that test.
inline void (*mpi_split_test_hook)(int rank) = nullptr;

// Ends the process if a blocking MPI call has not returned within `timeout` (no thread when the
// timeout is off): for MPI_Comm_split, the one call here without a nonblocking form. A blocked
// MPI call can be neither cancelled nor abandoned: running it on a thread of its own and raising
// the timeout here instead would leave that thread inside a collective of a communicator still
// in use (and needs MPI_THREAD_MULTIPLE), so the job ends, as MpiWorld ends it after a timeout
// anyway. Destroying the watchdog (the call returned) wakes and joins its thread at once.
class MpiWatchdog {
 public:
  // `what` is printed as is; the thread level is queried here, as only this thread may call MPI
  // below MPI_THREAD_MULTIPLE.
  MpiWatchdog(std::chrono::milliseconds timeout, std::string what) {
    if (timeout.count() <= 0) return;
    int level = MPI_THREAD_SINGLE;
    MPI_Query_thread(&level);
    thread_ = std::thread([this, deadline = std::chrono::steady_clock::now() + timeout, what = std::move(what),
                           level] {
      std::unique_lock lock(mutex_);
      if (!cv_.wait_until(lock, deadline, [this] { return done_; })) fire(what, level);
    });
  }
  MpiWatchdog(const MpiWatchdog&) = delete;
  MpiWatchdog& operator=(const MpiWatchdog&) = delete;
  ~MpiWatchdog() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

 private:
  // MPI_Abort ends every rank (the others may be blocked in the same call); without
  // MPI_THREAD_MULTIPLE this thread may not call MPI, so it exits and mpirun ends the rest.
  [[noreturn]] static void fire(const std::string& what, int level) {
    const bool multiple = level == MPI_THREAD_MULTIPLE;
    std::fprintf(stderr, "%s; a blocking MPI call cannot be abandoned, so this process %s\n", what.c_str(),
                 multiple ? "ends the job: MPI_Abort(MPI_COMM_WORLD, 1)"
                          : "exits (std::_Exit(1): MPI_Abort from this thread needs MPI_THREAD_MULTIPLE)");
    std::fflush(stdout);
    std::fflush(stderr);
    if (multiple) MPI_Abort(MPI_COMM_WORLD, 1);
    std::_Exit(1);  // MPI_Abort does not return
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;  // last: started once the members it uses exist
};

}  // namespace detail

// The Communicator over MPI. Build one from any MPI_Comm (it is duplicated, never modified) or
// take the one MpiWorld::run hands out. Move-only; split() makes sub-communicators.
class MpiComm {
 public:
  using request_type = MpiRequest;
  using space = Host;  // buffers are host memory

  // Duplicates `comm` (collective over it, with the timeout of TRELLIS_COMM_TIMEOUT_MS: a rank
  // that never arrives raises instead of hanging). `label` names the communicator in errors.
  explicit MpiComm(MPI_Comm comm, std::string label = "mpi")
      : state_(std::make_shared<detail::MpiCommState>()) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    TRELLIS_CHECK(initialized && !finalized, "MpiComm needs MPI initialised and not finalised (use MpiWorld)");
    auto& s = *state_;
    const auto timeout = detail::mpi_env_timeout();
    s.comm = dup_within(comm, timeout, label);
    TRELLIS_CHECK_MPI(MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN));
    s.control = dup_within(s.comm, timeout, label);
    TRELLIS_CHECK_MPI(MPI_Comm_set_errhandler(s.control, MPI_ERRORS_RETURN));
    init_state(std::move(label));
  }

  MpiComm(MpiComm&&) noexcept = default;
  MpiComm& operator=(MpiComm&&) noexcept = default;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;
  ~MpiComm() = default;

  int rank() const { return state_->rank; }
  int size() const { return state_->size; }
  // The data communicator (MPI_ERRORS_RETURN set); for calling MPI directly alongside.
  MPI_Comm native() const { return state_->comm; }
  const std::string& label() const { return state_->recorder.label(); }
  const FlightRecorder& recorder() const { return state_->recorder; }

  // Debug mode: fingerprints compared before every collective. Set it the same on every rank.
  void set_debug(bool on) { state_->debug = on; }
  bool debug() const { return state_->debug; }
  // How long any blocking call or wait() may take; zero or less switches the timeout off.
  void set_timeout(std::chrono::milliseconds timeout) { state_->timeout = timeout; }
  std::chrono::milliseconds timeout() const { return state_->timeout; }

  // ---- collectives -------------------------------------------------------------------------

  template <Element T>
  void all_reduce(const T* in, T* out, std::size_t n, ReduceOp op,
                  std::source_location where = std::source_location::current()) {
    run_blocking(start_all_reduce(in, out, n, dtype_v<T>, op, where));
  }
  template <Element T>
  MpiRequest all_reduce_async(const T* in, T* out, std::size_t n, ReduceOp op,
                              std::source_location where = std::source_location::current()) {
    return make_request(start_all_reduce(in, out, n, dtype_v<T>, op, where, true));
  }

  template <Element T>
  void reduce(const T* in, T* out, std::size_t n, ReduceOp op, int root,
              std::source_location where = std::source_location::current()) {
    run_blocking(start_reduce(in, out, n, dtype_v<T>, op, root, where));
  }

  template <Element T>
  void broadcast(T* buffer, std::size_t n, int root,
                 std::source_location where = std::source_location::current()) {
    run_blocking(start_broadcast(buffer, n, dtype_v<T>, root, where));
  }
  template <Element T>
  MpiRequest broadcast_async(T* buffer, std::size_t n, int root,
                             std::source_location where = std::source_location::current()) {
    return make_request(start_broadcast(buffer, n, dtype_v<T>, root, where, true));
  }

  template <Element T>
  void all_gather(const T* in, T* out, std::size_t n,
                  std::source_location where = std::source_location::current()) {
    run_blocking(start_all_gather(in, out, n, dtype_v<T>, where));
  }
  template <Element T>
  MpiRequest all_gather_async(const T* in, T* out, std::size_t n,
                              std::source_location where = std::source_location::current()) {
    return make_request(start_all_gather(in, out, n, dtype_v<T>, where, true));
  }

  template <Element T>
  void reduce_scatter(const T* in, T* out, std::size_t n, ReduceOp op,
                      std::source_location where = std::source_location::current()) {
    run_blocking(start_reduce_scatter(in, out, n, dtype_v<T>, op, where));
  }
  template <Element T>
  MpiRequest reduce_scatter_async(const T* in, T* out, std::size_t n, ReduceOp op,
                                  std::source_location where = std::source_location::current()) {
    return make_request(start_reduce_scatter(in, out, n, dtype_v<T>, op, where, true));
  }

  template <Element T>
  void all_to_all(const T* in, T* out, std::size_t n,
                  std::source_location where = std::source_location::current()) {
    run_blocking(start_all_to_all(in, out, n, dtype_v<T>, where));
  }

  // Counts and displacements in elements, one per rank.
  template <Element T>
  void all_to_allv(const T* in, std::span<const std::size_t> send_counts,
                   std::span<const std::size_t> send_displs, T* out,
                   std::span<const std::size_t> recv_counts, std::span<const std::size_t> recv_displs,
                   std::source_location where = std::source_location::current()) {
    run_blocking(start_all_to_allv(in, send_counts, send_displs, out, recv_counts, recv_displs,
                                   dtype_v<T>, where));
  }

  void barrier(std::source_location where = std::source_location::current()) {
    auto p = begin(OpKind::barrier, DType::u8, 0, -1, ReduceOp::sum, where, true);
    if (direct()) {
      TRELLIS_CHECK_MPI(MPI_Barrier(comm()));
    } else {
      TRELLIS_CHECK_MPI(MPI_Ibarrier(comm(), push(*p)));
    }
    run_blocking(std::move(p));
  }

  // ---- point to point ---------------------------------------------------------------------

  template <Element T>
  void send(const T* buffer, std::size_t n, int peer, int tag = 0,
            std::source_location where = std::source_location::current()) {
    run_blocking(start_p2p(P2POp::Kind::send, const_cast<T*>(buffer), n, dtype_v<T>, peer, tag, where));
  }
  template <Element T>
  void recv(T* buffer, std::size_t n, int peer, int tag = 0,
            std::source_location where = std::source_location::current()) {
    run_blocking(start_p2p(P2POp::Kind::recv, buffer, n, dtype_v<T>, peer, tag, where));
  }
  template <Element T>
  MpiRequest isend(const T* buffer, std::size_t n, int peer, int tag = 0,
                   std::source_location where = std::source_location::current()) {
    return make_request(start_p2p(P2POp::Kind::send, const_cast<T*>(buffer), n, dtype_v<T>, peer, tag, where));
  }
  template <Element T>
  MpiRequest irecv(T* buffer, std::size_t n, int peer, int tag = 0,
                   std::source_location where = std::source_location::current()) {
    return make_request(start_p2p(P2POp::Kind::recv, buffer, n, dtype_v<T>, peer, tag, where));
  }

  // Starts every send and receive at once; one request completes them all.
  MpiRequest batch(std::span<const P2POp> ops,
                   std::source_location where = std::source_location::current()) {
    auto& s = *state_;
    s.check_usable();
    for (const P2POp& op : ops) check_p2p_args(op.peer, op.tag, op.kind == P2POp::Kind::send ? "batch send" : "batch recv");
    auto p = std::make_unique<detail::MpiPending>();
    p->call = s.recorder.record(OpKind::batch, ops.empty() ? DType::u8 : ops[0].dtype, ops.size(), -1,
                                ReduceOp::sum, where);
    p->finish = detail::MpiPending::Finish::check_recv_counts;
    for (const P2POp& op : ops) {
      const int count = detail::mpi_count(op.count, "batch");
      MPI_Datatype type = detail::mpi_datatype(op.dtype);
      MPI_Request r;
      if (op.kind == P2POp::Kind::send) {
        TRELLIS_CHECK_MPI(MPI_Isend(op.buffer, count, type, op.peer, op.tag, comm(), &r));
      } else {
        TRELLIS_CHECK_MPI(MPI_Irecv(op.buffer, count, type, op.peer, op.tag, comm(), &r));
      }
      p->requests.push_back(r);
      p->peers.push_back(op.peer);
      p->dtypes.push_back(op.dtype);
      p->expected_counts.push_back(op.kind == P2POp::Kind::recv ? op.count : SIZE_MAX);
    }
    return MpiRequest(state_, std::move(p));
  }

  // Ranks with the same color form a new communicator, ordered by key then rank (collective).
  // The colors and keys are first gathered with the timeout, so a missing rank raises instead of
  // hanging inside MPI_Comm_split; a rank that stops or dies after the gather makes the others'
  // MPI_Comm_split (blocking: MPI has no nonblocking split) end the job after the timeout.
  MpiComm split(int color, int key, std::source_location where = std::source_location::current()) {
    state_->check_usable();
    if (color < 0)
      TRELLIS_THROW("split: color must be >= 0, got ", color,
                    "; use split_or_none() for ranks that take part without joining a communicator");
    return *split_or_none(color, key, where);
  }
  // As split(), and a negative color (MPI_UNDEFINED) takes part in the collective but joins no
  // communicator: those ranks get std::nullopt. Every rank of this communicator must call it.
  std::optional<MpiComm> split_or_none(int color, int key,
                                       std::source_location where = std::source_location::current()) {
    auto& s = *state_;
    s.check_usable();
    const std::string call = trellis::detail::concat("split(", color, ")");
    if (color < 0) color = MPI_UNDEFINED;
    auto p = begin(OpKind::split, DType::i32, 0, -1, ReduceOp::sum, where, true);
    p->counts.assign(static_cast<std::size_t>(2 * s.size + 2), 0);
    p->counts[0] = color;
    p->counts[1] = key;
    TRELLIS_CHECK_MPI(MPI_Iallgather(p->counts.data(), 2, MPI_INT, p->counts.data() + 2, 2, MPI_INT,
                                     comm(), push(*p)));
    run_blocking(std::move(p));
    if (detail::mpi_split_test_hook) detail::mpi_split_test_hook(s.rank);
    MPI_Comm sub = MPI_COMM_NULL;
    {
      // Every rank was at the gather, so only a rank that stopped or died since can block this;
      // a thread per split costs well under a millisecond, and splits are rare.
      const int rank = trellis::current_rank();  // as trellis::Error names it
      const std::string who = rank >= 0 ? trellis::detail::concat("[rank ", rank, "] ") : std::string();
      detail::MpiWatchdog watchdog(s.timeout, trellis::detail::concat(
          "trellis: ", who, "MPI_Comm_split of ", call, " timed out after ", s.timeout.count(), " ms ", s.where(),
          ": a rank stopped or died after the colors were gathered"));
      TRELLIS_CHECK_MPI(MPI_Comm_split(comm(), color, key, &sub));
    }
    if (sub == MPI_COMM_NULL) return std::nullopt;
    // (The new communicator's control duplicate is made by dup_within, with the same deadline.)
    MpiComm result(adopt_tag{}, sub, s.recorder.label() + "/split(" + std::to_string(color) + ")", s.timeout);
    result.set_debug(s.debug);
    result.set_timeout(s.timeout);
    return result;
  }

 private:
  struct adopt_tag {};
  // Takes ownership of `comm` (fresh from MPI_Comm_split).
  MpiComm(adopt_tag, MPI_Comm comm, std::string label, std::chrono::milliseconds timeout)
      : state_(std::make_shared<detail::MpiCommState>()) {
    auto& s = *state_;
    s.comm = comm;
    TRELLIS_CHECK_MPI(MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN));
    s.control = dup_within(s.comm, timeout, label);
    TRELLIS_CHECK_MPI(MPI_Comm_set_errhandler(s.control, MPI_ERRORS_RETURN));
    init_state(std::move(label));
  }

  // MPI_Comm_dup with a deadline (MPI_Comm_idup and a test loop). On a timeout the handle's slot
  // is left allocated: MPI may still complete the duplicate into it, and the job is ending (the
  // fault is recorded, so MpiWorld aborts instead of finalising).
  static MPI_Comm dup_within(MPI_Comm from, std::chrono::milliseconds timeout, const std::string& label) {
    MPI_Comm out = MPI_COMM_NULL;
    if (timeout.count() <= 0) {
      TRELLIS_CHECK_MPI(MPI_Comm_dup(from, &out));
      return out;
    }
    auto* slot = new MPI_Comm(MPI_COMM_NULL);
    MPI_Request request = MPI_REQUEST_NULL;
    TRELLIS_CHECK_MPI(MPI_Comm_idup(from, slot, &request));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (int done = 0; !done;) {
      TRELLIS_CHECK_MPI(MPI_Test(&request, &done, MPI_STATUS_IGNORE));
      if (!done && std::chrono::steady_clock::now() > deadline) {
        int rank = -1, size = 0;
        MPI_Comm_rank(from, &rank);
        MPI_Comm_size(from, &size);
        const std::string what = trellis::detail::concat(
            "MPI_Comm_dup of communicator '", label, "' (collective over ", size, " ranks) timed out after ",
            timeout.count(), " ms on rank ", rank, ": a rank did not arrive (stopped, or not constructing it)");
        detail::mpi_record_fault(what);
        TRELLIS_THROW(what);
      }
      if (!done) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    out = *slot;
    delete slot;
    return out;
  }

  void init_state(std::string label) {
    auto& s = *state_;
    TRELLIS_CHECK_MPI(MPI_Comm_rank(s.comm, &s.rank));
    TRELLIS_CHECK_MPI(MPI_Comm_size(s.comm, &s.size));
    s.world_ranks.resize(static_cast<std::size_t>(s.size));
    std::vector<int> mine(static_cast<std::size_t>(s.size));
    for (int r = 0; r < s.size; ++r) mine[static_cast<std::size_t>(r)] = r;
    MPI_Group group, world;
    TRELLIS_CHECK_MPI(MPI_Comm_group(s.comm, &group));
    TRELLIS_CHECK_MPI(MPI_Comm_group(MPI_COMM_WORLD, &world));
    TRELLIS_CHECK_MPI(MPI_Group_translate_ranks(group, s.size, mine.data(), world, s.world_ranks.data()));
    MPI_Group_free(&group);
    MPI_Group_free(&world);
    int world_size = 0;
    TRELLIS_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
    s.world_order = world_size == s.size;
    for (int r = 0; r < s.size; ++r) s.world_order = s.world_order && s.world_ranks[static_cast<std::size_t>(r)] == r;
    int* tag_ub = nullptr;
    int flag = 0;
    TRELLIS_CHECK_MPI(MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &flag));
    if (flag && tag_ub) s.tag_upper_bound = *tag_ub;
    s.recorder.identify(std::move(label), s.rank, s.size);
    s.debug = detail::mpi_env_debug();
    s.timeout = detail::mpi_env_timeout();
  }

  MPI_Comm comm() const { return state_->comm; }
  // Blocking MPI calls are used directly when no timeout applies (MPI's tuned algorithms).
  bool direct() const { return state_->forever(); }

  static MPI_Request* push(detail::MpiPending& p) {
    p.requests.push_back(MPI_REQUEST_NULL);
    return &p.requests.back();
  }

  void check_root(int root, const char* what) const {
    if (root < 0 || root >= state_->size) [[unlikely]]
      TRELLIS_THROW(what, ": root ", root, " is not a rank of communicator '", label(), "' (size ",
                    state_->size, ")");
  }
  void check_p2p_args(int peer, int tag, const char* what) const {
    if (peer < 0 || peer >= state_->size) [[unlikely]]
      TRELLIS_THROW(what, ": peer ", peer, " is not a rank of communicator '", label(), "' (size ",
                    state_->size, ")");
    if (tag < 0) [[unlikely]] TRELLIS_THROW(what, ": tag ", tag, " is negative");
    if (tag > state_->tag_upper_bound) [[unlikely]]
      TRELLIS_THROW(what, ": tag ", tag, " exceeds MPI_TAG_UB (", state_->tag_upper_bound, ")");
  }

  // Validates, records and (debug mode) cross-checks a call; returns its pending state.
  std::unique_ptr<detail::MpiPending> begin(OpKind kind, DType dtype, std::size_t n, int root, ReduceOp op,
                                            std::source_location where, bool collective) {
    auto& s = *state_;
    s.check_usable();
    auto p = std::make_unique<detail::MpiPending>();
    p->call = s.recorder.record(kind, dtype, n, root, op, where);
    p->dtype = dtype;
    if (collective) {
      // Ranks may run different numbers of point-to-point calls: collectives are compared by
      // their own sequence number.
      OpFingerprint shared = p->call;
      shared.seq = s.collectives++;
      try {
        s.check_fingerprints(shared);
      } catch (...) {
        s.recorder.failed(p->call.seq);
        throw;
      }
    }
    return p;
  }

  void run_blocking(std::unique_ptr<detail::MpiPending> p) { state_->finish(std::move(p)); }
  MpiRequest make_request(std::unique_ptr<detail::MpiPending> p) { return MpiRequest(state_, std::move(p)); }

  std::unique_ptr<detail::MpiPending> start_all_reduce(const void* in, void* out, std::size_t n, DType t,
                                                       ReduceOp op, std::source_location where,
                                                       bool async = false) {
    const int count = detail::mpi_count(n, "all_reduce");
    auto p = begin(OpKind::all_reduce, t, n, -1, op, where, true);
    const bool blocking = !async && direct();
    if (detail::mpi_widens(t, op)) {
      p->staging = Buffer<float>(n, false);
      detail::mpi_widen_16(in, p->staging.data(), n, t);
      set_narrow(*p, out, n, t, op);
      if (blocking) {
        TRELLIS_CHECK_MPI(MPI_Allreduce(MPI_IN_PLACE, p->staging.data(), count, MPI_FLOAT, detail::mpi_reduce_op(op, DType::f32), comm()));
      } else {
        TRELLIS_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, p->staging.data(), count, MPI_FLOAT, detail::mpi_reduce_op(op, DType::f32), comm(), push(*p)));
      }
      return p;
    }
    set_divide(*p, out, n, t, op);
    const void* send = in == out ? MPI_IN_PLACE : in;
    if (blocking) {
      TRELLIS_CHECK_MPI(MPI_Allreduce(send, out, count, detail::mpi_datatype(t), detail::mpi_reduce_op(op, t), comm()));
    } else {
      TRELLIS_CHECK_MPI(MPI_Iallreduce(send, out, count, detail::mpi_datatype(t), detail::mpi_reduce_op(op, t), comm(), push(*p)));
    }
    return p;
  }

  std::unique_ptr<detail::MpiPending> start_reduce(const void* in, void* out, std::size_t n, DType t, ReduceOp op,
                                                   int root, std::source_location where) {
    const int count = detail::mpi_count(n, "reduce");
    check_root(root, "reduce");
    auto p = begin(OpKind::reduce, t, n, root, op, where, true);
    const bool at_root = state_->rank == root;
    const bool blocking = direct();
    if (detail::mpi_widens(t, op)) {
      p->staging = Buffer<float>(n, false);
      detail::mpi_widen_16(in, p->staging.data(), n, t);
      if (at_root) set_narrow(*p, out, n, t, op);
      const void* send = at_root ? MPI_IN_PLACE : p->staging.data();
      if (blocking) {
        TRELLIS_CHECK_MPI(MPI_Reduce(send, p->staging.data(), count, MPI_FLOAT, detail::mpi_reduce_op(op, DType::f32), root, comm()));
      } else {
        TRELLIS_CHECK_MPI(MPI_Ireduce(send, p->staging.data(), count, MPI_FLOAT, detail::mpi_reduce_op(op, DType::f32), root, comm(), push(*p)));
      }
      return p;
    }
    if (at_root) set_divide(*p, out, n, t, op);
    const void* send = (at_root && in == out) ? MPI_IN_PLACE : in;
    if (blocking) {
      TRELLIS_CHECK_MPI(MPI_Reduce(send, out, count, detail::mpi_datatype(t), detail::mpi_reduce_op(op, t), root, comm()));
    } else {
      TRELLIS_CHECK_MPI(MPI_Ireduce(send, out, count, detail::mpi_datatype(t), detail::mpi_reduce_op(op, t), root, comm(), push(*p)));
    }
    return p;
  }

  std::unique_ptr<detail::MpiPending> start_broadcast(void* buffer, std::size_t n, DType t, int root,
                                                      std::source_location where, bool async = false) {
    const int count = detail::mpi_count(n, "broadcast");
    check_root(root, "broadcast");
    auto p = begin(OpKind::broadcast, t, n, root, ReduceOp::sum, where, true);
    if (!async && direct()) {
      TRELLIS_CHECK_MPI(MPI_Bcast(buffer, count, detail::mpi_datatype(t), root, comm()));
    } else {
      TRELLIS_CHECK_MPI(MPI_Ibcast(buffer, count, detail::mpi_datatype(t), root, comm(), push(*p)));
    }
    return p;
  }

  std::unique_ptr<detail::MpiPending> start_all_gather(const void* in, void* out, std::size_t n, DType t,
                                                       std::source_location where, bool async = false) {
    const int count = detail::mpi_count(n, "all_gather");
    auto p = begin(OpKind::all_gather, t, n, -1, ReduceOp::sum, where, true);
    const std::size_t bytes = n * dtype_size(t);
    const void* send = in == static_cast<const std::byte*>(out) + bytes * static_cast<std::size_t>(state_->rank)
                           ? MPI_IN_PLACE
                           : in;
    MPI_Datatype type = detail::mpi_datatype(t);
    if (!async && direct()) {
      TRELLIS_CHECK_MPI(MPI_Allgather(send, count, type, out, count, type, comm()));
    } else {
      TRELLIS_CHECK_MPI(MPI_Iallgather(send, count, type, out, count, type, comm(), push(*p)));
    }
    return p;
  }

  std::unique_ptr<detail::MpiPending> start_reduce_scatter(const void* in, void* out, std::size_t n, DType t,
                                                           ReduceOp op, std::source_location where,
                                                           bool async = false) {
    const int count = detail::mpi_count(n, "reduce_scatter");
    const std::size_t total = n * static_cast<std::size_t>(state_->size);
    auto p = begin(OpKind::reduce_scatter, t, n, -1, op, where, true);
    const bool blocking = !async && direct();
    if (detail::mpi_widens(t, op)) {
      // Reduced in place in the staging buffer; block 0 of it holds this rank's result.
      p->staging = Buffer<float>(total, false);
      detail::mpi_widen_16(in, p->staging.data(), total, t);
      set_narrow(*p, out, n, t, op);
      if (blocking) {
        TRELLIS_CHECK_MPI(MPI_Reduce_scatter_block(MPI_IN_PLACE, p->staging.data(), count, MPI_FLOAT, detail::mpi_reduce_op(op, DType::f32), comm()));
      } else {
        TRELLIS_CHECK_MPI(MPI_Ireduce_scatter_block(MPI_IN_PLACE, p->staging.data(), count, MPI_FLOAT, detail::mpi_reduce_op(op, DType::f32), comm(), push(*p)));
      }
      return p;
    }
    set_divide(*p, out, n, t, op);
    const void* send = copy_if_overlapping(*p, in, total * dtype_size(t), out, n * dtype_size(t));
    if (blocking) {
      TRELLIS_CHECK_MPI(MPI_Reduce_scatter_block(send, out, count, detail::mpi_datatype(t), detail::mpi_reduce_op(op, t), comm()));
    } else {
      TRELLIS_CHECK_MPI(MPI_Ireduce_scatter_block(send, out, count, detail::mpi_datatype(t), detail::mpi_reduce_op(op, t), comm(), push(*p)));
    }
    return p;
  }

  std::unique_ptr<detail::MpiPending> start_all_to_all(const void* in, void* out, std::size_t n, DType t,
                                                       std::source_location where) {
    const int count = detail::mpi_count(n, "all_to_all");
    const std::size_t bytes = n * dtype_size(t) * static_cast<std::size_t>(state_->size);
    auto p = begin(OpKind::all_to_all, t, n, -1, ReduceOp::sum, where, true);
    const void* send = copy_if_overlapping(*p, in, bytes, out, bytes);
    MPI_Datatype type = detail::mpi_datatype(t);
    if (direct()) {
      TRELLIS_CHECK_MPI(MPI_Alltoall(send, count, type, out, count, type, comm()));
    } else {
      TRELLIS_CHECK_MPI(MPI_Ialltoall(send, count, type, out, count, type, comm(), push(*p)));
    }
    return p;
  }

  std::unique_ptr<detail::MpiPending> start_all_to_allv(const void* in, std::span<const std::size_t> send_counts,
                                                        std::span<const std::size_t> send_displs, void* out,
                                                        std::span<const std::size_t> recv_counts,
                                                        std::span<const std::size_t> recv_displs, DType t,
                                                        std::source_location where) {
    const auto n = static_cast<std::size_t>(state_->size);
    if (send_counts.size() != n || send_displs.size() != n || recv_counts.size() != n || recv_displs.size() != n)
      TRELLIS_THROW("all_to_allv: counts and displacements need one entry per rank (", n, "), got ",
                    send_counts.size(), ", ", send_displs.size(), ", ", recv_counts.size(), ", ",
                    recv_displs.size());
    std::vector<int> counts(4 * n);
    std::size_t send_end = 0, recv_end = 0;
    for (std::size_t r = 0; r < n; ++r) {
      counts[r] = detail::mpi_count(send_counts[r], "all_to_allv send count");
      counts[n + r] = detail::mpi_count(send_displs[r], "all_to_allv send displacement");
      counts[2 * n + r] = detail::mpi_count(recv_counts[r], "all_to_allv recv count");
      counts[3 * n + r] = detail::mpi_count(recv_displs[r], "all_to_allv recv displacement");
      send_end = std::max(send_end, send_displs[r] + send_counts[r]);
      recv_end = std::max(recv_end, recv_displs[r] + recv_counts[r]);
    }
    auto p = begin(OpKind::all_to_allv, t, 0, -1, ReduceOp::sum, where, true);
    p->counts = std::move(counts);
    const int* c = p->counts.data();
    state_->check_exchange_counts(p->call, c, c + 2 * n);
    const void* send = copy_if_overlapping(*p, in, send_end * dtype_size(t), out, recv_end * dtype_size(t));
    MPI_Datatype type = detail::mpi_datatype(t);
    if (direct()) {
      TRELLIS_CHECK_MPI(MPI_Alltoallv(send, c, c + n, type, out, c + 2 * n, c + 3 * n, type, comm()));
    } else {
      TRELLIS_CHECK_MPI(MPI_Ialltoallv(send, c, c + n, type, out, c + 2 * n, c + 3 * n, type, comm(), push(*p)));
    }
    return p;
  }

  std::unique_ptr<detail::MpiPending> start_p2p(P2POp::Kind kind, void* buffer, std::size_t n, DType t, int peer,
                                                int tag, std::source_location where) {
    const bool is_send = kind == P2POp::Kind::send;
    const int count = detail::mpi_count(n, is_send ? "send" : "recv");
    check_p2p_args(peer, tag, is_send ? "send" : "recv");
    auto p = begin(is_send ? OpKind::send : OpKind::recv, t, n, peer, ReduceOp::sum, where, false);
    MPI_Datatype type = detail::mpi_datatype(t);
    if (is_send) {
      TRELLIS_CHECK_MPI(MPI_Isend(buffer, count, type, peer, tag, comm(), push(*p)));
    } else {
      TRELLIS_CHECK_MPI(MPI_Irecv(buffer, count, type, peer, tag, comm(), push(*p)));
      p->finish = detail::MpiPending::Finish::check_recv_counts;
      p->expected_counts.push_back(n);
      p->dtypes.push_back(t);
      p->peers.push_back(peer);
    }
    return p;
  }

  void set_narrow(detail::MpiPending& p, void* out, std::size_t n, DType t, ReduceOp op) const {
    p.finish = detail::MpiPending::Finish::narrow;
    p.out = out;
    p.out_count = n;
    p.dtype = t;
    p.divisor = op == ReduceOp::avg ? state_->size : 1;
  }
  void set_divide(detail::MpiPending& p, void* out, std::size_t n, DType t, ReduceOp op) const {
    if (op != ReduceOp::avg || state_->size == 1) return;
    p.finish = detail::MpiPending::Finish::divide;
    p.out = out;
    p.out_count = n;
    p.dtype = t;
    p.divisor = state_->size;
  }

  // MPI forbids aliased send and receive buffers: overlapping input is copied to scratch first.
  static const void* copy_if_overlapping(detail::MpiPending& p, const void* in, std::size_t in_bytes,
                                         const void* out, std::size_t out_bytes) {
    const auto* a = static_cast<const std::byte*>(in);
    const auto* b = static_cast<const std::byte*>(out);
    if (in_bytes == 0 || out_bytes == 0 || a + in_bytes <= b || b + out_bytes <= a) return in;
    p.scratch = Buffer<std::byte>(in_bytes, false);
    std::memcpy(p.scratch.data(), in, in_bytes);
    return p.scratch.data();
  }

  std::shared_ptr<detail::MpiCommState> state_;
};

static_assert(Communicator<MpiComm>);

}  // namespace trellis::comm
