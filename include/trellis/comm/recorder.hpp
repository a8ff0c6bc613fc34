// The safety layer shared by every communicator backend (threads, MPI, NCCL):
//  - OpFingerprint: a small POD describing one collective call (sequence number, operation,
//    dtype, count, root/peer, reduce op). In debug mode backends gather every rank's fingerprint
//    before a collective and call find_fingerprint_mismatch(), which names the odd rank and both
//    calls, so a mismatched program fails with a message instead of hanging or corrupting data.
//  - FlightRecorder: the last TRELLIS_RECORDER_DEPTH operations of one communicator on one rank,
//    with their call sites; dump() goes into every error the backend raises (timeouts, aborts),
//    so "which collective was each rank in?" is answered by the error message itself.
// Backend-neutral: no threads, MPI or CUDA here. A FlightRecorder is not thread-safe: the rank's
// own thread records and marks operations (async ones are marked when their request is waited).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <source_location>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/config.hpp"
#include "trellis/core/dtype.hpp"

namespace trellis::comm {

enum class OpKind : std::uint8_t {
  all_reduce,
  reduce,
  broadcast,
  all_gather,
  reduce_scatter,
  all_to_all,
  all_to_allv,
  barrier,
  send,
  recv,
  batch,
  split,
};

constexpr const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::all_reduce: return "all_reduce";
    case OpKind::reduce: return "reduce";
    case OpKind::broadcast: return "broadcast";
    case OpKind::all_gather: return "all_gather";
    case OpKind::reduce_scatter: return "reduce_scatter";
    case OpKind::all_to_all: return "all_to_all";
    case OpKind::all_to_allv: return "all_to_allv";
    case OpKind::barrier: return "barrier";
    case OpKind::send: return "send";
    case OpKind::recv: return "recv";
    case OpKind::batch: return "batch";
    case OpKind::split: return "split";
  }
  return "?";
}

// Which fields every rank must agree on for a collective of this kind.
constexpr bool op_has_reduce_op(OpKind kind) {
  return kind == OpKind::all_reduce || kind == OpKind::reduce || kind == OpKind::reduce_scatter;
}
constexpr bool op_has_root(OpKind kind) {
  return kind == OpKind::reduce || kind == OpKind::broadcast;
}
constexpr bool op_is_point_to_point(OpKind kind) {
  return kind == OpKind::send || kind == OpKind::recv || kind == OpKind::batch;
}
// all_to_allv counts legitimately differ per rank (their consistency is checked pairwise by the
// backend); barrier and split move no data of a given type.
constexpr bool op_count_must_match(OpKind kind) {
  return kind != OpKind::all_to_allv && kind != OpKind::barrier && kind != OpKind::split &&
         !op_is_point_to_point(kind);
}
constexpr bool op_has_dtype(OpKind kind) { return kind != OpKind::barrier && kind != OpKind::split; }

// One call, as every rank should see it. Trivially copyable with no implicit padding, so MPI and
// NCCL backends can gather it as raw bytes (MPI_BYTE, sizeof(OpFingerprint) per rank).
struct OpFingerprint {
  std::uint64_t seq = 0;     // per-communicator call number, starting at 0
  std::uint64_t count = 0;   // elements (per rank for all_gather/reduce_scatter/all_to_all blocks)
  std::int32_t root = -1;    // root (reduce, broadcast) or peer (send, recv); -1 if none
  OpKind kind = OpKind::barrier;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
  std::uint8_t reserved[1] = {};

  // The fields that every rank must agree on for a collective (seq, kind, and where they apply
  // dtype, count, root and reduce op).
  friend bool same_call(const OpFingerprint& a, const OpFingerprint& b) {
    if (a.seq != b.seq || a.kind != b.kind) return false;
    if (op_has_dtype(a.kind) && a.dtype != b.dtype) return false;
    if (op_count_must_match(a.kind) && a.count != b.count) return false;
    if (op_has_root(a.kind) && a.root != b.root) return false;
    if (op_has_reduce_op(a.kind) && a.op != b.op) return false;
    return true;
  }

  // e.g. "#12 all_reduce(float, count=1024, op=sum)".
  std::string describe() const {
    std::ostringstream out;
    out << '#' << seq << ' ' << op_kind_name(kind) << '(';
    const char* sep = "";
    if (op_has_dtype(kind)) {
      out << dtype_name(dtype);
      sep = ", ";
    }
    if (kind != OpKind::barrier && kind != OpKind::split) {
      out << sep << "count=" << count;
      sep = ", ";
    }
    if (op_has_root(kind)) {
      out << sep << "root=" << root;
      sep = ", ";
    } else if (kind == OpKind::send || kind == OpKind::recv) {
      out << sep << "peer=" << root;
      sep = ", ";
    }
    if (op_has_reduce_op(kind)) out << sep << "op=" << reduce_op_name(op);
    out << ')';
    return out.str();
  }
};
static_assert(std::is_trivially_copyable_v<OpFingerprint>);
static_assert(std::is_standard_layout_v<OpFingerprint>);
static_assert(sizeof(OpFingerprint) == 24, "OpFingerprint must have no implicit padding");

// Given the fingerprints of ranks 0..n-1 (index = rank) for the same call, returns nothing when
// they agree, else a message naming the odd rank(s) and both calls. The expected call is the
// majority; on a tie for the most common call, rank 0's call is taken as expected.
inline std::optional<std::string> find_fingerprint_mismatch(std::span<const OpFingerprint> all) {
  const std::size_t n = all.size();
  if (n < 2) return std::nullopt;
  std::size_t best = 0, best_votes = 0;
  bool tie = false;
  for (std::size_t i = 0; i < n; ++i) {
    std::size_t votes = 0;
    for (std::size_t j = 0; j < n; ++j) votes += same_call(all[i], all[j]) ? 1 : 0;
    if (votes > best_votes) {
      best = i, best_votes = votes, tie = false;
    } else if (votes == best_votes && !same_call(all[i], all[best])) {
      tie = true;
    }
  }
  if (best_votes == n) return std::nullopt;
  if (tie) best = 0;
  std::size_t agreeing = 0;
  std::ostringstream odd;
  std::size_t first_odd = n, odd_count = 0;
  for (std::size_t r = 0; r < n; ++r) {
    if (same_call(all[r], all[best])) {
      ++agreeing;
    } else {
      if (first_odd == n) first_odd = r;
      odd << (odd_count++ ? ", " : "") << r;
    }
  }
  std::ostringstream out;
  out << "collective mismatch: rank " << first_odd << " called " << all[first_odd].describe()
      << " but rank " << best;
  if (agreeing > 1) out << " (and " << (agreeing - 1) << " other rank" << (agreeing > 2 ? "s" : "") << ")";
  out << " called " << all[best].describe();
  if (odd_count > 1) out << "; ranks that differ: " << odd.str();
  for (std::size_t r = 0; r < n; ++r) {
    if (r != first_odd && !same_call(all[r], all[best]) && !same_call(all[r], all[first_odd])) {
      out << "; rank " << r << " called " << all[r].describe();
    }
  }
  return out.str();
}

// The last TRELLIS_RECORDER_DEPTH operations of one communicator on one rank.
class FlightRecorder {
 public:
  static constexpr std::size_t depth = TRELLIS_RECORDER_DEPTH;
  static_assert(depth > 0);

  enum class State : std::uint8_t { started, completed, failed };

  struct Entry {
    OpFingerprint call;
    std::source_location where;
    State state = State::started;
  };

  FlightRecorder() = default;
  FlightRecorder(std::string label, int rank, int size) { identify(std::move(label), rank, size); }

  // Names the communicator in dumps ("world", "world/split(1)" ...).
  void identify(std::string label, int rank, int size) {
    label_ = std::move(label);
    rank_ = rank;
    size_ = size;
  }
  const std::string& label() const { return label_; }

  // Records the start of a call and returns its fingerprint, with the next sequence number.
  OpFingerprint record(OpKind kind, DType dtype, std::size_t count, int root_or_peer, ReduceOp op,
                       std::source_location where = std::source_location::current()) {
    OpFingerprint fp;
    fp.seq = next_seq_++;
    fp.kind = kind;
    fp.dtype = dtype;
    fp.count = static_cast<std::uint64_t>(count);
    fp.root = root_or_peer;
    fp.op = op;
    Entry& e = ring_[fp.seq % depth];
    e.call = fp;
    e.where = where;
    e.state = State::started;
    return fp;
  }

  // Marks a recorded call done (or failed); ignored when it has left the ring already.
  void mark(std::uint64_t seq, State state) {
    if (seq >= next_seq_ || next_seq_ - seq > depth) return;
    Entry& e = ring_[seq % depth];
    if (e.call.seq == seq) e.state = state;
  }
  void completed(std::uint64_t seq) { mark(seq, State::completed); }
  void failed(std::uint64_t seq) { mark(seq, State::failed); }

  // Number of calls recorded so far (the next sequence number).
  std::uint64_t calls() const { return next_seq_; }

  // The most recent call, if any.
  std::optional<Entry> last() const {
    if (next_seq_ == 0) return std::nullopt;
    return ring_[(next_seq_ - 1) % depth];
  }

  // Oldest first, at most `max_entries` (the most recent ones).
  std::string dump(std::size_t max_entries = depth) const {
    std::ostringstream out;
    const std::uint64_t kept = next_seq_ < depth ? next_seq_ : depth;
    const std::uint64_t shown = kept < max_entries ? kept : max_entries;
    out << "flight recorder of communicator '" << label_ << "' (rank " << rank_ << " of " << size_
        << "): last " << shown << " of " << next_seq_ << " calls";
    for (std::uint64_t s = next_seq_ - shown; s < next_seq_; ++s) {
      const Entry& e = ring_[s % depth];
      out << "\n  " << e.call.describe() << " at " << e.where.file_name() << ':' << e.where.line()
          << " [" << state_name(e.state) << ']';
    }
    return out.str();
  }

  static constexpr const char* state_name(State s) {
    switch (s) {
      case State::started: return "started";
      case State::completed: return "completed";
      case State::failed: return "failed";
    }
    return "?";
  }

 private:
  std::array<Entry, depth> ring_{};
  std::uint64_t next_seq_ = 0;
  std::string label_ = "comm";
  int rank_ = -1;
  int size_ = 0;
};

}  // namespace trellis::comm
