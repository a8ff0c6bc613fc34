// One thread rank's view of one communicator: the barrier, the collective protocol (publish,
// validate, share the tasks), split, the point-to-point mailboxes and the progress thread for
// async collectives (part of comm/threads.hpp, whose leading comment describes the algorithms).
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <source_location>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/comm/recorder.hpp"
#include "trellis/comm/threads/copy.hpp"
#include "trellis/comm/threads/group.hpp"
#include "trellis/comm/threads/reduce.hpp"
#include "trellis/comm/threads/wait.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace trellis::comm {

namespace detail {

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
    // Taken out (a request is waited once), so the exception dies on this thread. Left in, the
    // progress thread could free it when it dropped its OpState after our handler had read it;
    // ordered only by libstdc++'s own reference counts, which ThreadSanitizer cannot see.
    if (s.error) std::rethrow_exception(std::exchange(s.error, nullptr));
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

}  // namespace trellis::comm
