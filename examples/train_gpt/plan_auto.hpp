// What the planner (include/trellis/plan) decides before a train_gpt run starts:
// - --plan auto --ranks N: the layout for N thread ranks on this machine (--mpi: for mpirun's
//   ranks, apply_plan_mpi). Rates: the host kernels
//   timed here at the model's shapes with N copies running at once (plan::MeasuredRates); the
//   ranks' link: thread-rank collectives are memory copies, so a bus bandwidth of the measured
//   memory-pass rate and 5 us latency; memory per rank: this machine's / N. Prints the planner's
//   table and returns the options with the fastest layout's dp, tp, pp, cp (ring), schedule,
//   chunks, microbatches, sp, recompute, ZeRO stage, tp overlap chunks (--overlap) and, for a
//   Mixture-of-Experts model (--experts), expert parallelism (--ep).
// - --cluster FILE: the ranks' speeds from the file's devices (plan::stage_speeds), and
//   --stage-costs measured: the costs the balanced split weighs, timed on this machine
//   (plan::stage_costs), so every rank takes the same split.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "flags.hpp"
#include "trellis/plan/measured_link.hpp"
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
    // every stage at one pace: that pace goes into each replica's speed (for --simulate-rank-speed:
    // a tp group with a slow device is slowed as a whole), which is dropped when all are 1
    std::vector<double> dp = speeds.dp_speed;
    if (o.rank_speed.empty())
      for (double& x : dp) x *= speeds.rank_speed.front();
    o.dp_speed = std::all_of(dp.begin(), dp.end(), [](double x) { return x == 1.0; }) ? std::vector<double>{} : dp;
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

// The layout (dp, tp, pp, cp by ring, ep, schedule, chunks, microbatches, sp, recompute, ZeRO
// stage, tp overlap chunks, stage split, dp shares) of a planned config, taken into `o`; --plan is
// then done.
inline void adopt_layout(Options& o, const trellis::train::TrainerConfig& c) {
  o.plan.clear();  // planned: what follows is an ordinary run of this layout
  o.ranks = 0;
  o.dp = c.dp;
  o.tp = c.tp;
  o.pp = c.pp;
  o.cp = c.cp;
  o.ep = c.ep;
  o.cp_mode = trellis::nn::to_string(c.cp_mode);
  o.cp_ulysses = c.cp_ulysses;
  o.shard_degree = c.shard_degree;
  o.offload = c.offload_optimizer ? "optimizer" : "";
  o.schedule = c.schedule;
  o.chunks = c.virtual_chunks;
  o.microbatches = c.microbatches;
  o.sp = c.options.sequence_parallel;
  o.recompute = c.options.recompute;
  o.zero = c.zero;
  o.overlap = c.options.overlap_chunks;
  o.stage_layers = c.stage_layers;
  o.dp_rows.assign(c.dp_rows.begin(), c.dp_rows.end());
}

// --plan auto --ranks N: the planner's `top` fastest layouts (apply_plan runs the first).
inline trellis::plan::Plan plan_layouts(const Options& given, int top = 5) {
  Options o = given;
  o.dp = o.tp = o.pp = o.cp = o.ep = 1;
  trellis::train::TrainerConfig base = trainer_config(o);
  base.simulate_rank_speed = false;  // how the run slows its ranks is not the plan's business
  trellis::plan::MeasuredRates measured(3, o.ranks);
  trellis::plan::Cluster host = host_cluster(o.ranks, measured);
  if (!o.cluster.empty()) {  // the thread ranks' speeds from a cluster file (simulated with --simulate-rank-speed)
    const trellis::plan::Cluster file = trellis::plan::load_cluster(o.cluster);
    TRELLIS_CHECK(file.devices() == o.ranks, "--plan auto --cluster ", o.cluster, ": ", file.devices(),
                  " devices for --ranks ", o.ranks, ": one device per rank");
    host.speed = file.speed;
    host.name += ", speeds of " + o.cluster;
  }
  trellis::plan::SearchSpace space;
  space.max_microbatches = 16;
  trellis::plan::Plan p = trellis::plan::search(base, host, measured.rates(), space, top);
  TRELLIS_CHECK(!p.best.empty(), "--plan auto: no layout of ", o.ranks, " ranks fits (", p.over_memory,
                " over this machine's memory / ", o.ranks, ", ", p.invalid, " refused by the trainer's checks)");
  return p;
}

inline Options apply_plan(const Options& given) {
  Options o = given;
  const trellis::plan::Plan p = plan_layouts(o);
  std::printf("plan: %ld layouts of %d thread ranks (%ld refused, %ld over memory, %ld pruned); predicted step, "
              "rates timed on this machine:\n",
              p.layouts, o.ranks, p.invalid, p.over_memory, p.pruned);
  for (std::size_t i = 0; i < p.best.size(); ++i)
    std::printf("  %zu. %8.1f ms  %s\n", i + 1, p.best[i].cost.step * 1e3,
                trellis::plan::train_gpt_flags(p.best[i].config).c_str());
  adopt_layout(o, p.best.front().config);
  std::printf("plan: running the first\n");
  return o;
}

// --plan auto --mpi: the layout for mpirun's ranks. The link: all-reduces over the world, timed
// and fitted (plan::measure_link; every rank takes part); the rates: rank 0 times the host
// kernels with as many copies at once as there are ranks on its node (host names compared), and
// gives each rank this machine's memory / those ranks. Rank 0 searches and prints the table,
// then sends the first layout's flags to every rank, which takes them (the same layout
// everywhere, whatever each rank would have timed).
template <class Comm>
Options apply_plan_mpi(Comm& world, const Options& given) {
  Options o = given;
  o.dp = o.tp = o.pp = o.cp = o.ep = 1;
  const int n = world.size();
  const trellis::plan::Link link = n > 1 ? trellis::plan::measure_link(world).link : trellis::plan::Link{1e12, 0};
  constexpr std::size_t name_bytes = 256;
  std::vector<std::uint8_t> name(name_bytes, 0), names(name_bytes * static_cast<std::size_t>(n), 0);
  ::gethostname(reinterpret_cast<char*>(name.data()), name_bytes - 1);
  world.all_gather(name.data(), names.data(), name_bytes);
  int local = 0;  // ranks on rank 0's node
  for (int r = 0; r < n; ++r)
    local += std::equal(names.begin(), names.begin() + name_bytes, names.begin() + r * static_cast<std::ptrdiff_t>(name_bytes));
  std::string flags;
  if (world.rank() == 0) {
    trellis::plan::MeasuredRates measured(3, local);
    trellis::plan::Cluster cluster = host_cluster(local, measured);
    cluster.name = "this job's " + std::to_string(n) + " MPI ranks, " + std::to_string(local) + " on rank 0's node";
    cluster.devices_per_node = local;
    cluster.nodes = n / local;
    TRELLIS_CHECK(n % local == 0, "--plan auto --mpi: ", n, " ranks with ", local,
                  " on rank 0's node: plan for nodes of equal rank counts");
    cluster.intra_node = cluster.inter_node = link;
    trellis::plan::SearchSpace space;
    space.max_microbatches = 16;
    const trellis::plan::Plan p = trellis::plan::search(trainer_config(o), cluster, measured.rates(), space, 5);
    TRELLIS_CHECK(!p.best.empty(), "--plan auto: no layout of ", n, " MPI ranks fits (", p.over_memory,
                  " over memory, ", p.invalid, " refused by the trainer's checks)");
    std::printf("plan: %ld layouts of %d MPI ranks (%ld refused, %ld over memory, %ld pruned); link measured over "
                "the world: %.2f GB/s, %.1f us; predicted step, rates timed on rank 0's node:\n",
                p.layouts, n, p.invalid, p.over_memory, p.pruned, link.bandwidth / 1e9, link.latency * 1e6);
    for (std::size_t i = 0; i < p.best.size(); ++i)
      std::printf("  %zu. %8.1f ms  %s\n", i + 1, p.best[i].cost.step * 1e3,
                  trellis::plan::train_gpt_flags(p.best[i].config).c_str());
    std::printf("plan: running the first\n");
    flags = trellis::plan::train_gpt_flags(p.best.front().config);
  }
  std::int64_t length = static_cast<std::int64_t>(flags.size());
  // the other ranks wait while rank 0 times kernels and searches: longer than a collective
  const auto timeout = world.timeout();
  if (timeout.count() > 0) world.set_timeout(std::max<std::chrono::milliseconds>(timeout, std::chrono::minutes(10)));
  world.broadcast(&length, 1, 0);
  world.set_timeout(timeout);
  std::vector<std::uint8_t> bytes(flags.begin(), flags.end());
  bytes.resize(static_cast<std::size_t>(length));
  world.broadcast(bytes.data(), bytes.size(), 0);
  std::istringstream words(std::string(bytes.begin(), bytes.end()));
  std::vector<std::string> args;
  for (std::string w; words >> w;) args.push_back(w);
  adopt_layout(o, trainer_config(parse_flags(args)));
  return o;
}


}  // namespace train_gpt
