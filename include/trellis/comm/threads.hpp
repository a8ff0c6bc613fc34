// The thread-rank backend: n ranks as n threads of one process, sharing memory.
//
//   trellis::comm::ThreadWorld world(4);
//   world.run([&](trellis::comm::ThreadComm& comm) { ... comm.all_reduce(x, x, n); ... });
//
// Algorithms (bandwidth-optimal for shared memory): every rank publishes its buffer pointers,
// then the message is cut into 64 KiB tasks that read and write peers' buffers directly, one
// 64-byte line at a time (accumulators in registers, each finished line stored straight into
// every destination, streaming stores for large messages), so every input byte is read once and
// every output byte written once -- the minimum -- with no staging copy:
//  - all_reduce: a task reduces one chunk over every rank's input and writes it into every
//    rank's output (a fused reduce-scatter + all-gather in one pass);
//  - reduce: the same, writing only into the root's output; reduce_scatter: a chunk of one
//    rank's block; all_gather: a chunk of one rank's input, read once, written into every
//    output; broadcast: a chunk of the root's buffer into every other rank's; all_to_all(v):
//    memcpy of one chunk.
// The tasks are cut into one contiguous region per rank: a rank claims its own region's tasks
// first (one sequential stream per core, which the memory system serves best), then helps with
// the other regions, so when ranks outnumber cores the ranks that are running do the work of
// those that are not. One barrier per collective (publish) plus a wait for the last task; no
// lock on the data path. The reduction order is fixed (rank 0, 1, ..., n-1 for every element,
// whoever runs the task) so results are deterministic and equal a serial left-to-right sum;
// half/bfloat16 reduce in float and round once; copies move bits (NaN payloads intact).
//
// Waiting: a short spin (none when ranks outnumber cores), then a futex sleep, so 8 ranks on 2
// cores stay fast. Every wait checks an abort flag (a rank's function threw: the others get
// "rank k failed: ..."), a deadline (set_timeout, env TRELLIS_COMM_TIMEOUT_MS, default 60 s: the
// error names the ranks that never joined) and whether the missing ranks already returned.
//
// Safety: every collective compares all ranks' fingerprints (operation, dtype, count, root,
// reduce op) after publishing, which costs nothing here, so a mismatched program raises an Error
// on every rank naming the odd rank and both calls; set_debug()/TRELLIS_COMM_DEBUG is accepted
// for parity with the MPI/NCCL backends, where the check costs an extra exchange. Each
// communicator keeps a FlightRecorder whose dump is part of every timeout/abort error.
//
// Point to point: per-destination mailboxes; whichever side arrives second copies (sends of at
// most eager_limit bytes are buffered and complete at once). isend/irecv/batch therefore progress
// without any thread. Async collectives run in order on a per-rank progress thread that sleeps on
// a condition variable until work arrives; blocking collectives first wait for pending async ones.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <source_location>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ctime>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "trellis/comm/communicator.hpp"
#include "trellis/comm/recorder.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

class ThreadComm;
class ThreadWorld;
class ThreadRequest;

namespace detail {

// ------------------------------------------------------------------------------------------------
// Waiting: spin briefly, then sleep on a futex word that every state change bumps.

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// A futex word plus a count of sleepers, so that notify() costs a syscall only when someone sleeps.
struct alignas(64) WakeWord {
  std::atomic<std::uint32_t> word{0};
  std::atomic<std::uint32_t> sleepers{0};

  void notify() {
    word.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) != 0) {
#if defined(__linux__)
      syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAKE_PRIVATE, INT_MAX,
              nullptr, nullptr, 0);
#endif
    }
  }

  // Sleeps while word == seen, at most `limit`.
  void sleep(std::uint32_t seen, std::chrono::nanoseconds limit) {
    sleepers.fetch_add(1, std::memory_order_seq_cst);
#if defined(__linux__)
    if (limit.count() < 1000) limit = std::chrono::nanoseconds(1000);
    timespec ts{};
    ts.tv_sec = static_cast<time_t>(limit.count() / 1000000000);
    ts.tv_nsec = static_cast<long>(limit.count() % 1000000000);
    if (word.load(std::memory_order_seq_cst) == seen) {
      syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&word), FUTEX_WAIT_PRIVATE, seen, &ts,
              nullptr, 0);
    }
#else
    if (word.load(std::memory_order_seq_cst) == seen)
      std::this_thread::sleep_for(std::min<std::chrono::nanoseconds>(limit, std::chrono::microseconds(100)));
#endif
    sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
};
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));

// Waits until done() holds: spins for spin_ns, then sleeps on `wake` in slices of at most 20 ms,
// calling check() (which throws on abort or deadline) between sleeps.
template <class Done, class Check>
void wait_until(WakeWord& wake, std::int64_t spin_ns, Done&& done, Check&& check) {
  if (done()) return;
  if (spin_ns > 0) {
    auto start = std::chrono::steady_clock::now();
    for (int i = 1;; ++i) {
      cpu_relax();
      if (done()) return;
      if ((i & 63) == 0 &&
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count() > spin_ns)
        break;
    }
  } else {
    std::this_thread::yield();
    if (done()) return;
  }
  for (;;) {
    std::uint32_t seen = wake.word.load(std::memory_order_seq_cst);
    if (done()) return;
    check();
    wake.sleep(seen, std::chrono::milliseconds(20));
  }
}

// ------------------------------------------------------------------------------------------------
// Copies for large messages: non-temporal stores skip the read-for-ownership of the destination
// (a third less memory traffic) when the data would not fit in cache anyway.

// Messages whose buffers (all ranks, inputs + outputs) exceed this many bytes use streaming stores.
#ifndef TRELLIS_COMM_STREAM_BYTES
#define TRELLIS_COMM_STREAM_BYTES (std::size_t{16} << 20)
#endif

inline void stream_copy(std::byte* dst, const std::byte* src, std::size_t bytes) {
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
#if defined(__AVX512F__)
  constexpr std::size_t vec = 64;
#elif defined(__AVX__)
  constexpr std::size_t vec = 32;
#else
  constexpr std::size_t vec = 16;
#endif
  std::size_t head = (vec - (reinterpret_cast<std::uintptr_t>(dst) & (vec - 1))) & (vec - 1);
  if (head > bytes) head = bytes;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  std::size_t i = 0;
  for (; i + vec <= bytes; i += vec) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
#elif defined(__AVX__)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
#else
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
#endif
  }
  std::memcpy(dst + i, src + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

// Orders streaming stores before the release that publishes a finished task.
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

inline void copy_bytes(std::byte* dst, const std::byte* src, std::size_t bytes, bool streaming) {
  if (streaming) stream_copy(dst, src, bytes);
  else std::memcpy(dst, src, bytes);
}

// ------------------------------------------------------------------------------------------------
// Reduction kernels: out = op(in_0, in_1, ..., in_{n-1}) element-wise, in that order.

template <class T>
struct ReduceArith {
  using A = accumulate_t<T>;
  static A load(T v) { return static_cast<A>(v); }
  static T store(A v) { return static_cast<T>(v); }
  static A add(A a, A b) {
    if constexpr (std::is_integral_v<A>) {  // integers wrap (no signed-overflow UB)
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  }
  static A mul(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
      return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
    } else {
      return a * b;
    }
  }
};

// Stores one 64-byte line at a 64-byte aligned `dst`, bypassing the cache when `streaming`.
inline void store_line(std::byte* dst, const void* line, bool streaming) {
#if defined(__AVX512F__)
  if (streaming) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_loadu_si512(line));
    return;
  }
#elif defined(__AVX__)
  if (streaming) {
    const auto* src = static_cast<const __m256i*>(line);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), _mm256_loadu_si256(src));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), _mm256_loadu_si256(src + 1));
    return;
  }
#elif defined(__SSE2__)
  if (streaming) {
    const auto* src = static_cast<const __m128i*>(line);
    for (int i = 0; i < 4; ++i)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16 * i), _mm_loadu_si128(src + i));
    return;
  }
#endif
  std::memcpy(dst, line, 64);
}

// acc op v, with acc holding the lower ranks: the order is fixed (rank 0, 1, ..., n-1).
template <class T, ReduceOp Op>
inline accumulate_t<T> reduce_combine(accumulate_t<T> acc, accumulate_t<T> v) {
  using R = ReduceArith<T>;
  if constexpr (Op == ReduceOp::sum || Op == ReduceOp::avg) return R::add(acc, v);
  else if constexpr (Op == ReduceOp::prod) return R::mul(acc, v);
  else if constexpr (Op == ReduceOp::min) return v < acc ? v : acc;
  else return acc < v ? v : acc;
}

// res[0, Len) = op over the inputs of elements [base, base + Len). Len is a compile-time
// constant for whole lines so the accumulators live in vector registers.
template <class T, ReduceOp Op, std::size_t Len>
inline void reduce_span(const std::byte* const* ins, int n_in, std::size_t base, std::size_t len, int divisor,
                        T* TRELLIS_RESTRICT res) {
  using R = ReduceArith<T>;
  using A = typename R::A;
  const std::size_t m = Len > 0 ? Len : len;
  alignas(64) A acc[Len > 0 ? Len : 64 / sizeof(T)];
  const T* TRELLIS_RESTRICT in0 = reinterpret_cast<const T*>(ins[0]) + base;
  for (std::size_t i = 0; i < m; ++i) acc[i] = R::load(in0[i]);
  for (int k = 1; k < n_in; ++k) {
    const T* TRELLIS_RESTRICT src = reinterpret_cast<const T*>(ins[k]) + base;
    for (std::size_t i = 0; i < m; ++i) acc[i] = reduce_combine<T, Op>(acc[i], R::load(src[i]));
  }
  if constexpr (Op == ReduceOp::avg) {
    const A d = static_cast<A>(divisor);
    for (std::size_t i = 0; i < m; ++i) acc[i] = static_cast<A>(acc[i] / d);
  }
  for (std::size_t i = 0; i < m; ++i) res[i] = R::store(acc[i]);
}

// outs[o][i] = op(ins[0][i], ..., ins[n_in-1][i]) for i < count and every output o, one cache
// line at a time: the line's accumulators stay in registers and each finished line goes straight
// to every output (streaming stores for large messages), so every input byte is read once and
// every output byte written once, with no staging buffer. n_in == 1 is a copy to n_out outputs.
template <class T, ReduceOp Op>
inline void reduce_into(const std::byte* const* ins, int n_in, std::byte* const* outs, int n_out,
                        std::size_t count, int divisor, bool streaming) {
  constexpr std::size_t line = 64 / sizeof(T);  // elements per 64-byte output line
  const bool copy = n_in == 1 && Op != ReduceOp::avg;
  // Elements [base, base + len), len < line or not aligned: through a small buffer.
  const auto partial = [&](std::size_t base, std::size_t len) {
    alignas(64) T res[line];
    reduce_span<T, Op, 0>(ins, n_in, base, len, divisor, res);
    for (int o = 0; o < n_out; ++o) std::memcpy(outs[o] + base * sizeof(T), res, len * sizeof(T));
  };
  // Whole lines need every output at the same offset within a line (true for the usual
  // allocations); otherwise everything goes through the partial path.
  const auto misalignment = [](const std::byte* p) { return reinterpret_cast<std::uintptr_t>(p) & 63; };
  bool aligned_together = misalignment(outs[0]) % sizeof(T) == 0;
  for (int o = 1; o < n_out; ++o) aligned_together = aligned_together && misalignment(outs[o]) == misalignment(outs[0]);
  std::size_t head = count;
  if (aligned_together) head = std::min(count, ((64 - misalignment(outs[0])) & 63) / sizeof(T));
  for (std::size_t base = 0; base < head; base += line) partial(base, std::min(line, head - base));
  std::size_t base = head;
  if (copy) {
    for (; base + line <= count; base += line)
      for (int o = 0; o < n_out; ++o) store_line(outs[o] + base * sizeof(T), ins[0] + base * sizeof(T), streaming);
  } else {
    for (; base + line <= count; base += line) {
      alignas(64) T res[line];
      reduce_span<T, Op, line>(ins, n_in, base, line, divisor, res);
      for (int o = 0; o < n_out; ++o) store_line(outs[o] + base * sizeof(T), res, streaming);
    }
  }
  for (; base < count; base += line) partial(base, std::min(line, count - base));
}

template <class T>
inline void reduce_typed(const std::byte* const* ins, int n_in, std::byte* const* outs, int n_out,
                         std::size_t count, ReduceOp op, int divisor, bool streaming) {
  switch (op) {
    case ReduceOp::sum: return reduce_into<T, ReduceOp::sum>(ins, n_in, outs, n_out, count, divisor, streaming);
    case ReduceOp::avg: return reduce_into<T, ReduceOp::avg>(ins, n_in, outs, n_out, count, divisor, streaming);
    case ReduceOp::min: return reduce_into<T, ReduceOp::min>(ins, n_in, outs, n_out, count, divisor, streaming);
    case ReduceOp::max: return reduce_into<T, ReduceOp::max>(ins, n_in, outs, n_out, count, divisor, streaming);
    case ReduceOp::prod: return reduce_into<T, ReduceOp::prod>(ins, n_in, outs, n_out, count, divisor, streaming);
  }
}

// outs[o][i] = op(ins[0][i], ..., ins[n_in-1][i]) for every o, in rank order.
inline void reduce_dispatch(DType dtype, const std::byte* const* ins, int n_in,
                            std::byte* const* outs, int n_out, std::size_t count, ReduceOp op,
                            int divisor, bool streaming = false) {
  if (count == 0 || n_out == 0) return;
  if (n_in == 1 && op != ReduceOp::avg) {  // a copy: move the bits, whatever they mean
    switch (dtype_size(dtype)) {
      case 1: return reduce_into<std::uint8_t, ReduceOp::sum>(ins, 1, outs, n_out, count, 1, streaming);
      case 2: return reduce_into<std::uint16_t, ReduceOp::sum>(ins, 1, outs, n_out, count, 1, streaming);
      case 4: return reduce_into<std::uint32_t, ReduceOp::sum>(ins, 1, outs, n_out, count, 1, streaming);
      case 8: return reduce_into<std::uint64_t, ReduceOp::sum>(ins, 1, outs, n_out, count, 1, streaming);
      default: break;
    }
  }
  switch (dtype) {
    case DType::f32: return reduce_typed<float>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::f64: return reduce_typed<double>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::f16: return reduce_typed<half>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::bf16: return reduce_typed<bfloat16>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::i8: return reduce_typed<std::int8_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::u8: return reduce_typed<std::uint8_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::i32: return reduce_typed<std::int32_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::u32: return reduce_typed<std::uint32_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::i64: return reduce_typed<std::int64_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::u64: return reduce_typed<std::uint64_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
  }
}

// ------------------------------------------------------------------------------------------------
// Shared state of one ThreadWorld and of each group (the world and every split of it).

struct ThreadGroup;

struct ThreadWorldState {
  explicit ThreadWorldState(int n) : size(n), exited(new std::atomic<bool>[static_cast<std::size_t>(n)]) {
    for (int i = 0; i < n; ++i) exited[i].store(false);
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    spin_ns = static_cast<unsigned>(n) <= cores ? 20000 : 0;  // oversubscribed: sleep at once
    if (const char* env = std::getenv("TRELLIS_COMM_TIMEOUT_MS")) {
      long long ms = std::atoll(env);
      if (ms > 0) default_timeout = std::chrono::milliseconds(ms);
    }
    if (const char* env = std::getenv("TRELLIS_COMM_DEBUG")) default_debug = env[0] == '1';
  }

  // Marks the world failed by `rank` (the first failure wins) and wakes every waiter.
  void abort(int rank, const std::string& what) {
    {
      std::lock_guard lock(mutex);
      if (!aborted.load()) {
        failed_rank = rank;
        failure = what;
        aborted.store(true);
      }
    }
    wake_all();
  }
  inline void wake_all();
  inline void add_group(const std::shared_ptr<ThreadGroup>& g);

  [[noreturn]] void throw_aborted() {
    std::string what;
    int rank;
    {
      std::lock_guard lock(mutex);
      what = failure;
      rank = failed_rank;
    }
    throw Error(concat_failure(rank, what));
  }
  static std::string concat_failure(int rank, const std::string& what) {
    return trellis::detail::concat("rank ", rank, " failed: ", what);
  }

  const int size;
  std::unique_ptr<std::atomic<bool>[]> exited;  // per world rank: returned from its function
  std::int64_t spin_ns = 0;
  std::chrono::milliseconds default_timeout{60000};
  bool default_debug = false;
  std::atomic<bool> aborted{false};
  std::mutex mutex;  // guards failure, failed_rank, groups
  int failed_rank = -1;
  std::string failure;
  std::vector<std::weak_ptr<ThreadGroup>> groups;
};

// What each rank publishes for the collective in progress.
struct alignas(64) ThreadSlot {
  OpFingerprint fp;
  const std::byte* in = nullptr;
  std::byte* out = nullptr;
  // all_to_allv: copies (the caller's arrays may be gone while a slow peer still validates)
  std::vector<std::size_t> send_counts, send_displs, recv_counts, recv_displs;
  int color = 0;
  int key = 0;
  std::shared_ptr<ThreadGroup> new_group;  // split: set by each new group's leader
};

struct alignas(64) ThreadProgress {
  std::atomic<std::uint64_t> arrived{0};  // barriers this rank has reached
  std::atomic<std::uint64_t> calls{0};    // collectives this rank has entered
};

// State shared by a pending send or receive and the side that completes it.
struct OpState {
  std::atomic<std::uint32_t> done{0};
  std::exception_ptr error;  // written before done is set
  std::string failure;       // p2p: raised as an Error on the waiting rank's own thread
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::string what;  // "recv of 10 float from rank 1 (tag 0)", for timeout messages
  int mailbox = -1;  // p2p: destination rank whose mailbox holds the envelope until matched
};

struct alignas(64) TaskCounter {
  std::atomic<std::uint64_t> next{0};
};

struct Envelope {
  int source = 0;  // sending rank (group rank)
  int tag = 0;
  DType dtype = DType::f32;
  std::size_t count = 0;
  const std::byte* send_data = nullptr;  // sends
  std::byte* recv_data = nullptr;        // receives
  std::vector<std::byte> eager;          // copy of a small send, which has completed already
  std::shared_ptr<OpState> state;
};

struct Mailbox {
  std::mutex mutex;
  std::deque<Envelope> unexpected;  // sends that arrived before their receive
  std::deque<Envelope> posted;      // receives waiting for their send
};

struct ThreadGroup {
  ThreadGroup(std::shared_ptr<ThreadWorldState> w, std::string name, std::vector<int> ranks)
      : world(std::move(w)),
        label(std::move(name)),
        size(static_cast<int>(ranks.size())),
        world_ranks(std::move(ranks)),
        slots(new ThreadSlot[2 * world_ranks.size()]),
        progress(new ThreadProgress[world_ranks.size()]),
        region_next(new TaskCounter[world_ranks.size()]),
        mailboxes(new Mailbox[world_ranks.size()]) {}

  std::shared_ptr<ThreadWorldState> world;
  const std::string label;
  const int size;
  const std::vector<int> world_ranks;  // group rank -> world rank
  std::unique_ptr<ThreadSlot[]> slots;  // two per rank: [2 * rank + collective parity]
  std::unique_ptr<ThreadProgress[]> progress;
  // Work sharing: a collective's tasks are cut into one contiguous region per rank; each rank
  // claims from its own region first (a sequential stream per core), then from the others'.
  // Each region's counter numbers that region's tasks of all collectives so far consecutively.
  std::unique_ptr<TaskCounter[]> region_next;  // next task to claim, per region
  alignas(64) std::atomic<std::uint64_t> done_tasks{0};  // tasks finished, all collectives
  std::unique_ptr<Mailbox[]> mailboxes;
  WakeWord wake;
  std::atomic<bool> broken{false};  // a timeout left the barriers out of step
  std::mutex broken_mutex;
  std::string broken_reason;
};

inline void ThreadWorldState::wake_all() {
  std::vector<std::shared_ptr<ThreadGroup>> alive;
  {
    std::lock_guard lock(mutex);
    for (auto& g : groups)
      if (auto p = g.lock()) alive.push_back(std::move(p));
  }
  for (auto& g : alive) g->wake.notify();
}
inline void ThreadWorldState::add_group(const std::shared_ptr<ThreadGroup>& g) {
  std::lock_guard lock(mutex);
  std::erase_if(groups, [](const std::weak_ptr<ThreadGroup>& w) { return w.expired(); });
  groups.push_back(g);
}

// Arguments of one collective, as the calling rank sees them.
struct CollectiveArgs {
  OpFingerprint fp;       // fp.seq counts collectives only (what every rank must agree on)
  std::uint64_t call = 0;  // this call's number in the flight recorder (all operations)
  const std::byte* in = nullptr;
  std::byte* out = nullptr;
  std::span<const std::size_t> send_counts, send_displs, recv_counts, recv_displs;
  int color = 0, key = 0;
};

inline std::size_t max_count(DType dtype, std::size_t blocks = 1) {
  return static_cast<std::size_t>(PTRDIFF_MAX) / dtype_size(dtype) / std::max<std::size_t>(blocks, 1);
}

// ------------------------------------------------------------------------------------------------
// One rank's view of one communicator: settings, recorder, progress thread.

class ThreadRankState {
 public:
  ThreadRankState(std::shared_ptr<ThreadGroup> g, int r, std::chrono::milliseconds timeout, bool debug)
      : group_(std::move(g)),
        rank_(r),
        timeout_(timeout),
        debug_(debug),
        region_base_(static_cast<std::size_t>(group_->size), 0) {
    recorder_.identify(group_->label, rank_, group_->size);
  }
  ThreadRankState(const ThreadRankState&) = delete;
  ThreadRankState& operator=(const ThreadRankState&) = delete;

  ~ThreadRankState() {
    {
      std::lock_guard lock(queue_mutex_);
      stopping_ = true;
      // Unwinding from an exception: pending async collectives must not wait for peers.
      if (std::uncaught_exceptions() > 0) cancelled_.store(true);
    }
    queue_cv_.notify_all();
    group_->wake.notify();
    if (worker_.joinable()) worker_.join();
  }

  ThreadGroup& group() const { return *group_; }
  const std::shared_ptr<ThreadGroup>& group_ptr() const { return group_; }
  int rank() const { return rank_; }
  int size() const { return group_->size; }
  int world_rank() const { return group_->world_ranks[static_cast<std::size_t>(rank_)]; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) {
    TRELLIS_CHECK(t.count() > 0, "timeout must be positive, got ", t.count(), " ms");
    timeout_ = t;
  }
  bool debug() const { return debug_; }
  void set_debug(bool on) { debug_ = on; }

  std::string recorder_dump() const {
    std::lock_guard lock(recorder_mutex_);
    return recorder_.dump(16);
  }
  FlightRecorder recorder_copy() const {
    std::lock_guard lock(recorder_mutex_);
    return recorder_;
  }
  // Records a call; for collectives, fp.seq is then renumbered to count collectives only.
  OpFingerprint record(OpKind kind, DType dtype, std::size_t count, int root, ReduceOp op,
                       std::source_location where, std::uint64_t* call) {
    std::lock_guard lock(recorder_mutex_);
    OpFingerprint fp = recorder_.record(kind, dtype, count, root, op, where);
    *call = fp.seq;
    fp.seq = op_is_point_to_point(kind) ? collectives_ : collectives_++;
    return fp;
  }
  void mark(std::uint64_t seq, bool ok) {
    std::lock_guard lock(recorder_mutex_);
    recorder_.mark(seq, ok ? FlightRecorder::State::completed : FlightRecorder::State::failed);
  }

  std::string where() const {
    return trellis::detail::concat("communicator '", group_->label, "' (rank ", rank_, " of ",
                                   group_->size, ", world rank ", world_rank(), ")");
  }

  // Throws when the world aborted, this state was cancelled, or the group is broken.
  void check_alive() {
    if (group_->world->aborted.load(std::memory_order_acquire)) group_->world->throw_aborted();
    if (cancelled_.load()) throw Error(trellis::detail::concat("operation cancelled on ", where(), ": the rank is unwinding from an exception"));
    if (group_->broken.load()) {
      std::lock_guard lock(group_->broken_mutex);
      throw Error(trellis::detail::concat("communicator '", group_->label,
                                          "' is unusable after an earlier failure: ", group_->broken_reason));
    }
  }

  void mark_broken(const std::string& reason) {
    std::lock_guard lock(group_->broken_mutex);
    if (!group_->broken.load()) {
      group_->broken_reason = reason;
      group_->broken.store(true);
    }
  }

  // ---- barrier --------------------------------------------------------------------------------
  // Waits until every rank of the group reached this barrier; names the missing ranks on timeout.
  void barrier(const OpFingerprint& fp, std::chrono::steady_clock::time_point deadline) {
    ThreadGroup& g = *group_;
    const int n = g.size;
    ThreadProgress& mine = g.progress[rank_];
    const std::uint64_t target = mine.arrived.load(std::memory_order_relaxed) + 1;
    mine.arrived.store(target, std::memory_order_seq_cst);
    if (n == 1) return;
    g.wake.notify();
    auto all_arrived = [&] {
      for (int k = 0; k < n; ++k)
        if (g.progress[k].arrived.load(std::memory_order_seq_cst) < target) return false;
      return true;
    };
    auto check = [&] {
      check_alive();
      std::string exited_ranks;
      for (int k = 0; k < n; ++k) {
        if (g.progress[k].arrived.load() < target && g.world->exited[g.world_ranks[k]].load())
          exited_ranks += (exited_ranks.empty() ? "" : ", ") + std::to_string(k);
      }
      if (!exited_ranks.empty()) {
        std::string msg = trellis::detail::concat("rank(s) ", exited_ranks, " of communicator '", g.label,
                                                  "' returned without joining ", fp.describe(), " on ",
                                                  where(), "\n", recorder_dump());
        mark_broken(msg);
        throw Error(msg);
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        std::string missing;
        for (int k = 0; k < n; ++k) {
          if (g.progress[k].arrived.load() < target) {
            missing += trellis::detail::concat(missing.empty() ? "" : ", ", k,
                                               g.world_ranks[k] != k ? trellis::detail::concat(" (world rank ", g.world_ranks[k], ")") : std::string(),
                                               " [has entered ", g.progress[k].calls.load(), " collectives]");
          }
        }
        std::string msg = trellis::detail::concat(
            "timeout after ", timeout_.count(), " ms in ", fp.describe(), " on ", where(),
            ": rank(s) ", missing, " never joined (this rank has entered ",
            g.progress[rank_].calls.load(), " collectives)\n", recorder_dump());
        mark_broken(msg);
        throw Error(msg);
      }
    };
    wait_until(g.wake, g.world->spin_ns, all_arrived, check);
  }

  // ---- collectives ------------------------------------------------------------------------------
  // Protocol: publish (slot of this collective's parity) -> barrier -> validate (every rank
  // reads the same published slots, so all agree) -> share the work -> wait until every task is
  // done. The work is a list of tasks (chunks) that ANY rank may take, claimed from a shared
  // counter: when ranks outnumber cores, whoever is running does the work of those that are
  // not. Slots alternate by collective parity so a fast rank can publish collective c+1 while a
  // slow one still reads collective c; it cannot reach c+2 before everyone entered c+1.
  void collective(const CollectiveArgs& a) {
    check_alive();
    ThreadGroup& g = *group_;
    const int n = g.size;
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    const int parity = static_cast<int>(a.fp.seq & 1);
    const auto slot_of = [&](int k) -> ThreadSlot& { return g.slots[2 * k + parity]; };

    // An in-place all_to_all(v) would overwrite input blocks peers still read: stage the input.
    std::vector<std::byte> staged;
    const std::byte* in = a.in;
    if ((a.fp.kind == OpKind::all_to_all || a.fp.kind == OpKind::all_to_allv) && a.in == a.out && a.in) {
      std::size_t bytes = 0;
      const std::size_t es = dtype_size(a.fp.dtype);
      if (a.fp.kind == OpKind::all_to_all) {
        bytes = static_cast<std::size_t>(n) * a.fp.count * es;
      } else {
        for (int j = 0; j < n; ++j) bytes = std::max(bytes, (a.send_displs[j] + a.send_counts[j]) * es);
      }
      staged.assign(a.in, a.in + bytes);
      in = staged.data();
    }

    ThreadSlot& slot = slot_of(rank_);
    slot.fp = a.fp;
    slot.in = in;
    slot.out = a.out;
    slot.send_counts.assign(a.send_counts.begin(), a.send_counts.end());
    slot.send_displs.assign(a.send_displs.begin(), a.send_displs.end());
    slot.recv_counts.assign(a.recv_counts.begin(), a.recv_counts.end());
    slot.recv_displs.assign(a.recv_displs.begin(), a.recv_displs.end());
    slot.color = a.color;
    slot.key = a.key;
    slot.new_group.reset();
    g.progress[rank_].calls.fetch_add(1);

    barrier(a.fp, deadline);  // everything published

    if (auto problem = validate(a, parity)) throw Error(*problem + "\n" + recorder_dump());
    if (a.fp.kind == OpKind::split) {
      split_body(parity, deadline);
      return;
    }
    const std::uint64_t tasks = task_count(a.fp, n);
    if (tasks == 0) return;
    const std::uint64_t last = task_base_ + tasks;
    task_base_ = last;
    std::vector<const std::byte*> ins(static_cast<std::size_t>(n));
    std::vector<std::byte*> outs(static_cast<std::size_t>(n));
    std::uint64_t ran = 0;
    for (int i = 0; i < n; ++i) {  // own region first, then help the others
      const int k = (rank_ + i) % n;
      const std::uint64_t lo = tasks * static_cast<std::uint64_t>(k) / static_cast<std::uint64_t>(n);
      const std::uint64_t hi = tasks * static_cast<std::uint64_t>(k + 1) / static_cast<std::uint64_t>(n);
      const std::uint64_t base = region_base_[k], end = base + (hi - lo);
      region_base_[k] = end;
      std::atomic<std::uint64_t>& next = g.region_next[k].next;
      for (;;) {  // claim tasks of region k until none is left
        std::uint64_t t = next.load(std::memory_order_relaxed);
        do {
          if (t >= end) break;
        } while (!next.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel));
        if (t >= end) break;
        run_task(a.fp, parity, lo + (t - base), ins, outs);
        ++ran;
      }
    }
    if (ran > 0) {
      stream_fence();  // streaming stores land before the tasks count as done
      g.done_tasks.fetch_add(ran, std::memory_order_acq_rel);
    }
    // Peers may still be writing our output (or reading our input): wait for every task.
    auto all_done = [&] { return g.done_tasks.load(std::memory_order_acquire) >= last; };
    if (!all_done()) {
      g.wake.notify();  // (cheap when nobody sleeps) keeps the word moving for sleepers below
      auto check = [&] {
        check_alive();
        if (std::chrono::steady_clock::now() >= deadline) {
          std::string msg = trellis::detail::concat("timeout after ", timeout_.count(), " ms in ", a.fp.describe(),
                                                    " on ", where(), ": peers did not finish their share\n",
                                                    recorder_dump());
          mark_broken(msg);
          throw Error(msg);
        }
      };
      wait_until(g.wake, g.world->spin_ns, all_done, check);
    } else {
      g.wake.notify();
    }
  }

  // Elements per task: big enough to amortise claiming, small enough to balance and stay in L2.
  static std::size_t chunk_elements(DType dtype) { return (std::size_t{64} << 10) / dtype_size(dtype); }
  static std::uint64_t chunks(std::size_t count, DType dtype) {
    const std::size_t c = chunk_elements(dtype);
    return (count + c - 1) / c;
  }

  // Bytes of all ranks' buffers touched by a collective (decides streaming stores).
  static std::size_t footprint_bytes(const OpFingerprint& fp, int n) {
    const std::size_t per_rank = fp.count * dtype_size(fp.dtype);
    const auto nn = static_cast<std::size_t>(n);
    switch (fp.kind) {
      case OpKind::all_reduce: return 2 * nn * per_rank;
      case OpKind::reduce: case OpKind::broadcast: return (nn + 1) * per_rank;
      case OpKind::reduce_scatter: case OpKind::all_gather: return (nn + 1) * nn * per_rank;
      case OpKind::all_to_all: return 2 * nn * nn * per_rank;
      default: return nn * per_rank;
    }
  }

  // Identical on every rank once the fingerprints agree.
  static std::uint64_t task_count(const OpFingerprint& fp, int n) {
    const auto nn = static_cast<std::uint64_t>(n);
    switch (fp.kind) {
      case OpKind::all_reduce:
      case OpKind::reduce: return chunks(fp.count, fp.dtype);
      case OpKind::reduce_scatter: return nn * chunks(fp.count, fp.dtype);
      case OpKind::broadcast: return chunks(fp.count, fp.dtype);
      case OpKind::all_gather: return nn * chunks(fp.count, fp.dtype);
      case OpKind::all_to_all: return nn * nn * chunks(fp.count, fp.dtype);
      case OpKind::all_to_allv: return nn * nn;
      default: return 0;
    }
  }

  void run_task(const OpFingerprint& fp, int parity, std::uint64_t task, std::vector<const std::byte*>& ins,
                std::vector<std::byte*>& outs) {
    ThreadGroup& g = *group_;
    const int n = g.size;
    const auto slot_of = [&](int k) -> ThreadSlot& { return g.slots[2 * k + parity]; };
    const std::size_t es = dtype_size(fp.dtype);
    const std::size_t count = fp.count;
    const std::size_t chunk = chunk_elements(fp.dtype);
    const std::uint64_t per_block = chunks(count, fp.dtype);
    auto range = [&](std::uint64_t c, std::size_t& begin, std::size_t& len) {
      begin = static_cast<std::size_t>(c) * chunk;
      len = std::min(chunk, count - begin);
    };
    std::size_t begin = 0, len = 0;
    const bool streaming = footprint_bytes(fp, n) > TRELLIS_COMM_STREAM_BYTES;
    switch (fp.kind) {
      case OpKind::all_reduce:
      case OpKind::reduce: {
        range(task, begin, len);
        for (int k = 0; k < n; ++k) ins[k] = slot_of(k).in + begin * es;
        int n_out = 0;
        if (fp.kind == OpKind::all_reduce) {
          for (int k = 0; k < n; ++k) outs[n_out++] = slot_of(k).out + begin * es;
        } else {
          outs[n_out++] = slot_of(fp.root).out + begin * es;
        }
        reduce_dispatch(fp.dtype, ins.data(), n, outs.data(), n_out, len, fp.op, n, streaming);
        break;
      }
      case OpKind::reduce_scatter: {  // task = (block j, chunk c): rank j's output
        const int j = static_cast<int>(task / per_block);
        range(task % per_block, begin, len);
        const std::size_t offset = (static_cast<std::size_t>(j) * count + begin) * es;
        for (int k = 0; k < n; ++k) ins[k] = slot_of(k).in + offset;
        outs[0] = slot_of(j).out + begin * es;
        reduce_dispatch(fp.dtype, ins.data(), n, outs.data(), 1, len, fp.op, n, streaming);
        break;
      }
      case OpKind::broadcast: {  // task = chunk c: the root's chunk, read once, into every other rank
        range(task, begin, len);
        ins[0] = slot_of(fp.root).out + begin * es;
        int n_out = 0;
        for (int j = 0; j < n; ++j)
          if (j != fp.root) outs[n_out++] = slot_of(j).out + begin * es;
        reduce_dispatch(fp.dtype, ins.data(), 1, outs.data(), n_out, len, ReduceOp::sum, 1, streaming);  // a copy
        break;
      }
      case OpKind::all_gather: {  // task = (source k, chunk c): k's chunk, read once, into every output
        const int k = static_cast<int>(task / per_block);
        range(task % per_block, begin, len);
        ins[0] = slot_of(k).in + begin * es;
        int n_out = 0;
        for (int j = 0; j < n; ++j) {
          std::byte* dst = slot_of(j).out + (static_cast<std::size_t>(k) * count + begin) * es;
          if (dst != ins[0]) outs[n_out++] = dst;  // in place: the block is there already
        }
        reduce_dispatch(fp.dtype, ins.data(), 1, outs.data(), n_out, len, ReduceOp::sum, 1, streaming);  // a copy
        break;
      }
      case OpKind::all_to_all: {  // task = (destination j, source k, chunk c)
        const int j = static_cast<int>(task / (per_block * static_cast<std::uint64_t>(n)));
        const int k = static_cast<int>((task / per_block) % static_cast<std::uint64_t>(n));
        range(task % per_block, begin, len);
        const std::byte* src = slot_of(k).in + (static_cast<std::size_t>(j) * count + begin) * es;
        std::byte* dst = slot_of(j).out + (static_cast<std::size_t>(k) * count + begin) * es;
        if (src != dst) copy_bytes(dst, src, len * es, streaming);
        break;
      }
      case OpKind::all_to_allv: {  // task = (destination j, source k), whole block
        const int j = static_cast<int>(task / static_cast<std::uint64_t>(n));
        const int k = static_cast<int>(task % static_cast<std::uint64_t>(n));
        const ThreadSlot& dst = slot_of(j);
        const ThreadSlot& src = slot_of(k);
        const std::size_t c = dst.recv_counts[k];
        if (c > 0) copy_bytes(dst.out + dst.recv_displs[k] * es, src.in + src.send_displs[j] * es, c * es, streaming);
        break;
      }
      default:
        break;
    }
  }

  // Identical on every rank (reads only published slots), so all ranks agree on the verdict.
  std::optional<std::string> validate(const CollectiveArgs& a, int parity) {
    ThreadGroup& g = *group_;
    const int n = g.size;
    const auto slot_of = [&](int k) -> ThreadSlot& { return g.slots[2 * k + parity]; };
    std::vector<OpFingerprint> fps(static_cast<std::size_t>(n));
    for (int k = 0; k < n; ++k) fps[k] = slot_of(k).fp;
    if (auto mismatch = find_fingerprint_mismatch(fps))
      return trellis::detail::concat(*mismatch, " (communicator '", g.label, "')");
    if (a.fp.kind == OpKind::all_to_allv) {
      for (int src = 0; src < n; ++src) {
        for (int dst = 0; dst < n; ++dst) {
          const std::size_t sent = slot_of(src).send_counts[dst];
          const std::size_t expected = slot_of(dst).recv_counts[src];
          if (sent != expected) {
            return trellis::detail::concat("all_to_allv count mismatch on communicator '", g.label,
                                           "': rank ", src, " sends ", sent, " elements to rank ", dst,
                                           " but rank ", dst, " expects ", expected, " from rank ", src);
          }
        }
      }
    }
    return std::nullopt;
  }

  void split_body(int parity, std::chrono::steady_clock::time_point deadline) {
    ThreadGroup& g = *group_;
    const int n = g.size;
    const auto slot_of = [&](int k) -> ThreadSlot& { return g.slots[2 * k + parity]; };
    const int color = slot_of(rank_).color;
    if (color < 0) {  // takes part, joins nothing: only waits until the leaders have published
      barrier(slot_of(rank_).fp, deadline);
      split_result_.reset();
      return;
    }
    std::vector<std::pair<int, int>> members;  // (key, rank) of my color
    for (int k = 0; k < n; ++k)
      if (slot_of(k).color == color) members.emplace_back(slot_of(k).key, k);
    std::sort(members.begin(), members.end());
    const int leader = members.front().second;
    if (leader == rank_) {
      std::vector<int> world_ranks;
      for (auto& m : members) world_ranks.push_back(g.world_ranks[m.second]);
      auto child = std::make_shared<ThreadGroup>(
          g.world, trellis::detail::concat(g.label, "/split(", color, ")"), std::move(world_ranks));
      g.world->add_group(child);
      slot_of(rank_).new_group = std::move(child);
    }
    barrier(slot_of(rank_).fp, deadline);  // every leader has published its group
    split_result_ = slot_of(leader).new_group;
    split_rank_ = 0;
    for (std::size_t i = 0; i < members.size(); ++i)
      if (members[i].second == rank_) split_rank_ = static_cast<int>(i);
  }

  std::shared_ptr<ThreadGroup> take_split(int& rank) {
    rank = split_rank_;
    return std::move(split_result_);
  }

  // ---- point to point ---------------------------------------------------------------------------
  std::shared_ptr<OpState> post_send(const std::byte* data, std::size_t count, DType dtype, int peer,
                                     int tag, std::size_t eager_limit) {
    check_alive();
    auto state = std::make_shared<OpState>();
    state->deadline = std::chrono::steady_clock::now() + timeout_;
    state->what = trellis::detail::concat("send of ", count, ' ', dtype_name(dtype), " to rank ", peer,
                                          " (tag ", tag, ") on ", where());
    state->mailbox = peer;
    Mailbox& box = group_->mailboxes[peer];
    std::unique_lock lock(box.mutex);
    for (auto it = box.posted.begin(); it != box.posted.end(); ++it) {
      if (it->source == rank_ && it->tag == tag) {
        Envelope recv = std::move(*it);
        box.posted.erase(it);
        lock.unlock();
        complete_pair(data, count, dtype, tag, rank_, state, recv.recv_data, recv.count, recv.dtype, peer, recv.state);
        return state;
      }
    }
    Envelope env;
    env.source = rank_;
    env.tag = tag;
    env.dtype = dtype;
    env.count = count;
    env.state = state;
    const std::size_t bytes = count * dtype_size(dtype);
    if (bytes <= eager_limit) {
      env.eager.assign(data, data + bytes);
      state->done.store(1, std::memory_order_release);
    } else {
      env.send_data = data;
    }
    box.unexpected.push_back(std::move(env));
    return state;
  }

  std::shared_ptr<OpState> post_recv(std::byte* data, std::size_t count, DType dtype, int peer, int tag) {
    check_alive();
    auto state = std::make_shared<OpState>();
    state->deadline = std::chrono::steady_clock::now() + timeout_;
    state->what = trellis::detail::concat("recv of ", count, ' ', dtype_name(dtype), " from rank ", peer,
                                          " (tag ", tag, ") on ", where());
    state->mailbox = rank_;
    Mailbox& box = group_->mailboxes[rank_];
    std::unique_lock lock(box.mutex);
    for (auto it = box.unexpected.begin(); it != box.unexpected.end(); ++it) {
      if (it->source == peer && it->tag == tag) {
        Envelope send = std::move(*it);
        box.unexpected.erase(it);
        lock.unlock();
        const std::byte* src = send.eager.empty() ? send.send_data : send.eager.data();
        complete_pair(src, send.count, send.dtype, tag, peer, send.state, data, count, dtype, rank_, state);
        return state;
      }
    }
    Envelope env;
    env.source = peer;
    env.tag = tag;
    env.dtype = dtype;
    env.count = count;
    env.recv_data = data;
    env.state = state;
    box.posted.push_back(std::move(env));
    return state;
  }

  // Copies a matched send into its receive (outside any lock) and completes both.
  void complete_pair(const std::byte* src, std::size_t send_count, DType send_dtype, int tag, int sender,
                     const std::shared_ptr<OpState>& send_state, std::byte* dst, std::size_t recv_count,
                     DType recv_dtype, int receiver, const std::shared_ptr<OpState>& recv_state) {
    if (send_count != recv_count || send_dtype != recv_dtype) {
      std::string msg = trellis::detail::concat(
          "point-to-point size mismatch on communicator '", group_->label, "': rank ", sender, " sent ",
          send_count, ' ', dtype_name(send_dtype), " to rank ", receiver, " (tag ", tag, ") but rank ",
          receiver, " posted a receive of ", recv_count, ' ', dtype_name(recv_dtype));
      recv_state->failure = msg;
      if (!send_state->done.load()) send_state->failure = msg;
    } else if (send_count > 0) {
      std::memcpy(dst, src, send_count * dtype_size(send_dtype));
    }
    recv_state->done.store(1, std::memory_order_release);
    send_state->done.store(1, std::memory_order_release);
    group_->wake.notify();
  }

  // Waits for a p2p operation; on timeout withdraws it from its mailbox (if still unmatched).
  void wait_p2p(OpState& s) {
    ThreadGroup& g = *group_;
    auto done = [&] { return s.done.load(std::memory_order_acquire) != 0; };
    auto check = [&] {
      check_alive();
      if (std::chrono::steady_clock::now() >= s.deadline) {
        Mailbox& box = g.mailboxes[s.mailbox];
        std::unique_lock lock(box.mutex);
        auto owned = [&](const Envelope& e) { return e.state.get() == &s; };
        bool withdrawn = false;
        for (auto* queue : {&box.unexpected, &box.posted}) {
          auto it = std::find_if(queue->begin(), queue->end(), owned);
          if (it != queue->end()) {
            queue->erase(it);
            withdrawn = true;
          }
        }
        lock.unlock();
        if (withdrawn) {
          throw Error(trellis::detail::concat("timeout after ", timeout_.count(), " ms: ", s.what,
                                              " was never matched\n", recorder_dump()));
        }
        // Matched meanwhile: the copy is in progress and finishes shortly.
        while (!done()) std::this_thread::yield();
      }
    };
    wait_until(g.wake, g.world->spin_ns, done, check);
    if (!s.failure.empty()) throw Error(s.failure);
  }

  // Waits for an async collective run by the progress thread.
  void wait_collective(OpState& s) {
    auto done = [&] { return s.done.load(std::memory_order_acquire) != 0; };
    auto check = [&] {
      // The progress thread enforces the timeout and aborts; this is only a backstop.
      if (std::chrono::steady_clock::now() >= s.deadline) {
        if (group_->world->aborted.load()) group_->world->throw_aborted();
        throw Error(trellis::detail::concat("async collective did not finish within twice the timeout on ", where()));
      }
    };
    wait_until(group_->wake, group_->world->spin_ns, done, check);
    if (s.error) std::rethrow_exception(s.error);
  }

  // ---- progress thread for async collectives ----------------------------------------------------
  std::shared_ptr<OpState> submit(CollectiveArgs args) {
    check_alive();
    auto state = std::make_shared<OpState>();
    state->deadline = std::chrono::steady_clock::now() + 2 * timeout_;
    {
      std::lock_guard lock(queue_mutex_);
      if (!worker_.joinable()) {
        const int world_rank_for_errors = current_rank();
        worker_ = std::thread([this, world_rank_for_errors] { worker_loop(world_rank_for_errors); });
      }
      ++pending_;
      queue_.push_back([this, args = std::move(args), state] {
        try {
          collective(args);
        } catch (...) {
          state->error = std::current_exception();
        }
        state->done.store(1, std::memory_order_release);
        group_->wake.notify();
      });
    }
    queue_cv_.notify_all();
    return state;
  }

  // Blocks until every submitted async collective has run (keeps collectives in program order).
  void drain() {
    std::unique_lock lock(queue_mutex_);
    queue_cv_.wait(lock, [&] { return pending_ == 0; });
  }

 private:
  void worker_loop(int world_rank_for_errors) {
    RankScope scope(world_rank_for_errors);
    std::unique_lock lock(queue_mutex_);
    for (;;) {
      queue_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;
      auto task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      task();
      lock.lock();
      --pending_;
      queue_cv_.notify_all();
    }
  }

  std::shared_ptr<ThreadGroup> group_;
  int rank_;
  std::chrono::milliseconds timeout_;
  bool debug_;
  mutable std::mutex recorder_mutex_;
  FlightRecorder recorder_;
  std::uint64_t collectives_ = 0;
  std::uint64_t task_base_ = 0;  // tasks of this group's earlier collectives (same on every rank)
  std::vector<std::uint64_t> region_base_;  // per region: its tasks in earlier collectives
  std::shared_ptr<ThreadGroup> split_result_;
  int split_rank_ = 0;
  std::atomic<bool> cancelled_{false};
  std::mutex queue_mutex_;
  std::condition_variable queue_cv_;
  std::deque<std::function<void()>> queue_;
  std::size_t pending_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace detail

// ------------------------------------------------------------------------------------------------

// A pending thread-backend operation (point to point, batch, or async collective). wait() blocks
// until it completes and rethrows its error; test() polls (and also rethrows). The communicator
// that started it must outlive it.
class ThreadRequest {
 public:
  ThreadRequest() = default;
  ThreadRequest(ThreadRequest&&) noexcept = default;
  ThreadRequest& operator=(ThreadRequest&&) noexcept = default;
  ThreadRequest(const ThreadRequest&) = delete;
  ThreadRequest& operator=(const ThreadRequest&) = delete;
  ~ThreadRequest() = default;

  void wait() {
    if (!owner_) return;
    std::exception_ptr first;
    for (auto& part : parts_) {
      try {
        if (collective_) owner_->wait_collective(*part);
        else owner_->wait_p2p(*part);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    owner_->mark(seq_, !first);
    parts_.clear();
    owner_.reset();
    if (first) std::rethrow_exception(first);
  }

  // The host has one implicit stream: waiting "on" it is waiting.
  void wait_on(HostStream) { wait(); }

  bool test() {
    if (!owner_) return true;
    for (auto& part : parts_)
      if (part->done.load(std::memory_order_acquire) == 0) return false;
    wait();
    return true;
  }

 private:
  friend class ThreadComm;
  std::shared_ptr<detail::ThreadRankState> owner_;
  std::vector<std::shared_ptr<detail::OpState>> parts_;
  std::uint64_t seq_ = 0;
  bool collective_ = false;
};

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

// Runs a function once per rank, each on its own thread.
class ThreadWorld {
 public:
  explicit ThreadWorld(int size) : size_(size) {
    TRELLIS_CHECK(size >= 1, "ThreadWorld needs at least one rank (got ", size, ")");
  }
  int size() const { return size_; }

  // Calls fn(ThreadComm&) on `size` threads, joins them all, and then rethrows the exception of
  // the rank that failed first (a trellis::Error naming that rank). When a rank throws, the
  // others fail at their current or next operation with "rank k failed: ..." instead of hanging.
  template <class Fn>
  void run(Fn&& fn) {
    auto world = std::make_shared<detail::ThreadWorldState>(size_);
    std::vector<int> ranks(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) ranks[r] = r;
    auto group = std::make_shared<detail::ThreadGroup>(world, "world", std::move(ranks));
    world->add_group(group);
    std::vector<std::exception_ptr> errors(static_cast<std::size_t>(size_));
    std::vector<std::thread> threads;
    threads.reserve(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      threads.emplace_back([&, r] {
        RankScope scope(r);
        try {
          ThreadComm comm(group, r, world->default_timeout, world->default_debug);
          fn(comm);
        } catch (const std::exception& e) {
          errors[r] = std::current_exception();
          world->abort(r, e.what());
        } catch (...) {
          errors[r] = std::current_exception();
          world->abort(r, "unknown exception");
        }
        world->exited[r].store(true);
        world->wake_all();
      });
    }
    for (auto& t : threads) t.join();
    if (!world->aborted.load()) return;
    const int origin = world->failed_rank;
    try {
      std::rethrow_exception(errors[origin]);
    } catch (const Error& e) {
      if (e.rank() == origin) throw;
      throw Error(detail::ThreadWorldState::concat_failure(origin, e.what()), "", 0, origin);
    } catch (const std::exception& e) {
      throw Error(detail::ThreadWorldState::concat_failure(origin, e.what()), "", 0, origin);
    } catch (...) {
      throw Error(detail::ThreadWorldState::concat_failure(origin, "unknown exception"), "", 0, origin);
    }
  }

 private:
  int size_;
};

}  // namespace trellis::comm
