// plan::predict_step: the time of one training step of a train::TrainerConfig on a cluster, from
// the work the GPT's layers do and the rates a device does it at (plan::Rates).
//
// The model (docs/plan.md has the derivation and what it leaves out):
//   - Compute. Per microbatch and tp rank, each block's forward is four GEMMs (qkv, attention
//     projection, MLP up and down, their widths split over tp), causal attention over its heads
//     / tp, and memory-bound passes (norms, GELU, residuals, head layout) counted in bytes. The
//     backward is split as the schedules split it: B (input gradients: the same GEMMs transposed,
//     attention's backward, twice the memory passes; plus the forward again with recompute) and W
//     (weight gradients: a GEMM per linear over the rows, bias sums). The first virtual stage adds
//     the embedding, the last the LM head and cross-entropy over vocab / tp.
//   - Tensor parallelism. The collectives inside the layers are on the critical path: without
//     sequence parallelism 2 all-reduces of rows x width per block in F and in B; with it an
//     all-gather and a reduce-scatter each instead (and B gathers again). The embedding and head
//     add one each. Time on the tp group's link (Cluster::link).
//   - TP overlap chunks (options.overlap_chunks = K > 1, nn/tensor_parallel.hpp): each of those
//     collectives and the GEMM that feeds it (or that it feeds) run as K row chunks, chunk j's
//     collective on the link while chunk j+1 computes: g + (K - 1) max(g, c) + c per section, g
//     and c one chunk's compute and collective (K latencies; the chunk GEMMs at their own shape,
//     so measured rates charge smaller GEMMs' lower efficiency). Derivation at detail::chunk_pipeline.
//   - Pipeline. Each (rank, chunk, action) costs its layers' F, B or W divided by the rank's
//     speed; a send costs latency + bytes / bandwidth on the pp link; pipe::simulate_with runs
//     the schedule on these costs (bubbles, warm-up and messages as the executor has them).
//   - Devices that share a machine (Rates::shared_by > 1: thread ranks on one CPU, where a kernel
//     runs faster while the other ranks' cores are idle -- memory bandwidth, caches, clock). Rates
//     timed with shared_by devices computing at once, and Rates::alone with one. Outside a
//     pipeline every rank computes at once, so the shared rates hold. In a pipeline an action is
//     charged between the two by the mean number of the node's devices computing beside it, taken
//     from the simulated timeline (simulated again with the blended costs, three passes: a fixed
//     point, as an action's cost moves its neighbours). Ranks alone on their node are unaffected.
//   - Data parallelism. ZeRO 0: the gradients all-reduced in buckets that start as their chunk's
//     last W finishes (each bucket becomes ready uniformly over the last microbatch's backward;
//     the link serialises them: what is left after the backward is exposed). ZeRO 1: reduce-
//     scattered the same way, the updated values all-gathered after the update (exposed). ZeRO 2:
//     reduce-scattered every microbatch, overlapped with the backward; ZeRO 3 also gathers every
//     unit's values before its F and its B. With ZeRO 2/3 a rank's weight units are played out
//     against that traffic (plan/sharded_traffic.hpp: a call per bucket, the next unit's gather
//     prefetched, the copies' memory traffic where the device moves the bytes itself,
//     Rates::collective_copy_bytes), and its actions stretch by what the play-out takes over its
//     compute alone.
//   - The optimizer: AdamW over this rank's (ZeRO: sharded) parameters plus the gradient norm,
//     memory-bound.
//   - Context parallelism: rows b T / cp per rank; gradients over dp x cp. Ring: cp attention
//     steps over blocks of T/cp, the partials merged, the K/V ring's hops exposed where the
//     attention compute does not cover them. Ulysses (u = cp) and hybrid (Ulysses in groups of u,
//     a ring over the cp / u groups): an all-to-all of q, k, v before attention and of the output
//     after in F, of dO before and dQ, dK, dV after in B (blocking, so on the critical path), on
//     the link of u ranks at stride tp; attention over heads / (tp u) heads, the whole sequence
//     (Ulysses) or the ring's cp / u steps (hybrid, on the link at stride tp u).
//   - Hybrid sharding (shard_degree S < dp x cp): ZeRO's reduce-scatters and all-gathers over the S
//     ranks of a shard group (their link), and the reduced shards (1/S of the gradients) all-reduced
//     across the dp x cp / S groups once per step: ZeRO-1 after the schedule, ZeRO-2/3 overlapping
//     the last backward.
//   - Offloaded optimizer (offload_optimizer): the moments on the host; each update downloads the
//     values and gradients and uploads the values (Rates::host_copy) around the host's AdamW
//     (Rates::host_adamw): after the schedule, or with fused_update and the update thread, the
//     host AdamW overlapping the last backward unit by unit (the copies stay on the critical path).
//   - Mixture of Experts (model.moe_every, ep; detail::moe_mlp_times): an MoE block's MLP is the
//     router GEMM, routing passes, the grouped GEMM as E/ep GEMMs at their own shape over the
//     copies routed to this rank (R k, or E x capacity where a capacity factor cuts them: routing
//     taken as BALANCED), the exchange's copies; with ep > 1 two all-to-alls of the copies in F
//     (dispatch, combine) and two in B, blocking, on the ep group's link (ep consecutive dp
//     ranks). Expert gradients reduce over their dp/ep x cp replicas (ZeRO over all of them), the
//     rest over dp x cp as before.
// Not modelled yet: offloaded activations, the disk tier, contention between communicators
// sharing one physical link (nor, on a GPU, compute slowed by the collectives' own kernels while
// chunks overlap), MoE routing imbalance (the busiest expert's rows set the grouped GEMM's and the
// all-to-all's time) and dropped copies.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/schedule.hpp"
#include "trellis/pipe/simulate.hpp"
#include "trellis/plan/cluster.hpp"
#include "trellis/plan/layer_costs.hpp"
#include "trellis/plan/schedule_cache.hpp"
#include "trellis/plan/sharded_traffic.hpp"
#include "trellis/train/trainer_config.hpp"

namespace trellis::plan {

// What predict_step returns: the step and where its time goes (seconds).
struct StepCost {
  double step = 0;           // the predicted wall time of one optimizer step
  bool bound_only = false;   // predict_step stopped at its lower bound (step holds the bound)
  double pipeline = 0;       // the schedule's makespan (compute, tp collectives, p2p, bubbles)
  double compute = 0;        // the busiest rank's compute in the schedule (no bubbles)
  double tp_comm = 0;        // of which tp collectives, on that rank (overlap chunks: what they leave exposed)
  double ep_comm = 0;        // of which MoE ep all-to-alls (dispatch, combine and their backward), on that rank
  double dp_exposed = 0;     // dp/ZeRO communication not hidden behind the backward
  double optimizer = 0;      // AdamW + gradient norm
  double bubble_fraction = 0;
  std::vector<PassTimes> stage;  // per virtual stage, one microbatch
};

namespace detail {

// A pipeline action's identity in a timeline: (rank, chunk, microbatch, kind).
using ActionKey = std::tuple<int, int, int, int>;
inline ActionKey action_key(int rank, const pipe::Action& a) {
  return {rank, a.chunk, a.microbatch, static_cast<int>(a.kind)};
}

// Devices sharing a node (Rates::shared_by): each compute action of `timeline` costed between
// alone(rank, action) (one device of the node computing) and shared(rank, action) (shared_by of
// them), linearly in the mean number of the node's devices computing during the action: its own
// pipeline rank's `group` devices, and each other pipeline rank on the node for the fraction of
// the action's time it computes. Pipeline rank r holds devices r group ... r group + group - 1.
template <class Shared, class Alone>
std::map<ActionKey, double> shared_node_costs(const pipe::Timeline& timeline, int group, int devices_per_node,
                                              int shared_by, Shared&& shared, Alone&& alone) {
  const int ranks = timeline.stages;
  std::vector<std::vector<std::pair<double, double>>> busy(static_cast<std::size_t>(ranks));
  for (const auto& e : timeline.events)
    if (e.action.is_compute() && e.end > e.start) busy[static_cast<std::size_t>(e.rank)].emplace_back(e.start, e.end);
  for (auto& b : busy) std::sort(b.begin(), b.end());
  auto node_of = [&](int r) { return static_cast<long long>(r) * group / devices_per_node; };
  // time rank r computes within [s, e): its intervals are disjoint and sorted
  auto computing = [&](int r, double s, double e) {
    const auto& b = busy[static_cast<std::size_t>(r)];
    double t = 0;
    auto it = std::lower_bound(b.begin(), b.end(), std::make_pair(s, s),
                               [](const auto& x, const auto& y) { return x.second <= y.first; });
    for (; it != b.end() && it->first < e; ++it) t += std::max(0.0, std::min(e, it->second) - std::max(s, it->first));
    return t;
  };
  std::map<ActionKey, double> cost;
  for (const auto& e : timeline.events) {
    if (!e.action.is_compute()) continue;
    const double one = alone(e.rank, e.action), all = shared(e.rank, e.action);
    double devices = group;
    if (e.end > e.start)
      for (int r = 0; r < ranks; ++r)
        if (r != e.rank && node_of(r) == node_of(e.rank)) devices += group * computing(r, e.start, e.end) / (e.end - e.start);
    const double share = std::clamp((devices - 1) / (shared_by - 1), 0.0, 1.0);
    cost[action_key(e.rank, e.action)] = one + (all - one) * share;
  }
  return cost;
}

}  // namespace detail

// The speed of the device group that computes together, the cp x tp ranks of dp replica d of
// pipeline stage p (the trainer's mesh order pp, dp, cp, tp): its slowest device's. Checks first
// that the cluster has one device per rank of the layout.
inline double group_speed(const train::TrainerConfig& c, const Cluster& cluster, int p, int d) {
  const int inner = c.cp * c.tp;
  const std::int64_t ranks = static_cast<std::int64_t>(std::max(1, c.pp)) * c.dp * inner;
  TRELLIS_CHECK(ranks == cluster.devices(), "cluster '", cluster.name, "' has ", cluster.devices(),
                " devices but the layout dp x tp x pp x cp = ", c.dp, " x ", c.tp, " x ", c.pp, " x ", c.cp, " has ",
                ranks, " ranks: one device per rank");
  double s = 1e300;
  for (int i = 0; i < inner; ++i) s = std::min(s, cluster.speed_of((p * c.dp + d) * inner + i));
  return s;
}

// Each pipeline rank's pace for compute, relative to one device of speed 1 computing the mean
// share of rows: its dp replicas compute their rows (dp_rows, or equal shares) each at its
// slowest device's speed (the cp x tp ranks of one replica of one stage work together), and the
// stage goes at its slowest replica's pace: 1 / max_d (rows_d / mean rows) / speed(p, d). The
// compute is taken as linear in the rows. Ranks in the trainer's mesh order (pp, dp, cp, tp).
inline std::vector<double> pipeline_rank_pace(const train::TrainerConfig& c, const Cluster& cluster) {
  const double mean = static_cast<double>(c.batch) / c.dp;
  std::vector<double> pace(static_cast<std::size_t>(std::max(1, c.pp)));
  for (int p = 0; p < std::max(1, c.pp); ++p) {
    double slowest = 0;  // the largest time per mean share among the replicas
    for (int d = 0; d < c.dp; ++d)
      slowest = std::max(slowest, static_cast<double>(train::dp_rows_of(c, d)) / mean / group_speed(c, cluster, p, d));
    pace[static_cast<std::size_t>(p)] = 1.0 / slowest;
  }
  return pace;
}

// The schedule a config runs (pp > 1).
inline pipe::Schedule schedule_of(const train::TrainerConfig& c) {
  if (c.custom_schedule) return *c.custom_schedule;
  return pipe::make_schedule(c.schedule, c.pp, c.microbatches, c.schedule == "interleaved_1f1b" ? c.virtual_chunks : 1);
}

// Predicts one optimizer step of `c` on `cluster` with `rates` (from cluster_rates or measured).
// Ranks are laid out as train::Trainer's mesh (pp, dp, cp, tp: tp fastest). Refuses what it does not
// model (balanced documents, offloaded activations, the disk tier).
// stop_above: when the step's lower bound (no pipeline simulation) is already at least this, stop
// there and return the bound with bound_only set (plan::search's pruning).
// schedules: where the schedule is made once for many calls (the search); null: made here.
inline StepCost predict_step(const train::TrainerConfig& c, const Cluster& cluster, const Rates& rates,
                             double stop_above = std::numeric_limits<double>::infinity(),
                             ScheduleCache* schedules = nullptr) {
  TRELLIS_CHECK((c.cp == 1 || !c.cp_balance_documents) && !c.offload_activations && c.offload_dir.empty(),
                "predict_step: balanced documents, offloaded activations and the optimizer's disk tier are not in "
                "the cost model yet");
  const auto& m = c.model;
  const detail::Shape s = detail::shape_of(c);
  // the trainer's mesh (pp, dp, cp, tp): tp at stride 1, cp at tp, dp at tp cp; gradients are
  // reduced over the dp x cp replicas (stride tp). Ulysses' groups: u consecutive cp ranks (stride
  // tp); the ring: the cp / u members at stride tp u (all of cp for the plain ring).
  const int reps = c.dp * c.cp;
  const int u = static_cast<int>(s.u);
  const Link& tp_link = cluster.link(1, c.tp);
  const Link& cp_link = cluster.link(c.tp * u, c.cp / u);
  const Link& a2a_link = cluster.link(c.tp, u);
  const Link& dp_link = cluster.link(c.tp, reps);
  const Link& pp_link = cluster.link(c.tp * reps, c.pp);
  // ZeRO's shards: over S replicas -- all of them, or a shard group of S consecutive ones (hybrid
  // sharding, train/grad_buckets.hpp), whose reduced shards are then all-reduced across the groups
  // (the same group rank in each: stride tp S)
  const int S = c.zero >= 1 && c.shard_degree > 0 && c.shard_degree < reps ? c.shard_degree : reps;
  const int groups = reps / S;
  const Link& shard_link = cluster.link(c.tp, S);
  const Link& across_link = cluster.link(c.tp * S, groups);
  // MoE (train/trainer.hpp): an ep group is ep consecutive dp ranks (stride tp cp); an expert's
  // replicas, the dp / ep x cp ranks with the same dp coordinate mod ep (dp stride tp cp ep, cp
  // stride tp), reduce its gradients, sharded over all of them under ZeRO (never in shard groups).
  // Their link: inside a node when the group's last member is (Cluster::link's rule).
  const bool moe = m.moe_every > 0;
  const detail::MoeShape moe_shape = moe ? detail::moe_shape_of(c, s) : detail::MoeShape{};
  const int S_e = reps / c.ep;
  const Link& ep_link = cluster.link(c.tp * c.cp, c.ep);
  const Link& expert_link =
      cluster.link(1, 1 + c.tp * (c.cp - 1) + c.tp * c.cp * c.ep * (c.dp / c.ep - 1));

  const bool piped = c.pp > 1;
  const ScheduleCache::Prepared* prepared = piped && schedules ? schedules->usable(c) : nullptr;
  pipe::Schedule made;
  if (piped && !prepared) made = pipe::prepare_for_simulation(schedule_of(c));
  const pipe::Schedule& sched = prepared ? prepared->schedule : made;
  // local learning (PPLL): every stage but the last also trains a head of its own
  const bool local = piped && sched.local_learning;
  const bool own_heads = local && c.local_head == train::TrainerConfig::LocalHead::own;
  const int stages = piped ? sched.virtual_stages() : 1;
  // the trainer's split: uneven stages where the config gives them (train::pipeline_split), else even
  std::vector<int> bounds = piped && sched.chunks == 1 ? train::pipeline_split(c, local) : std::vector<int>{};
  if (bounds.empty()) bounds = pipe::split_layers(static_cast<int>(m.layers), stages);

  StepCost out;
  // MoE blocks of virtual stage v (GptConfig::is_moe_layer).
  auto moe_blocks = [&](int v) {
    int n = 0;
    for (int l = bounds[static_cast<std::size_t>(v)]; l < bounds[static_cast<std::size_t>(v) + 1]; ++l) n += m.is_moe_layer(l);
    return n;
  };
  // Each virtual stage's F, B and W at rates r, and (comm) its tp collectives' share, (ep_comm)
  // its ep all-to-alls'.
  // One microbatch's F, B and W of each kind of weight unit at rates r, and their tp (and ep) comm.
  struct UnitTimes {
    PassTimes block, moe_block, emb, head;
    double block_comm = 0, moe_comm = 0, moe_ep = 0, emb_comm = 0, head_comm = 0;
  };
  auto unit_times = [&](const Rates& r) {
    UnitTimes u;
    u.block = detail::block_times(s, r, tp_link, cp_link, c.options.recompute, &u.block_comm, &a2a_link);
    if (moe)
      u.moe_block = detail::block_times(s, r, tp_link, cp_link, c.options.recompute, &u.moe_comm, &a2a_link, &moe_shape,
                                        &ep_link, &u.moe_ep);
    u.emb = detail::embedding_times(s, r, tp_link, &u.emb_comm);
    u.head = detail::head_times(s, r, tp_link, &u.head_comm);
    return u;
  };
  const UnitTimes units = unit_times(rates);
  auto stage_times = [&](const UnitTimes& u, std::vector<double>* comm, std::vector<double>* ep_comm) {
    const auto& [block, moe_block, emb, head, block_comm, moe_comm, moe_ep, emb_comm, head_comm] = u;
    std::vector<PassTimes> times;
    for (int v = 0; v < stages; ++v) {
      const int n = bounds[static_cast<std::size_t>(v) + 1] - bounds[static_cast<std::size_t>(v)], e = moe_blocks(v);
      PassTimes t;
      double sc = (n - e) * block_comm + e * moe_comm;
      for (int i = 0; i < n - e; ++i) t += block;
      for (int i = 0; i < e; ++i) t += moe_block;
      if (v == 0) t += emb, sc += emb_comm;
      if (v == stages - 1 || local) t += head, sc += head_comm;  // the model's head, or a local one
      times.push_back(t);
      if (comm) comm->push_back(sc);
      if (ep_comm) ep_comm->push_back(e * moe_ep);
    }
    return times;
  };
  std::vector<double> stage_comm, stage_ep;
  out.stage = stage_times(units, &stage_comm, &stage_ep);
  // Devices sharing a node (Rates::shared_by): the pipeline ranks whose groups of dp x cp x tp
  // devices share one are charged by how many of its devices compute beside each action.
  const int group = reps * c.tp;
  const bool sharing = piped && rates.alone && rates.shared_by > 1 && group < cluster.devices_per_node;
  const std::vector<PassTimes> stage_alone = sharing ? stage_times(unit_times(*rates.alone), nullptr, nullptr) : std::vector<PassTimes>{};

  // Parameters this rank holds per chunk (for dp traffic and the optimizer): dense and experts'.
  const detail::BlockParams moe_params = moe ? detail::moe_block_params(s, moe_shape) : detail::BlockParams{};
  auto chunk_params = [&](int v) {
    const int n = bounds[static_cast<std::size_t>(v) + 1] - bounds[static_cast<std::size_t>(v)], e = moe_blocks(v);
    detail::BlockParams p{(n - e) * detail::block_params(s) + e * moe_params.dense, e * moe_params.expert};
    if (v == 0) p.dense += (s.V / s.tp + s.P) * s.W;
    if (v == stages - 1) p.dense += 2 * s.W + (stages > 1 ? s.V / s.tp * s.W : 0.0);  // ln_f; the tied wte's copy
    else if (local) p.dense += 2 * s.W + (own_heads || v > 0 ? s.V / s.tp * s.W : 0.0);  // its ln_f; its LM matrix or wte copy
    return p;
  };
  const int chunks = piped ? sched.chunks : 1;
  const int ranks = piped ? c.pp : 1;
  auto stage_of = [&](int rank, int chunk) { return piped ? sched.virtual_stage(rank, chunk) : chunk; };
  auto speed = [&](int rank) {  // the slowest device among the dp x cp x tp ranks of this pipeline rank
    double sp = 1e300;
    for (int i = 0; i < reps * c.tp; ++i) sp = std::min(sp, cluster.speed_of(rank * reps * c.tp + i));
    return sp;
  };
  const std::vector<double> pace = pipeline_rank_pace(c, cluster);  // compute: rows and speeds of its replicas
  const double shard_n = S;
  auto rank_params = [&](int rank) {
    detail::BlockParams p;
    for (int k = 0; k < chunks; ++k) {
      const detail::BlockParams q = chunk_params(stage_of(rank, k));
      p.dense += q.dense;
      p.expert += q.expert;
    }
    return p;
  };
  // ZeRO's traffic of one pass over a rank's parameters (a reduce-scatter or an all-gather): the
  // dense ones over the shard group, the experts' over their replicas; and the bytes of it the
  // device copies itself per byte on the wire (times collective_copy_bytes).
  auto zero_pass = [&](const detail::BlockParams& p) {
    return gather_seconds(shard_link, 4 * p.dense, S) + (p.expert > 0 ? gather_seconds(expert_link, 4 * p.expert, S_e) : 0.0);
  };
  auto copy_traffic = [&](double passes, const detail::BlockParams& p) {  // memory bytes, times collective_copy_bytes
    return rates.collective_copy_bytes * passes * (shard_n - 1) / shard_n * (4 * p.dense) +
           (p.expert > 0 ? rates.collective_copy_bytes * passes * (S_e - 1.0) / S_e * (4 * p.expert) : 0.0);
  };
  auto rank_compute = [&](int rank) {  // one microbatch through every chunk
    double t = 0;
    for (int k = 0; k < chunks; ++k) t += out.stage[static_cast<std::size_t>(stage_of(rank, k))].total();
    return t / pace[static_cast<std::size_t>(rank)];
  };
  // ZeRO 2/3: a rank's units played out against its dp traffic (plan/sharded_traffic.hpp); its
  // actions stretch by the step that gives over its compute alone.
  auto transfer = [&](const Link& l, int members, double elements, int buckets) {
    return members <= 1 ? 0.0 : buckets * l.latency + (members - 1.0) / members * 4 * elements / l.bandwidth;
  };
  auto copy_of = [&](int members, double elements) {  // the device's own copying of a transfer
    return members <= 1 ? 0.0 : rates.memory(rates.collective_copy_bytes * (members - 1.0) / members * 4 * elements);
  };
  const double bucket = static_cast<double>(c.bucket_elements);
  auto sharded_unit = [&](const PassTimes& t, const detail::BlockParams& p, int dense_buckets, double pace_r) {
    detail::ShardedUnit u;
    u.forward = t.forward / pace_r;
    u.backward = (t.backward_input + t.backward_weight) / pace_r;
    const int expert_buckets = static_cast<int>(std::ceil(p.expert / bucket));
    u.reduce = transfer(shard_link, S, p.dense, dense_buckets) + transfer(expert_link, S_e, p.expert, expert_buckets);
    u.reduce_copy = copy_of(S, p.dense) + copy_of(S_e, p.expert);
    if (c.zero == 3) u.gather = u.reduce, u.gather_copy = u.reduce_copy;
    return u;
  };
  const int block_buckets = detail::bucket_count(detail::block_parameter_sizes(s), bucket);
  const int moe_dense_buckets = static_cast<int>(std::ceil(moe_params.dense / bucket));
  std::vector<double> stretch(static_cast<std::size_t>(ranks), 1.0);
  if (reps > 1 && c.zero >= 2)
    for (int r = 0; r < ranks; ++r) {
      const double pace_r = pace[static_cast<std::size_t>(r)];
      std::vector<detail::ShardedUnit> su;  // forward order through the rank's chunks
      bool wte = false;
      for (int k = 0; k < chunks; ++k) {
        const int v = stage_of(r, k);
        if (v == 0) {  // the embedding's unit: wpe (wte is held for the step)
          su.push_back(sharded_unit(units.emb, {s.P * s.W, 0}, 1, pace_r));
          su.back().gathered_in_backward = false;
        }
        for (int l = bounds[static_cast<std::size_t>(v)]; l < bounds[static_cast<std::size_t>(v) + 1]; ++l)
          su.push_back(m.is_moe_layer(l) ? sharded_unit(units.moe_block, moe_params, moe_dense_buckets, pace_r)
                                         : sharded_unit(units.block, {detail::block_params(s), 0}, block_buckets, pace_r));
        const bool head = v == stages - 1 || local;
        if (head) {  // ln_f, and a local head's own matrix (the last stage's is the tied wte)
          const double own = own_heads && v < stages - 1 ? s.V / s.tp * s.W : 0.0;
          su.push_back(sharded_unit(units.head, {2 * s.W + own, 0}, detail::bucket_count({own, 2 * s.W}, bucket), pace_r));
        }
        wte = wte || v == 0 || (v == stages - 1 && stages > 1) || (local && !own_heads);
      }
      detail::HeldTraffic held;  // the tied wte's bucket: gathered once (ZeRO-3), reduced once
      if (wte) {
        held.reduce = transfer(shard_link, S, s.V / s.tp * s.W, 1);
        held.reduce_copy = copy_of(S, s.V / s.tp * s.W);
        if (c.zero == 3) held.gather = held.reduce, held.gather_copy = held.reduce_copy;
      }
      const double alone = c.microbatches * rank_compute(r);
      const double step = detail::sharded_step_seconds(su, c.microbatches, c.zero < 3 || c.prefetch_values, held);
      stretch[static_cast<std::size_t>(r)] = std::max(1.0, step / alone);
    }
  auto action_cost_at = [&](const std::vector<PassTimes>& times, int rank, int chunk, pipe::ActionKind kind) {
    const PassTimes& t = times[static_cast<std::size_t>(stage_of(rank, chunk))];
    double x = kind == pipe::ActionKind::forward ? t.forward
               : kind == pipe::ActionKind::backward_input ? t.backward_input : t.backward_weight;
    return x * stretch[static_cast<std::size_t>(rank)] / pace[static_cast<std::size_t>(rank)];
  };
  auto action_cost = [&](int rank, int chunk, pipe::ActionKind kind) { return action_cost_at(out.stage, rank, chunk, kind); };
  // the least an action can cost: with the node's other devices idle where they share it
  auto least_cost = [&](int rank, int chunk, pipe::ActionKind kind) {
    const double x = action_cost(rank, chunk, kind);
    return sharing ? std::min(x, action_cost_at(stage_alone, rank, chunk, kind)) : x;
  };
  // Every rank's busy time (its actions, no waiting; the least it can be, for the bound) and its
  // last microbatch's backward.
  std::vector<double> busy(static_cast<std::size_t>(ranks), 0.0), last_backward(static_cast<std::size_t>(ranks), 0.0);
  int busiest = 0;
  for (int r = 0; r < ranks; ++r) {
    for (int k = 0; k < chunks; ++k) {
      const double b = action_cost(r, k, pipe::ActionKind::backward_input) + action_cost(r, k, pipe::ActionKind::backward_weight);
      last_backward[static_cast<std::size_t>(r)] += b;
      busy[static_cast<std::size_t>(r)] +=
          c.microbatches * (least_cost(r, k, pipe::ActionKind::forward) + least_cost(r, k, pipe::ActionKind::backward_input) +
                            least_cost(r, k, pipe::ActionKind::backward_weight));
    }
    if (busy[static_cast<std::size_t>(r)] > busy[static_cast<std::size_t>(busiest)]) busiest = r;
  }
  out.compute = busy[static_cast<std::size_t>(busiest)];
  for (int k = 0; k < chunks; ++k) {
    out.tp_comm += c.microbatches * stage_comm[static_cast<std::size_t>(stage_of(busiest, k))];
    out.ep_comm += c.microbatches * stage_ep[static_cast<std::size_t>(stage_of(busiest, k))];
  }

  // The offloaded optimizer's host AdamW and copies (Rates' defaults: the device's own, as on the host).
  auto host_adamw = [&](double n) { return rates.host_adamw ? rates.host_adamw(n) : rates.adamw(n); };
  auto host_copy = [&](double bytes) { return rates.host_copy ? rates.host_copy(bytes) : rates.memory(2 * bytes); };
  // the weight units a rank updates one by one under fused_update: its blocks, wpe, ln_f, and wte
  auto rank_units = [&](int rank) {
    int n = 0;
    bool wte = false;
    for (int k = 0; k < chunks; ++k) {
      const int v = stage_of(rank, k);
      n += bounds[static_cast<std::size_t>(v) + 1] - bounds[static_cast<std::size_t>(v)];
      n += (v == 0) + (v == stages - 1 || local);
      wte = wte || v == 0 || v == stages - 1 || (local && !own_heads);
    }
    return n + (wte ? 1 : 0);
  };

  // dp: what the backward does not hide, and the optimizer, per rank; the step waits for the slowest.
  double after = 0;
  for (int r = 0; r < ranks; ++r) {
    const detail::BlockParams split = rank_params(r);
    const double params = split.total();
    // MoE: the dense and the expert buckets, each on its own communicator, taken as one queue (a
    // unit's expert buckets become ready with its dense ones)
    const int buckets = std::max(1, static_cast<int>(std::ceil(params / static_cast<double>(c.bucket_elements))));
    const double last_b = last_backward[static_cast<std::size_t>(r)];
    double exposed = 0;
    if (reps > 1) {
      const double window = c.overlap_dp ? last_b : 0.0;
      if (c.zero <= 1)  // the buckets' copies where the device makes them itself (during the backward)
        exposed += rates.memory(copy_traffic(c.zero == 0 ? 2.0 : 1.0, split));
      if (c.zero == 0)
        exposed += exposed_after(window, all_reduce_seconds(dp_link, 4 * split.dense, reps) +
                                             (split.expert > 0 ? all_reduce_seconds(expert_link, 4 * split.expert, S_e) : 0.0),
                                 buckets);
      if (c.zero == 1) exposed += exposed_after(window, zero_pass(split), buckets) + zero_pass(split);
      if (c.zero == 2) exposed += zero_pass(split);  // values all-gathered after the update
      if (c.zero >= 1 && groups > 1) {
        // hybrid sharding: each bucket's reduced shard (1/S of its gradients) all-reduced across the
        // groups once per step (grad_buckets.hpp). ZeRO-1: at the end, after every reduce-scatter
        // (exposed); ZeRO-2/3: started as the bucket's last reduce-scatter retires, overlapping
        // the rest of the last backward (the reduce-scatters are on the shard group's link).
        // (dense buckets only: the experts' shard over all their replicas)
        const double sum = all_reduce_seconds(across_link, 4 * split.dense / S, groups);
        exposed += c.zero == 1 ? sum : exposed_after(last_b, sum, buckets);
        exposed += rates.memory(rates.collective_copy_bytes * 2.0 * (groups - 1) / groups * 4 * split.dense / S);
      }
    }
    const double shard = c.zero >= 1 ? split.dense / shard_n + split.expert / S_e : params;
    double opt = (rates.adamw(shard) + rates.memory(4 * params)) / speed(r);
    if (c.offload_optimizer) {
      // the moments on the host (train/optimizer_state.hpp): the update downloads values and
      // gradients (8 bytes an element) and uploads the values (4) on the training thread, and
      // runs AdamW on the host. fused_update with the update thread: unit by unit on a worker as
      // each unit's gradients are final, overlapping the last backward; else after the schedule.
      const bool overlapped = c.fused_update != train::TrainerConfig::FusedUpdate::off && c.offload_update_thread;
      // The host's time is not the device's speed's business; the norm's pass stays on the device.
      opt = rates.memory(4 * params) / speed(r) + host_copy(12 * shard) +
            (overlapped ? exposed_after(last_b, host_adamw(shard), rank_units(r)) : host_adamw(shard));
    }
    if (exposed + opt > after) {
      after = exposed + opt;
      out.dp_exposed = exposed;
      out.optimizer = opt;
    }
  }
  // the tied wte: its gradient summed between the first and last pipeline ranks (local heads tied
  // to it: over every pipeline rank, each holding a copy)
  if (c.pp > 1) after += all_reduce_seconds(pp_link, 4 * s.V / s.tp * s.W, local && !own_heads ? c.pp : 2);

  // The pipeline's makespan is at least the busiest rank's busy time: a bound without simulating.
  out.pipeline = out.compute;
  out.step = out.pipeline + after;
  if (out.step >= stop_above) {
    out.bound_only = true;
    return out;
  }
  if (piped) {
    const double msg = 4 * s.R * s.W / (s.sp ? s.tp : 1.0);
    auto send = [&](int, const pipe::Action&) { return send_seconds(pp_link, msg); };
    auto cost_of = [&](int rank, const pipe::Action& a) { return action_cost(rank, a.chunk, a.kind); };
    pipe::Simulation sim = pipe::simulate_prepared(sched, cost_of, send);
    for (int pass = 0; sharing && pass < 2; ++pass) {
      const auto cost = detail::shared_node_costs(
          sim.timeline, group, cluster.devices_per_node, rates.shared_by,
          [&](int rank, const pipe::Action& a) { return action_cost(rank, a.chunk, a.kind); },
          [&](int rank, const pipe::Action& a) { return action_cost_at(stage_alone, rank, a.chunk, a.kind); });
      sim = pipe::simulate_prepared(sched, [&](int rank, const pipe::Action& a) { return cost.at(detail::action_key(rank, a)); },
                                send);
    }
    out.pipeline = sim.step_time;
    out.bubble_fraction = sim.bubble_fraction;
    if (sharing) out.compute = *std::max_element(sim.busy.begin(), sim.busy.end());
  }
  out.step = out.pipeline + after;
  return out;
}

}  // namespace trellis::plan
