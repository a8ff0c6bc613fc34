// MpiComm: the Communicator over an MPI communicator (OpenMPI), for multi-process and multi-node
// CPU runs under mpirun; MpiWorld: MPI's lifetime plus run(fn), shaped like ThreadWorld.
//
// How it maps onto MPI:
//  - every MpiComm owns two duplicates of the communicator it was built from: one for the data
//    (MPI_ERRORS_RETURN set, so every failure becomes a trellis::Error) and one private control
//    channel for the debug-mode fingerprint exchange, so neither disturbs the user's tags.
//  - blocking operations are the nonblocking MPI call (MPI_I*) plus a test loop with a deadline:
//    yield first, then sleep a little (no hot spin), and raise Error when the timeout passes.
//    With the timeout switched off (set_timeout(0ms)) the blocking MPI call itself is used.
//  - half and bfloat16 travel as a committed 2-byte user MPI_Datatype. min/max reduce them with
//    user MPI_Ops (exact); sum/avg/prod widen to float, reduce in float and round once at the
//    end, as the thread backend does. avg = sum, then divide by size() (integers truncate).
//  - debug mode (TRELLIS_COMM_DEBUG=1 or set_debug(true)): before each collective every rank
//    sends its OpFingerprint to every other rank (an all-gather written as point-to-point, so a
//    partial arrival is visible). A mismatch raises on every rank naming the odd rank and both
//    calls; a timeout there names exactly the ranks whose fingerprint never came.
//  - outside debug mode MPI gives no partial view of a collective in flight, so a rank whose
//    collective times out asks every peer, on the control channel, which call it is waiting in:
//    ranks waiting in a collective of this communicator answer from their wait loop (a probe
//    once a wait has lasted a millisecond: nothing on fast calls), and the error names the ranks
//    that neither answered nor asked themselves within a grace period (timeout/4, 50 ms..2 s),
//    plus any rank waiting in a different call.
// After a timeout the communicator is unusable (the MPI operation may still be in flight and is
// kept alive, with its staging buffers, until the communicator is destroyed); later calls raise.
// Needs MPI (the header's name contains "mpi": built only with trellis::mpi).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <source_location>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/comm/recorder.hpp"
#include "trellis/core/buffer.hpp"
#include "trellis/core/check_mpi.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

class MpiComm;

namespace detail {

// ---- datatypes and reduction operators ---------------------------------------------------------

// MPI user function: inout[i] = min/max(in[i], inout[i]) for a 16-bit float type, compared in float.
template <class T, bool IsMax>
void mpi_min_max_16(void* in, void* inout, int* len, MPI_Datatype*) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = static_cast<float>(a[i]);
    const float y = static_cast<float>(b[i]);
    if (IsMax ? (x > y) : (x < y)) b[i] = a[i];
  }
}

// The user datatypes and operators for half / bfloat16, created on first use (after MPI_Init)
// and left to MPI_Finalize.
struct MpiTypes16 {
  MPI_Datatype half = MPI_DATATYPE_NULL;
  MPI_Datatype bf16 = MPI_DATATYPE_NULL;
  MPI_Op half_min = MPI_OP_NULL, half_max = MPI_OP_NULL;
  MPI_Op bf16_min = MPI_OP_NULL, bf16_max = MPI_OP_NULL;
};

inline const MpiTypes16& mpi_types_16() {
  static const MpiTypes16 types = [] {
    MpiTypes16 t;
    TRELLIS_CHECK_MPI(MPI_Type_contiguous(2, MPI_BYTE, &t.half));
    TRELLIS_CHECK_MPI(MPI_Type_set_name(t.half, "trellis_half"));
    TRELLIS_CHECK_MPI(MPI_Type_commit(&t.half));
    TRELLIS_CHECK_MPI(MPI_Type_contiguous(2, MPI_BYTE, &t.bf16));
    TRELLIS_CHECK_MPI(MPI_Type_set_name(t.bf16, "trellis_bfloat16"));
    TRELLIS_CHECK_MPI(MPI_Type_commit(&t.bf16));
    TRELLIS_CHECK_MPI(MPI_Op_create(&mpi_min_max_16<half, false>, 1, &t.half_min));
    TRELLIS_CHECK_MPI(MPI_Op_create(&mpi_min_max_16<half, true>, 1, &t.half_max));
    TRELLIS_CHECK_MPI(MPI_Op_create(&mpi_min_max_16<bfloat16, false>, 1, &t.bf16_min));
    TRELLIS_CHECK_MPI(MPI_Op_create(&mpi_min_max_16<bfloat16, true>, 1, &t.bf16_max));
    return t;
  }();
  return types;
}

constexpr bool mpi_is_float16(DType t) { return t == DType::f16 || t == DType::bf16; }

// sum/avg/prod of 16-bit floats go through a float staging buffer (one rounding at the end).
constexpr bool mpi_widens(DType t, ReduceOp op) {
  return mpi_is_float16(t) && (op == ReduceOp::sum || op == ReduceOp::avg || op == ReduceOp::prod);
}

inline MPI_Datatype mpi_datatype(DType t) {
  switch (t) {
    case DType::f32: return MPI_FLOAT;
    case DType::f64: return MPI_DOUBLE;
    case DType::f16: return mpi_types_16().half;
    case DType::bf16: return mpi_types_16().bf16;
    case DType::i8: return MPI_INT8_T;
    case DType::u8: return MPI_UINT8_T;
    case DType::i32: return MPI_INT32_T;
    case DType::u32: return MPI_UINT32_T;
    case DType::i64: return MPI_INT64_T;
    case DType::u64: return MPI_UINT64_T;
  }
  TRELLIS_THROW("no MPI datatype for dtype ", static_cast<int>(t));
}

// The MPI operator for `op` on data of type `t` as it is handed to MPI (after widening).
inline MPI_Op mpi_reduce_op(ReduceOp op, DType t) {
  if (mpi_is_float16(t)) {
    const MpiTypes16& types = mpi_types_16();
    if (op == ReduceOp::min) return t == DType::f16 ? types.half_min : types.bf16_min;
    if (op == ReduceOp::max) return t == DType::f16 ? types.half_max : types.bf16_max;
    TRELLIS_THROW("internal: 16-bit ", reduce_op_name(op), " must be widened to float first");
  }
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return MPI_SUM;
    case ReduceOp::prod: return MPI_PROD;
    case ReduceOp::min: return MPI_MIN;
    case ReduceOp::max: return MPI_MAX;
  }
  TRELLIS_THROW("unknown reduce op ", static_cast<int>(op));
}

inline void mpi_widen_16(const void* src, float* dst, std::size_t n, DType t) {
  if (t == DType::f16) {
    const half* s = static_cast<const half*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
  } else {
    const bfloat16* s = static_cast<const bfloat16*>(src);
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
  }
}

// Rounds once to the 16-bit type; divides by `divisor` first (in float) when it is not 1.
inline void mpi_narrow_16(const float* src, void* dst, std::size_t n, DType t, int divisor) {
  const float d = static_cast<float>(divisor);
  if (t == DType::f16) {
    half* o = static_cast<half*>(dst);
    for (std::size_t i = 0; i < n; ++i) o[i] = half(divisor == 1 ? src[i] : src[i] / d);
  } else {
    bfloat16* o = static_cast<bfloat16*>(dst);
    for (std::size_t i = 0; i < n; ++i) o[i] = bfloat16(divisor == 1 ? src[i] : src[i] / d);
  }
}

template <class T>
void mpi_divide_typed(void* data, std::size_t n, int divisor) {
  T* p = static_cast<T*>(data);
  const T d = static_cast<T>(divisor);
  for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / d);
}

// avg's second half for types MPI reduced natively: x / size (integers: truncating division).
inline void mpi_divide_in_place(void* data, std::size_t n, DType t, int divisor) {
  switch (t) {
    case DType::f32: return mpi_divide_typed<float>(data, n, divisor);
    case DType::f64: return mpi_divide_typed<double>(data, n, divisor);
    case DType::i8: return mpi_divide_typed<std::int8_t>(data, n, divisor);
    case DType::u8: return mpi_divide_typed<std::uint8_t>(data, n, divisor);
    case DType::i32: return mpi_divide_typed<std::int32_t>(data, n, divisor);
    case DType::u32: return mpi_divide_typed<std::uint32_t>(data, n, divisor);
    case DType::i64: return mpi_divide_typed<std::int64_t>(data, n, divisor);
    case DType::u64: return mpi_divide_typed<std::uint64_t>(data, n, divisor);
    case DType::f16:
    case DType::bf16: break;
  }
  TRELLIS_THROW("internal: 16-bit avg is divided while narrowing");
}

// MPI counts are int: larger operations are refused with a clear message.
inline int mpi_count(std::size_t n, const char* what) {
  if (n > static_cast<std::size_t>(INT_MAX)) [[unlikely]]
    TRELLIS_THROW(what, ": ", n, " elements exceed MPI's int count limit (", INT_MAX, ")");
  return static_cast<int>(n);
}

// ---- environment -------------------------------------------------------------------------------

inline bool mpi_env_debug() {
  const char* v = std::getenv("TRELLIS_COMM_DEBUG");
  return v && *v && std::strcmp(v, "0") != 0;
}

// TRELLIS_COMM_TIMEOUT_MS, or 60 s (as the thread backend); 0 (or less) switches the timeout off.
inline std::chrono::milliseconds mpi_env_timeout() {
  if (const char* v = std::getenv("TRELLIS_COMM_TIMEOUT_MS"); v && *v) {
    char* end = nullptr;
    long long ms = std::strtoll(v, &end, 10);
    if (end && *end == '\0') return std::chrono::milliseconds(ms);
  }
  return std::chrono::seconds(60);
}

// ---- operations in flight ----------------------------------------------------------------------

// Everything one started operation needs until it completes: the MPI requests, the buffers MPI
// reads or writes (staging copies, int count arrays) and what to do once it is done. Heap
// allocated so its addresses stay put while requests are moved around or abandoned.
struct MpiPending {
  enum class Finish : std::uint8_t { none, divide, narrow, check_recv_counts };

  std::vector<MPI_Request> requests;
  std::vector<MPI_Status> statuses;
  OpFingerprint call;
  Finish finish = Finish::none;
  void* out = nullptr;           // final destination (narrow / divide)
  std::size_t out_count = 0;
  DType dtype = DType::f32;
  int divisor = 1;
  Buffer<float> staging;         // widened 16-bit data
  Buffer<std::byte> scratch;     // input copies where input and output overlap
  std::vector<int> counts;       // all_to_allv: send counts, send displs, recv counts, recv displs
  std::vector<std::size_t> expected_counts;  // batch/recv: elements each receive must bring (or SIZE_MAX)
  std::vector<DType> dtypes;                 // batch/recv: the element type of each request
  std::vector<int> peers;                    // batch/recv: the peer of each request

  // Polls once; true when every request has completed (errors raise).
  bool test() {
    if (requests.empty()) return true;
    int flag = 0;
    statuses.resize(requests.size());
    int rc = MPI_Testall(static_cast<int>(requests.size()), requests.data(), &flag, statuses.data());
    if (rc == MPI_ERR_IN_STATUS) {
      for (const MPI_Status& s : statuses)
        if (s.MPI_ERROR != MPI_ERR_PENDING) TRELLIS_CHECK_MPI(s.MPI_ERROR);
    }
    TRELLIS_CHECK_MPI(rc);
    return flag != 0;
  }

  // Runs the finishing step once all requests completed.
  void complete() {
    switch (finish) {
      case Finish::none: break;
      case Finish::divide: mpi_divide_in_place(out, out_count, dtype, divisor); break;
      case Finish::narrow: mpi_narrow_16(staging.data(), out, out_count, dtype, divisor); break;
      case Finish::check_recv_counts:
        for (std::size_t i = 0; i < expected_counts.size() && i < statuses.size(); ++i) {
          if (expected_counts[i] == SIZE_MAX) continue;
          int got = 0;
          TRELLIS_CHECK_MPI(MPI_Get_count(&statuses[i], mpi_datatype(dtypes[i]), &got));
          if (static_cast<std::size_t>(got) != expected_counts[i])
            TRELLIS_THROW("recv from rank ", peers[i], ": expected ", expected_counts[i], " ",
                          dtype_name(dtypes[i]), " elements, the message held ", got);
        }
        break;
    }
    finish = Finish::none;
  }
};

// Waits for `pending` with polite polling until `deadline` (none when `forever`); true if done.
// `idle()` runs between polls once the wait has lasted a millisecond (fast calls never run it).
template <class Idle>
inline bool mpi_wait_until(MpiPending& pending, std::chrono::steady_clock::time_point deadline, bool forever,
                           Idle&& idle) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  for (;;) {
    if (pending.test()) return true;
    const auto now = clock::now();
    if (!forever && now >= deadline) return false;
    const auto waited = std::chrono::duration_cast<std::chrono::microseconds>(now - start);
    if (waited >= std::chrono::milliseconds(1)) idle();
    if (waited < std::chrono::microseconds(200)) {
      std::this_thread::yield();
    } else {
      // Sleep about 1/16 of the time waited so far, between 20 us and 1 ms: short operations keep
      // a low latency, long ones cost little CPU (other ranks may share this core).
      std::this_thread::sleep_for(std::clamp(waited / 16, std::chrono::microseconds(20), std::chrono::microseconds(1000)));
    }
  }
}
inline bool mpi_wait_until(MpiPending& pending, std::chrono::steady_clock::time_point deadline, bool forever) {
  return mpi_wait_until(pending, deadline, forever, [] {});
}

// A small message this rank sent on the control channel (arrival query or answer), kept alive
// until MPI is done with it.
struct MpiControlSend {
  OpFingerprint fp;
  MPI_Request request = MPI_REQUEST_NULL;
};

// The state of one MpiComm, shared with its requests (a request may outlive a moved communicator
// handle, never the state).
struct MpiCommState {
  MPI_Comm comm = MPI_COMM_NULL;     // data traffic
  MPI_Comm control = MPI_COMM_NULL;  // debug fingerprint exchange, arrival queries
  int rank = 0;
  int size = 1;
  std::vector<int> world_ranks;      // world rank of each rank of this communicator
  bool world_order = true;           // rank r is world rank r for every r, and all are here
  FlightRecorder recorder;
  bool debug = false;
  std::chrono::milliseconds timeout{0};
  std::uint64_t collectives = 0;     // collective sequence number (equal on every rank)
  int tag_upper_bound = 32767;       // MPI_TAG_UB (the standard's minimum until queried)
  std::string failure;               // why the communicator is unusable; empty while healthy
  std::vector<std::unique_ptr<MpiPending>> abandoned;  // timed-out operations, maybe in flight
  // Arrival queries (a collective timed out without debug mode): the last query each rank sent
  // here, i.e. the call it was waiting in when it timed out, and our sends still in flight.
  static constexpr int arrival_query_tag = 1, arrival_answer_tag = 2;  // control channel (0: debug)
  std::vector<std::optional<OpFingerprint>> queried_from;
  std::vector<std::unique_ptr<MpiControlSend>> control_sends;

  MpiCommState() = default;
  MpiCommState(const MpiCommState&) = delete;
  MpiCommState& operator=(const MpiCommState&) = delete;

  ~MpiCommState() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    for (auto& p : abandoned) {
      int flag = 0;
      if (!p->requests.empty())
        MPI_Testall(static_cast<int>(p->requests.size()), p->requests.data(), &flag, MPI_STATUSES_IGNORE);
      // Still in flight: MPI may write into its buffers later, so they are never freed.
      if (!p->requests.empty() && !flag) (void)p.release();
    }
    for (auto& c : control_sends) {
      int flag = 0;
      MPI_Test(&c->request, &flag, MPI_STATUS_IGNORE);
      if (!flag) (void)c.release();  // 24 bytes MPI may still read
    }
    if (control != MPI_COMM_NULL) MPI_Comm_free(&control);
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }

  // "rank 2" or, in a communicator whose ranks are not the world's, "rank 2 (world rank 5)".
  std::string name_rank(int r) const {
    std::ostringstream out;
    out << "rank " << r;
    if (!world_order && r >= 0 && r < static_cast<int>(world_ranks.size()))
      out << " (world rank " << world_ranks[r] << ")";
    return out.str();
  }

  std::string where() const {
    std::ostringstream out;
    out << "on rank " << rank << " of " << size << " of communicator '" << recorder.label() << "'";
    return out.str();
  }

  void check_usable() const {
    if (!failure.empty()) [[unlikely]]
      TRELLIS_THROW("communicator '", recorder.label(), "' is unusable after an earlier failure: ", failure);
  }

  bool forever() const { return timeout.count() <= 0; }

  std::chrono::steady_clock::time_point deadline() const {
    return std::chrono::steady_clock::now() + (forever() ? std::chrono::milliseconds(0) : timeout);
  }

  // Raises the timeout error for `call`, keeping the operation's buffers alive for MPI.
  [[noreturn]] void timed_out(std::unique_ptr<MpiPending> pending, const OpFingerprint& call,
                              const std::string& who) {
    recorder.failed(call.seq);
    std::ostringstream out;
    out << call.describe() << " timed out after " << timeout.count() << " ms " << where() << ": "
        << who << ". The communicator is unusable from now on.\n"
        << recorder.dump(8);
    failure = out.str();
    if (pending) abandoned.push_back(std::move(pending));
    TRELLIS_THROW(failure);
  }

  // Waits for a started operation (blocking form) and finishes it.
  void finish(std::unique_ptr<MpiPending> pending) {
    const OpFingerprint call = pending->call;
    bool timed = false;
    try {
      const bool collective = !op_is_point_to_point(call.kind) && size > 1;
      const auto answer = [&] {
        if (collective) answer_arrival_queries(call);
      };
      if (!mpi_wait_until(*pending, deadline(), forever(), answer)) {
        std::string who;
        if (collective) who = ask_who_arrived(*pending, call);
        else who = "the peer never posted its side";
        if (!who.empty()) {  // (empty: a late rank arrived while we asked, and the call completed)
          if (debug) who = "every rank passed the debug fingerprint check; " + who;
          timed = true;
          timed_out(std::move(pending), call, who);
        }
      }
      pending->complete();
    } catch (const Error& e) {
      recorder.failed(call.seq);
      if (timed) throw;  // the timeout error, complete already
      throw Error(call.describe() + " failed " + where() + ": " + e.message(), e.file(), e.line(), e.rank());
    } catch (...) {
      recorder.failed(call.seq);
      throw;
    }
    recorder.completed(call.seq);
  }

  // Sends `fp` to `peer` on the control channel with `tag` (nonblocking; kept until done).
  void send_control(const OpFingerprint& fp, int peer, int tag) {
    std::erase_if(control_sends, [](const std::unique_ptr<MpiControlSend>& c) {
      int flag = 0;
      MPI_Test(&c->request, &flag, MPI_STATUS_IGNORE);
      return flag != 0;
    });
    auto c = std::make_unique<MpiControlSend>();
    c->fp = fp;
    TRELLIS_CHECK_MPI(MPI_Isend(&c->fp, static_cast<int>(sizeof(OpFingerprint)), MPI_BYTE, peer, tag, control, &c->request));
    control_sends.push_back(std::move(c));
  }

  // While waiting in `current` (for a millisecond or more): answers every arrival query that came
  // in with the call this rank is waiting in, and remembers who asked about which call.
  void answer_arrival_queries(const OpFingerprint& current) {
    if (queried_from.size() != static_cast<std::size_t>(size)) queried_from.assign(static_cast<std::size_t>(size), std::nullopt);
    OpFingerprint asked;
    int source = 0;
    while (receive_control(arrival_query_tag, asked, source)) {
      queried_from[static_cast<std::size_t>(source)] = asked;
      send_control(current, source, arrival_answer_tag);
    }
  }

  // Receives one fingerprint with `tag` from any rank if one has come (a matched probe, so that
  // two threads waiting on requests of this communicator cannot take each other's message).
  bool receive_control(int tag, OpFingerprint& fp, int& source) {
    int flag = 0;
    MPI_Message message;
    MPI_Status status;
    TRELLIS_CHECK_MPI(MPI_Improbe(MPI_ANY_SOURCE, tag, control, &flag, &message, &status));
    if (!flag) return false;
    source = status.MPI_SOURCE;
    TRELLIS_CHECK_MPI(MPI_Mrecv(&fp, static_cast<int>(sizeof(OpFingerprint)), MPI_BYTE, &message, MPI_STATUS_IGNORE));
    return true;
  }

  // A collective timed out: asks every peer which call it is waiting in (the peers that wait in a
  // collective of this communicator answer from their wait loop; a rank that timed out first has
  // asked us already) and names the ranks that neither answered nor asked within a grace period.
  // Returns "" if the call completed meanwhile (a late rank arrived). Costs nothing before the
  // timeout: the only per-call work is a probe while a wait has lasted over a millisecond.
  std::string ask_who_arrived(MpiPending& pending, const OpFingerprint& call) {
    answer_arrival_queries(call);
    for (int peer = 0; peer < size; ++peer)
      if (peer != rank) send_control(call, peer, arrival_query_tag);
    std::vector<std::optional<OpFingerprint>> answered(static_cast<std::size_t>(size));
    const auto grace = std::clamp(timeout / 4, std::chrono::milliseconds(50), std::chrono::milliseconds(2000));
    const auto until = std::chrono::steady_clock::now() + grace;
    // A query about an earlier collective is stale (that rank got past it, since we did).
    const auto asked_now = [&](int r) { return queried_from[r] && queried_from[r]->seq >= call.seq; };
    const auto known = [&](int r) { return r == rank || answered[r] || asked_now(r); };
    for (;;) {
      if (pending.test()) return "";
      answer_arrival_queries(call);
      OpFingerprint fp;
      int source = 0;
      while (receive_control(arrival_answer_tag, fp, source))
        if (fp.seq >= call.seq) answered[static_cast<std::size_t>(source)] = fp;  // else: an old round's
      bool all_known = true;
      for (int r = 0; r < size; ++r) all_known = all_known && known(r);
      if (all_known || std::chrono::steady_clock::now() >= until) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::vector<int> missing;
    std::ostringstream elsewhere;
    for (int r = 0; r < size; ++r) {
      if (!known(r)) {
        missing.push_back(r);
        continue;
      }
      if (r == rank) continue;
      const OpFingerprint& fp = answered[r] ? *answered[r] : *queried_from[r];  // known(r): one is set
      if (!same_call(fp, call)) elsewhere << "; " << name_rank(r) << " is waiting in " << fp.describe();
    }
    std::ostringstream who;
    if (missing.empty()) {
      who << "every rank answered from a collective of this communicator";
    } else {
      who << (missing.size() == 1 ? "rank " : "ranks ");
      for (std::size_t i = 0; i < missing.size(); ++i) who << (i ? ", " : "") << name_rank(missing[i]).substr(5);
      who << " did not arrive (no answer to an arrival query within " << grace.count()
          << " ms: not waiting in a collective of this communicator)";
    }
    who << elsewhere.str();
    return who.str();
  }

  // Debug mode: every rank learns every rank's fingerprint of this collective, then each raises
  // the same error when they differ. Written as point-to-point so that a timeout can name the
  // ranks whose fingerprint never came.
  void check_fingerprints(const OpFingerprint& call) {
    if (!debug || size == 1) return;
    auto exchange = std::make_unique<MpiPending>();
    exchange->call = call;
    exchange->scratch = Buffer<std::byte>(sizeof(OpFingerprint) * static_cast<std::size_t>(size + 1));
    auto* all = reinterpret_cast<OpFingerprint*>(exchange->scratch.data());
    auto* mine = all + size;
    *mine = call;
    all[rank] = call;
    const int bytes = static_cast<int>(sizeof(OpFingerprint));
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      MPI_Request r;
      TRELLIS_CHECK_MPI(MPI_Irecv(&all[peer], bytes, MPI_BYTE, peer, 0, control, &r));
      exchange->requests.push_back(r);
      exchange->peers.push_back(peer);
    }
    const std::size_t receives = exchange->requests.size();
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      MPI_Request r;
      TRELLIS_CHECK_MPI(MPI_Isend(mine, bytes, MPI_BYTE, peer, 0, control, &r));
      exchange->requests.push_back(r);
    }
    if (!mpi_wait_until(*exchange, deadline(), forever())) {
      std::vector<int> missing, arrived;
      for (std::size_t i = 0; i < receives; ++i) {
        int flag = 0;
        TRELLIS_CHECK_MPI(MPI_Test(&exchange->requests[i], &flag, MPI_STATUS_IGNORE));
        if (flag) {
          arrived.push_back(exchange->peers[i]);
        } else {
          missing.push_back(exchange->peers[i]);
          MPI_Cancel(&exchange->requests[i]);
          MPI_Wait(&exchange->requests[i], MPI_STATUS_IGNORE);
        }
      }
      std::ostringstream who;
      who << (missing.size() == 1 ? "rank " : "ranks ");
      for (std::size_t i = 0; i < missing.size(); ++i) who << (i ? ", " : "") << name_rank(missing[i]).substr(5);
      if (missing.empty()) {
        who.str("");
        who << "every rank's fingerprint arrived but this rank's own sends did not complete";
      } else {
        who << " did not arrive (debug fingerprint exchange)";
      }
      for (int r : arrived) {
        if (!same_call(all[r], call)) who << "; rank " << r << " arrived with " << all[r].describe();
      }
      timed_out(std::move(exchange), call, who.str());
    }
    if (auto mismatch = find_fingerprint_mismatch(std::span<const OpFingerprint>(all, size))) {
      recorder.failed(call.seq);
      TRELLIS_THROW(*mismatch, " (communicator '", recorder.label(), "')\n", recorder.dump(8));
    }
  }

  // Debug mode, all_to_allv: what each rank sends to each peer must be what that peer expects.
  // Every rank learns every disagreement (one all-to-all and one all-gather of int triples on the
  // control communicator, under the deadline) and raises the same error.
  void check_exchange_counts(const OpFingerprint& call, const int* send_counts, const int* recv_counts) {
    if (!debug || size == 1) return;
    const auto n = static_cast<std::size_t>(size);
    auto p = std::make_unique<MpiPending>();
    p->call = call;
    p->counts.assign(n + 3 + 3 * n, 0);
    int* announced = p->counts.data();  // announced[j]: what rank j says it sends here
    TRELLIS_CHECK_MPI(MPI_Ialltoall(send_counts, 1, MPI_INT, announced, 1, MPI_INT, control, &p->requests.emplace_back()));
    if (!mpi_wait_until(*p, deadline(), forever()))
      timed_out(std::move(p), call, "some rank did not arrive at the debug check of all_to_allv counts");
    p->requests.clear();
    int* mine = announced + n;  // first disagreement seen here: (sender, sent, expected) or -1
    mine[0] = -1;
    for (int j = 0; j < size; ++j) {
      if (announced[j] != recv_counts[j]) {
        mine[0] = j, mine[1] = announced[j], mine[2] = recv_counts[j];
        break;
      }
    }
    int* everyone = mine + 3;
    TRELLIS_CHECK_MPI(MPI_Iallgather(mine, 3, MPI_INT, everyone, 3, MPI_INT, control, &p->requests.emplace_back()));
    if (!mpi_wait_until(*p, deadline(), forever()))
      timed_out(std::move(p), call, "some rank did not arrive at the debug check of all_to_allv counts");
    std::ostringstream out;
    for (int r = 0; r < size; ++r) {
      const int* e = everyone + 3 * r;
      if (e[0] < 0) continue;
      out << (out.tellp() > 0 ? "; " : "") << "rank " << r << " expects " << e[2] << " elements from rank "
          << e[0] << ", which sends " << e[1];
    }
    if (out.tellp() > 0) {
      recorder.failed(call.seq);
      TRELLIS_THROW(call.describe(), ": send and receive counts disagree: ", out.str(), " (communicator '",
                    recorder.label(), "')");
    }
  }
};

}  // namespace detail

// A handle to an MPI operation in flight. wait() blocks until it completes (with the
// communicator's timeout) and finishes it (16-bit narrowing, avg division); test() polls and
// finishes it when done. Destroying an unfinished request waits for it (errors are swallowed:
// call wait() to see them).
class MpiRequest {
 public:
  MpiRequest() = default;
  MpiRequest(MpiRequest&&) noexcept = default;
  MpiRequest& operator=(MpiRequest&& other) noexcept {
    if (this != &other) {
      drain();
      state_ = std::move(other.state_);
      pending_ = std::move(other.pending_);
    }
    return *this;
  }
  MpiRequest(const MpiRequest&) = delete;
  MpiRequest& operator=(const MpiRequest&) = delete;
  ~MpiRequest() { drain(); }

  void wait() {
    if (!pending_) return;
    state_->finish(std::move(pending_));
  }

  // The host has one implicit stream: waiting "on" it is waiting.
  void wait_on(HostStream) { wait(); }

  bool test() {
    if (!pending_) return true;
    const std::uint64_t seq = pending_->call.seq;
    try {
      if (!pending_->test()) return false;
      pending_->complete();
    } catch (...) {
      state_->recorder.failed(seq);
      pending_.reset();
      throw;
    }
    state_->recorder.completed(seq);
    pending_.reset();
    return true;
  }

  // True until the operation completed and was finished by wait() or test().
  bool pending() const noexcept { return pending_ != nullptr; }

 private:
  friend class MpiComm;
  MpiRequest(std::shared_ptr<detail::MpiCommState> state, std::unique_ptr<detail::MpiPending> pending)
      : state_(std::move(state)), pending_(std::move(pending)) {}

  void drain() noexcept {
    if (!pending_) return;
    try {
      wait();
    } catch (...) {
    }
    pending_.reset();
  }

  std::shared_ptr<detail::MpiCommState> state_;
  std::unique_ptr<detail::MpiPending> pending_;
};

// The Communicator over MPI. Build one from any MPI_Comm (it is duplicated, never modified) or
// take the one MpiWorld::run hands out. Move-only; split() makes sub-communicators.
class MpiComm {
 public:
  using request_type = MpiRequest;
  using space = Host;  // buffers are host memory

  // Duplicates `comm` (collective over it). `label` names the communicator in errors and dumps.
  explicit MpiComm(MPI_Comm comm, std::string label = "mpi")
      : state_(std::make_shared<detail::MpiCommState>()) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    TRELLIS_CHECK(initialized && !finalized, "MpiComm needs MPI initialised and not finalised (use MpiWorld)");
    auto& s = *state_;
    TRELLIS_CHECK_MPI(MPI_Comm_dup(comm, &s.comm));
    TRELLIS_CHECK_MPI(MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN));
    TRELLIS_CHECK_MPI(MPI_Comm_dup(s.comm, &s.control));
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
  // hanging inside MPI_Comm_split.
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
    if (color < 0) color = MPI_UNDEFINED;
    auto p = begin(OpKind::split, DType::i32, 0, -1, ReduceOp::sum, where, true);
    p->counts.assign(static_cast<std::size_t>(2 * s.size + 2), 0);
    p->counts[0] = color;
    p->counts[1] = key;
    TRELLIS_CHECK_MPI(MPI_Iallgather(p->counts.data(), 2, MPI_INT, p->counts.data() + 2, 2, MPI_INT,
                                     comm(), push(*p)));
    run_blocking(std::move(p));
    MPI_Comm sub = MPI_COMM_NULL;
    TRELLIS_CHECK_MPI(MPI_Comm_split(comm(), color, key, &sub));
    if (sub == MPI_COMM_NULL) return std::nullopt;
    MpiComm result(adopt_tag{}, sub, s.recorder.label() + "/split(" + std::to_string(color) + ")");
    result.set_debug(s.debug);
    result.set_timeout(s.timeout);
    return result;
  }

 private:
  struct adopt_tag {};
  // Takes ownership of `comm` (fresh from MPI_Comm_split).
  MpiComm(adopt_tag, MPI_Comm comm, std::string label) : state_(std::make_shared<detail::MpiCommState>()) {
    auto& s = *state_;
    s.comm = comm;
    TRELLIS_CHECK_MPI(MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN));
    TRELLIS_CHECK_MPI(MPI_Comm_dup(s.comm, &s.control));
    TRELLIS_CHECK_MPI(MPI_Comm_set_errhandler(s.control, MPI_ERRORS_RETURN));
    init_state(std::move(label));
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

// MPI's lifetime for a program: initialises MPI (MPI_THREAD_MULTIPLE) unless it already is, and
// finalises it on destruction only if it initialised it. run(fn) calls fn(comm) with an MpiComm
// over MPI_COMM_WORLD, with this process's rank set for error messages (trellis::RankScope).
class MpiWorld {
 public:
  MpiWorld() : MpiWorld(nullptr, nullptr) {}
  MpiWorld(int& argc, char**& argv) : MpiWorld(&argc, &argv) {}

  MpiWorld(const MpiWorld&) = delete;
  MpiWorld& operator=(const MpiWorld&) = delete;

  ~MpiWorld() {
    if (!owns_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The thread support MPI gave (MPI_THREAD_MULTIPLE unless someone else initialised MPI lower).
  int thread_level() const { return thread_level_; }
  // True when this object initialised MPI (and so finalises it).
  bool owns_mpi() const { return owns_; }

  // A fresh communicator over MPI_COMM_WORLD (collective).
  MpiComm communicator(std::string label = "world") const { return MpiComm(MPI_COMM_WORLD, std::move(label)); }

  // Calls fn(comm) once in this process, as this process's rank; returns what fn returns.
  template <class Fn>
  decltype(auto) run(Fn&& fn) const {
    RankScope scope(rank_);
    MpiComm comm = communicator();
    return std::invoke(std::forward<Fn>(fn), comm);
  }

 private:
  MpiWorld(int* argc, char*** argv) {
    int initialized = 0;
    TRELLIS_CHECK_MPI(MPI_Initialized(&initialized));
    if (!initialized) {
      TRELLIS_CHECK_MPI(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &thread_level_));
      owns_ = true;
    } else {
      TRELLIS_CHECK_MPI(MPI_Query_thread(&thread_level_));
    }
    TRELLIS_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
    TRELLIS_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &size_));
  }

  bool owns_ = false;
  int thread_level_ = 0;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace trellis::comm
