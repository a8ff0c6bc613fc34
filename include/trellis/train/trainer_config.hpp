// What a train::Trainer runs (TrainerConfig: model, layout, schedule, optimizer, clipping, dp
// buckets, point-to-point mode), the checks that refuse a config before any work (each problem
// saying what to change), the per-step dropout seed, and what a step returns (StepResult).
// Separate from train/trainer.hpp so flag parsers and tools can check a config without the
// trainer's machinery.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/core/hash.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/optim/adamw.hpp"
#include "trellis/optim/lr_schedule.hpp"
#include "trellis/pipe/executor.hpp"
#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/partition.hpp"
#include "trellis/pipe/schedule.hpp"
#include "trellis/pipe/simulate.hpp"
#include "trellis/pipe/verify.hpp"

namespace trellis::train {

// The work the balanced pipeline split weighs (pipe::balanced_split), in one unit of any kind:
// per block, and fixed per pipeline stage (the embedding, the heads).
struct LayerCosts {
  std::vector<double> layers, fixed;  // per block; per pipeline stage
};

struct TrainerConfig {
  nn::GptConfig model{};
  nn::GptOptions options{};
  int pp = 1, dp = 1, tp = 1;
  // Context parallelism: every sample's sequence split over cp ranks (zig-zag chunks; attention by
  // cp_mode, nn/context_parallel.hpp). Gradients are then reduced over dp x cp.
  int cp = 1;
  // Expert parallelism: a Mixture-of-Experts model's experts (model.moe_every > 0) split over
  // groups of ep consecutive dp ranks (ep divides dp and the expert count).
  int ep = 1;
  nn::CpMode cp_mode = nn::CpMode::ring;
  int cp_ulysses = 2;  // hybrid: the Ulysses group size u (cp = u x ring size)
  // Packed rows reordered so every cp rank gets near-equal causal attention work (ring, hybrid;
  // nn::balanced_document_order).
  bool cp_balance_documents = false;
  std::string schedule = "1f1b";  // any pipe generator (local_learning: PPLL, see local_head)
  // A schedule of your own (e.g. pipe::load_schedule of a text file) used instead of `schedule`
  // with pp > 1; checked by config_problems (ranks = pp, microbatches, verify()).
  std::optional<pipe::Schedule> custom_schedule{};
  int virtual_chunks = 2;         // v of interleaved_1f1b (vee schedules always hold 2)
  // Local learning (a schedule with local losses: local_learning, or a custom one): every virtual
  // stage but the last trains against its own loss through a LayerNorm + LM head of its own
  // (nn::GptStage::local_head), the LM head being the tied wte (tied) or a matrix of its own (own);
  // no gradient crosses a stage boundary. StepResult::loss stays the last stage's (the model's).
  enum class LocalHead { tied, own };
  LocalHead local_head = LocalHead::tied;
  // Uneven pipeline stages (schedules of one chunk per rank): stage_layers, blocks per pipeline
  // stage (pp entries summing to the layers); or rank_speed, each pipeline rank's relative speed
  // (pp entries > 0), from which pipeline_split picks the split whose slowest stage is fastest
  // (pipe::balanced_split over layer_costs). Empty: the even split. simulate_rank_speed: each
  // pipeline rank also runs its compute 1 / rank_speed times slower (it sleeps after each action
  // for the extra time), a slow device simulated on the host.
  std::vector<int> stage_layers{};
  std::vector<double> rank_speed{};
  bool simulate_rank_speed = false;
  // What rank_speed's split weighs: unset, FLOP counts (layer_costs); or costs timed on a machine
  // (plan::stage_costs: one microbatch's F + B + W per block and per stage, in seconds).
  std::optional<LayerCosts> stage_costs{};
  // Unequal data-parallel shares (replicas of unequal speed): the rows of the global batch each dp
  // rank takes (dp entries summing to batch, each a multiple of microbatches; dp rank d holds rows
  // [sum of the entries before d, + dp_rows[d])). Empty: batch / dp each. The loss stays the mean
  // over the global batch's tokens, so the gradients are those of equal shares of the same rows.
  // dp_speed: each dp rank's relative speed (dp entries > 0); with simulate_rank_speed each rank
  // computes 1 / (rank_speed x dp_speed) times slower. balanced_dp_rows picks shares from it.
  std::vector<index_t> dp_rows{};
  std::vector<double> dp_speed{};
  int microbatches = 1;
  index_t batch = 8;  // rows of the GLOBAL batch
  index_t seq = 64;   // T
  // ZeRO stage over the replicas (dp x cp): 0 none; 1 the optimizer state sharded; 2 the
  // gradients too (reduce-scattered per microbatch out of short-lived unit slots); 3 the values
  // too (a weight unit's gathered around its forward and backward: train/param_shards.hpp).
  int zero = 0;
  // ZeRO-3: the next unit's gather starts while the current unit computes (false: each unit's
  // gather starts when it is needed -- the baseline; the same bits either way).
  bool prefetch_values = true;
  // Hybrid sharding (ZeRO 1-3; FSDP's HYBRID_SHARD, torchtitan's dp_shard x dp_replicate): shard
  // over groups of this many consecutive replicas and replicate across the groups, whose shards'
  // gradients are all-reduced once per step (train/grad_buckets.hpp). 0 (or dp x cp): every
  // replica holds one shard. Must divide dp x cp; MoE experts shard over all their replicas.
  int shard_degree = 0;
  optim::AdamW adamw{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  optim::WarmupCosine lr{.max_lr = 1e-3, .min_lr = 1e-4, .warmup_steps = 10, .total_steps = 100};
  double clip = 1.0;  // max global grad norm (<= 0: no clipping)
  // The optimizer step fused into the backward: each weight unit's AdamW update runs as soon as its
  // gradients are reduced (one unit behind the backward, so a unit's reduction overlaps the next
  // unit's W), wte's after the tied sum. Clipping by the global norm needs every gradient first, so:
  // unclipped (refused with clip > 0) or previous_clip (this step scaled by the clip factor of the
  // previous step's norm; the first step of a run unscaled; the factor is checkpointed).
  enum class FusedUpdate { off, unclipped, previous_clip };
  FusedUpdate fused_update = FusedUpdate::off;
  // AdamW moments in host memory, each update on the CPU over staged copies of the values and
  // gradients (train/optimizer_state.hpp; ZeRO-Offload's optimizer tier). The same bits on the host.
  // offload_update_thread: the CPU updates run on a thread of their own, so with fused_update a
  // unit's update overlaps the rest of the backward (false: on the training thread).
  bool offload_optimizer = false;
  bool offload_update_thread = true;
  // The disk tier (ZeRO-Infinity's): the AdamW moments in a scratch file under this directory
  // (train/disk_moments.hpp), streamed through host buffers of offload_buffer_elements; set, it
  // is used whatever offload_optimizer says. offload_dir_cap_bytes: the most the file may take
  // (0: no cap; tests simulate a full disk with it). offload_disk_prefetch: the tier's I/O thread
  // reads the next offload_disk_readahead (D) chunks' moments and writes the previous one's back
  // while the CPU updates a chunk (host buffers: a chunk's m and v D + 1 times, its values and
  // gradients once, 2 (D + 1) + 2 chunks in all, 8 at the default D = 2; false: synchronous, on
  // the training thread, 4 chunks).
  std::filesystem::path offload_dir{};
  std::uint64_t offload_dir_cap_bytes = 0;
  std::size_t offload_buffer_elements = std::size_t{1} << 22;
  bool offload_disk_prefetch = true;
  int offload_disk_readahead = 2;
  // Saved activations offloaded to host memory unit by unit (a block, the head, the embedding;
  // nn/activation_arena.hpp's offloaded pools): each chunk keeps offload_activation_frames units'
  // worth in device memory, a cache that evicts the least recently used unit to host memory and
  // fetches the next unit of a backward while the current one computes. The same bits.
  // offload_activation_copy_queue: the copies run on the backend's copy queue (a worker thread on
  // the host, a copy stream into pinned memory on CUDA), overlapped with the compute: a unit's
  // write-back starts once its forward is done (false: synchronous, each copy waited for at
  // once). offload_activation_simulated_gbps: tests and benches on host backends, a SIMULATED
  // host link of that many GB/s holding each copy for bytes / bandwidth (0: memcpy speed).
  bool offload_activations = false;
  int offload_activation_frames = 2;
  bool offload_activation_copy_queue = true;
  double offload_activation_simulated_gbps = 0;
  std::size_t bucket_elements = std::size_t{1} << 18;
  // dp buckets start as soon as their chunk's gradients are final (overlapping the rest of the
  // backward); false: all start after the schedule -- the synchronous baseline (same buckets,
  // same order of results, so the same bits).
  bool overlap_dp = true;
  // How the pipe executor posts a run of sends/receives (pipe::ExecuteOptions::P2P): unset means
  // isend on host communicators and batch (one group, as NCCL needs) on device ones.
  std::optional<pipe::ExecuteOptions::P2P> p2p{};
  // Device communicators (NCCL): collectives and point-to-point transfers on a stream of each
  // communicator's own, ordered after the compute stream by events, so dp buckets, ZeRO-1's
  // reduce-scatters and the tp chunks (options.overlap_chunks) overlap kernels on the GPU
  // (NcclComm::set_compute_stream). false: everything on the compute stream (no overlap).
  bool comm_stream = true;
  // Tests: fill each activation-arena slot with NaN when a microbatch claims it, so a saved tensor
  // read before it is written shows up in the loss (nn/activation_arena.hpp).
  bool poison_activations = false;
  std::uint64_t seed = 1234;  // Rng streams (one per rank) and dropout masks; the model's init seed is options.seed
};

// The dropout seed of optimizer step `step` (0-based) of a run with seed `run_seed`: every step
// draws new masks, and a resumed run (same seed, restored step count) draws the uninterrupted
// run's. Which elements drop also depends on the token's global sample index (nn/dropout.hpp),
// not on the dp rank or microbatch that holds it.
inline std::uint64_t dropout_seed(std::uint64_t run_seed, std::int64_t step) {
  return trellis::splitmix64(trellis::splitmix64(run_seed ^ name_hash("dropout")) + static_cast<std::uint64_t>(step));
}

// Problems of a custom pipeline schedule for this config (empty: usable).
inline std::vector<std::string> custom_schedule_problems(const TrainerConfig& c, const pipe::Schedule& s) {
  std::vector<std::string> out;
  const std::string what = "the custom schedule '" + s.name + "'";
  if (c.pp <= 1) {
    out.push_back(what + " is a pipeline schedule: it needs --pp > 1");
    return out;
  }
  if (s.stages != c.pp)
    out.push_back(what + " has " + std::to_string(s.stages) + " rank lines but --pp is " + std::to_string(c.pp));
  if (s.microbatches != c.microbatches)
    out.push_back(what + " has " + std::to_string(s.microbatches) + " microbatches but --microbatches is " +
                  std::to_string(c.microbatches));
  if (s.chunks >= 1 && c.model.layers < static_cast<index_t>(s.stages) * s.chunks)
    out.push_back("--layers " + std::to_string(c.model.layers) + " is fewer than the " +
                  std::to_string(s.stages * s.chunks) + " virtual pipeline stages of " + what);
  if (out.empty()) {
    try {
      pipe::verify(s);
    } catch (const Error& e) {
      out.push_back(what + " does not verify: " + e.message());
    }
  }
  return out;
}

// dp x tp x pp (x cp), or -1 when it does not fit in an int (ranks are ints everywhere); 0 when a
// size is < 1.
inline std::int64_t layout_ranks(int pp, int dp, int tp, int cp = 1) {
  std::int64_t n = 1;
  for (int k : {pp, dp, tp, cp}) {
    if (k < 1) return 0;
    n *= k;
    if (n > std::numeric_limits<int>::max()) return -1;
  }
  return n;
}

// The rows of the global batch dp rank d takes, and the first of them (TrainerConfig::dp_rows).
inline index_t dp_rows_of(const TrainerConfig& c, int d) {
  return c.dp_rows.empty() ? c.batch / c.dp : c.dp_rows.at(static_cast<std::size_t>(d));
}
inline index_t dp_first_row(const TrainerConfig& c, int d) {
  if (c.dp_rows.empty()) return static_cast<index_t>(d) * (c.batch / c.dp);
  index_t first = 0;
  for (int i = 0; i < d; ++i) first += c.dp_rows.at(static_cast<std::size_t>(i));
  return first;
}
// Shares of `batch` rows for dp ranks of these speeds, each a multiple of `microbatches` and at
// least one microbatch, such that the slowest rank's rows / speed is smallest: one unit of
// `microbatches` rows each, then every further unit to the rank that would finish it soonest (the
// first on ties) -- greedy, which is optimal for a max of increasing per-rank times.
inline std::vector<index_t> balanced_dp_rows(index_t batch, int microbatches, std::span<const double> speeds) {
  const auto n = static_cast<index_t>(speeds.size());
  TRELLIS_CHECK(n >= 1 && microbatches >= 1 && batch % microbatches == 0 && batch / microbatches >= n,
                "balanced_dp_rows: ", batch, " rows in units of ", microbatches, " cannot give each of ", n,
                " dp ranks one unit");
  for (double s : speeds) TRELLIS_CHECK(s > 0 && s <= 1e6, "balanced_dp_rows: a speed of ", s, " (must be in (0, 1e6])");
  std::vector<index_t> u(speeds.size(), 1);
  for (index_t given = n; given < batch / microbatches; ++given) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < u.size(); ++i)
      if ((static_cast<double>(u[i]) + 1) / speeds[i] < (static_cast<double>(u[best]) + 1) / speeds[best]) best = i;
    ++u[best];
  }
  for (auto& x : u) x *= microbatches;
  return u;
}

// Every problem with a layout, each saying what to change; empty when the config is usable.
// make_schedule = false leaves out asking the schedule's generator whether it accepts pp and the
// microbatches (a caller that makes the schedule anyway, e.g. plan::ScheduleCache, asks once).
inline std::vector<std::string> config_problems(const TrainerConfig& c, bool make_schedule = true) {
  std::vector<std::string> out;
  auto add = [&](auto&&... parts) {
    std::ostringstream s;
    (s << ... << parts);
    out.push_back(s.str());
  };
  const auto& m = c.model;
  if (c.pp < 1 || c.dp < 1 || c.tp < 1 || c.cp < 1)
    add("--pp, --dp, --tp and --cp must be >= 1 (got pp ", c.pp, ", dp ", c.dp, ", tp ", c.tp, ", cp ", c.cp, ")");
  if (layout_ranks(c.pp, c.dp, c.tp, c.cp) < 0)
    add("--dp ", c.dp, " x --tp ", c.tp, " x --pp ", c.pp, " x --cp ", c.cp, " is more ranks than an int holds (",
        std::numeric_limits<int>::max(), "): use smaller sizes");
  if (c.cp > 1 && c.seq >= 1 && c.seq % (2 * static_cast<index_t>(c.cp)) != 0)
    add("--cp ", c.cp, " cuts every sequence into 2 x cp = ", 2 * c.cp, " equal chunks (zig-zag, for balanced ",
        "causal attention): the sequence length ", c.seq, " must be a multiple of ", 2 * c.cp);
  // Ulysses splits every tp rank's heads over its all-to-all group: cp (ulysses) or u (hybrid).
  const int group = c.cp_mode == nn::CpMode::ulysses ? c.cp : c.cp_mode == nn::CpMode::hybrid ? c.cp_ulysses : 1;
  if (c.cp > 1 && c.cp_mode == nn::CpMode::hybrid && (c.cp_ulysses < 2 || c.cp_ulysses >= c.cp || c.cp % c.cp_ulysses != 0))
    add("--cp-mode hybrid runs Ulysses in groups of --cp-ulysses ", c.cp_ulysses, " ranks and a ring across the groups: ",
        "it needs 1 < --cp-ulysses < --cp ", c.cp, " and dividing it (use ring or ulysses for a single level)");
  else if (c.cp > 1 && group > 1 && c.tp >= 1 && m.heads >= 1 && (m.heads / c.tp) % group != 0)
    add("--cp-mode ", nn::to_string(c.cp_mode), " gives each of ", group, " ranks an equal share of every tp rank's ",
        m.heads / c.tp, " heads (--heads ", m.heads, " over --tp ", c.tp, "): the ", m.heads / c.tp,
        " heads must be a multiple of ", group, "; use --cp-mode ring or another --cp");
  if (c.cp_balance_documents && (c.cp < 2 || c.cp_mode == nn::CpMode::ulysses || c.options.dropout != 0.0f))
    add("--cp-balance-docs reorders each packed row per document for ring or hybrid context parallelism: it needs ",
        "--cp > 1 (got ", c.cp, "), --cp-mode ring or hybrid (got ", nn::to_string(c.cp_mode), ") and --dropout 0 (got ",
        c.options.dropout, "; masks follow positions in the row)");
  if (c.ep < 1) add("--ep must be >= 1 (got ", c.ep, ")");
  if (m.moe_every < 0) add("--moe-every must be >= 0 (0: dense; got ", m.moe_every, ")");
  if (m.moe_every > 0 && (m.experts < 1 || (m.moe_topk != 1 && m.moe_topk != 2) || m.moe_topk > m.experts))
    add("--experts ", m.experts, " --topk ", m.moe_topk, ": an MoE block needs >= 1 expert and top-1 or top-2 routing ",
        "of at most that many experts");
  if (m.moe_every == 0 && c.ep > 1) add("--ep ", c.ep, " splits experts over ranks: it needs an MoE model (--experts, --moe-every)");
  if (c.ep > 1 && c.dp >= 1 && c.dp % c.ep != 0)
    add("--ep ", c.ep, " groups consecutive dp ranks: it must divide --dp ", c.dp);
  if (m.moe_every > 0 && c.ep >= 1 && m.experts >= 1 && m.experts % c.ep != 0)
    add("--experts ", m.experts, " do not split evenly over --ep ", c.ep);
  if (m.moe_every > 0 && !(c.options.moe_capacity >= 0.0f && c.options.moe_aux_loss >= 0.0f && c.options.moe_z_loss >= 0.0f))
    add("--capacity, the load-balancing and the z-loss coefficients must be >= 0");
  if (m.layers < 1 || m.heads < 1 || m.width < 1 || m.vocab < 1 || m.positions < 1)
    add("--layers, --heads, --width, --vocab and --context must be >= 1");
  if (m.heads >= 1 && m.width % m.heads != 0)
    add("--width ", m.width, " is not divisible by --heads ", m.heads, ": change one of them");
  if (c.tp >= 1 && m.heads >= 1 && m.heads % c.tp != 0)
    add("--tp ", c.tp, " does not divide --heads ", m.heads, ": use a tp that divides the head count");
  if (c.tp >= 1 && m.vocab < c.tp) add("--vocab ", m.vocab, " is smaller than --tp ", c.tp);
  if (c.seq < 1 || c.seq > m.positions)
    add("sequence length ", c.seq, " must be in 1..--context (", m.positions, ")");
  if (c.microbatches < 1) add("--microbatches must be >= 1 (got ", c.microbatches, ")");
  if (c.batch < 1) add("--batch must be >= 1 (got ", c.batch, ")");
  if (!c.dp_rows.empty()) {
    index_t sum = 0;
    bool fits = true;
    for (index_t r : c.dp_rows) {
      sum += r;
      fits = fits && r >= 1 && c.microbatches >= 1 && r % c.microbatches == 0;
    }
    if (static_cast<int>(c.dp_rows.size()) != c.dp || sum != c.batch || !fits)
      add("--dp-rows needs --dp ", c.dp, " row counts summing to --batch ", c.batch, ", each a positive multiple of "
          "--microbatches ", c.microbatches, " (got ", c.dp_rows.size(), " counts summing to ", sum, ")");
    if (m.moe_every > 0) add("--dp-rows: unequal data-parallel shares with a Mixture-of-Experts model are not supported yet");
  } else if (c.dp >= 1 && c.microbatches >= 1 && c.batch >= 1 &&
      c.batch % (static_cast<index_t>(c.dp) * c.microbatches) != 0)
    add("--batch ", c.batch, " must be a multiple of dp x microbatches = ", c.dp, " x ", c.microbatches,
        " (each dp rank cuts its rows into equal microbatches)");
  if (!(c.options.dropout >= 0.0f && c.options.dropout < 1.0f))
    add("--dropout is a probability in [0, 1), got ", c.options.dropout);
  if (c.options.overlap_chunks < 1) add("--overlap must be >= 1 (1: no overlap), got ", c.options.overlap_chunks);
  if (c.options.sequence_parallel && c.tp >= 1 && c.cp >= 1 && (c.seq / c.cp) % c.tp != 0)
    add("--sp needs each rank's sequence length ", c.seq / c.cp, c.cp > 1 ? " (the sequence over --cp)" : "",
        " divisible by --tp ", c.tp);
  if (c.custom_schedule) {
    for (auto& p : custom_schedule_problems(c, *c.custom_schedule)) out.push_back(std::move(p));
  } else if (c.pp > 1) {
    const auto names = pipe::schedule_names();
    if (std::find(names.begin(), names.end(), c.schedule) == names.end()) {
      std::string known;
      for (auto& n : names) known += (known.empty() ? "" : ", ") + n;
      add("unknown --schedule '", c.schedule, "' (known: ", known, ")");
    } else {
      const int v = c.schedule == "interleaved_1f1b"                       ? c.virtual_chunks
                    : (c.schedule == "zb_v" || c.schedule == "dualpipe_v") ? 2
                                                                           : 1;
      if (v < 1)
        add("--chunks must be >= 1");
      else if (m.layers < static_cast<index_t>(c.pp) * v)
        add("--layers ", m.layers, " is fewer than the ", static_cast<index_t>(c.pp) * v, " virtual pipeline stages of '",
            c.schedule, "' with pp ", c.pp, ": use more layers or a smaller --pp");
      else if (c.microbatches >= 1 && make_schedule) {
        try {  // what the generator itself refuses (e.g. interleaved: microbatches a multiple of pp)
          (void)pipe::make_schedule(c.schedule, c.pp, c.microbatches, c.schedule == "interleaved_1f1b" ? v : 1);
        } catch (const Error& e) {
          add("--schedule ", c.schedule, " with --pp ", c.pp, " and --microbatches ", c.microbatches, ": ", e.message());
        }
      }
    }
  }
  if (!c.stage_layers.empty() || !c.rank_speed.empty()) {
    const bool one_chunk = c.custom_schedule ? c.custom_schedule->chunks == 1
                                             : c.schedule != "interleaved_1f1b" && c.schedule != "zb_v" &&
                                                   c.schedule != "dualpipe_v";
    if (c.pp < 2 || !one_chunk)
      add("uneven pipeline stages (--stage-layers, --rank-speed) need --pp > 1 and a schedule of one chunk per rank");
    if (!c.stage_layers.empty()) {
      index_t sum = 0;
      bool positive = true;
      for (int n : c.stage_layers) {
        sum += n;
        positive = positive && n >= 1;
      }
      if (static_cast<int>(c.stage_layers.size()) != c.pp || sum != m.layers || !positive)
        add("--stage-layers needs --pp ", c.pp, " counts of at least 1 block summing to --layers ", m.layers, " (got ",
            c.stage_layers.size(), " counts summing to ", sum, ")");
    }
    if (!c.rank_speed.empty()) {
      bool positive = true;
      for (double s : c.rank_speed) positive = positive && s > 0 && s <= 1e6;
      if (static_cast<int>(c.rank_speed.size()) != c.pp || !positive)
        add("--rank-speed needs --pp ", c.pp, " speeds in (0, 1e6] (got ", c.rank_speed.size(), ")");
    }
  }
  if (c.stage_costs) {
    bool finite = true;
    for (const auto* v : {&c.stage_costs->layers, &c.stage_costs->fixed})
      for (double x : *v) finite = finite && std::isfinite(x) && x >= 0;
    if (static_cast<index_t>(c.stage_costs->layers.size()) != m.layers ||
        static_cast<int>(c.stage_costs->fixed.size()) != std::max(1, c.pp) || !finite)
      add("stage costs need --layers ", m.layers, " block costs and --pp ", std::max(1, c.pp),
          " stage costs, finite and >= 0 (got ", c.stage_costs->layers.size(), " and ", c.stage_costs->fixed.size(), ")");
  }
  if (!c.dp_speed.empty()) {
    bool positive = true;
    for (double x : c.dp_speed) positive = positive && x > 0 && x <= 1e6;
    if (static_cast<int>(c.dp_speed.size()) != c.dp || !positive)
      add("--dp-speed needs --dp ", c.dp, " speeds in (0, 1e6] (got ", c.dp_speed.size(), ")");
  }
  if (c.simulate_rank_speed && c.rank_speed.empty() && c.dp_speed.empty())
    add("--simulate-rank-speed needs --rank-speed or --dp-speed");
  if (c.clip < 0) add("--clip must be >= 0");
  if (c.fused_update == TrainerConfig::FusedUpdate::unclipped && c.clip > 0)
    add("--fused-update updates each block before the global gradient norm is known, so it cannot clip by it: "
        "give --clip 0, or --fused-update previous-clip (the clip factor of the previous step's norm)");
  if (c.fused_update == TrainerConfig::FusedUpdate::previous_clip && c.clip <= 0)
    add("--fused-update previous-clip needs --clip > 0 (without clipping use --fused-update unclipped)");
  if (c.bucket_elements < 1) add("bucket size must be >= 1 element");
  if (c.offload_buffer_elements < 1)
    add("the optimizer disk tier's chunk (offload_buffer_elements) must be >= 1 element");
  if (c.offload_disk_readahead < 1)
    add("the optimizer disk tier reads ahead at least 1 chunk (--offload-disk-readahead, got ", c.offload_disk_readahead,
        "; offload_disk_prefetch false makes it synchronous)");
  if (c.offload_activations && c.offload_activation_frames < 1)
    add("offloaded activations need at least 1 device frame per chunk (got ", c.offload_activation_frames, ")");
  if (c.offload_activation_simulated_gbps < 0)
    add("a simulated activation copy link needs a bandwidth >= 0 GB/s (got ", c.offload_activation_simulated_gbps, ")");
  if (c.shard_degree < 0) add("--shard-degree must be >= 0 (0: shard over every replica), got ", c.shard_degree);
  if (c.shard_degree > 0 && c.zero == 0)
    add("--shard-degree ", c.shard_degree, " shards the ZeRO state: give --zero 1, 2 or 3");
  if (c.shard_degree > 0 && c.dp >= 1 && c.cp >= 1 && (c.dp * c.cp) % c.shard_degree != 0)
    add("--shard-degree ", c.shard_degree, " must divide the replicas dp x cp = ", c.dp * c.cp,
        " (shard groups of equal size)");
  if (c.zero < 0 || c.zero > 3)
    add("--zero ", c.zero, " is not a ZeRO stage this trainer has (0: none, 1: optimizer state, 2: and gradients, "
        "3: and parameters)");
  return out;
}

// A block's and the fixed per-stage work of the GPT's pipeline stages: c.stage_costs where given
// (e.g. plan::stage_costs, timed on a machine), else forward FLOPs per token (the backward scales
// them alike): a block 24 W^2 + 2 T W (attention over T positions; an MoE block's MLP 16 W^2 per
// routed expert), the LM head 2 V W on the last stage (and on every stage with a local head), the
// embedding nothing.
inline LayerCosts layer_costs(const TrainerConfig& c, bool local_heads = false) {
  if (c.stage_costs) return *c.stage_costs;
  const double W = static_cast<double>(c.model.width), T = static_cast<double>(c.seq),
               V = static_cast<double>(c.model.vocab);
  LayerCosts k;
  for (index_t i = 0; i < c.model.layers; ++i)
    k.layers.push_back(c.model.is_moe_layer(i) ? 8 * W * W + 16 * W * W * static_cast<double>(c.model.moe_topk) + 2 * T * W
                                               : 24 * W * W + 2 * T * W);
  k.fixed.assign(static_cast<std::size_t>(std::max(1, c.pp)), local_heads ? 2 * V * W : 0.0);
  k.fixed.back() = 2 * V * W;
  return k;
}
// The pipeline's split into stages (pipe::split_layers bounds): stage_layers, or the balanced
// split for rank_speed; empty: the even split.
inline std::vector<int> pipeline_split(const TrainerConfig& c, bool local_heads = false) {
  if (!c.stage_layers.empty()) {
    std::vector<int> bounds{0};
    for (int n : c.stage_layers) bounds.push_back(bounds.back() + n);
    return bounds;
  }
  if (c.rank_speed.empty()) return {};
  const LayerCosts k = layer_costs(c, local_heads);
  return pipe::balanced_split(k.layers, c.rank_speed, k.fixed);
}

// What the cost model predicts for the pipeline of a config (one chunk per rank): its split, each
// stage's forward time per token (layer_costs over rank_speed; FLOP units), and the step of the
// schedule simulated with those times for F, B and W alike (pipe::simulate_with; no messages):
// relative units, to compare splits and schedules of one model, not seconds.
struct PipelinePrediction {
  std::vector<int> bounds;
  std::vector<double> stage_time;
  double step = 0;
};
inline PipelinePrediction predict_pipeline(const TrainerConfig& c) {
  PipelinePrediction out;
  const pipe::Schedule s = c.custom_schedule ? *c.custom_schedule : pipe::make_schedule(c.schedule, c.pp, c.microbatches);
  TRELLIS_CHECK(s.chunks == 1, "predict_pipeline: schedules of one chunk per rank only (", s.name, " has ", s.chunks, ")");
  out.bounds = pipeline_split(c, s.local_learning);
  if (out.bounds.empty()) out.bounds = pipe::split_layers(static_cast<int>(c.model.layers), c.pp);
  const std::vector<double> speeds = c.rank_speed.empty() ? std::vector<double>(static_cast<std::size_t>(c.pp), 1.0) : c.rank_speed;
  const LayerCosts k = layer_costs(c, s.local_learning);
  out.stage_time = pipe::stage_times(out.bounds, k.layers, speeds, k.fixed);
  out.step = pipe::simulate_with(s, [&](int rank, const pipe::Action&) { return out.stage_time[static_cast<std::size_t>(rank)]; }, 0.0)
                 .step_time;
  return out;
}

// Throws trellis::Error listing every problem (with `world_size` also checking dp x tp x pp).
// make_schedule: as config_problems'.
inline void check_config(const TrainerConfig& c, std::optional<int> world_size = std::nullopt, bool make_schedule = true) {
  auto problems = config_problems(c, make_schedule);
  const std::int64_t ranks = layout_ranks(c.pp, c.dp, c.tp, c.cp);
  if (world_size && ranks > 0 && *world_size != ranks) {
    std::ostringstream s;
    s << "the run has " << *world_size << " ranks but dp x tp x pp" << (c.cp > 1 ? " x cp" : "") << " = " << c.dp
      << " x " << c.tp << " x " << c.pp;
    if (c.cp > 1) s << " x " << c.cp;
    s << " = " << ranks << ": start " << ranks << " ranks or change the layout";
    problems.push_back(s.str());
  }
  if (problems.empty()) return;
  std::string msg = "invalid training configuration:";
  for (auto& p : problems) msg += "\n  - " + p;
  TRELLIS_THROW(msg);
}

// What one rank holds, in bytes: allocations are exact; the activation arena is reserved from
// the schedule's count of live microbatches, and its peak is measured as the steps run.
struct MemoryUse {
  std::size_t parameters = 0;        // fp32 master weights (the packed values; ZeRO-3: shards + unit slots + wte)
  std::size_t gradients = 0;         // packed gradients, or ZeRO's shards (ZeRO-2/3: + unit slots, wte)
  std::size_t optimizer = 0;         // AdamW moments (ZeRO: this rank's shards) in the backend's memory
  std::size_t host_optimizer = 0;    // offloaded: the moments and the update's staging, in host memory
  std::size_t disk_optimizer = 0;    // the disk tier: the moments' file
  std::size_t activations = 0;       // the activation arena's reserve
  std::size_t activations_peak = 0;  // the most it held at once so far
  std::size_t host_activations = 0;       // offloaded activations: the arena's host memory
  std::size_t host_activations_peak = 0;  // the most bytes offloaded there at once so far
  std::size_t workspace = 0;         // kernel scratch reserved
  std::size_t total() const { return parameters + gradients + optimizer + activations + workspace; }
};

struct StepResult {
  double loss = 0;       // global mean loss of the step (before the update)
  double grad_norm = 0;  // global norm before clipping
  double lr = 0;
  float clip_scale = 1;
  std::int64_t step = 0;  // optimizer steps done after this one
  // dp buckets (no ZeRO) of this rank: how many there are, and how many were started while this
  // rank still had W passes of the step to run (their all-reduce overlaps that compute; 0 with
  // overlap_dp = false). That the overlap saves time is measured with comm::SimulatedLink
  // (tests/train/test_overlap_timing.cpp), not by this count.
  int buckets = 0;
  int buckets_overlapped = 0;
  // Local learning: each virtual stage's own loss but the last's (global mean, before the update).
  std::vector<double> local_losses;
  // MoE models: the auxiliary losses (load balancing + z-loss, with their coefficients) summed
  // over the MoE layers, each a mean over microbatches and replicas; not part of `loss`.
  double moe_aux_loss = 0;
};

}  // namespace trellis::train
