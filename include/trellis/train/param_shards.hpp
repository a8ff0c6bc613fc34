// train::ParamShards: ZeRO-3's parameters (DeepSpeed's stage 3, FSDP's FULL_SHARD). Each rank
// keeps only its shard of every data-parallel bucket's values (GradBuckets' buckets and shard
// layout: the optimizer's pieces update them in place), and a weight unit's values exist whole
// only while the unit computes:
//   need(c, u)      before unit u of chunk c reads its values (its forward, its backward_input):
//                   its buckets all-gathered (Shard(0) -> Replicate over the replicas) into a free
//                   slot, and the unit's value views bound to it;
//   done(c, u)      after: the views unbound, the slot free for the next unit;
//   prefetch(c, u)  the gather of the unit that computes next started into a free slot while the
//                   current one computes (its need() then only waits);
//   follow(order)   the step's value-reading actions on this rank, in order (a schedule's F and B
//                   of each microbatch and chunk): an action's last unit then prefetches the next
//                   action's first unit (prefetch_next), and when that is the same unit (a stage's
//                   F then a B at its head) keeps it gathered instead of releasing it and
//                   gathering it again (done(c, u, action)), as FSDP leaves its last unit
//                   unsharded after the forward;
//   hold_wte()      wte (tied: the embedding's forward and the head's forward and backward read it,
//                   on every microbatch) gathered once per step into a buffer of its own and kept
//                   until release_step(), as FSDP keeps a tied weight in its root unit;
//   summon()/release_full()   every value whole in the chunks' packed buffers, for checkpoints
//                   and the host (FSDP's summon_full_params); release_full(write_back) keeps
//                   changes made meanwhile (a load) in the shards.
// Outside these windows a value view is unbound: a read is an error naming the parameter's state,
// never stale data. Slots: `slots` (2: the unit computing and the one prefetched), each as large
// as the largest unit. Every rank of a replica group calls these in the same order (the schedule
// is the same on every replica), so the gathers match.
#pragma once

#include <algorithm>
#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"
#include "trellis/pipe/schedule.hpp"
#include "trellis/shard/flat.hpp"
#include "trellis/train/grad_buckets.hpp"

namespace trellis::train {

// One value-reading action of a step: the forward or backward_input of (microbatch, chunk), and
// the unit it reads first (a forward counts down from the top unit to the head, a backward up
// from the head).
struct ValueAction {
  bool backward = false;
  int microbatch = 0, chunk = 0, first = 0;
};
// The value-reading actions of pipeline rank `rank` in `schedule` (its F and B; a W reads none),
// or without a schedule the pp = 1 loop's (each microbatch's F through the chunks, then its B back
// through them). chunks[c]: a model chunk (weight_units(), stage().embedding); a backward reads
// none of an embedding-only chunk.
template <class Model>
std::vector<ValueAction> value_actions(const pipe::Schedule* schedule, int rank, int microbatches,
                                       const std::vector<std::unique_ptr<Model>>& chunks) {
  std::vector<ValueAction> out;
  const auto add = [&](bool backward, int mb, int c) {
    const Model& m = *chunks.at(static_cast<std::size_t>(c));
    if (backward && m.weight_units() == (m.stage().embedding ? 1 : 0)) return;
    out.push_back({backward, mb, c, backward ? 0 : m.weight_units() - 1});
  };
  if (schedule) {
    for (const pipe::Action& a : schedule->ranks.at(static_cast<std::size_t>(rank)))
      if (a.kind == pipe::ActionKind::forward || a.kind == pipe::ActionKind::backward_input)
        add(a.kind == pipe::ActionKind::backward_input, a.microbatch, a.chunk);
    return out;
  }
  const int n = static_cast<int>(chunks.size());
  for (int mb = 0; mb < microbatches; ++mb) {
    for (int c = 0; c < n; ++c) add(false, mb, c);
    for (int c = n - 1; c >= 0; --c) add(true, mb, c);
  }
  return out;
}

template <comm::Communicator C, backend::Backend B>
class ParamShards {
 public:
  using Buckets = GradBuckets<C, B>;
  using Piece = typename Buckets::Piece;
  struct Options {
    int slots = 2;
    bool prefetch = true;
  };

  // Takes this rank's shard of every bucket from the chunks' packed values, then drops those.
  ParamShards(const Buckets& buckets, const Options& o, B be) : buckets_(&buckets), opt_(o), be_(std::move(be)) {
    TRELLIS_CHECK(buckets.zero() == 3, "ParamShards: ZeRO stage ", buckets.zero(), " (values are sharded at stage 3)");
    TRELLIS_CHECK(o.slots >= 1, "ParamShards: ", o.slots, " value slots");
    shards_ = be_.template allocate<float>(buckets.shard_elements());
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      const auto& b = buckets.bucket(k);
      if (b.chunk < 0) wte_bucket_ = k;
      be_.copy(shards_.data() + b.shard_begin, packed_values(b) + my_offset(b), b.shard_size());
    }
    std::size_t largest = 0;
    for (std::size_t c = 0; c < buckets.chunks().size(); ++c) {
      const int units = buckets.chunks()[c]->weight_units();
      resident_.emplace_back(static_cast<std::size_t>(units), -1);
      auto& offsets = offsets_.emplace_back();
      for (int u = 0; u < units; ++u) {
        const auto& unit = buckets.unit(static_cast<int>(c), u);
        largest = std::max(largest, unit.size);
        auto& mine = offsets.emplace_back();
        for (nn::Parameter* p : unit.params)
          mine.push_back(buckets.chunks()[c]->parameter_buffer().packed_range(*p, *p).first - unit.begin);
      }
    }
    slots_.resize(static_cast<std::size_t>(o.slots));
    for (auto& s : slots_) s.values = be_.template allocate<float>(largest);
    if (wte_bucket_) wte_ = be_.template allocate<float>(buckets.bucket(*wte_bucket_).size);
    for (auto* m : buckets.chunks()) m->parameter_buffer().drop_values();
  }

  // The optimizer's piece k of the values: in this rank's shard.
  std::span<float> piece_value(const Piece& pc) {
    return {shards_.data() + buckets_->bucket(pc.bucket).shard_begin + pc.shard_offset, static_cast<std::size_t>(pc.size)};
  }
  // Bytes of value storage this rank holds: the shards, the unit slots and wte's step buffer.
  std::size_t bytes() const {
    std::size_t n = shards_.size() + wte_.size();
    for (const auto& s : slots_) n += s.values.size();
    return n * sizeof(float);
  }
  // Gathers started ahead of their unit (prefetch) and found ready or in flight by its need().
  int prefetched() const { return prefetched_; }
  // Unit gathers started (prefetched or not); a unit kept for the next action is not gathered again.
  int gathers() const { return gathers_; }

  // The order of this step's value-reading actions (see the file's header); empty: none (an
  // evaluation, or prefetch off), each action then releases its last unit and prefetches nothing
  // beyond itself. Every replica follows the same order, so the gathers still match.
  void follow(std::vector<ValueAction> order) {
    next_.clear();
    if (!opt_.prefetch) return;
    for (std::size_t i = 0; i + 1 < order.size(); ++i)
      next_[key(order[i].backward, order[i].microbatch, order[i].chunk)] = {order[i + 1].chunk, order[i + 1].first};
  }
  // A training step begins: wte held, `order` followed.
  void begin_step(std::vector<ValueAction> order) {
    hold_wte();
    follow(std::move(order));
  }
  // Action (backward, mb, c) reached its last unit: the next action's first unit prefetched.
  void prefetch_next(bool backward, int mb, int c) {
    if (const auto it = next_.find(key(backward, mb, c)); it != next_.end()) prefetch(it->second.first, it->second.second);
  }

  // ---- during a step ------------------------------------------------------------------------------
  void need(int c, int u) {
    int& at = resident(c, u);
    if (at < 0) at = start(c, u, /*prefetch=*/false);
    Slot& s = slots_[static_cast<std::size_t>(at)];
    if (s.requests.size() > 0 && s.prefetched) ++prefetched_;
    for (auto& r : s.requests) r.wait();
    s.requests.clear();
    s.prefetched = false;
    if (s.users++ == 0) bind(c, u, s.values.data());
  }
  // keep_for: unit u was the last that action (backward, mb, c) reads; if the next action reads it
  // first, its slot stays gathered (unbound) for that action's need().
  void done(int c, int u, std::optional<std::pair<bool, int>> keep_for = std::nullopt) {
    int& at = resident(c, u);
    TRELLIS_CHECK(at >= 0 && slots_[static_cast<std::size_t>(at)].users > 0, "ParamShards: unit ", u, " of chunk ", c,
                  " done without need");
    Slot& s = slots_[static_cast<std::size_t>(at)];
    if (--s.users > 0) return;
    bind(c, u, nullptr);
    if (keep_for) {
      const auto it = next_.find(key(keep_for->first, keep_for->second, c));
      if (it != next_.end() && it->second == std::make_pair(c, u)) return;
    }
    s.unit.reset();
    at = -1;
  }
  void prefetch(int c, int u) {
    if (!opt_.prefetch || c < 0 || u < 0 || static_cast<std::size_t>(c) >= resident_.size() ||
        static_cast<std::size_t>(u) >= resident_[static_cast<std::size_t>(c)].size() || resident(c, u) >= 0)
      return;
    if (free_slot() < 0) return;  // every slot busy: the unit is gathered when needed
    resident(c, u) = start(c, u, /*prefetch=*/true);
  }
  void hold_wte() {
    if (!wte_bucket_ || wte_held_) return;
    const auto& b = buckets_->bucket(*wte_bucket_);
    if (auto r = gather(b, wte_.data())) r->wait();
    buckets_->parameters()[b.params.front()]->value.rebind(wte_.data(), B::host_readable);
    wte_held_ = true;
  }
  // After a step (or an evaluation): wte released; every unit must be done (a prefetch that was
  // never needed, or a unit kept for an action that did not come, is waited for and dropped); the
  // order followed is forgotten.
  void release_step() {
    next_.clear();
    if (wte_held_) buckets_->parameters()[buckets_->bucket(*wte_bucket_).params.front()]->value.rebind(nullptr, B::host_readable);
    wte_held_ = false;
    for (std::size_t c = 0; c < resident_.size(); ++c)
      for (std::size_t u = 0; u < resident_[c].size(); ++u) {
        int& at = resident_[c][u];
        if (at < 0) continue;
        Slot& s = slots_[static_cast<std::size_t>(at)];
        TRELLIS_CHECK(s.users == 0, "ParamShards: unit ", u, " of chunk ", c, " still in use at the end of a step");
        for (auto& r : s.requests) r.wait();
        s.requests.clear();
        s.unit.reset();
        at = -1;
      }
  }

  // ---- every value whole (checkpoints, the host) ----------------------------------------------------
  // A collective over the replicas: the chunks' packed values back, every bucket gathered into them.
  void summon() {
    TRELLIS_CHECK(!wte_held_, "ParamShards: summon inside a step");
    for (auto* m : buckets_->chunks()) m->parameter_buffer().restore_values();
    std::vector<typename C::request_type> started;
    for (std::size_t k = 0; k < buckets_->size(); ++k) {
      const auto& b = buckets_->bucket(k);
      if (auto r = gather(b, packed_values(b))) started.push_back(std::move(*r));
    }
    for (auto& r : started) r.wait();
  }
  // write_back: this rank's part of every bucket copied into its shard first (values changed meanwhile).
  void release_full(bool write_back) {
    if (write_back)
      for (std::size_t k = 0; k < buckets_->size(); ++k) {
        const auto& b = buckets_->bucket(k);
        be_.copy(shards_.data() + b.shard_begin, packed_values(b) + my_offset(b), b.shard_size());
      }
    for (auto* m : buckets_->chunks()) m->parameter_buffer().drop_values();
  }

 private:
  struct Slot {
    typename B::template buffer<float> values;
    std::vector<typename C::request_type> requests;
    std::optional<std::pair<int, int>> unit;  // (chunk, unit) it holds
    int users = 0;
    bool prefetched = false;
  };

  static long key(bool backward, int mb, int c) { return (static_cast<long>(mb) * 65536 + c) * 2 + (backward ? 1 : 0); }
  int& resident(int c, int u) { return resident_.at(static_cast<std::size_t>(c)).at(static_cast<std::size_t>(u)); }
  float* packed_values(const typename Buckets::Bucket& b) const {
    return buckets_->chunks()[static_cast<std::size_t>(b.owner)]->parameter_buffer().values().data() + b.packed_begin;
  }
  static std::size_t my_offset(const typename Buckets::Bucket& b) {
    return static_cast<std::size_t>(b.comm->rank()) * b.shard_size();
  }
  // Bucket b's shard (Shard(0) over its replicas) -> Replicate, into `full` (b.size floats).
  std::optional<typename C::request_type> gather(const typename Buckets::Bucket& b, float* full) {
    return shard::start_flat_redistribute(*b.comm, shard::shard_code(0), shard::replicate_code(), full,
                                          shards_.data() + b.shard_begin, b.size);
  }
  int free_slot() const {
    for (std::size_t s = 0; s < slots_.size(); ++s)
      if (!slots_[s].unit) return static_cast<int>(s);
    return -1;
  }
  // Starts the gathers of unit u of chunk c into a free slot.
  int start(int c, int u, bool prefetch) {
    const int at = free_slot();
    TRELLIS_CHECK(at >= 0, "ParamShards: no free value slot for unit ", u, " of chunk ", c, " (", slots_.size(),
                  " slots, all in use)");
    Slot& s = slots_[static_cast<std::size_t>(at)];
    s.unit = std::make_pair(c, u);
    s.prefetched = prefetch;
    ++gathers_;
    const auto& unit = buckets_->unit(c, u);
    for (std::size_t k : unit.buckets) {
      const auto& b = buckets_->bucket(k);
      if (auto r = gather(b, s.values.data() + (b.packed_begin - unit.begin))) s.requests.push_back(std::move(*r));
    }
    return at;
  }
  // The unit's value views onto `slot` (its packed layout from unit.begin), or unbound (nullptr).
  void bind(int c, int u, float* slot) {
    const auto& params = buckets_->unit(c, u).params;
    const auto& offsets = offsets_[static_cast<std::size_t>(c)][static_cast<std::size_t>(u)];
    for (std::size_t k = 0; k < params.size(); ++k)
      params[k]->value.rebind(slot ? slot + offsets[k] : nullptr, B::host_readable);
  }

  const Buckets* buckets_;
  Options opt_;
  B be_;
  typename B::template buffer<float> shards_, wte_;
  std::optional<std::size_t> wte_bucket_;
  bool wte_held_ = false;
  std::vector<Slot> slots_;
  std::vector<std::vector<int>> resident_;  // [chunk][unit]: its slot, or -1
  std::vector<std::vector<std::vector<std::size_t>>> offsets_;  // [chunk][unit][k]: param k's offset in the unit
  int prefetched_ = 0, gathers_ = 0;
  std::map<long, std::pair<int, int>> next_;  // follow(): action key -> the next action's (chunk, first unit)
};

}  // namespace trellis::train
