// ZeRO-2/3's data-parallel traffic against a rank's compute, weight unit by weight unit: what
// plan::predict_step charges a rank's actions for it (docs/plan.md, "Data parallelism").
//
// ZeRO-2 reduce-scatters each unit's gradients right after its W, every microbatch
// (train/grad_buckets.hpp); ZeRO-3 also all-gathers each unit's values before its F and its B, the
// next unit's gather started while one computes (two slots: train/param_shards.hpp). Every bucket
// is a call of its own (one latency each), and one communicator runs them in order. Whether that
// traffic hides behind the compute depends on each unit's share, not only on the totals: a unit
// whose gathers outlast its compute stalls the next one even when the step as a whole has time
// to spare (the LM head computes long with little to gather; a block at a small microbatch the
// other way round). So the step is played out unit by unit on two clocks, the device's and the
// link's.
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace trellis::plan::detail {

// Buckets of a weight unit whose parameters have `sizes` elements in packing order, cut as
// train::GradBuckets cuts them: consecutive parameters while they fit in `bucket_elements`, a
// larger one alone.
inline int bucket_count(const std::vector<double>& sizes, double bucket_elements) {
  int buckets = 0;
  double run = 0;
  bool open = false;
  for (double n : sizes) {
    if (open && run + n > bucket_elements) {
      ++buckets;
      run = 0;
      open = false;
    }
    run += n;
    open = true;
  }
  return buckets + (open ? 1 : 0);
}

// One weight unit of a rank under ZeRO-2/3, times in seconds.
struct ShardedUnit {
  double forward = 0, backward = 0;  // its compute in one microbatch: F, and B + W
  double gather = 0;                 // ZeRO-3: its values' all-gathers (every bucket) before its F and its B
  bool gathered_in_backward = true;  // false for the embedding: its backward reads no values
  double reduce = 0;                 // its gradients' reduce-scatters after each microbatch's W
  // the device's own time moving those bytes (thread ranks copy them on their cores; 0 on a GPU,
  // whose link engines move them): charged to the compute when the transfer starts
  double gather_copy = 0, reduce_copy = 0;
};

// Transfers of a step besides the units': once per step (the tied wte's bucket, train/param_shards.hpp's hold_wte).
struct HeldTraffic {
  double gather = 0, gather_copy = 0;  // ZeRO-3: gathered before the first unit and kept for the step (waited for)
  double reduce = 0, reduce_copy = 0;  // reduce-scattered once, after the last microbatch's backward
};

// The time from the step's first unit to its last transfer on a rank whose weight units are
// `units` (forward order: a forward runs them first to last, a backward last to first), running
// `microbatches` times a forward then a backward through them. prefetch: each gather starts when
// the unit before it starts computing (else when its own unit needs it). A forward's last unit
// stays gathered for the backward that follows (FSDP keeps it; ParamShards::follow).
inline double sharded_step_seconds(const std::vector<ShardedUnit>& units, int microbatches, bool prefetch,
                                   const HeldTraffic& held = {}) {
  const int n = static_cast<int>(units.size());
  if (n == 0 || microbatches < 1) return 0;
  struct Visit {
    int unit;
    bool backward;
  };
  std::vector<Visit> order;
  for (int mb = 0; mb < microbatches; ++mb) {
    for (int i = 0; i < n; ++i) order.push_back({i, false});
    for (int i = n - 1; i >= 0; --i) order.push_back({i, true});
  }
  const auto gathers = [&](std::size_t k) {  // does visit k gather its unit's values?
    const Visit& v = order[k];
    const ShardedUnit& u = units[static_cast<std::size_t>(v.unit)];
    if (u.gather <= 0 || (v.backward && !u.gathered_in_backward)) return false;
    return !(v.backward && k > 0 && !order[k - 1].backward && order[k - 1].unit == v.unit);  // kept from the forward
  };
  double now = 0, link = 0;                 // the device's clock and the link's (when it is next free)
  std::vector<double> ready(order.size(), 0);  // when visit k's gather is done
  auto start_gather = [&](std::size_t k) {
    const ShardedUnit& u = units[static_cast<std::size_t>(order[k].unit)];
    link = std::max(link, now) + u.gather;
    ready[k] = link;
    now += u.gather_copy;
  };
  if (held.gather > 0) {  // gathered and waited for before the first unit
    link = held.gather;
    now = std::max(held.gather_copy, link);
  }
  for (std::size_t k = 0; k < order.size(); ++k) {
    const bool mine = gathers(k);
    if (mine && (!prefetch || k == 0)) start_gather(k);  // not started ahead: started now
    if (mine) now = std::max(now, ready[k]);
    if (prefetch && k + 1 < order.size() && gathers(k + 1)) start_gather(k + 1);
    const ShardedUnit& u = units[static_cast<std::size_t>(order[k].unit)];
    now += order[k].backward ? u.backward : u.forward;
    if (order[k].backward && u.reduce > 0) {
      link = std::max(link, now) + u.reduce;
      now += u.reduce_copy;
    }
  }
  if (held.reduce > 0) {
    link = std::max(link, now) + held.reduce;
    now += held.reduce_copy;
  }
  return std::max(now, link);
}

}  // namespace trellis::plan::detail
