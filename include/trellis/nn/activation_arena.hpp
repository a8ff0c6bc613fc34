// Where layers keep what a microbatch's forward saves for its backward: a per-rank arena of the
// backend's memory, sized once at set-up and reused every step (no allocation in the middle of a
// step, no zero-filling, no page faults; on CUDA no cudaMalloc between kernels).
//
// The arena is split into pools, one per model chunk on the rank (GptModel). A pool holds `slots`
// slots of `slot_bytes`: a microbatch claims a slot with its first saved tensor, every saved
// tensor of that microbatch (the forward's, and what backward_input keeps for backward_weight) is
// cut from the slot in call order, and the chunk frees the slot after the microbatch's last W.
// So a pool needs as many slots as the schedule keeps microbatches alive in that chunk, F to W,
// which is what the pipeline simulator counts (pipe::Simulation::peak_chunk_activations_by_chunk),
// and slot_bytes is the chunk's saved bytes per microbatch (GptModel::saved_bytes, a formula per
// layer, checked against the arena's own count in the tests).
//
// Layers see a SavedMemory handle (arena + pool): take<T>(be, mb, n) returns a SavedTensor, a
// view into the slot, or, when the layer is not bound to an arena (a model used on its own), an
// owning backend buffer as before. A slot's memory is not cleared between uses: every saved tensor
// is written in full before it is read (the tests fill new slots with NaN to prove it: poison).
//
// Offloaded pools (add_offloaded_pool; ZeRO-Offload / Megatron's activation offloading): a
// microbatch's saved tensors are cut per weight unit (a block, the head, the embedding) into a
// region, and the pool's device memory is only `frames` frames of the largest unit's bytes, a
// cache of regions. The caller brackets each unit's compute with begin_unit / end_unit (the
// region is pinned in a frame meanwhile, fetched from host memory if it was offloaded) and frees
// it with release_unit after its W; a frame wanted while none is free evicts the least recently
// used unpinned region to its place in the pool's host memory (every microbatch slot has room for
// every unit there, so host memory holds what the device did without offloading). prefetch()
// fetches the next unit's region while the current one computes. Saved tensors of these pools
// are handles (region, offset), resolved at each read, so a region may come back to another frame;
// a read of a region that is not pinned is an error (it would read whatever the frame holds).
// Copies run on the backend's copy queue (backend/copy_queue.hpp: a worker thread and a FIFO on
// the host; a copy stream, events and pinned host rooms on CUDA), in one of two modes
// (OffloadCopies::queue):
//   - overlapped (queue = true; what the Trainer uses by default): a region's write-back to its
//     host room starts right after the compute that wrote it, when the pool's next unit begins
//     after the region's forward ended (end_forward), unless that next unit is the region itself
//     (its backward follows at once: nothing to copy); the copy runs while the next units
//     compute. A frame is reused, and a unit computes in its frame, only once the copies reading
//     or writing that frame are done (a wait on their ticket, normally long done). Eviction then
//     costs nothing for a region already written back, and a region still resident when its
//     backward or W comes needs no fetch. prefetch() starts the next unit's fetch and returns;
//     its begin_unit waits for it.
//     With the pool's calls known (set_unit_calls: the calls of one step, in order, repeated each
//     step; the Trainer lists them from its schedule), a region is written back after its forward
//     only if it must leave: the arena replays the calls that follow on a copy of its bookkeeping
//     (no copies) and writes the region back only if its frame is taken before its unit computes
//     again, so the regions that stay resident until their backward are never copied. A call off
//     the list (an evaluation between steps, a schedule the list does not describe) makes the pool
//     write every region back again until a step's first call comes round; a wrong guess costs a
//     copy at eviction, never a wrong byte (eviction writes back what the host lacks).
//   - synchronous (queue = false; the baseline benches compare with): each copy is waited for at
//     once, a region is written back only when its frame is wanted (evicted), fetched only when
//     its unit begins or is prefetched, as the arena did before the queue.
// offloaded_bytes() counts the write-backs made, fetched_bytes() the fetches; a region counts in
// held_bytes() while it is in a frame and in host_held_bytes() while its host room has a valid
// copy (both, between an overlapped write-back and the eviction or the unit's next compute).
//
// Figures: capacity_bytes() (what was reserved), peak_held_bytes() (the most bytes of saved
// tensors alive at once, measured) and peak_held_slots() (microbatch-chunks alive at once,
// measured), to compare with the simulator's prediction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/backend/copy_queue.hpp"  // defines: copy_queue_t, HostCopyQueue, SimulatedCopyLink
#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"

namespace trellis::nn {

// Every saved tensor starts on this boundary (the CUDA allocator's): one rule for the arena and
// for the saved-bytes formulas.
inline constexpr std::size_t saved_alignment = 256;
inline constexpr std::size_t saved_round(std::size_t bytes) {
  return (bytes + saved_alignment - 1) / saved_alignment * saved_alignment;
}
// Bytes of the arena one saved tensor of n elements of T takes.
template <class T>
constexpr std::size_t saved_size(index_t n) {
  return saved_round(static_cast<std::size_t>(n) * sizeof(T));
}

// How an offloaded pool copies between its frames and its host rooms (see above).
struct OffloadCopies {
  bool queue = false;                      // overlapped on the copy queue; false: synchronous
  backend::SimulatedCopyLink simulated{};  // host backends: a SIMULATED link (tests, benches)
};

// One call a Trainer makes to an offloaded pool (set_unit_calls: a step's calls, in order).
struct UnitCall {
  enum class Op : std::uint8_t { begin, end, end_forward, prefetch, release };
  Op op = Op::begin;
  int mb = 0, unit = 0;
  friend bool operator==(const UnitCall&, const UnitCall&) = default;
};

template <backend::Backend B>
class ActivationArena {
 public:
  using CopyQueue = backend::copy_queue_t<B>;
  explicit ActivationArena(B be = {}, OffloadCopies copies = {}) : be_(std::move(be)), copies_(copies) {}
  ActivationArena(const ActivationArena&) = delete;
  ActivationArena& operator=(const ActivationArena&) = delete;

  // Set-up, before allocate(): a pool of `slots` slots of `slot_bytes` (rounded to the alignment).
  // Returns the pool's id. `name` appears in errors (e.g. "chunk 1 (virtual stage 5)").
  int add_pool(std::string name, std::size_t slot_bytes, int slots) {
    TRELLIS_CHECK(memory_.size() == 0, "ActivationArena: add_pool(\"", name, "\") after allocate()");
    TRELLIS_CHECK(slots >= 1, "ActivationArena: pool \"", name, "\" needs at least one slot, got ", slots);
    Pool p;
    p.name = std::move(name);
    p.slot_bytes = saved_round(std::max<std::size_t>(slot_bytes, 1));
    p.first_byte = capacity_;
    p.owner.assign(static_cast<std::size_t>(slots), -1);
    p.used.assign(static_cast<std::size_t>(slots), 0);
    capacity_ += p.slot_bytes * static_cast<std::size_t>(slots);
    pools_.push_back(std::move(p));
    return static_cast<int>(pools_.size()) - 1;
  }
  // An offloaded pool (see above): `unit_bytes` per weight unit (saved bytes of one microbatch in
  // that unit, GptModel::unit_saved_bytes), room in host memory for `slots` microbatches, and
  // `frames` device frames of the largest unit's bytes (2: one computing, one prefetched).
  int add_offloaded_pool(std::string name, std::vector<std::size_t> unit_bytes, int slots, int frames) {
    TRELLIS_CHECK(frames >= 1, "ActivationArena: offloaded pool \"", name, "\" needs at least one frame, got ", frames);
    TRELLIS_CHECK(!unit_bytes.empty(), "ActivationArena: offloaded pool \"", name, "\" without units");
    std::size_t frame = 1, host_slot = 0;
    std::vector<std::size_t> offsets;
    for (auto& b : unit_bytes) {
      b = saved_round(b);
      frame = std::max(frame, b);
      offsets.push_back(host_slot);
      host_slot += b;
    }
    TRELLIS_CHECK(slots >= 1, "ActivationArena: offloaded pool \"", name, "\" needs room for a microbatch, got ", slots);
    const int id = add_pool(std::move(name), frame, frames);
    Pool& p = pools_.back();
    p.offloaded = true;
    p.owner.assign(static_cast<std::size_t>(slots), -1);  // slots are host rooms; frames are device memory
    p.used.assign(static_cast<std::size_t>(slots), 0);
    p.unit_host_offset = std::move(offsets);
    p.unit_bytes = std::move(unit_bytes);
    p.host_slot_bytes = saved_round(host_slot);
    p.host_first_byte = host_capacity_;
    host_capacity_ += p.host_slot_bytes * static_cast<std::size_t>(slots);
    p.frame_region.assign(static_cast<std::size_t>(frames), -1);
    p.frame_pins.assign(static_cast<std::size_t>(frames), 0);
    p.frame_prefetched.assign(static_cast<std::size_t>(frames), 0);
    p.frame_used_at.assign(static_cast<std::size_t>(frames), 0);
    p.frame_ticket.assign(static_cast<std::size_t>(frames), 0);
    const std::size_t regions = static_cast<std::size_t>(slots) * p.unit_bytes.size();
    p.region_frame.assign(regions, -1);
    p.region_used.assign(regions, 0);
    p.region_alive.assign(regions, 0);
    p.region_on_host.assign(regions, 0);
    return id;
  }
  bool offloaded(int pool) const { return pools_.at(static_cast<std::size_t>(pool)).offloaded; }

  // Reserves the memory of every pool (one backend buffer). poison: fill each slot with NaN bytes
  // when a microbatch claims it (tests: a read before a write shows up as NaN).
  void allocate(bool poison = false) {
    TRELLIS_CHECK(memory_.size() == 0, "ActivationArena: allocate() twice");
    TRELLIS_CHECK(capacity_ > 0, "ActivationArena: allocate() without pools");
    memory_ = be_.template allocate<std::uint8_t>(capacity_);
    if (host_capacity_ > 0) {  // offloaded pools: their rooms in host memory (pinned on CUDA), the queue
      host_ = CopyQueue::allocate_host(host_capacity_);
      queue_ = std::make_unique<CopyQueue>(copies_.simulated);
    }
    poison_ = poison;
  }
  bool allocated() const { return memory_.size() != 0; }

  // n elements of T for microbatch mb in `pool`, cut from mb's slot (claimed on its first take).
  // `what` names the caller in errors.
  template <class T>
  T* take(int pool, int mb, index_t n, const char* what) {
    TRELLIS_CHECK(allocated(), "ActivationArena: take before allocate() (", what, ")");
    Pool& p = pool_at(pool);
    TRELLIS_CHECK(!p.offloaded, "ActivationArena: take from offloaded pool \"", p.name, "\" (", what,
                  "): use take_in_region");
    const std::size_t s = slot_of(p, mb, what);
    const std::size_t bytes = saved_size<T>(n);
    TRELLIS_CHECK(p.used[s] + bytes <= p.slot_bytes, "ActivationArena: pool \"", p.name, "\": microbatch ", mb,
                  " saves more than its slot of ", p.slot_bytes, " bytes (", p.used[s], " used, ", what, " asks ",
                  bytes, "): the saved-bytes formula of this model is out of date");
    std::uint8_t* at = memory_.data() + p.first_byte + s * p.slot_bytes + p.used[s];
    p.used[s] += bytes;
    held_bytes_ += bytes;
    peak_held_bytes_ = std::max(peak_held_bytes_, held_bytes_);
    return reinterpret_cast<T*>(at);
  }
  // Frees microbatch mb's slot in `pool` (after its last W, or after an evaluation forward); a
  // microbatch without a slot is fine (it saved nothing).
  void release(int pool, int mb) {
    Pool& p = pool_at(pool);
    if (p.offloaded) {
      for (std::size_t s = 0; s < p.owner.size(); ++s)
        if (p.owner[s] == mb)
          for (int u = 0; u < p.units(); ++u) drop_region(p, static_cast<int>(s) * p.units() + u);
      return;
    }
    for (std::size_t s = 0; s < p.owner.size(); ++s)
      if (p.owner[s] == mb) {
        held_bytes_ -= p.used[s];
        p.used[s] = 0;
        p.owner[s] = -1;
        --held_slots_;
        return;
      }
  }

  // ---- offloaded pools -------------------------------------------------------------------------
  // Unit `unit` of microbatch mb computes: its region is pinned in a frame (fetched back if it was
  // offloaded; evicting the least recently used unpinned region when no frame is free), and takes
  // of mb cut from it until end_unit. A no-op on other pools.
  void begin_unit(int pool, int mb, int unit) {
    Pool& p = pool_at(pool);
    if (!p.offloaded) return;
    TRELLIS_CHECK(allocated(), "ActivationArena: begin_unit before allocate()");
    follow(p, {UnitCall::Op::begin, mb, unit});
    const int r = region_of(p, mb, unit, "begin_unit");
    if (!p.region_alive[r]) {
      p.region_alive[r] = 1;
      p.region_used[r] = 0;
      p.region_on_host[r] = 0;
    }
    if (p.pending_writeback != r) start_pending_writeback(p);  // the compute that wrote it is done
    p.pending_writeback = -1;  // or the region computes again at once: no copy
    const int f = make_resident(p, r, "begin_unit");
    if (!dry_) queue_->wait(be_, p.frame_ticket[f]);  // its fetch, or a write-back still reading the frame
    if (p.region_on_host[r]) {  // the unit may write its region: the host copy is stale from here
      p.region_on_host[r] = 0;
      host_held_ -= p.region_used[r];
    }
    ++p.frame_pins[f];
    p.frame_prefetched[f] = 0;
    p.current = r;
  }
  void end_unit(int pool, int mb, int unit) {
    Pool& p = pool_at(pool);
    if (!p.offloaded) return;
    follow(p, {UnitCall::Op::end, mb, unit});
    unpin(p, mb, unit);
  }
  // end_unit after the unit's forward: overlapped, the region's write-back starts when the pool's
  // next unit begins (if that is not the region itself), and only if it must leave its frame
  // before its unit computes again (when the pool's calls are known: set_unit_calls).
  void end_forward(int pool, int mb, int unit) {
    Pool& p = pool_at(pool);
    if (!p.offloaded) return;
    follow(p, {UnitCall::Op::end_forward, mb, unit});
    unpin(p, mb, unit);
    if (!copies_.queue) return;
    const int r = find_region(p, mb, unit);
    if (r < 0 || !p.region_alive[r] || p.region_frame[r] < 0 || p.frame_pins[p.region_frame[r]] > 0) return;
    if (p.pending_writeback != r) start_pending_writeback(p);
    p.pending_writeback = dry_ || leaves_before_next_use(pool, r) ? r : -1;
  }
  // Unit `unit` of microbatch mb is done (after its W): its region is freed on both tiers.
  void release_unit(int pool, int mb, int unit) {
    Pool& p = pool_at(pool);
    if (!p.offloaded) return;
    follow(p, {UnitCall::Op::release, mb, unit});
    const int r = find_region(p, mb, unit);
    if (r >= 0) drop_region(p, r);
  }
  // The calls `pool` sees in one step, in order (set-up; see the file's header): begin_unit,
  // end_unit, end_forward, prefetch and release_unit as UnitCalls.
  void set_unit_calls(int pool, std::vector<UnitCall> calls) {
    Pool& p = pool_at(pool);
    TRELLIS_CHECK(p.offloaded, "ActivationArena: set_unit_calls on pool \"", p.name, "\", which is not offloaded");
    p.calls = std::move(calls);
    p.next_call = 0;
    p.on_track = true;
  }
  // One UnitCall made (what the Trainer's unit hook does with the calls it lists).
  void call(int pool, const UnitCall& c) {
    switch (c.op) {
      case UnitCall::Op::begin: begin_unit(pool, c.mb, c.unit); return;
      case UnitCall::Op::end: end_unit(pool, c.mb, c.unit); return;
      case UnitCall::Op::end_forward: end_forward(pool, c.mb, c.unit); return;
      case UnitCall::Op::prefetch: prefetch(pool, c.mb, c.unit); return;
      case UnitCall::Op::release: release_unit(pool, c.mb, c.unit); return;
    }
  }
  // Fetches unit `unit` of microbatch mb back into a frame ahead of its begin_unit, if it is
  // offloaded and a frame is free or holds a region neither pinned nor itself prefetched.
  // Returns whether it copied (overlapped: whether it started the copy).
  bool prefetch(int pool, int mb, int unit) {
    Pool& p = pool_at(pool);
    if (!p.offloaded) return false;
    follow(p, {UnitCall::Op::prefetch, mb, unit});
    if (unit < 0 || unit >= p.units()) return false;
    const int r = find_region(p, mb, unit);
    if (r < 0 || !p.region_alive[r] || p.region_frame[r] >= 0) return false;
    if (free_or_evictable(p, /*for_prefetch=*/true) < 0) return false;
    p.frame_prefetched[make_resident(p, r, "prefetch", true)] = 1;
    ++prefetched_;
    return true;
  }
  // Whether the pool's calls so far follow its set_unit_calls list (tests).
  bool following_calls(int pool) const {
    const Pool& p = pools_.at(static_cast<std::size_t>(pool));
    return !p.calls.empty() && p.on_track;
  }

  // Where take<T> put a saved tensor of an offloaded pool: (region, byte offset in it).
  template <class T>
  std::pair<int, std::size_t> take_in_region(int pool, int mb, index_t n, const char* what) {
    TRELLIS_CHECK(allocated(), "ActivationArena: take before allocate() (", what, ")");
    Pool& p = pool_at(pool);
    const int r = p.current;
    TRELLIS_CHECK(r >= 0 && p.owner[static_cast<std::size_t>(r / p.units())] == mb, "ActivationArena: pool \"",
                  p.name, "\": microbatch ", mb, " saves a tensor (", what, ") outside any begin_unit of it");
    const int unit = r % p.units();
    const std::size_t bytes = saved_size<T>(n), at = p.region_used[r];
    TRELLIS_CHECK(at + bytes <= p.unit_bytes[unit], "ActivationArena: pool \"", p.name, "\": microbatch ", mb,
                  " unit ", unit, " saves more than its ", p.unit_bytes[unit], " bytes (", at, " used, ", what,
                  " asks ", bytes, "): the saved-bytes formula of this unit is out of date");
    p.region_used[r] += bytes;
    p.used[static_cast<std::size_t>(r / p.units())] += bytes;
    held_bytes_ += bytes;
    peak_held_bytes_ = std::max(peak_held_bytes_, held_bytes_);
    return {r, at};
  }
  // The device address of a saved tensor of an offloaded pool; its region must be pinned.
  template <class T>
  T* address(int pool, int region, std::size_t offset) {
    Pool& p = pool_at(pool);
    const int f = region >= 0 && region < static_cast<int>(p.region_frame.size()) && p.region_alive[region]
                      ? p.region_frame[region] : -1;
    TRELLIS_CHECK(f >= 0 && p.frame_pins[f] > 0, "ActivationArena: pool \"", p.name, "\": a saved tensor of unit ",
                  region % std::max(1, p.units()), " read while its unit is not computing (",
                  f < 0 ? "offloaded to host memory" : "not pinned", "): begin_unit first");
    return reinterpret_cast<T*>(memory_.data() + p.first_byte + static_cast<std::size_t>(f) * p.slot_bytes + offset);
  }
  // Host memory of the offloaded pools (every microbatch slot's room), bytes offloaded there now
  // and at most, bytes copied each way, and fetches made ahead of their unit.
  std::size_t host_capacity_bytes() const { return host_capacity_; }
  std::size_t host_held_bytes() const { return host_held_; }
  std::size_t peak_host_held_bytes() const { return peak_host_held_; }
  std::size_t offloaded_bytes() const { return offloaded_bytes_; }
  std::size_t fetched_bytes() const { return fetched_bytes_; }
  std::size_t prefetches() const { return prefetched_; }
  // The offloaded pools' copy queue (null before allocate() or without offloaded pools): tests
  // and benches read its records (HostCopyQueue::set_recording) and set its simulated link.
  CopyQueue* copy_queue() const { return queue_.get(); }
  const OffloadCopies& copies() const { return copies_; }

  // ---- figures -----------------------------------------------------------------------------------
  std::size_t capacity_bytes() const { return capacity_; }
  int pools() const { return static_cast<int>(pools_.size()); }
  int slots(int pool) const { return static_cast<int>(pools_.at(static_cast<std::size_t>(pool)).owner.size()); }
  std::size_t slot_bytes(int pool) const { return pools_.at(static_cast<std::size_t>(pool)).slot_bytes; }
  // Bytes microbatch mb holds in `pool` now (0 without a slot).
  std::size_t used_bytes(int pool, int mb) const {
    const Pool& p = pools_.at(static_cast<std::size_t>(pool));
    for (std::size_t s = 0; s < p.owner.size(); ++s)
      if (p.owner[s] == mb) return p.used[s];
    return 0;
  }
  std::size_t held_bytes() const { return held_bytes_; }
  int held_slots() const { return held_slots_; }
  std::size_t peak_held_bytes() const { return peak_held_bytes_; }
  int peak_held_slots() const { return peak_held_slots_; }
  // Slots of `pool` held at once, at most (measured).
  int peak_slots(int pool) const { return pools_.at(static_cast<std::size_t>(pool)).peak; }
  void reset_peaks() {
    peak_held_bytes_ = held_bytes_;
    peak_held_slots_ = held_slots_;
    peak_host_held_ = host_held_;
    for (auto& p : pools_) p.peak = static_cast<int>(std::count_if(p.owner.begin(), p.owner.end(), [](int o) { return o >= 0; }));
  }

 private:
  struct Pool {
    std::string name;
    std::size_t slot_bytes = 0, first_byte = 0;
    std::vector<int> owner;         // microbatch holding each slot, -1: free
    std::vector<std::size_t> used;  // bytes cut from each slot
    int peak = 0;
    // ---- offloaded pools: slot_bytes is a frame's, first_byte the first frame's; a slot is a
    // microbatch's room in host memory (host_first_byte + slot * host_slot_bytes)
    bool offloaded = false;
    std::vector<std::size_t> unit_bytes, unit_host_offset;  // per unit: formula, place in a host slot
    std::size_t host_slot_bytes = 0, host_first_byte = 0;
    std::vector<int> frame_region, frame_pins;  // per frame: region held (-1 none), pins
    std::vector<char> frame_prefetched;         // per frame: fetched ahead, not begun yet
    std::vector<std::uint64_t> frame_used_at;   // per frame: last use (LRU)
    std::vector<std::uint64_t> frame_ticket;    // per frame: the last copy reading or writing it
    // per region (slot * units + unit): frame (-1: not on the device), bytes cut, alive, on host
    std::vector<int> region_frame;
    std::vector<std::size_t> region_used;
    std::vector<char> region_alive, region_on_host;
    int current = -1;  // the region takes cut from (the last begin_unit)
    int pending_writeback = -1;  // overlapped: forward done, written back when the next unit begins
    std::vector<UnitCall> calls;  // a step's calls (set_unit_calls), and the next one expected
    std::size_t next_call = 0;
    bool on_track = true;  // the calls so far followed the list
    int units() const { return static_cast<int>(unit_bytes.size()); }
  };

  Pool& pool_at(int pool) {
    TRELLIS_CHECK(pool >= 0 && pool < static_cast<int>(pools_.size()), "ActivationArena: no pool ", pool);
    return pools_[static_cast<std::size_t>(pool)];
  }
  std::size_t slot_of(Pool& p, int mb, const char* what) {
    std::size_t free = p.owner.size();
    for (std::size_t s = 0; s < p.owner.size(); ++s) {
      if (p.owner[s] == mb) return s;
      if (p.owner[s] < 0 && free == p.owner.size()) free = s;
    }
    if (free == p.owner.size()) {
      std::string held;
      for (int o : p.owner) held += (held.empty() ? "" : ", ") + std::to_string(o);
      TRELLIS_THROW("ActivationArena: pool \"", p.name, "\" has all ", p.owner.size(), " slots held (microbatches ",
                    held, ") when microbatch ", mb, " saves its first tensor (", what,
                    "): the schedule keeps more microbatches alive than the arena was sized for");
    }
    p.owner[free] = mb;
    ++held_slots_;
    peak_held_slots_ = std::max(peak_held_slots_, held_slots_);
    p.peak = std::max(p.peak, static_cast<int>(std::count_if(p.owner.begin(), p.owner.end(), [](int o) { return o >= 0; })));
    if (poison_ && !p.offloaded) {
      const std::vector<std::uint8_t> nan_bytes(p.slot_bytes, 0xFF);  // 0xFFFF.. is a NaN in fp32 and bf16
      be_.upload(memory_.data() + p.first_byte + free * p.slot_bytes, nan_bytes.data(), nan_bytes.size());
    }
    return free;
  }

  // ---- offloaded pools ---------------------------------------------------------------------------
  int find_region(const Pool& p, int mb, int unit) const {
    for (std::size_t s = 0; s < p.owner.size(); ++s)
      if (p.owner[s] == mb) return static_cast<int>(s) * p.units() + unit;
    return -1;
  }
  int region_of(Pool& p, int mb, int unit, const char* what) {
    TRELLIS_CHECK(unit >= 0 && unit < p.units(), "ActivationArena: pool \"", p.name, "\": ", what, " of unit ", unit,
                  " of ", p.units());
    return static_cast<int>(slot_of(p, mb, what)) * p.units() + unit;
  }
  void unpin(Pool& p, int mb, int unit) {
    const int r = find_region(p, mb, unit);
    if (r < 0 || !p.region_alive[r]) return;  // released inside its unit (a fused W)
    const int f = p.region_frame[r];
    TRELLIS_CHECK(f >= 0 && p.frame_pins[f] > 0, "ActivationArena: pool \"", p.name, "\": end_unit of microbatch ", mb,
                  " unit ", unit, " without begin_unit");
    --p.frame_pins[f];
    if (p.current == r && p.frame_pins[f] == 0) p.current = -1;
  }
  // Moves the pool's place in its call list on; a call off the list loses it until a step's
  // first call comes round (the list wraps: every step repeats it).
  void follow(Pool& p, const UnitCall& c) {
    if (dry_ || p.calls.empty()) return;
    if (p.next_call == p.calls.size()) p.next_call = 0;
    if (p.on_track && p.calls[p.next_call] == c) {
      ++p.next_call;
      return;
    }
    p.on_track = p.calls.front() == c;
    p.next_call = p.on_track ? 1 : 0;
  }
  // Whether region r (its forward just ended) leaves its frame before its unit begins again: the
  // calls that follow replayed on a copy of the pool's bookkeeping, without copies (dry_), until
  // r is evicted (true), begun or freed (false). Without a list to follow: true (write it back).
  bool leaves_before_next_use(int pool, int r) {
    Pool& p = pools_[static_cast<std::size_t>(pool)];
    if (p.calls.empty() || !p.on_track) return true;
    std::vector<UnitCall> calls = std::move(p.calls);  // not copied into the snapshot
    const std::size_t from = p.next_call;
    const Pool snapshot = p;
    const auto figures = std::tuple(held_bytes_, peak_held_bytes_, held_slots_, peak_held_slots_, host_held_,
                                    peak_host_held_, offloaded_bytes_, fetched_bytes_, prefetched_, clock_);
    dry_ = true;
    watched_ = r;
    watched_evicted_ = false;
    bool leaves = true;  // the list ran out (or a call failed) first: write it back
    try {
      for (std::size_t k = 0; k < calls.size(); ++k) {
        const UnitCall& c = calls[(from + k) % calls.size()];
        if (c.op == UnitCall::Op::begin && find_region(p, c.mb, c.unit) == r) {
          leaves = false;
          break;
        }
        call(pool, c);
        if (watched_evicted_ || !p.region_alive[r]) {
          leaves = watched_evicted_;
          break;
        }
      }
    } catch (...) {
    }
    dry_ = false;
    watched_ = -1;
    p = snapshot;
    p.calls = std::move(calls);
    std::tie(held_bytes_, peak_held_bytes_, held_slots_, peak_held_slots_, host_held_, peak_host_held_, offloaded_bytes_,
             fetched_bytes_, prefetched_, clock_) = figures;
    return leaves;
  }
  std::uint8_t* frame_at(const Pool& p, int f) {
    return memory_.data() + p.first_byte + static_cast<std::size_t>(f) * p.slot_bytes;
  }
  std::uint8_t* host_room(const Pool& p, int r) {
    return host_.data() + p.host_first_byte + static_cast<std::size_t>(r / p.units()) * p.host_slot_bytes +
           p.unit_host_offset[static_cast<std::size_t>(r % p.units())];
  }
  // A free frame, else the least recently used unpinned one (a prefetch spares the regions
  // prefetched before it); -1 when there is none.
  int free_or_evictable(const Pool& p, bool for_prefetch = false) const {
    int best = -1;
    for (int f = 0; f < static_cast<int>(p.frame_region.size()); ++f) {
      if (p.frame_region[f] < 0) return f;
      const bool spare = p.frame_pins[f] > 0 || (for_prefetch && p.frame_prefetched[f]);
      if (!spare && (best < 0 || p.frame_used_at[f] < p.frame_used_at[best])) best = f;
    }
    return best;
  }
  // Region r in a frame (evicting to host memory when needed); returns the frame.
  int make_resident(Pool& p, int r, const char* what, bool for_prefetch = false) {
    int f = p.region_frame[r];
    if (f < 0) {
      f = free_or_evictable(p, for_prefetch);
      TRELLIS_CHECK(f >= 0, "ActivationArena: pool \"", p.name, "\": all ", p.frame_region.size(),
                    " frames hold units that are computing (", what, "): the pool needs more frames");
      if (const int old = p.frame_region[f]; old >= 0) {  // evict: the old region's bytes to its host room
        watched_evicted_ = watched_evicted_ || old == watched_;
        if (!p.region_on_host[old]) write_back(p, old);  // (overlapped: usually written back already)
        if (p.pending_writeback == old) p.pending_writeback = -1;
        p.region_frame[old] = -1;
        held_bytes_ -= p.region_used[old];
      }
      if (poison_ && !dry_) {
        queue_->wait(be_, p.frame_ticket[f]);  // the frame's last write-back has read it
        const std::vector<std::uint8_t> nan_bytes(p.slot_bytes, 0xFF);
        be_.upload(frame_at(p, f), nan_bytes.data(), nan_bytes.size());
      }
      if (p.region_on_host[r]) {  // fetch (after the frame's write-back: the queue is FIFO)
        const std::size_t n = p.region_used[r];
        if (!dry_) p.frame_ticket[f] = queue_->to_device(be_, frame_at(p, f), host_room(p, r), n);
        if (!copies_.queue && !dry_) queue_->wait(be_, p.frame_ticket[f]);
        p.region_on_host[r] = 0;
        host_held_ -= n;
        held_bytes_ += n;
        fetched_bytes_ += n;
      }
      p.frame_region[f] = r;
      p.frame_pins[f] = 0;
      p.frame_prefetched[f] = 0;
      p.region_frame[r] = f;
      peak_host_held_ = std::max(peak_host_held_, host_held_);
      peak_held_bytes_ = std::max(peak_held_bytes_, held_bytes_);
    }
    p.frame_used_at[f] = ++clock_;
    return f;
  }
  // Region r's bytes (in its frame) to its host room, after the compute issued so far.
  void write_back(Pool& p, int r) {
    const int f = p.region_frame[r];
    const std::size_t n = p.region_used[r];
    if (!dry_) {
      p.frame_ticket[static_cast<std::size_t>(f)] = queue_->to_host(be_, host_room(p, r), frame_at(p, f), n);
      if (!copies_.queue) queue_->wait(be_, p.frame_ticket[static_cast<std::size_t>(f)]);
    }
    p.region_on_host[r] = 1;
    host_held_ += n;
    offloaded_bytes_ += n;
    peak_host_held_ = std::max(peak_host_held_, host_held_);
  }
  // Overlapped: the write-back of the region whose forward ended last, if it is still in an
  // unpinned frame and the host lacks it.
  void start_pending_writeback(Pool& p) {
    const int r = std::exchange(p.pending_writeback, -1);
    if (r < 0 || !p.region_alive[r] || p.region_on_host[r]) return;
    const int f = p.region_frame[r];
    if (f >= 0 && p.frame_pins[f] == 0) write_back(p, r);
  }
  // Frees region r on both tiers, and its microbatch's slot once no region of it is alive.
  void drop_region(Pool& p, int r) {
    if (!p.region_alive[r]) return;
    const std::size_t n = p.region_used[r];
    if (const int f = p.region_frame[r]; f >= 0) {  // the frame is reused after its last copy's ticket
      p.frame_region[f] = -1;
      p.frame_pins[f] = 0;
      p.frame_prefetched[f] = 0;
      held_bytes_ -= n;
    }
    if (p.region_on_host[r]) host_held_ -= n;
    if (p.pending_writeback == r) p.pending_writeback = -1;
    p.region_frame[r] = -1;
    p.region_alive[r] = 0;
    p.region_on_host[r] = 0;
    p.region_used[r] = 0;
    if (p.current == r) p.current = -1;
    const std::size_t s = static_cast<std::size_t>(r / p.units());
    p.used[s] -= n;
    for (int u = 0; u < p.units(); ++u)
      if (p.region_alive[s * p.units() + u]) return;
    p.owner[s] = -1;
    p.used[s] = 0;
    --held_slots_;
  }

  B be_;
  OffloadCopies copies_;
  typename B::template buffer<std::uint8_t> memory_;
  typename CopyQueue::host_memory host_;  // offloaded pools' host rooms (pinned on CUDA)
  std::size_t host_capacity_ = 0, host_held_ = 0, peak_host_held_ = 0;
  std::size_t offloaded_bytes_ = 0, fetched_bytes_ = 0, prefetched_ = 0;
  std::uint64_t clock_ = 0;
  std::vector<Pool> pools_;
  std::size_t capacity_ = 0, held_bytes_ = 0, peak_held_bytes_ = 0;
  int held_slots_ = 0, peak_held_slots_ = 0;
  bool poison_ = false;
  // leaves_before_next_use: calls replayed without copies, watching one region's eviction
  bool dry_ = false, watched_evicted_ = false;
  int watched_ = -1;
  std::unique_ptr<CopyQueue> queue_;  // last: drained and destroyed before the memory its copies use
};

// A saved tensor: a view into an arena slot, a handle into an offloaded pool's region (resolved at
// each read: the region may come back to another frame), or an owning backend buffer (layer not
// bound to an arena). Move-only, like the buffers it replaces.
template <backend::Backend B, class T>
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(typename B::template buffer<T> own)
      : own_(std::move(own)), data_(own_.data()), size_(own_.size()) {}
  SavedTensor(T* view, std::size_t n) : data_(view), size_(n) {}
  SavedTensor(ActivationArena<B>* arena, int pool, std::pair<int, std::size_t> at, std::size_t n)
      : arena_(arena), pool_(pool), region_(at.first), offset_(at.second), size_(n) {}
  SavedTensor(SavedTensor&& o) noexcept { *this = std::move(o); }
  SavedTensor& operator=(SavedTensor&& o) noexcept {
    if (this != &o) {
      own_ = std::move(o.own_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      arena_ = std::exchange(o.arena_, nullptr);
      pool_ = o.pool_;
      region_ = o.region_;
      offset_ = o.offset_;
    }
    return *this;
  }
  SavedTensor(const SavedTensor&) = delete;
  SavedTensor& operator=(const SavedTensor&) = delete;

  T* data() { return arena_ ? arena_->template address<T>(pool_, region_, offset_) : data_; }
  const T* data() const { return arena_ ? arena_->template address<T>(pool_, region_, offset_) : data_; }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  typename B::template buffer<T> own_;
  T* data_ = nullptr;
  ActivationArena<B>* arena_ = nullptr;  // set: an offloaded pool's handle
  int pool_ = -1, region_ = -1;
  std::size_t offset_ = 0;
  std::size_t size_ = 0;
};

// A layer's handle on where its saved tensors go: an arena pool, or (default) its own buffers.
template <backend::Backend B>
class SavedMemory {
 public:
  SavedMemory() = default;
  SavedMemory(ActivationArena<B>* arena, int pool) : arena_(arena), pool_(pool) {}

  template <class T>
  SavedTensor<B, T> take(const B& be, int mb, index_t n, const char* what) const {
    if (!arena_) return SavedTensor<B, T>(be.template allocate<T>(static_cast<std::size_t>(n)));
    if (arena_->offloaded(pool_))
      return SavedTensor<B, T>(arena_, pool_, arena_->template take_in_region<T>(pool_, mb, n, what),
                               static_cast<std::size_t>(n));
    return SavedTensor<B, T>(arena_->template take<T>(pool_, mb, n, what), static_cast<std::size_t>(n));
  }
  void release(int mb) const {
    if (arena_) arena_->release(pool_, mb);
  }
  bool bound() const { return arena_ != nullptr; }

 private:
  ActivationArena<B>* arena_ = nullptr;
  int pool_ = -1;
};

}  // namespace trellis::nn
