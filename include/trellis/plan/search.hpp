// plan::search: every layout of a model on a cluster -- dp x tp x pp x cp over all its devices, the
// pipeline schedule (and virtual chunks), microbatches, recompute, sequence parallelism, ZeRO
// stage, tp overlap chunks -- checked (train::config_problems), pruned by memory
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
#include <vector>

#include "trellis/plan/cluster.hpp"
#include "trellis/plan/cost_model.hpp"
#include "trellis/plan/memory_model.hpp"
#include "trellis/plan/stage_balance.hpp"
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
  int max_cp = 0;             // context parallel (ring) up to this; 0: any that divides the devices and 2 cp the sequence
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
};

// The flags that make train_gpt run config `c`'s layout (beside the model and data flags).
inline std::string train_gpt_flags(const train::TrainerConfig& c) {
  std::ostringstream s;
  s << "--dp " << c.dp << " --tp " << c.tp << " --pp " << c.pp;
  if (c.cp > 1) s << " --cp " << c.cp;
  s << " --microbatches " << c.microbatches;
  if (c.pp > 1) s << " --schedule " << c.schedule;
  if (c.pp > 1 && c.schedule == "interleaved_1f1b") s << " --chunks " << c.virtual_chunks;
  if (c.zero > 0) s << " --zero " << c.zero;
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

// Every layout of the search space for `base` on `devices` ranks, in a fixed order (unchecked).
inline std::vector<train::TrainerConfig> layouts(const train::TrainerConfig& base, int devices, int max_tp,
                                                 const SearchSpace& space) {
  std::vector<train::TrainerConfig> out;
  for (int tp = 1; tp <= devices; ++tp) {
    if (devices % tp != 0 || (max_tp > 0 && tp > max_tp)) continue;
    for (int cp = 1; cp <= devices / tp; ++cp) {
      if ((devices / tp) % cp != 0 || (space.max_cp > 0 && cp > space.max_cp) || base.seq % (2 * cp) != 0) continue;
      for (int pp = 1; pp <= devices / tp / cp; ++pp) {
        if ((devices / tp / cp) % pp != 0) continue;
        const int dp = devices / tp / cp / pp;
        if (base.batch % dp != 0) continue;
        const std::vector<std::string> schedules = pp > 1 ? space.schedules : std::vector<std::string>{"1f1b"};
        for (const auto& sched : schedules)
          for (int m = 1; m <= space.max_microbatches && m <= base.batch / dp; ++m) {
            if ((base.batch / dp) % m != 0) continue;
            for (bool rc : space.recompute)
              for (bool sp : space.sequence_parallel) {
                if (sp && tp == 1) continue;
                for (int z : space.zero) {
                  if (z > 0 && dp * cp == 1) continue;
                  train::TrainerConfig c = base;
                  c.dp = dp;
                  c.tp = tp;
                  c.pp = pp;
                  c.cp = cp;
                  c.cp_mode = nn::CpMode::ring;
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
                    out.push_back(std::move(ck));
                  }
                }
              }
          }
      }
    }
  }
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
    return a.dp == b.dp && a.tp == b.tp && a.pp == b.pp && a.cp == b.cp && a.schedule == b.schedule &&
           a.virtual_chunks == b.virtual_chunks && a.microbatches == b.microbatches &&
           a.options.recompute == b.options.recompute && a.options.sequence_parallel == b.options.sequence_parallel &&
           a.zero == b.zero && a.dp_rows == b.dp_rows && a.stage_layers == b.stage_layers;
  };
  for (train::TrainerConfig& c : layouts(base, cluster.devices(), max_tp, space)) {
    ++plan.layouts;
    if (!train::config_problems(c).empty()) {
      ++plan.invalid;
      continue;
    }
    if (balance_for_speeds(c, cluster, rates) && !train::config_problems(c).empty()) {  // mixed speeds: uneven shares, stages
      ++plan.invalid;
      continue;
    }
    const bool reuse = last && same_but_overlap(*last, c);
    const PeakMemory peak = reuse ? last_peak : predict_peak_memory(c);
    if (!reuse) {
      last = c;
      last_peak = peak;
    }
    MemoryEstimate mem = peak.memory;
    mem.activations *= space.activation_scale;
    if (mem.device_total() > cluster.device.memory_bytes) {
      ++plan.over_memory;
      continue;
    }
    const double kth = static_cast<int>(plan.best.size()) < top ? std::numeric_limits<double>::infinity()
                                                                 : plan.best.back().cost.step;
    const StepCost cost = predict_step(c, cluster, rates, prune ? kth : std::numeric_limits<double>::infinity());
    if (cost.bound_only) {
      ++plan.pruned;
      continue;
    }
    ++plan.simulated;
    if (!(cost.step < kth)) continue;
    Candidate cand{std::move(c), cost, mem, peak.pp_rank};
    auto at = std::upper_bound(plan.best.begin(), plan.best.end(), cand.cost.step,
                               [](double t, const Candidate& x) { return t < x.cost.step; });
    plan.best.insert(at, std::move(cand));
    if (static_cast<int>(plan.best.size()) > top) plan.best.pop_back();
  }
  return plan;
}

// Model FLOPs of one step (the PaLM count: 6 per parameter per token outside the embedding
// lookups, the LM head included, and 12 L T W per token for attention), for MFU.
inline double model_flops(const train::TrainerConfig& c) {
  const double W = static_cast<double>(c.model.width), L = static_cast<double>(c.model.layers),
               V = static_cast<double>(c.model.vocab), T = static_cast<double>(c.seq);
  const double tokens = static_cast<double>(c.batch) * T;
  return tokens * (6 * (L * 12 * W * W + V * W) + 12 * L * T * W);
}

}  // namespace trellis::plan
