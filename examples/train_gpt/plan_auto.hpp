// What the planner (include/trellis/plan) decides before a train_gpt run starts:
// - --plan auto --ranks N: the layout for N thread ranks on this machine. Rates: the host kernels
//   timed here at the model's shapes with N copies running at once (plan::MeasuredRates); the
//   ranks' link: thread-rank collectives are memory copies, so a bus bandwidth of the measured
//   memory-pass rate and 5 us latency; memory per rank: this machine's / N. Prints the planner's
//   table and returns the options with the fastest layout's dp, tp, pp, cp (ring), schedule,
//   chunks, microbatches, sp, recompute and ZeRO stage.
// - --cluster FILE: the ranks' speeds from the file's devices (plan::stage_speeds), and
//   --stage-costs measured: the costs the balanced split weighs, timed on this machine
//   (plan::stage_costs), so every rank takes the same split.
#pragma once

#include <cstdio>
#include <string>

#include "flags.hpp"
#include "trellis/plan/measured_rates.hpp"
#include "trellis/plan/search.hpp"
#include "trellis/plan/stage_balance.hpp"

namespace train_gpt {

// This machine as `ranks` thread ranks: the link of their collectives (memory copies) and their
// share of the memory; the rates come from `measured`.
inline trellis::plan::Cluster host_cluster(int ranks, trellis::plan::MeasuredRates& measured) {
  trellis::plan::Cluster host;
  host.name = "this machine as " + std::to_string(ranks) + " thread ranks";
  host.devices_per_node = ranks;
  host.device = {.name = "thread rank", .memory_bytes = physical_memory_bytes() / ranks, .peak_flops_fp32 = 1,
                 .peak_flops_bf16 = 1, .memory_bandwidth = 1};
  host.intra_node = host.inter_node = {.bandwidth = 1.0 / measured.seconds_per_byte(), .latency = 5e-6};
  return host;
}

// --cluster and --stage-costs measured, resolved into the speeds and costs the trainer takes
// (--cluster then reads as the --rank-speed and --dp-speed it gave; `print`: say so).
inline Options apply_balance(const Options& given, bool print = true) {
  Options o = given;
  if (!o.cluster.empty()) {
    const trellis::plan::Cluster cluster = trellis::plan::load_cluster(o.cluster);
    const auto speeds = trellis::plan::stage_speeds(trainer_config(o), cluster);
    o.rank_speed = trellis::plan::StageSpeeds::uneven(speeds.rank_speed);
    o.dp_speed = trellis::plan::StageSpeeds::uneven(speeds.dp_speed);
    if (print) {
      auto list = [](const std::vector<double>& v) {
        std::string s;
        for (double x : v) {
          if (!s.empty()) s += ',';
          s += trellis::detail::concat(x);
        }
        return s.empty() ? std::string("(all equal)") : s;
      };
      std::printf("cluster %s ('%s'): --rank-speed %s --dp-speed %s\n", o.cluster.c_str(), cluster.name.c_str(),
                  list(o.rank_speed).c_str(), list(o.dp_speed).c_str());
    }
    o.cluster.clear();
    if (o.rank_speed.empty() && o.dp_speed.empty()) o.simulate_rank_speed = false;  // all equal: nothing to slow
  }
  if (o.stage_costs == "measured") {
    const int ranks = o.dp * o.tp * o.pp * o.cp;
    trellis::plan::MeasuredRates measured(3, ranks);
    o.measured_costs = trellis::plan::stage_costs(trainer_config(o), host_cluster(ranks, measured), measured.rates());
  }
  return o;
}

inline Options apply_plan(const Options& given) {
  Options o = given;
  o.dp = o.tp = o.pp = o.cp = 1;
  trellis::train::TrainerConfig base = trainer_config(o);
  trellis::plan::MeasuredRates measured(3, o.ranks);
  const trellis::plan::Cluster host = host_cluster(o.ranks, measured);
  trellis::plan::SearchSpace space;
  space.max_microbatches = 16;
  const trellis::plan::Plan p = trellis::plan::search(base, host, measured.rates(), space, 5);
  TRELLIS_CHECK(!p.best.empty(), "--plan auto: no layout of ", o.ranks, " ranks fits (", p.over_memory,
                " over this machine's memory / ", o.ranks, ", ", p.invalid, " refused by the trainer's checks)");
  std::printf("plan: %ld layouts of %d thread ranks (%ld refused, %ld over memory, %ld pruned); predicted step, "
              "rates timed on this machine:\n",
              p.layouts, o.ranks, p.invalid, p.over_memory, p.pruned);
  for (std::size_t i = 0; i < p.best.size(); ++i)
    std::printf("  %zu. %8.1f ms  %s\n", i + 1, p.best[i].cost.step * 1e3,
                trellis::plan::train_gpt_flags(p.best[i].config).c_str());
  const auto& c = p.best.front().config;
  o.plan.clear();  // planned: what follows is an ordinary run of this layout
  o.ranks = 0;
  o.dp = c.dp;
  o.tp = c.tp;
  o.pp = c.pp;
  o.cp = c.cp;
  o.cp_mode = "ring";
  o.schedule = c.schedule;
  o.chunks = c.virtual_chunks;
  o.microbatches = c.microbatches;
  o.sp = c.options.sequence_parallel;
  o.recompute = c.options.recompute;
  o.zero = c.zero;
  std::printf("plan: running the first\n");
  return o;
}

}  // namespace train_gpt
