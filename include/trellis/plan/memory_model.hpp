// plan::predict_memory: the bytes one rank of a train::Trainer holds, by kind, predicted from the
// TrainerConfig alone (no model is built), so a planner can prune layouts that do not fit before
// running them. Every figure is derived from the shapes -- parameter counts per layer and tp
// split, the trainer's packing and ZeRO shard rules, the layers' saved tensors per microbatch --
// and tests/plan/test_memory_model.cpp checks them against Trainer::memory(), byte for byte.
//
// The rules it follows (each the trainer's; see the files named):
//  - parameters: each chunk's tensors packed with every start aligned to A floats
//    (nn/parameter_buffer.hpp; A = lcm(pack_alignment, dp x cp) under ZeRO so buckets split evenly);
//    a block is 12 W^2 + 13 W, its attention and MLP matrices and column biases split over tp
//    (heads in whole heads), the embedding wte V/tp rows (shard::chunk: earlier ranks get the
//    extra row), wpe and the LayerNorms whole. A head chunk on a rank without the embedding holds
//    its own wte copy (vee schedules put both on rank 0: one wte). Local learning (PPLL): every
//    stage but the last has a local head unit, its LayerNorm (and, with local_head own, a V/tp
//    x W matrix of its own) saving what the head saves; tied to wte, a stage without the
//    embedding holds a wte copy as a head stage does.
//  - ZeRO (train/grad_buckets.hpp, param_shards.hpp): every bucket splits into S equal parts (S:
//    shard_degree, or dp x cp); 1: the packed gradients + the reduced shards T/S; 2: no packed
//    gradients, shards T/S + 2 unit slots (U + U/S, U the largest weight unit) + wte's whole
//    gradient; 3: as 2, and the values as shards T/S + 2 value slots of U + wte's step buffer.
//  - optimizer: m and v (8 bytes) per parameter element, or per element of this rank's pieces of
//    the buckets (the padding holds none, so the rank matters); offloaded, they and one update's
//    staged values and gradients move to host memory.
//  - activations (nn/activation_arena.hpp): per chunk, slots x one microbatch's saved bytes, each
//    saved tensor rounded up to 256 bytes; slots = the simulated peak of live microbatches of the
//    chunk (pipe::simulate) with pp > 1, else 1.
//    Recompute saves the block inputs only; sequence parallelism splits the norm-region rows over
//    tp; cp splits the sequence (the attention's saved tensors are the same size in every cp mode).
//    offload_activations: per chunk, frames x the largest unit on the device, the rooms on the host.
//    tp overlap chunks (options.overlap_chunks) change nothing here: the layers save the same
//    tensors at any chunk count (their saved_bytes do not depend on it), and the chunks' buffers
//    are scratch of one call (nn/tensor_parallel.hpp: a chunked all-gather stages its R x W rows
//    beside the gathered ones, a chunked reduce-scatter's staging replaces the whole partial
//    buffer, an all-reduce runs in place), which Trainer::memory() does not count at any K.
//  - Mixture of Experts (model.moe_every > 0, nn/moe.hpp; ep: train/trainer.hpp): an MoE block's
//    MLP is a router (W x E, whole on every rank) and this rank's E/ep experts (c_fc W x 4W/tp and
//    its bias, c_proj 4W/tp x W, its bias W whole), packed in the block's unit like the dense
//    MLP's tensors. The expert tensors form buckets of their own (a run breaks where the expert
//    flag changes), which shard over all their replicas -- the dp / ep x cp ranks holding the
//    same experts (rank (d / ep) cp + c among them), never in hybrid shard groups -- while the
//    router and the rest of the block shard as dense tensors. So under ZeRO the shards, the
//    ZeRO-2 received slot (per unit: dense / S + expert / S_e) and the optimizer's pieces follow
//    each bucket's own part count. The arena holds an MoE block's norms and attention only: the
//    MoE layer keeps its saved state in buffers of its own (saved_bytes() is 0), which
//    Trainer::memory() does not count. Those are `moe_activations` below, the one figure here
//    that is not exact: how many copies reach this rank's experts depends on the routing.
//    moe_activations: per live microbatch (the arena's slots) and MoE layer of the chunk, every
//    buffer MoeMlp keeps from a forward to its W (x, probs, lse, the routing's choices, gates,
//    slots and source rows over rows; xe, pre, h, dye, dh over the copies received; yp over the
//    copies sent; dlogits; the regroup's indices with ep > 1), all counted at once (pre and yp are
//    freed as dye, dh and dlogits appear: the sum is an upper bound by that). With a capacity
//    factor the copies are taken at their most (ep x E/ep x capacity received, E x capacity sent:
//    an upper bound whatever the routing); dropless at balanced routing (rows x k each: NOT a bound,
//    an imbalanced router sends more). Recompute does not lower it (the recomputed state lives
//    from B to W, as long as split schedules keep it). The layer's scratch of one call is not
//    counted, as nowhere here.
// fp32 compute only (4-byte activations: backend::Host<float>, the trainer's default). workspace:
// the host backends reserve none (0); the CUDA backend's scratch is not modelled. Exact after a
// step (the offloaded update's staging grows at the first update), except fused_update with
// offload_optimizer: its staging is an upper bound (units alternate between two buffers), and
// moe_activations (above).
// Refused (TRELLIS_CHECK): configs that train::config_problems refuses.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "trellis/core/error.hpp"
#include "trellis/nn/activation_arena.hpp"
#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/schedule.hpp"
#include "trellis/pipe/simulate.hpp"
#include "trellis/plan/schedule_cache.hpp"
#include "trellis/shard/layout.hpp"
#include "trellis/train/trainer_config.hpp"

namespace trellis::plan {

// Bytes one rank holds, by kind; the fields mean what train::MemoryUse's do.
struct MemoryEstimate {
  double parameters = 0, gradients = 0, optimizer = 0, host_optimizer = 0, activations = 0, workspace = 0;
  double disk_optimizer = 0;    // the disk tier's file (offload_dir)
  double host_activations = 0;  // offloaded activations: the arena's host rooms
  // MoE layers' own saved buffers (not in Trainer::memory(): data-dependent; see the header)
  double moe_activations = 0;
  double device_total() const { return parameters + gradients + optimizer + activations + workspace + moe_activations; }
};

// Which rank of the mesh: pipeline, tensor-parallel and replica (dp x cp: dp coordinate x cp + cp
// coordinate) coordinates. Ranks differ only where vocab does not split evenly over tp (wte's
// rows, the logits) and in the optimizer's pieces of the ZeRO shards (padding falls in some ranks'
// parts only).
struct RankCoords {
  int pp = 0, tp = 0, replica = 0;
};

namespace memory_detail {

using Bytes = std::uint64_t;

// One weight unit (a block, the head's ln_f, the embedding's wpe): its tensors' elements in
// packing order (the reverse of the layer's parameter order), its saved bytes per microbatch in
// the arena, and (MoE blocks) how many leading tensors are experts' and the MoE layer's own
// saved bytes.
struct Unit {
  std::vector<index_t> tensors;
  Bytes saved = 0;
  std::size_t experts = 0;  // tensors[0, experts) are expert tensors (their own buckets)
  double moe_saved = 0;
};
// One model chunk on the rank: its units (head, blocks last to first, embedding: the trainer's
// unit order), whether it holds a wte (the embedding's or a head copy), and its arena slots.
struct Chunk {
  std::vector<Unit> units;
  index_t wte = 0;  // elements of its wte, 0: none
  int slots = 1;
};

inline index_t round_up(index_t n, index_t a) { return (n + a - 1) / a * a; }
// Arena bytes of a saved tensor of n 4-byte elements (fp32 activations, fp32 statistics, int32 ids).
inline Bytes saved(index_t n) { return nn::saved_round(static_cast<std::size_t>(n) * 4); }

// The shapes one rank's layers see: tp split, rows of a microbatch, sequence parallelism.
struct Shapes {
  index_t W = 0, heads_local = 0, head_dim = 0, hidden_local = 0, vocab_local = 0;
  index_t rows = 0;        // microbatch rows on this rank: batch / (dp x microbatches) x seq / cp
  index_t local_rows = 0;  // the norm region's rows: rows / tp under sequence parallelism
  index_t ids = 0;         // the attention's document ids: the whole (cp-gathered) sequence
  bool gathers = false;    // sequence parallel over tp > 1: column layers keep an input shard too
};

// A LayerNorm's saved bytes: input rows, mean and rstd, the (weight, bias) gradients of the microbatch.
inline Bytes layernorm_saved(const Shapes& s) { return saved(s.local_rows * s.W) + 2 * saved(s.local_rows) + saved(2 * s.W); }
// A column-parallel layer (in -> out_local): dz or GELU's pre-activation, its input (rows), and
// under sp the input shard it keeps until backward_input.
inline Bytes column_saved(const Shapes& s, index_t in, index_t out_local) {
  return saved(s.rows * out_local) + saved(s.rows * in) + (s.gathers ? saved(s.local_rows * in) : 0);
}
// A row-parallel layer (in_local -> out): its input and the (gathered) output gradient.
inline Bytes row_saved(const Shapes& s, index_t in_local, index_t out) { return saved(s.rows * in_local) + saved(s.rows * out); }

// moe: an MoE block, whose MLP saves nothing in the arena (nn/moe.hpp: its own buffers).
inline Bytes block_saved(const Shapes& s, bool recompute, bool moe = false) {
  if (recompute) return saved(s.local_rows * s.W);  // the block input only; the rest is recomputed
  const index_t wl = s.heads_local * s.head_dim;
  // attention core: q, k, v, o (rows x this rank's heads, whatever the cp mode) and lse, the ids
  const Bytes attn = 4 * saved(s.rows * wl) + saved(s.rows * s.heads_local) + saved(s.ids) +
                     column_saved(s, s.W, 3 * wl) + row_saved(s, wl, s.W);
  const Bytes mlp = moe ? 0 : column_saved(s, s.W, s.hidden_local) + row_saved(s, s.hidden_local, s.W);
  return 2 * layernorm_saved(s) + attn + mlp;
}

// The bytes one MoE layer (nn/moe.hpp MoeMlp::Saved) keeps for one microbatch from its forward to
// its W, every buffer at once (4-byte elements): over the `rows` tokens it routes (whole rows,
// sp gathered) x, probs, lse, expert, gate, slot, source_row, dlogits; over the copies `received`
// at its experts xe, pre, h, dye, dh (and with ep > 1 the regroup's by_expert, by_source); over
// the copies `sent` of its tokens yp. Each buffer at least one element, as the layer allocates.
inline double moe_layer_bytes(double rows, double received, double sent, double width, double hidden_local,
                              double experts, double topk, int ep) {
  auto n = [](double x) { return std::max(x, 1.0); };
  const double fixed = rows * width + 2 * rows * experts + rows + 3 * rows * topk + n(rows * topk);
  const double copies = 2 * n(received * width) + 3 * n(received * hidden_local) + (ep > 1 ? 2 * n(received) : 0.0);
  return 4 * (fixed + copies + n(sent * width));
}
// The copies an MoE layer of `c` receives and sends per microbatch of `rows` tokens: with a
// capacity factor the most there can be (each of the ep sources keeps at most `capacity` per
// expert, at most one copy per token; E x capacity sent, at most rows x k), dropless the balanced
// mean (rows x k each way: not a bound).
struct MoeCopies {
  double received = 0, sent = 0;
};
inline MoeCopies moe_copies(const train::TrainerConfig& c, double rows) {
  const auto& m = c.model;
  const double E = static_cast<double>(m.experts), k = static_cast<double>(m.moe_topk), El = E / c.ep;
  if (c.options.moe_capacity <= 0.0f) return {rows * k, rows * k};
  nn::MoeConfig mc = c.options.moe(m);
  const double cap = std::min(static_cast<double>(mc.capacity(static_cast<index_t>(rows))), rows);
  return {c.ep * El * cap, std::min(rows * k, E * cap)};
}
// ln_f + the LM head / cross-entropy: targets, the V/tp logits per row, its input, lse.
inline Bytes head_saved(const Shapes& s) {
  return layernorm_saved(s) + saved(s.rows) + saved(s.rows * s.vocab_local) + saved(s.rows * s.W) + saved(s.rows) +
         (s.gathers ? saved(s.local_rows * s.W) : 0);
}
// The embedding: the row ids and the full output gradient.
inline Bytes embedding_saved(const Shapes& s) { return saved(s.rows) + saved(s.rows * s.W); }

inline const pipe::Schedule* schedule_of(const train::TrainerConfig& c, pipe::Schedule& made) {
  if (c.pp <= 1) return nullptr;
  made = c.custom_schedule ? *c.custom_schedule : pipe::make_schedule(c.schedule, c.pp, c.microbatches, c.virtual_chunks);
  return &made;
}

// make_schedule = false: the caller made the schedule already (plan::ScheduleCache).
inline void check_supported(const train::TrainerConfig& c, bool make_schedule = true) {
  train::check_config(c, std::nullopt, make_schedule);
}

// The chunks a rank at `at` holds, with their units and slots (the trainer's construction).
inline std::vector<Chunk> chunks_of(const train::TrainerConfig& c, const RankCoords& at, const pipe::Schedule* s,
                                    const pipe::Simulation* sim) {
  const auto& m = c.model;
  Shapes sh;
  sh.W = m.width;
  sh.head_dim = m.width / m.heads;
  sh.heads_local = shard::chunk(m.heads, c.tp, at.tp).size;
  sh.hidden_local = shard::chunk(4 * m.width, c.tp, at.tp).size;
  sh.vocab_local = shard::chunk(m.vocab, c.tp, at.tp).size;
  const index_t batch = train::dp_rows_of(c, at.replica / c.cp) / c.microbatches;
  sh.rows = batch * (c.seq / c.cp);
  sh.gathers = c.options.sequence_parallel && c.tp > 1;
  sh.local_rows = c.options.sequence_parallel ? sh.rows / c.tp : sh.rows;
  sh.ids = batch * c.seq;

  const index_t W = m.width, wl = sh.heads_local * sh.head_dim, F = sh.hidden_local;
  // packing order of a block: mlp.c_proj (b, w), c_fc (b, w), ln_2, attn.c_proj (b, w), c_attn (b, w), ln_1
  const Unit block{{W, F * W, F, W * F, W, W, W, wl * W, 3 * wl, W * 3 * wl, W, W}, block_saved(sh, c.options.recompute)};
  // an MoE block: the experts' c_proj (b, w), c_fc (b, w) for this rank's E / ep experts, the
  // router (W x E), then as above (nn/moe.hpp's parameter order, reversed)
  Unit moe_block;
  if (m.moe_every > 0) {
    const index_t El = m.experts / c.ep;
    moe_block = {{El * W, El * F * W, El * F, El * W * F, W * m.experts, W, W, W, wl * W, 3 * wl, W * 3 * wl, W, W},
                 block_saved(sh, c.options.recompute, true), 4};
    const MoeCopies copies = moe_copies(c, static_cast<double>(sh.rows));
    moe_block.moe_saved = moe_layer_bytes(static_cast<double>(sh.rows), copies.received, copies.sent, static_cast<double>(W),
                                          static_cast<double>(F), static_cast<double>(m.experts),
                                          static_cast<double>(m.moe_topk), c.ep);
  }

  const int chunks = s ? s->chunks : 1, stages = s ? s->virtual_stages() : 1;
  auto virtual_stage = [&](int k) { return s ? s->virtual_stage(at.pp, k) : k; };
  // local learning: every stage but the last trains a head of its own (nn::GptStage::local_head)
  const bool local = s && s->local_learning;
  std::vector<int> bounds = s ? train::pipeline_split(c, local) : std::vector<int>{};
  if (bounds.empty()) bounds = pipe::split_layers(static_cast<int>(m.layers), stages);
  bool has_embedding = false;
  for (int k = 0; k < chunks; ++k) has_embedding = has_embedding || virtual_stage(k) == 0;

  std::vector<Chunk> out(static_cast<std::size_t>(chunks));
  for (int k = 0; k < chunks; ++k) {
    const int vs = virtual_stage(k);
    const bool embedding = vs == 0, head = vs == stages - 1, local_head = local && !head;
    const bool own_lm = local_head && c.local_head == train::TrainerConfig::LocalHead::own;
    Chunk& ch = out[static_cast<std::size_t>(k)];
    if (head) ch.units.push_back({{W, W}, head_saved(sh)});  // ln_f (b, w); wte is in no unit
    if (local_head)  // its ln_f, after its own LM matrix where it has one (packing order)
      ch.units.push_back({own_lm ? std::vector<index_t>{sh.vocab_local * W, W, W} : std::vector<index_t>{W, W}, head_saved(sh)});
    for (int l = bounds[vs + 1] - 1; l >= bounds[vs]; --l) ch.units.push_back(m.is_moe_layer(l) ? moe_block : block);
    if (embedding) ch.units.push_back({{m.positions * W}, embedding_saved(sh)});  // wpe
    // wte: the embedding's, or a head's own copy when the rank holds no embedding (else it is
    // shared); a local head tied to wte counts as a head
    if (embedding || ((head || (local_head && !own_lm)) && !has_embedding)) ch.wte = sh.vocab_local * W;
    if (sim) ch.slots = std::max(1, sim->peak_activations_by_chunk.at(static_cast<std::size_t>(at.pp)).at(static_cast<std::size_t>(k)));
  }
  return out;
}

// A bucket: tensors (elements) packed at aligned offsets, split into `parts` equal parts (ZeRO's
// shards); the elements of each tensor in part `rank` (the padding holds no optimizer state).
inline std::vector<index_t> pieces(const std::vector<index_t>& tensors, index_t align, int parts, int rank) {
  index_t total = 0;
  for (index_t n : tensors) total += round_up(n, align);
  const index_t lo = total / parts * rank, hi = lo + total / parts;
  std::vector<index_t> out;
  index_t at = 0;
  for (index_t n : tensors) {
    out.push_back(std::max<index_t>(0, std::min(hi, at + n) - std::max(lo, at)));
    at += round_up(n, align);
  }
  return out;
}

}  // namespace memory_detail

namespace memory_detail {
// predict_memory with the schedule and its simulation made once (s: null with pp = 1).
inline MemoryEstimate predict(const train::TrainerConfig& c, const RankCoords& at, const pipe::Schedule* s,
                              const pipe::Simulation* sim) {
  TRELLIS_CHECK(at.pp >= 0 && at.pp < c.pp && at.tp >= 0 && at.tp < c.tp && at.replica >= 0 && at.replica < c.dp * c.cp,
                "plan::predict_memory: rank (pp ", at.pp, ", tp ", at.tp, ", replica ", at.replica, ") outside pp ", c.pp,
                " x tp ", c.tp, " x replicas ", c.dp * c.cp);
  const std::vector<Chunk> chunks = chunks_of(c, at, s, sim);

  const int replicas = c.dp * c.cp;
  const index_t align = static_cast<index_t>(
      c.zero >= 1 ? std::lcm(c.options.pack_alignment, static_cast<std::size_t>(replicas)) : c.options.pack_alignment);
  // S: the ranks a bucket is sharded over (a shard group under hybrid sharding); this rank's part.
  const int S = c.zero >= 1 && c.shard_degree > 0 && c.shard_degree < replicas ? c.shard_degree : replicas;
  const int part = at.replica % S;
  // Expert buckets: over the dp / ep x cp replicas holding the same experts, never in shard groups;
  // this rank's place among them (the trainer splits the replicas by dp coordinate % ep, ordered
  // by replica rank).
  const int S_e = replicas / c.ep;
  const int part_e = at.replica / c.cp / c.ep * c.cp + at.replica % c.cp;

  // Over the rank's buckets: packed floats (dense, expert), the largest unit, the largest unit's
  // reduced shards (ZeRO-2's received slot), wte's bucket; the optimizer's tensors (parameters,
  // or ZeRO pieces): all their elements, the largest one, the largest update of one unit (the
  // fused update).
  index_t packed = 0, packed_experts = 0, largest_unit = 0, largest_received = 0, wte = 0, state = 0, largest_tensor = 0,
          largest_update = 0;
  auto bucket = [&](const std::vector<index_t>& tensors, bool expert) {
    index_t mine = 0;
    for (index_t n : c.zero >= 1 ? pieces(tensors, align, expert ? S_e : S, expert ? part_e : part) : tensors) {
      mine += n;
      largest_tensor = std::max(largest_tensor, n);
    }
    state += mine;
    return mine;
  };
  Bytes act = 0, act_host = 0;
  double moe_act = 0;
  for (const Chunk& ch : chunks) {
    Bytes slot = 0, largest_saved = 1;
    double moe_slot = 0;
    for (const Unit& u : ch.units) {
      index_t size = 0, expert_size = 0, update = 0, run_elements = 0;
      std::vector<index_t> run;  // a bucket: a run of the unit's tensors of at most bucket_elements
      bool run_expert = false;
      for (std::size_t i = 0; i < u.tensors.size(); ++i) {
        const index_t n = u.tensors[i];
        const bool expert = i < u.experts;
        if (!run.empty() && (static_cast<std::size_t>(run_elements + n) > c.bucket_elements || expert != run_expert)) {
          update += bucket(run, run_expert);
          run.clear();
          run_elements = 0;
        }
        run.push_back(n);
        run_expert = expert;
        run_elements += n;
        size += round_up(n, align);
        if (expert) expert_size += round_up(n, align);
      }
      update += bucket(run, run_expert);
      packed += size;
      packed_experts += expert_size;
      largest_unit = std::max(largest_unit, size);
      largest_received = std::max(largest_received, (size - expert_size) / S + expert_size / S_e);
      largest_update = std::max(largest_update, update);
      slot += u.saved;
      moe_slot += u.moe_saved;
      largest_saved = std::max<Bytes>(largest_saved, nn::saved_round(u.saved));
    }
    moe_act += moe_slot * ch.slots;
    if (ch.wte > 0) {  // wte: a bucket of its own (one per rank: a head copy only without the embedding)
      wte = round_up(ch.wte, align);
      packed += wte;
      largest_update = std::max(largest_update, bucket({ch.wte}, false));
    }
    if (c.offload_activations) {  // device frames of the largest unit; host rooms for every slot
      act += largest_saved * static_cast<Bytes>(c.offload_activation_frames);
      Bytes room = 0;
      for (const Unit& u : ch.units) room += nn::saved_round(u.saved);
      act_host += nn::saved_round(room) * static_cast<Bytes>(ch.slots);
    } else {
      act += nn::saved_round(std::max<Bytes>(slot, 1)) * static_cast<Bytes>(ch.slots);
    }
  }

  MemoryEstimate e;
  const double f = sizeof(float);
  // every bucket splits evenly (the alignment): dense ones over S, expert ones over S_e
  const double shards = static_cast<double>((packed - packed_experts) / S + packed_experts / S_e);
  switch (c.zero) {
    case 0: e.parameters = f * packed; e.gradients = f * packed; break;
    case 1: e.parameters = f * packed; e.gradients = f * (packed + shards); break;
    case 2:  // the gradient slots: a unit's gradients and its buckets' reduced shards, twice
      e.parameters = f * packed;
      e.gradients = f * (shards + wte + 2.0 * (largest_unit + largest_received));
      break;
    default:  // ZeRO-3: the values too as shards, two value slots and wte's step buffer
      e.parameters = f * (shards + wte + 2.0 * largest_unit);
      e.gradients = f * (shards + wte + 2.0 * (largest_unit + largest_received));
      break;
  }
  const double moments = 2 * f * static_cast<double>(state);
  if (!c.offload_dir.empty()) {  // the disk tier: the moments in a file, streamed through bounded host
    // buffers: values and gradients, and m, v in a ring of readahead + 1 chunks when chunks are read
    // ahead during an update (train/disk_moments.hpp), else one
    e.disk_optimizer = moments;
    e.host_optimizer = (c.offload_disk_prefetch ? 2.0 * (c.offload_disk_readahead + 1) + 2 : 4.0) * f * static_cast<double>(std::min<std::size_t>(c.offload_buffer_elements, static_cast<std::size_t>(largest_tensor)));
  } else if (c.offload_optimizer) {
    // host: the moments, and one update's staged values and gradients: every tensor at once
    // (unfused); fused, a unit at a time in two alternating buffers (overlapped), so an upper bound
    const double staged = c.fused_update == train::TrainerConfig::FusedUpdate::off
                              ? static_cast<double>(state)
                              : (c.offload_update_thread ? 2.0 : 1.0) * static_cast<double>(largest_update);
    e.host_optimizer = moments + 2 * f * staged;
  } else {
    e.optimizer = moments;
  }
  e.activations = static_cast<double>(act);
  e.moe_activations = moe_act;
  e.host_activations = static_cast<double>(act_host);
  e.workspace = 0;  // backend::Host reserves no kernel scratch
  return e;
}
}  // namespace memory_detail

// The memory of the rank at `at`.
inline MemoryEstimate predict_memory(const train::TrainerConfig& c, const RankCoords& at) {
  memory_detail::check_supported(c);
  pipe::Schedule made;
  const pipe::Schedule* s = memory_detail::schedule_of(c, made);
  pipe::Simulation sim;
  if (s) sim = pipe::simulate(*s);
  return memory_detail::predict(c, at, s, s ? &sim : nullptr);
}

// The memory of any rank at pipeline position pp_rank (all dp/tp/cp ranks of one pipeline rank
// hold the same amounts up to the rank-dependent parts named at RankCoords: this is tp rank 0,
// replica 0, which holds the largest wte shard when vocab does not split evenly over tp).
inline MemoryEstimate predict_memory(const train::TrainerConfig& c, int pp_rank) {
  return predict_memory(c, RankCoords{pp_rank, 0, 0});
}

// The pipeline rank with the largest device_total (the first on ties), and its estimate.
struct PeakMemory {
  int pp_rank = 0;
  MemoryEstimate memory;
};
// schedules: where the schedule and its simulation are made once for many calls (the search).
inline PeakMemory predict_peak_memory(const train::TrainerConfig& c, ScheduleCache* schedules = nullptr) {
  const ScheduleCache::Prepared* prepared = schedules ? schedules->usable(c) : nullptr;
  memory_detail::check_supported(c, !prepared);
  pipe::Schedule made;
  pipe::Simulation sim;
  const pipe::Schedule* s = prepared ? &prepared->schedule : memory_detail::schedule_of(c, made);
  if (s && !prepared) sim = pipe::simulate(*s);  // once for every pipeline rank
  const pipe::Simulation* unit = prepared ? &prepared->unit : s ? &sim : nullptr;
  PeakMemory best;
  const int replicas = c.dp_rows.empty() ? 1 : c.dp;  // unequal dp shares: every dp rank's rows differ
  for (int r = 0; r < std::max(1, c.pp) * replicas; ++r) {
    const MemoryEstimate e = memory_detail::predict(c, RankCoords{r / replicas, 0, r % replicas * c.cp}, s, unit);
    if (r == 0 || e.device_total() > best.memory.device_total()) best = {r / replicas, e};
  }
  return best;
}

}  // namespace trellis::plan
