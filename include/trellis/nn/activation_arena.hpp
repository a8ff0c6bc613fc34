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
// Figures: capacity_bytes() (what was reserved), peak_held_bytes() (the most bytes of saved
// tensors alive at once, measured) and peak_held_slots() (microbatch-chunks alive at once,
// measured), to compare with the simulator's prediction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "trellis/backend/backend.hpp"
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

template <backend::Backend B>
class ActivationArena {
 public:
  explicit ActivationArena(B be = {}) : be_(std::move(be)) {}
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
  // Reserves the memory of every pool (one backend buffer). poison: fill each slot with NaN bytes
  // when a microbatch claims it (tests: a read before a write shows up as NaN).
  void allocate(bool poison = false) {
    TRELLIS_CHECK(memory_.size() == 0, "ActivationArena: allocate() twice");
    TRELLIS_CHECK(capacity_ > 0, "ActivationArena: allocate() without pools");
    memory_ = be_.template allocate<std::uint8_t>(capacity_);
    poison_ = poison;
  }
  bool allocated() const { return memory_.size() != 0; }

  // n elements of T for microbatch mb in `pool`, cut from mb's slot (claimed on its first take).
  // `what` names the caller in errors.
  template <class T>
  T* take(int pool, int mb, index_t n, const char* what) {
    TRELLIS_CHECK(allocated(), "ActivationArena: take before allocate() (", what, ")");
    Pool& p = pool_at(pool);
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
    for (std::size_t s = 0; s < p.owner.size(); ++s)
      if (p.owner[s] == mb) {
        held_bytes_ -= p.used[s];
        p.used[s] = 0;
        p.owner[s] = -1;
        --held_slots_;
        return;
      }
  }

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
    for (auto& p : pools_) p.peak = static_cast<int>(std::count_if(p.owner.begin(), p.owner.end(), [](int o) { return o >= 0; }));
  }

 private:
  struct Pool {
    std::string name;
    std::size_t slot_bytes = 0, first_byte = 0;
    std::vector<int> owner;         // microbatch holding each slot, -1: free
    std::vector<std::size_t> used;  // bytes cut from each slot
    int peak = 0;
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
    if (poison_) {
      const std::vector<std::uint8_t> nan_bytes(p.slot_bytes, 0xFF);  // 0xFFFF.. is a NaN in fp32 and bf16
      be_.upload(memory_.data() + p.first_byte + free * p.slot_bytes, nan_bytes.data(), nan_bytes.size());
    }
    return free;
  }

  B be_;
  typename B::template buffer<std::uint8_t> memory_;
  std::vector<Pool> pools_;
  std::size_t capacity_ = 0, held_bytes_ = 0, peak_held_bytes_ = 0;
  int held_slots_ = 0, peak_held_slots_ = 0;
  bool poison_ = false;
};

// A saved tensor: a view into an arena slot, or an owning backend buffer (layer not bound to an
// arena). Move-only, like the buffers it replaces.
template <backend::Backend B, class T>
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(typename B::template buffer<T> own)
      : own_(std::move(own)), data_(own_.data()), size_(own_.size()) {}
  SavedTensor(T* view, std::size_t n) : data_(view), size_(n) {}
  SavedTensor(SavedTensor&& o) noexcept
      : own_(std::move(o.own_)), data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  SavedTensor& operator=(SavedTensor&& o) noexcept {
    if (this != &o) {
      own_ = std::move(o.own_);
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  SavedTensor(const SavedTensor&) = delete;
  SavedTensor& operator=(const SavedTensor&) = delete;

  T* data() { return data_; }
  const T* data() const { return data_; }
  std::size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

 private:
  typename B::template buffer<T> own_;
  T* data_ = nullptr;
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
