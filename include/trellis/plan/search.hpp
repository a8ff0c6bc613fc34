// plan::search: every layout of a model on a cluster -- dp x tp x pp x cp over all its devices, the
// cp mode (ring, Ulysses, hybrid), the pipeline schedule (and virtual chunks), microbatches,
// recompute, sequence parallelism, ZeRO stage and hybrid shard degree, the offloaded optimizer,
// tp overlap chunks, and for a Mixture-of-Experts model expert parallelism (ep: every divisor of
// dp that divides the expert count) -- checked (train::config_problems), pruned by memory
// (plan::predict_peak_memory against the device's memory), timed by the cost model
// (plan::predict_step), and the fastest returned with the train_gpt flags that run each. On a
// cluster of mixed speeds dp replicas get shares and a pipeline of one chunk per rank a split
// balanced for their speeds (plan::balance_for_speeds).
//
// Pruning by time: predict_step's bound (every rank's busy time plus what follows the schedule,
// without simulating the pipeline) is a lower bound of its step, so a layout whose bound is not
// below the k-th best step found so far cannot enter the top k and is not simulated. The result
// is the same as without pruning (tested against the exhaustive run).
#pragma once

#include <algorithm>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "trellis/plan/cluster.hpp"
#include "trellis/plan/cost_model.hpp"
#include "trellis/plan/memory_model.hpp"
#include "trellis/plan/stage_balance.hpp"
#include "trellis/train/metrics.hpp"  // defines: gpt_flops_per_token, moe_active_parameters
#include "trellis/train/trainer_config.hpp"

namespace trellis::plan {

// What the search varies (the model, batch, sequence and optimizer come from the base config).
struct SearchSpace {
  std::vector<std::string> schedules{"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"};
  std::vector<int> zero{0, 1, 2, 3};
  std::vector<bool> recompute{false, true};
  std::vector<bool> sequence_parallel{false, true};
  // tp overlap chunks (options.overlap_chunks, train_gpt --overlap K): tried with tp > 1 where K
  // divides the rows each chunked collective splits (overlap_fits)
  std::vector<int> overlap_chunks{1, 2, 4};
  int max_microbatches = 64;  // microbatches: every m with batch % (dp m) == 0, up to this
  int max_tp = 0;             // 0: the devices of one node (tp collectives stay on the fast link)
  int max_cp = 0;             // context parallel up to this; 0: any that divides the devices and 2 cp the sequence
  // cp > 1 modes (train_gpt --cp-mode): ring; ulysses where cp divides each tp rank's heads; hybrid
  // with every Ulysses group u (--cp-ulysses) that divides cp (1 < u < cp) and those heads
  std::vector<nn::CpMode> cp_modes{nn::CpMode::ring, nn::CpMode::ulysses, nn::CpMode::hybrid};
  // Hybrid sharding (train_gpt --shard-degree S): with ZeRO >= 1, every S dividing dp x cp with
  // 2 <= S < dp x cp besides full sharding (S = 1 shards nothing; ZeRO 0 does that with less traffic)
  bool shard_degrees = true;
  // The offloaded optimizer (train_gpt --offload optimizer): off, then on. It frees the moments'
  // device memory and costs host copies and a host AdamW, so it comes first only where memory
  // forces it or (fused_update with the update thread, from the base config) it hides.
  std::vector<bool> offload_optimizer{false, true};
  // Bytes of activations per fp32 byte the memory model counts (0.5: bf16 activations, as the
  // CUDA backend keeps them; 1: the host's fp32).
  double activation_scale = 1.0;
};

struct Candidate {
  train::TrainerConfig config;
  StepCost cost;
  MemoryEstimate memory;  // the pipeline rank that holds the most (activations scaled)
  int memory_pp_rank = 0;
};

struct Plan {
  std::vector<Candidate> best;  // fastest first
  long layouts = 0;             // candidates generated
  long invalid = 0;             // refused by train::config_problems
  long over_memory = 0;         // predicted not to fit the device
  long pruned = 0;              // not simulated: their time bound was no better than the k-th best
  long simulated = 0;
  long offload_not_needed = 0;  // offloaded-optimizer layouts not tried: the layout fits without (offload_tried)
};

// The device memory the search compares with the cluster's (activations scaled).
inline MemoryEstimate scaled_memory(const PeakMemory& peak, double activation_scale) {
  MemoryEstimate m = peak.memory;
  m.activations *= activation_scale;
  return m;
}

// Whether the search tries layout `c` with the offloaded optimizer: where the same layout keeping
// the moments on the device does not fit the device (`fits_without`), or where the host's update
// can hide behind the backward (fused_update with the update thread). Elsewhere the offload adds
// host copies and a host AdamW to what follows the schedule, and the device's memory is no
// concern: it is not tried (the layout without it comes first). Layouts without it: always.
inline bool offload_tried(const train::TrainerConfig& c, bool fits_without) {
  if (!c.offload_optimizer) return true;
  const bool may_hide = c.fused_update != train::TrainerConfig::FusedUpdate::off && c.offload_update_thread;
  return !fits_without || may_hide;
}
inline bool offload_tried(const train::TrainerConfig& c, const Cluster& cluster, double activation_scale) {
  if (!c.offload_optimizer) return true;
  train::TrainerConfig without = c;
  without.offload_optimizer = false;
  return offload_tried(
      c, scaled_memory(predict_peak_memory(without), activation_scale).device_total() <= cluster.device.memory_bytes);
}

// The flags that make train_gpt run config `c`'s layout (beside the model and data flags).
inline std::string train_gpt_flags(const train::TrainerConfig& c) {
  std::ostringstream s;
  s << "--dp " << c.dp << " --tp " << c.tp << " --pp " << c.pp;
  if (c.cp > 1) s << " --cp " << c.cp;
  if (c.cp > 1 && c.cp_mode != nn::CpMode::ring) s << " --cp-mode " << nn::to_string(c.cp_mode);
  if (c.cp > 1 && c.cp_mode == nn::CpMode::hybrid) s << " --cp-ulysses " << c.cp_ulysses;
  if (c.ep > 1) s << " --ep " << c.ep;
  s << " --microbatches " << c.microbatches;
  if (c.pp > 1) s << " --schedule " << c.schedule;
  if (c.pp > 1 && c.schedule == "interleaved_1f1b") s << " --chunks " << c.virtual_chunks;
  if (c.pp > 1 && c.schedule == "local_learning" && c.local_head == train::TrainerConfig::LocalHead::own)
    s << " --local-head own";
  if (c.zero > 0) s << " --zero " << c.zero;
  if (c.zero > 0 && c.shard_degree > 0) s << " --shard-degree " << c.shard_degree;
  if (c.offload_optimizer) s << " --offload optimizer";
  if (c.options.sequence_parallel) s << " --sp";
  if (c.options.recompute) s << " --recompute";
  if (c.options.overlap_chunks > 1) s << " --overlap " << c.options.overlap_chunks;
  if (!c.dp_rows.empty()) {
    s << " --dp-rows ";
    for (std::size_t i = 0; i < c.dp_rows.size(); ++i) s << (i ? "," : "") << c.dp_rows[i];
  }
  if (!c.stage_layers.empty()) {
    s << " --stage-layers ";
    for (std::size_t i = 0; i < c.stage_layers.size(); ++i) s << (i ? "," : "") << c.stage_layers[i];
  }
  return s.str();
}

// Whether the search tries `K` tp overlap chunks for layout `c`: K = 1, or tp > 1 (train_gpt
// refuses --overlap > 1 without tp; the layers chunk nothing on one rank) and K dividing the rows
// each chunked collective splits -- a microbatch's rows on a rank, (batch / dp / microbatches) x
// seq / cp, over tp under sp (the layers chunk this rank's sequence shard). The trainer itself
// accepts any K >= 1 (train::config_problems) and cuts uneven chunks, at most one per row
// (nn::detail::effective_chunks); the search keeps to the K whose chunks are equal, which the
// cost model assumes, and never one the layers would lower.
inline bool overlap_fits(const train::TrainerConfig& c, int K) {
  if (K == 1) return true;
  if (K < 1 || c.tp <= 1 || c.dp < 1 || c.microbatches < 1 || c.cp < 1) return false;
  const index_t per_microbatch = static_cast<index_t>(c.dp) * c.microbatches;
  if (c.batch % per_microbatch != 0 || c.seq % c.cp != 0) return false;
  index_t rows = c.batch / per_microbatch * (c.seq / c.cp);
  if (c.options.sequence_parallel) {
    if (rows % c.tp != 0) return false;
    rows /= c.tp;
  }
  return rows % K == 0;
}

// Every layout of the search space for `base` on `devices` ranks, in a fixed order (unchecked),
// each given to emit(TrainerConfig&&) (the search's spaces hold millions: none is kept).
template <class Emit>
void for_each_layout(const train::TrainerConfig& base, int devices, int max_tp, const SearchSpace& space, Emit&& emit) {
  const bool local = base.schedule == "local_learning" && !base.custom_schedule;
  for (int tp = 1; tp <= devices; ++tp) {
    if (devices % tp != 0 || (max_tp > 0 && tp > max_tp)) continue;
    for (int cp = 1; cp <= devices / tp; ++cp) {
      if ((devices / tp) % cp != 0 || (space.max_cp > 0 && cp > space.max_cp) || base.seq % (2 * cp) != 0) continue;
      // the cp modes (mode, Ulysses group u): ring; ulysses and hybrid where u divides the heads
      // of every tp rank (train::config_problems' rule; equal shares when tp divides the heads)
      std::vector<std::pair<nn::CpMode, int>> modes;
      for (nn::CpMode mode : cp > 1 ? space.cp_modes : std::vector<nn::CpMode>{nn::CpMode::ring}) {
        const index_t local_heads = base.model.heads / tp;
        if (mode == nn::CpMode::ring) modes.emplace_back(mode, 2);
        if (mode == nn::CpMode::ulysses && local_heads % cp == 0) modes.emplace_back(mode, 2);
        if (mode == nn::CpMode::hybrid)
          for (int u = 2; u < cp; ++u)
            if (cp % u == 0 && local_heads % u == 0) modes.emplace_back(mode, u);
      }
      for (auto [mode, u] : modes)
      for (int pp = 1; pp <= devices / tp / cp; ++pp) {
        if ((devices / tp / cp) % pp != 0) continue;
        const int dp = devices / tp / cp / pp;
        if (base.batch % dp != 0) continue;
        // local learning trains another model (a head per stage): planned only where the base
        // config asks for it, then as the only pipeline schedule and with pipelines only
        if (local && pp == 1) continue;
        const std::vector<std::string> schedules =
            local ? std::vector<std::string>{"local_learning"} : pp > 1 ? space.schedules : std::vector<std::string>{"1f1b"};
        // expert parallelism (MoE models): groups of ep consecutive dp ranks, ep dividing the experts
        std::vector<int> eps{1};
        if (base.model.moe_every > 0)
          for (int e = 2; e <= dp; ++e)
            if (dp % e == 0 && base.model.experts % e == 0) eps.push_back(e);
        for (int ep : eps)
        for (const auto& sched : schedules)
          for (int m = 1; m <= space.max_microbatches && m <= base.batch / dp; ++m) {
            if ((base.batch / dp) % m != 0) continue;
            for (bool rc : space.recompute)
              for (bool sp : space.sequence_parallel) {
                if (sp && tp == 1) continue;
                for (int z : space.zero) {
                  if (z > 0 && dp * cp == 1) continue;
                  std::vector<int> degrees{0};  // 0: over every replica
                  if (z > 0 && space.shard_degrees)
                    for (int S = 2; S < dp * cp; ++S)
                      if ((dp * cp) % S == 0) degrees.push_back(S);
                  for (int S : degrees)
                  for (bool off : space.offload_optimizer) {
                  train::TrainerConfig c = base;
                  c.dp = dp;
                  c.tp = tp;
                  c.pp = pp;
                  c.cp = cp;
                  c.cp_mode = mode;
                  c.cp_ulysses = u;
                  c.ep = ep;
                  c.shard_degree = S;
                  c.offload_optimizer = off;
                  c.schedule = sched;
                  c.virtual_chunks = 2;
                  c.microbatches = m;
                  c.options.recompute = rc;
                  c.options.sequence_parallel = sp;
                  c.zero = z;
                  for (int k : space.overlap_chunks) {
                    if (!overlap_fits(c, k)) continue;
                    train::TrainerConfig ck = c;
                    ck.options.overlap_chunks = k;
                    emit(std::move(ck));
                  }
                  }
                }
              }
          }
      }
    }
  }
}

// The same layouts, in a vector.
inline std::vector<train::TrainerConfig> layouts(const train::TrainerConfig& base, int devices, int max_tp,
                                                 const SearchSpace& space) {
  std::vector<train::TrainerConfig> out;
  for_each_layout(base, devices, max_tp, space, [&](train::TrainerConfig&& c) { out.push_back(std::move(c)); });
  return out;
}

// The `top` fastest layouts of `base` (its model, batch, seq, optimizer) on `cluster`.
// prune = false simulates every layout that fits (the reference the pruning is tested against).
inline Plan search(const train::TrainerConfig& base, const Cluster& cluster, const Rates& rates,
                   const SearchSpace& space = {}, int top = 10, bool prune = true) {
  TRELLIS_CHECK(top >= 1, "plan::search: top must be >= 1 (got ", top, ")");
  Plan plan;
  const int max_tp = space.max_tp > 0 ? space.max_tp : cluster.devices_per_node;
  // The memory of the previous layout: layouts() lists the overlap chunks innermost, and they do
  // not change memory (plan/memory_model.hpp), so a layout that differs from the previous one in
  // them alone reuses it.
  std::optional<train::TrainerConfig> last;
  PeakMemory last_peak;
  auto same_but_overlap = [](const train::TrainerConfig& a, const train::TrainerConfig& b) {
    return a.dp == b.dp && a.tp == b.tp && a.pp == b.pp && a.cp == b.cp && a.ep == b.ep && a.cp_mode == b.cp_mode &&
           a.cp_ulysses == b.cp_ulysses && a.shard_degree == b.shard_degree &&
           a.offload_optimizer == b.offload_optimizer && a.schedule == b.schedule &&
           a.virtual_chunks == b.virtual_chunks && a.microbatches == b.microbatches &&
           a.options.recompute == b.options.recompute && a.options.sequence_parallel == b.options.sequence_parallel &&
           a.zero == b.zero && a.dp_rows == b.dp_rows && a.stage_layers == b.stage_layers;
  };
  // The last layout without the offloaded optimizer and whether it fit: layouts() lists each
  // layout's offload right after it (offload_tried asks for it).
  std::optional<train::TrainerConfig> plain;
  bool plain_fits = false;
  ScheduleCache schedules;  // each schedule made, given its communication and verified once
  for_each_layout(base, cluster.devices(), max_tp, space, [&](train::TrainerConfig&& c) {
    ++plan.layouts;
    if (!train::config_problems(c, false).empty() || schedules.refuses(c)) {  // the generator asked once
      ++plan.invalid;
      return;
    }
    if (balance_for_speeds(c, cluster, rates) && !train::config_problems(c).empty()) {  // mixed speeds: uneven shares, stages
      ++plan.invalid;
      return;
    }
    if (c.offload_optimizer) {
      train::TrainerConfig without = c;
      without.offload_optimizer = false;
      const bool known = plain && same_but_overlap(*plain, without);
      if (!(known ? offload_tried(c, plain_fits) : offload_tried(c, cluster, space.activation_scale))) {
        ++plan.offload_not_needed;
        return;
      }
    }
    const bool reuse = last && same_but_overlap(*last, c);
    const PeakMemory peak = reuse ? last_peak : predict_peak_memory(c, &schedules);
    if (!reuse) {
      last = c;
      last_peak = peak;
    }
    const MemoryEstimate mem = scaled_memory(peak, space.activation_scale);
    const bool fits = mem.device_total() <= cluster.device.memory_bytes;
    if (!c.offload_optimizer && !(plain && same_but_overlap(*plain, c))) {
      plain = c;
      plain_fits = fits;
    }
    if (!fits) {
      ++plan.over_memory;
      return;
    }
    const double kth = static_cast<int>(plan.best.size()) < top ? std::numeric_limits<double>::infinity()
                                                                 : plan.best.back().cost.step;
    const StepCost cost =
        predict_step(c, cluster, rates, prune ? kth : std::numeric_limits<double>::infinity(), &schedules);
    if (cost.bound_only) {
      ++plan.pruned;
      return;
    }
    ++plan.simulated;
    if (!(cost.step < kth)) return;
    Candidate cand{std::move(c), cost, mem, peak.pp_rank};
    auto at = std::upper_bound(plan.best.begin(), plan.best.end(), cand.cost.step,
                               [](double t, const Candidate& x) { return t < x.cost.step; });
    plan.best.insert(at, std::move(cand));
    if (static_cast<int>(plan.best.size()) > top) plan.best.pop_back();
  });
  return plan;
}

// Model FLOPs of one step (the PaLM count: 6 per weight per token outside the embedding lookups,
// the LM head included, and 12 L T W per token for attention; biases and norms not counted), for
// MFU. An MoE block's weights: attention 4 W^2, the router W E and E experts of 8 W^2, of which a
// token uses the router and top-k experts (train::moe_active_parameters, as train_gpt's MFU).
inline double model_flops(const train::TrainerConfig& c) {
  const auto& m = c.model;
  const double W = static_cast<double>(m.width), L = static_cast<double>(m.layers), V = static_cast<double>(m.vocab),
               T = static_cast<double>(c.seq);
  const double tokens = static_cast<double>(c.batch) * T;
  double moe_layers = 0;
  for (index_t i = 0; i < m.layers; ++i) moe_layers += m.is_moe_layer(i) ? 1 : 0;
  const double E = static_cast<double>(m.experts);
  const double weights = (L - moe_layers) * 12 * W * W + moe_layers * (4 * W * W + W * E + E * 8 * W * W) + V * W;
  const double active = moe_layers > 0 ? train::moe_active_parameters(weights, moe_layers, static_cast<int>(m.experts),
                                                                      static_cast<int>(m.moe_topk),
                                                                      static_cast<int>(m.width), false)
                                       : weights;
  return tokens * train::gpt_flops_per_token(active, static_cast<int>(m.layers), static_cast<int>(m.width), T);
}

}  // namespace trellis::plan
