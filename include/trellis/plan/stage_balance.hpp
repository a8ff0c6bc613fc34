// What the trainer's balancing weighs, taken from a cluster and timed rates instead of given by
// hand: the per-device speeds of a cluster file as the trainer's per-pipeline-rank and per-dp-rank
// speeds (train::TrainerConfig::rank_speed, dp_speed), and the per-block and per-stage costs the
// balanced pipeline split weighs, timed by the cost model (TrainerConfig::stage_costs) rather than
// counted in FLOPs; and the uneven shares and split plan::search gives a layout on a cluster of
// mixed speeds (balance_for_speeds).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/plan/cluster.hpp"
#include "trellis/plan/cost_model.hpp"
#include "trellis/train/trainer_config.hpp"

namespace trellis::plan {

// One microbatch's F + B + W, seconds: of each block, and each pipeline stage's fixed work (the
// embedding on the first, the head on the last and, under local learning, the local head on every
// other), by the cost model with `rates` (plan::MeasuredRates on this machine, or cluster_rates)
// and the tp and cp collectives on `cluster`'s links. What the FLOP count leaves out shows here:
// the cross-entropy and norms around the head, memory passes, collectives, attention's own rate.
// The mean microbatch of a dp rank is costed (dp_rows shares all take the same split). MoE blocks
// cost their own (detail::moe_mlp_times, balanced routing, the ep group's link as predict_step's).
inline train::LayerCosts stage_costs(const train::TrainerConfig& c, const Cluster& cluster, const Rates& rates) {
  TRELLIS_CHECK(c.pp >= 1 && c.microbatches >= 1 && c.batch >= static_cast<index_t>(c.dp) * c.microbatches,
                "plan::stage_costs: pp ", c.pp, ", ", c.microbatches, " microbatches of a batch of ", c.batch,
                " rows over dp ", c.dp);
  const detail::Shape s = detail::shape_of(c);
  const Link& tp_link = cluster.link(1, c.tp);
  const int u = static_cast<int>(s.u);  // Ulysses' group (1: the ring alone), as predict_step links it
  const Link& cp_link = cluster.link(c.tp * u, c.cp / u);
  const Link& a2a_link = cluster.link(c.tp, u);
  const bool local = c.pp > 1 && (c.custom_schedule ? c.custom_schedule->local_learning : c.schedule == "local_learning");
  const double block = detail::block_times(s, rates, tp_link, cp_link, c.options.recompute, nullptr, &a2a_link).total();
  const double head = detail::head_times(s, rates, tp_link, nullptr).total();
  const double embedding = detail::embedding_times(s, rates, tp_link, nullptr).total();
  train::LayerCosts k;
  k.layers.assign(static_cast<std::size_t>(c.model.layers), block);
  if (c.model.moe_every > 0) {
    const detail::MoeShape moe = detail::moe_shape_of(c, s);
    const Link& ep_link = cluster.link(c.tp * c.cp, c.ep);
    const double moe_block =
        detail::block_times(s, rates, tp_link, cp_link, c.options.recompute, nullptr, &a2a_link, &moe, &ep_link).total();
    for (index_t l = 0; l < c.model.layers; ++l)
      if (c.model.is_moe_layer(l)) k.layers[static_cast<std::size_t>(l)] = moe_block;
  }
  k.fixed.assign(static_cast<std::size_t>(c.pp), local ? head : 0.0);
  k.fixed.front() += embedding;
  k.fixed.back() = (c.pp == 1 ? embedding : 0.0) + head;
  return k;
}

// The trainer's speeds from the cluster's per-device speeds, ranks laid out as the trainer's mesh
// (pp, dp, cp, tp: tp fastest; the cluster's devices in rank order, one per rank). A device group
// that computes together (the cp x tp ranks of one dp replica of one stage) goes at its slowest
// device's pace, s(p, d). A pipeline rank's speed is its fastest replica's, max_d s(p, d), and a dp
// rank's the most it keeps on every stage, min_p s(p, d) / rank_speed[p]: so rank_speed[p] x
// dp_speed[d] <= s(p, d) always, equal where the speeds factor that way (a slow node of dp
// replicas, a slow pipeline stage). A list whose entries are all equal asks for nothing uneven
// (StageSpeeds::uneven: the even split, equal shares).
struct StageSpeeds {
  std::vector<double> rank_speed;  // per pipeline rank (pp entries)
  std::vector<double> dp_speed;    // per dp rank (dp entries)
  // `v` itself, or empty where all its entries are equal (the even split, equal shares)
  static std::vector<double> uneven(const std::vector<double>& v) {
    return std::all_of(v.begin(), v.end(), [&](double x) { return x == v.front(); }) ? std::vector<double>{} : v;
  }
};
inline StageSpeeds stage_speeds(const train::TrainerConfig& c, const Cluster& cluster) {
  const auto group = [&](int p, int d) { return group_speed(c, cluster, p, d); };
  StageSpeeds out;
  out.rank_speed.assign(static_cast<std::size_t>(c.pp), 0.0);
  out.dp_speed.assign(static_cast<std::size_t>(c.dp), 1e300);
  for (int p = 0; p < c.pp; ++p)
    for (int d = 0; d < c.dp; ++d)
      out.rank_speed[static_cast<std::size_t>(p)] = std::max(out.rank_speed[static_cast<std::size_t>(p)], group(p, d));
  for (int p = 0; p < c.pp; ++p)
    for (int d = 0; d < c.dp; ++d)
      out.dp_speed[static_cast<std::size_t>(d)] =
          std::min(out.dp_speed[static_cast<std::size_t>(d)], group(p, d) / out.rank_speed[static_cast<std::size_t>(p)]);
  return out;
}

// A layout on a cluster of mixed speeds, made uneven to match (the search's step for such
// clusters); returns whether it changed `c`. A config whose shares or split are given already, or
// a cluster of one speed, is left as it is.
// - dp replicas of unequal speed (each replica at its slowest device: speed_d, the least over its
//   stages' cp x tp ranks) take unequal shares of the batch: train::balanced_dp_rows, the shares
//   whose slowest replica finishes first (dp_rows; --dp-rows).
// - A pipeline of one chunk per rank whose ranks then go at unequal paces (pipeline_rank_pace)
//   gets an uneven split (stage_layers; --stage-layers). It starts from the split whose slowest
//   stage is fastest, weighing the cost model's times (stage_costs): the best for many
//   microbatches, where the slowest stage sets the pace. With few microbatches the fill and drain
//   count too (with one, the step is the sum of the stages, best with more blocks on the fast
//   ranks), so single blocks then move from one stage to another (the stages between shift by one)
//   while predict_step's step drops: a local search.
inline bool balance_for_speeds(train::TrainerConfig& c, const Cluster& cluster, const Rates& rates) {
  if (cluster.speed.empty() || !c.dp_rows.empty() || !c.dp_speed.empty() || !c.stage_layers.empty() ||
      !c.rank_speed.empty())
    return false;
  bool changed = false;
  if (c.dp > 1 && c.microbatches >= 1 && c.batch % c.microbatches == 0 && c.batch / c.microbatches >= c.dp) {
    std::vector<double> replica(static_cast<std::size_t>(c.dp), 1e300);
    for (int p = 0; p < std::max(1, c.pp); ++p)
      for (int d = 0; d < c.dp; ++d)
        replica[static_cast<std::size_t>(d)] = std::min(replica[static_cast<std::size_t>(d)], group_speed(c, cluster, p, d));
    if (!StageSpeeds::uneven(replica).empty()) {
      c.dp_rows = train::balanced_dp_rows(c.batch, c.microbatches, replica);
      if (std::all_of(c.dp_rows.begin(), c.dp_rows.end(), [&](index_t r) { return r == c.batch / c.dp; }))
        c.dp_rows.clear();  // the balanced shares are the equal ones
      changed = !c.dp_rows.empty();
    }
  }
  if (c.pp < 2) return changed;
  const pipe::Schedule sched = schedule_of(c);
  if (sched.chunks != 1 || sched.local_learning) return changed;
  const std::vector<double> pace = StageSpeeds::uneven(pipeline_rank_pace(c, cluster));
  if (pace.empty()) return changed;
  train::TrainerConfig weighed = c;
  weighed.rank_speed = pace;
  weighed.stage_costs = stage_costs(c, cluster, rates);
  const std::vector<int> bounds = train::pipeline_split(weighed);
  for (std::size_t i = 0; i + 1 < bounds.size(); ++i) c.stage_layers.push_back(bounds[i + 1] - bounds[i]);
  double best = predict_step(c, cluster, rates).step;
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t to = 0; to < c.stage_layers.size(); ++to)
      for (std::size_t from = 0; from < c.stage_layers.size(); ++from) {  // one block from stage `from` to `to`
        if (from == to || c.stage_layers[from] == 1) continue;
        train::TrainerConfig t = c;
        ++t.stage_layers[to];
        --t.stage_layers[from];
        const double step = predict_step(t, cluster, rates).step;
        if (step < best * (1 - 1e-12)) {
          c = std::move(t);
          best = step;
          moved = true;
        }
      }
  }
  return true;
}

}  // namespace trellis::plan
