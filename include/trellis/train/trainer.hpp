// train::Trainer: one training step of a GPT-2 over a <pp, dp, cp, tp> mesh of any Communicator.
//
//   TrainerConfig cfg{.model = {...}, .pp = 2, .dp = 2, .tp = 2, .schedule = "zb_h1", .microbatches = 4};
//   Trainer<ThreadComm> trainer(comm, cfg);            // a collective over comm (builds the mesh)
//   StepResult r = trainer.step(batch);                  // batch: this dp rank's rows (train::Batch)
//   trainer.save(root, loader.state());                  // reshardable checkpoint
//   TrainState s = trainer.load(*latest_checkpoint(root)); loader.restore(s.data);
//   trainer.init_from_hf("gpt2/model.safetensors");      // or start from Hugging Face GPT-2 weights
//
// A step:
//  1. the rank's rows are cut into `microbatches` microbatches; the loss normaliser is the GLOBAL
//     token count (all dp ranks, all microbatches), so gradients are those of the global mean loss
//     and the data-parallel reduction is a plain sum;
//  2. pp > 1: pipe::execute runs the schedule over this rank's model chunks (GptStage::of over
//     p * v virtual stages; a rank holding the first and the last stage shares one wte between
//     them). pp = 1: one model and a plain loop (per microbatch F, then the fused backward: each
//     unit's W right after its B);
//  3. data parallel (dp > 1, no ZeRO): buckets are runs of a weight unit's parameters (a block,
//     ln_f, wpe; <= bucket_elements), each one range of the chunk's packed gradient buffer
//     (nn/parameter_buffer.hpp), reduced in place (no pack/unpack copies); when a unit's LAST W of
//     the step is done its grads are final, and its buckets start at once as all_reduce_async on
//     the dp communicator.
//     They overlap the rest of the schedule (pp = 1: the blocks before; pp: the remaining W, the
//     other virtual chunk, the drain), except the rank's last unit (wpe) and wte (final only after
//     the tied sum). overlap_dp = false starts every bucket after the schedule (the baseline);
//  4. the tied wte gradient is summed over the ranks/chunks holding a copy (pp communicator),
//     then reduced over dp;
//     zero = 1 instead: the same buckets, each split over the dp ranks; a bucket's reduce-scatter
//     starts when its chunk's gradients are final (overlapped like the dp buckets), AdamW runs on
//     this rank's shard of each bucket only (moments for those only), then an all-gather per
//     bucket, in place in the packed values, rebuilds the parameters;
//     zero = 2: as 1, but no whole gradient buffer: each weight unit's gradients live in a slot
//     around its W and are reduce-scattered every microbatch (train/grad_buckets.hpp);
//     zero = 3: as 2, and the values sharded too: AdamW updates the shards in place, and a weight
//     unit's values are all-gathered into a slot around its forward and its backward_input, the
//     next unit's gather prefetched (train/param_shards.hpp); wte is gathered once per step;
//     shard_degree: ZeRO 1-3 over groups of replicas, the groups' shards all-reduced (hybrid);
//  5. global gradient norm: squares summed over this rank's gradients, counting a tp-replicated
//     tensor on tp rank 0 only and wte on the embedding's rank only, reduced over (pp, tp) (over
//     the whole world with ZeRO, where dp ranks hold different partitions); clip factor fused
//     into AdamW; lr from warm-up + cosine at the optimizer's step count.
// The reported loss is the global mean (sum over pp and dp of the last stage's contributions).
// Mixture of Experts (model.moe_every > 0, nn/moe.hpp): experts split over ep groups of
// consecutive dp ranks; an expert tensor's buckets reduce over the ranks holding the same experts
// (dp / ep x cp), in their own buckets (and ZeRO partitions); the norm adds the expert squares
// over the world, once per such replica; each MoE layer's auxiliary losses enter the loss as a
// mean over microbatches and replicas (StepResult::moe_aux_loss reports it).
// Dropout (options.dropout): step s uses dropout_seed(seed, s), a token's mask depends on its global
// sample index: every layout drops the same elements, a resumed run draws the uninterrupted run's
// masks; evaluate() runs without dropout.
//
// Memory and backends: Trainer<C, B> runs on compute backend B (backend::Host<float> by default,
// Host<bfloat16>, backend::Cuda with NcclComm). Parameters, gradients, AdamW moments, ZeRO
// shards and stage activations live in B's memory; host code reaches them only through B's
// upload/download (tests run every layout on backend::DeviceChecked to prove it). With a device
// communicator every collective runs on B's stream, host scalars are staged through B's memory,
// and the pipe executor posts point-to-point runs as one group (TrainerConfig::p2p).
//
// Checkpoints (train/checkpoint.hpp, train_state.hpp): every parameter by its GPT-2 name and
// global shape, each box written once (dp rank 0, tp rank 0 for replicated tensors, the
// embedding's copy of wte), AdamW moments under the same boxes (ZeRO gathers its partitions
// first), step, per-rank Rng and the data position. load() reads any other layout's checkpoint.
#pragma once

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/comm/mesh.hpp"
#include "trellis/core/error.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/nn/pipeline_stage.hpp"
#include "trellis/optim/adamw.hpp"
#include "trellis/optim/clip.hpp"
#include "trellis/optim/lr_schedule.hpp"
#include "trellis/optim/zero.hpp"
#include "trellis/pipe/executor.hpp"
#include "trellis/pipe/generators.hpp"
#include "trellis/pipe/simulate.hpp"
#include "trellis/pipe/verify.hpp"
#include "trellis/shard/flat.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/checkpoint_model.hpp"
#include "trellis/train/data.hpp"
#include "trellis/train/grad_buckets.hpp"
#include "trellis/train/hf_gpt2.hpp"
#include "trellis/train/host_scalars.hpp"
#include "trellis/train/microbatch_inputs.hpp"
#include "trellis/train/moe_stats.hpp"
#include "trellis/train/optimizer_state.hpp"
#include "trellis/train/param_shards.hpp"
#include "trellis/train/rng.hpp"
#include "trellis/train/saved_activations.hpp"
#include "trellis/train/train_state.hpp"
#include "trellis/train/trainer_config.hpp"

namespace trellis::train {

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class Trainer {
 public:
  using Mesh = comm::Mesh<C, trellis::pp, trellis::dp, trellis::cp, trellis::tp>;
  using backend_type = B;
  using act_t = typename B::act_t;
  using Model = nn::GptModel<C, B>;
  using ActBuffer = typename B::template buffer<act_t>;  // stage activations and gradients, in B's memory
  // A communicator over device memory (NCCL): point-to-point runs go out as one group.
  static constexpr bool device_comm = !std::same_as<typename C::space, trellis::Host>;

  // be: the compute backend every layer runs on (host fp32 by default; backend::Host<bfloat16>
  // gives the CUDA backend's bf16 rounding points on the host). Master weights, gradients and
  // AdamW state stay fp32.
  Trainer(C& world, const TrainerConfig& cfg, B be = {})
      : cfg_(cfg),
        mesh_(make_checked_mesh(world, cfg)),
        pp_comm_(&mesh_.template comm<trellis::pp>()),
        replica_comm_(&mesh_.template comm<trellis::dp, trellis::cp>()),
        tp_comm_(&mesh_.template comm<trellis::tp>()),
        cp_comm_(&mesh_.template comm<trellis::cp>()),
        pp_replica_comm_(&mesh_.template comm<trellis::pp, trellis::dp, trellis::cp>()),
        pp_tp_comm_(&mesh_.template comm<trellis::pp, trellis::tp>()),
        rng_(cfg.seed, static_cast<std::uint64_t>(world.rank())),
        be_(std::move(be)) {
    // A device communicator's operations are ordered after the kernels that produce their data:
    // on a stream of its own, after the backend's stream by events, which waits for them in turn
    // (overlap, cfg.comm_stream), or on the backend's stream itself. Sets `world`'s streams too.
    if (cfg_.ep > 1) {  // ep groups: consecutive dp ranks; expert replicas: the same ep coordinate
      const int d = mesh_.template coord<trellis::dp>();
      ep_comm_ = std::make_unique<C>(mesh_.template comm<trellis::dp>().split(d / cfg_.ep, d));
      expert_replica_comm_ = std::make_unique<C>(replica_comm_->split(d % cfg_.ep, replica_rank()));
    }
    if (cfg_.zero >= 1 && cfg_.shard_degree > 0 && cfg_.shard_degree < replicas()) {  // hybrid sharding
      const int r = replica_comm_->rank(), s = cfg_.shard_degree;
      shard_group_comm_ = std::make_unique<C>(replica_comm_->split(r / s, r));
      across_groups_comm_ = std::make_unique<C>(replica_comm_->split(r % s, r));
    }
    std::vector<C*> comms{&mesh_.world(), pp_comm_, replica_comm_, tp_comm_, cp_comm_, pp_replica_comm_, pp_tp_comm_};
    for (C* c : {ep_comm_.get(), expert_replica_comm_.get(), shard_group_comm_.get(), across_groups_comm_.get()})
      if (c) comms.push_back(c);
    for (C* c : comms) {
      if constexpr (requires(C& x, typename B::stream_type st) { x.set_compute_stream(st); }) {
        if (cfg_.comm_stream) {
          c->set_compute_stream(be_.stream());
          continue;
        }
      }
      if constexpr (requires(C& x, typename B::stream_type st) { x.set_stream(st); }) c->set_stream(be_.stream());
    }
    const int pp_rank = mesh_.template coord<trellis::pp>();
    if (cfg_.cp > 1 && cfg_.cp_mode == nn::CpMode::hybrid) {
      hybrid_ = std::make_unique<nn::HybridComms<C>>(nn::make_hybrid_comms(*cp_comm_, cfg_.cp_ulysses));
      for (C* c : {&hybrid_->ulysses, &hybrid_->ring}) {
        if constexpr (requires(C& x, typename B::stream_type st) { x.set_stream(st); }) c->set_stream(be_.stream());
      }
    }
    int chunks = 1, stages = 1;
    if (cfg_.pp > 1) {
      schedule_ = cfg_.custom_schedule ? *cfg_.custom_schedule
                                       : pipe::make_schedule(cfg_.schedule, cfg_.pp, cfg_.microbatches, cfg_.virtual_chunks);
      chunks = schedule_->chunks;
      stages = schedule_->virtual_stages();
      if (p2p_mode() == pipe::ExecuteOptions::P2P::batch) {  // refused here, not at the first step
        try {
          pipe::verify(*schedule_, {pipe::SendMode::rendezvous});
        } catch (const Error& e) {
          TRELLIS_THROW("Trainer: schedule '", schedule_->name, "' cannot run with grouped sends and receives (",
                        device_comm ? "a device communicator such as NCCL needs them" : "TrainerConfig::p2p = batch",
                        "): ", e.what(), ". Every generated schedule can, and so can a custom one written without send/recv ",
                        "(pipe::insert_communication pairs its receives)");
        }
      }
    }
    nn::GptOptions options = cfg_.options;
    if (cfg_.zero >= 1)  // every bucket (a range of the packed buffer) splits evenly over the replicas
      options.pack_alignment = std::lcm(options.pack_alignment, static_cast<std::size_t>(replicas()));
    options.packed_gradients = cfg_.zero < 2;  // ZeRO-2: gradients live in GradBuckets' unit slots
    // The embedding stage first, so that a head stage on the same rank (vee schedules) shares its
    // wte (one parameter, one gradient) instead of holding a copy.
    auto virtual_stage = [&](int c) { return cfg_.pp > 1 ? schedule_->virtual_stage(pp_rank, c) : c; };
    models_.resize(static_cast<std::size_t>(chunks));
    std::vector<int> order(static_cast<std::size_t>(chunks));
    std::iota(order.begin(), order.end(), 0);
    std::stable_partition(order.begin(), order.end(), [&](int c) { return virtual_stage(c) == 0; });
    nn::Parameter* tied = nullptr;
    const bool local = schedule_ && schedule_->local_learning;
    const std::vector<int> split = pipeline_split(cfg_, local);  // empty: even
    for (int c : order) {
      auto st = split.empty() ? nn::GptStage::of(virtual_stage(c), stages, cfg_.model.layers)
                              : nn::GptStage::of(virtual_stage(c), split);
      if (local && !st.head) {
        st.local_head = virtual_stage(c);
        st.local_head_tied = cfg_.local_head == TrainerConfig::LocalHead::tied;
      }
      auto& m = models_[static_cast<std::size_t>(c)];
      m = std::make_unique<Model>(cfg_.model, *tp_comm_, options, st, be_, st.embedding ? nullptr : tied,
                                  context_parallel(), nn::ExpertParallel<C>{ep_comm_.get()});
      for (auto [layer, moe] : m->moe_layers()) moe_stats_.add(layer, moe, cfg_.microbatches * replicas());
      if (st.embedding) tied = &m->embedding()->wte();
    }
    std::vector<Model*> raw;
    for (auto& m : models_) raw.push_back(m.get());
    shape_ = nn::TokenShape{dp_rows_of(cfg_, mesh_.template coord<trellis::dp>()) / cfg_.microbatches, cfg_.seq / cfg_.cp};
    shape_.cp_rank = mesh_.template coord<trellis::cp>();
    shape_.cp_size = cfg_.cp;
    stage_ = std::make_unique<nn::GptPipelineStage<C, B>>(raw, shape_);
    if (cfg_.simulate_rank_speed)
      stage_->set_slowdown(1.0 / ((cfg_.rank_speed.empty() ? 1.0 : cfg_.rank_speed.at(static_cast<std::size_t>(pp_rank))) *
                                  (cfg_.dp_speed.empty() ? 1.0 : cfg_.dp_speed.at(static_cast<std::size_t>(mesh_.template coord<trellis::dp>())))));
    stage_->set_unit_hook([this](int mb, int c, int u, nn::UnitPhase ph) {
      saved_->on_unit(mb, c, u, ph);
      on_unit(mb, c, u, ph);
    });
    // Every parameter once per rank (chunks list only what they own; wte at most once).
    for (std::size_t c = 0; c < models_.size(); ++c)
      for (nn::Parameter* p : models_[c]->parameters()) {
        if (p->name == "wte.weight") {
          TRELLIS_CHECK(!primary_wte_, "Trainer: two wte copies on one rank");
          primary_wte_ = p;
        }
        params_.push_back(p);
        chunk_of_.push_back(static_cast<int>(c));
      }
    holds_embedding_ = false;
    for (auto& m : models_) holds_embedding_ = holds_embedding_ || m->stage().embedding;
    // The norm (summed over pp and tp) counts each element once: a parameter on tp coordinate 0
    // when its value (and, after the reductions, its gradient) is replicated over tp
    // (nn/parameter.hpp), and wte on the embedding's rank.
    for (nn::Parameter* p : params_) {
      const bool dup_wte = p->name == "wte.weight" && !holds_embedding_;
      norm_weight_.push_back(first_copy(*p, /*over_dp=*/false) && !dup_wte ? 1.0f : 0.0f);
      decay_.push_back(p->global_shape.size() >= 2 ? 1.0f : 0.0f);
    }
    if (replicas() > 1 || cfg_.zero >= 1)
      grads_.emplace(typename GradBuckets<C, B>::Options{cfg_.zero, cfg_.bucket_elements}, raw, params_,
                     shard_group_comm_ ? *shard_group_comm_ : *replica_comm_, expert_replicas(), be_,
                     across_groups_comm_.get());
    if (cfg_.zero == 3)  // from here on the values are shards; a unit's are whole only while it computes
      values_.emplace(*grads_, typename ParamShards<C, B>::Options{2, cfg_.prefetch_values}, be_);
    if (cfg_.zero >= 1) {
      std::vector<index_t> sizes;
      for (const auto& pc : grads_->pieces()) {
        sizes.push_back(pc.size);
        zdecay_.push_back(decay_[pc.param]);
      }
      state_ = OptimizerState<B>(std::span<const index_t>(sizes), offload(), be_);
    } else {
      std::vector<index_t> sizes;
      for (nn::Parameter* p : params_) sizes.push_back(p->numel());
      state_ = OptimizerState<B>(std::span<const index_t>(sizes), offload(), be_);
    }
    // What the global norm sums (a tp-replicated tensor and a duplicate wte once; under ZeRO the
    // reduced shards): fixed ranges of the packed buffers, so the spans are made once.
    if (cfg_.zero >= 1) {
      for (const auto& pc : grads_->pieces())
        if (norm_weight_[pc.param] != 0.0f && grads_->first_group(pc)) norm_spans_.push_back(grads_->piece_grad(pc));
    } else {
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (norm_weight_[i] != 0.0f)
          (params_[i]->expert() ? expert_norm_spans_ : norm_spans_).emplace_back(params_[i]->grad.elements());
    }
    saved_.emplace(models_, cfg_.pp > 1 ? &*schedule_ : nullptr, pp_rank, shape_,
                   SavedActivations<C, B>::options(cfg_), be_);
    // Scratch reserved once, before the first step (CUB style; backend::Cuda refuses growth later).
    for (auto& m : models_) m->reserve_workspace(shape_);
    be_.reserve_workspace(std::max(be_.sum_of_squares_workspace(norm_spans_), be_.sum_of_squares_workspace(expert_norm_spans_)));
  }

  const TrainerConfig& config() const { return cfg_; }
  const B& backend() const { return be_; }
  Mesh& mesh() { return mesh_; }
  std::int64_t step_count() const { return state_.step(); }
  const nn::TokenShape& microbatch_shape() const { return shape_; }
  // This rank's parameters (each once; GPT-2 names, shard boxes via pieces()). Under ZeRO-3 their
  // values are bound only inside with_parameters (and while their unit computes).
  const std::vector<nn::Parameter*>& parameters() const { return params_; }
  // f() with every parameter's value whole and bound on this rank. ZeRO-3: gathered for the call
  // and dropped after it (a collective over the world then: every rank calls it); other stages:
  // just f(). Changes f makes to the values are not kept.
  template <class F>
  void with_parameters(F&& f) {
    if (!values_) {
      f();
      return;
    }
    values_->summon();
    struct Release {
      ParamShards<C, B>* v;
      ~Release() { v->release_full(false); }
    } release{&*values_};
    f();
  }
  // ZeRO-3: the unit gathers started and those prefetched (started while another unit computed) so far.
  std::pair<int, int> value_gathers() const { return values_ ? std::pair{values_->gathers(), values_->prefetched()} : std::pair{0, 0}; }
  std::vector<std::unique_ptr<Model>>& chunks() { return models_; }
  Rng& rng() { return rng_; }
  OptimizerState<B>& optimizer_state() { return state_; }
  // Where the chunks keep saved activations (nn/activation_arena.hpp): capacity and measured peaks.
  const nn::ActivationArena<B>& activation_arena() const { return saved_->arena(); }
  // The most bytes of saved activations any rank's arena held at once so far (measured; host:
  // offloaded to host memory): a collective over the world (max).
  double peak_activation_bytes_over_ranks(bool host = false) {
    const auto& a = activation_arena();
    return reduce_scalar(mesh_.world(), static_cast<double>(host ? a.peak_host_held_bytes() : a.peak_held_bytes()),
                         comm::ReduceOp::max);
  }
  // Bytes of gradient storage this rank holds: the chunks' packed gradient buffers (none under
  // ZeRO-2) and GradBuckets' shards, slots and wte gradient.
  std::size_t gradient_bytes() const {
    std::size_t n = grads_ ? grads_->gradient_bytes() : 0;
    for (const auto& m : models_) n += m->parameter_buffer().grads().size() * sizeof(float);
    return n;
  }
  // This rank's memory by kind (train/trainer_config.hpp MemoryUse).
  MemoryUse memory() const {
    MemoryUse u;
    for (const auto& m : models_) u.parameters += m->parameter_buffer().values().size() * sizeof(float);
    if (values_) u.parameters += values_->bytes();
    u.gradients = gradient_bytes();
    u.optimizer = state_.device_bytes();
    u.host_optimizer = state_.host_bytes();
    u.disk_optimizer = static_cast<std::size_t>(state_.disk_bytes());
    u.activations = activation_arena().capacity_bytes();
    u.activations_peak = activation_arena().peak_held_bytes();
    u.host_activations = activation_arena().host_capacity_bytes();
    u.host_activations_peak = activation_arena().peak_host_held_bytes();
    u.workspace = be_.workspace_reserved();
    return u;
  }
  // Seconds of the last step spent waiting for dp reductions after the schedule (not hidden).
  double exposed_reduction_seconds() const { return exposed_reduce_s_; }

  // Parameters counted once over the whole model (all experts; for MFU): a collective over the world.
  double global_parameter_count() {
    double dense = 0, expert = 0;
    for (std::size_t i = 0; i < params_.size(); ++i)
      (params_[i]->expert() ? expert : dense) += norm_weight_[i] * static_cast<double>(params_[i]->numel());
    return reduce_scalar(*pp_tp_comm_, dense) + expert_sum(expert);
  }
  // Tokens routed to each expert of every MoE layer in the steps since the last call (all
  // ranks' tokens; before capacity drops): (layer, counts of its E experts), first layer first.
  // A collective over the world.
  std::vector<std::pair<int, std::vector<double>>> take_expert_load() {
    return moe_stats_.take_load(be_, mesh_.world(), cfg_.model, mesh_.template coord<trellis::tp>() == 0);
  }

  // One optimizer step on this dp rank's rows (batch.rows = dp_rows_of(cfg, dp rank), seq = cfg.seq).
  StepResult step(const Batch& batch) {
    check_batch(batch);
    for (auto& m : models_) m->zero_grad();
    if (grads_) grads_->begin_step();
    moe_stats_.begin_step();
    const double token_count = global_token_count(batch);
    set_microbatches(batch, token_count, true);
    unit_done_.assign(models_.size(), {});
    for (std::size_t c = 0; c < models_.size(); ++c)
      unit_done_[c].assign(static_cast<std::size_t>(models_[c]->weight_units()), 0);
    overlapped_ = 0;
    if (values_) values_->begin_step(value_actions(cfg_.pp > 1 ? &*schedule_ : nullptr, pp_comm_->rank(), cfg_.microbatches, models_));
    if (cfg_.pp > 1) {
      pipe::ExecuteOptions run;
      run.p2p = p2p_mode();
      pipe::execute(*pp_comm_, *schedule_, *stage_, run);
    } else {
      run_local_loop();
    }
    for (std::size_t c = 0; c < models_.size(); ++c)  // every unit's reductions ran (on_weight_unit)
      for (int done : unit_done_[c])
        TRELLIS_CHECK(done == cfg_.microbatches, "Trainer (rank ", mesh_.rank(), "): a weight unit of chunk ", c,
                      " saw ", done, " W of ", cfg_.microbatches, " microbatches");
    // the tied wte: sum of the copies' gradients over the chunks and pipeline ranks holding one
    stage_->all_reduce_tied_wte_grad(*pp_comm_);
    StepResult r;
    r.loss = reduce_scalar(*pp_replica_comm_, stage_->loss());
    if (schedule_ && schedule_->local_learning) r.local_losses = local_losses();
    if (cfg_.model.moe_every > 0) r.moe_aux_loss = moe_stats_.step_loss(be_, *pp_replica_comm_);
    finish_dp_reduction();
    if (fused())
      finish_fused_update(r);
    else if (cfg_.zero >= 1)
      sharded_update(r);
    else
      plain_update(r);
    if (values_) values_->release_step();
    r.step = state_.step();
    r.buckets = grads_ ? static_cast<int>(grads_->size()) : 0;
    r.buckets_overlapped = overlapped_;
    return r;
  }

  // Global mean loss of a batch without training (forward only, activations released, no dropout).
  double evaluate(const Batch& batch) {
    check_batch(batch);
    const double token_count = global_token_count(batch);
    set_microbatches(batch, token_count, false);
    double loss = 0;
    const int pp_rank = mesh_.template coord<trellis::pp>();
    const auto forward_only = saved_->forward_only();  // nothing kept for a backward: nothing offloaded
    if (values_) values_->hold_wte();
    for (int mb = 0; mb < cfg_.microbatches; ++mb) {
      ActBuffer act;
      const int stages = cfg_.pp > 1 ? schedule_->virtual_stages() : static_cast<int>(models_.size());
      auto holder = [&](int vs) -> std::pair<int, int> {  // (pipeline rank, chunk)
        if (cfg_.pp == 1) return {pp_rank, vs};
        auto slot = schedule_->locate(vs);
        return {slot.rank, slot.chunk};
      };
      for (int vs = 0; vs < stages; ++vs) {
        auto [rank, chunk] = holder(vs);
        if (rank != pp_rank) continue;
        if (vs > 0 && holder(vs - 1).first != pp_rank) {
          act = stage_->allocate(stage_->input_size(chunk));
          pp_comm_->recv(act.data(), act.size(), holder(vs - 1).first, 0);
        }
        ActBuffer next = stage_->allocate(stage_->output_size(chunk));
        const double before = stage_->loss();
        stage_->forward(mb, chunk, std::span<const act_t>(act.data(), vs == 0 ? 0 : act.size()),
                        std::span<act_t>(next.data(), next.size()));
        loss += stage_->loss() - before;
        models_[static_cast<std::size_t>(chunk)]->release(mb);
        act = std::move(next);
        if (vs + 1 < stages && holder(vs + 1).first != pp_rank)
          pp_comm_->send(act.data(), act.size(), holder(vs + 1).first, 0);
      }
    }
    if (values_) values_->release_step();
    return reduce_scalar(*pp_replica_comm_, loss);
  }

  // ---- checkpoints -----------------------------------------------------------------------------
  // Collective over the world: writes <root>/step-N (N = optimizer steps done) and commits it.
  void save(const std::filesystem::path& root, const DataState& data) {
    C& world = mesh_.world();
    CheckpointWriter w(root, state_.step(), world.rank(), world.size());
    std::vector<std::vector<float>> keep;  // contiguous copies, alive until finish()
    std::vector<std::vector<float>> m_full, v_full;
    full_moments(m_full, v_full);
    std::vector<std::vector<float>> values;  // host copies of the parameters this rank writes
    with_parameters([&] {
      for (nn::Parameter* p : params_)
        values.push_back(backend::download_vector(be_, p->value.data(), p->value.size()));
    });
    for (std::size_t i = 0; i < params_.size(); ++i) {
      nn::Parameter* p = params_[i];
      if (norm_weight_[i] == 0.0f || !first_copy(*p, /*over_dp=*/true)) continue;  // each box once
      for (const auto& pc : p->pieces()) {
        const Box box{pc.offsets, pc.shape};
        keep.push_back(gather_piece(pc, values[i]));
        w.add(p->name, DType::f32, p->global_shape, box, keep.back().data());
        keep.push_back(gather_piece(pc, m_full[i]));
        const float* m = keep.back().data();
        keep.push_back(gather_piece(pc, v_full[i]));
        const float* v = keep.back().data();
        w.add(optim::adamw_m_name(p->name), DType::f32, p->global_shape, box, m, CheckpointFile::optimizer);
        w.add(optim::adamw_v_name(p->name), DType::f32, p->global_shape, box, v, CheckpointFile::optimizer);
      }
    }
    TrainState s;
    s.step = state_.step();
    s.rng = rng_;
    s.data = data;
    save_train_state(w, s);
    w.set_metadata(fused_scale_key, std::to_string(std::bit_cast<std::uint32_t>(fused_scale_)));  // exact
    save_model_config(w, cfg_.model);
    with_host_world([&](auto& agree) { save_collectively(w, agree); });
  }

  // Loads a checkpoint written by any layout (parameters, moments, step, this rank's Rng when the
  // saving run had this rank); returns the saved train state (restore the loader with .data).
  TrainState load(const std::filesystem::path& step_dir) {
    Checkpoint ck = with_host_world([&](auto& w) { return open_checkpoint_collectively(step_dir, w); });  // same index on every rank, or all throw
    const bool local = schedule_ && schedule_->local_learning;
    check_model_config(ck, cfg_.model,
                       local ? local_head_names(schedule_->virtual_stages(), cfg_.local_head == TrainerConfig::LocalHead::tied)
                             : std::vector<std::string>{});
    TrainState s = load_train_state(ck, mesh_.world().rank());
    if (mesh_.world().rank() >= ck.world_size())
      s.rng = Rng(cfg_.seed, static_cast<std::uint64_t>(mesh_.world().rank()));
    with_host_world([&](auto& w) { agree_on_train_state(ck, s, w); });  // collective: a disagreement throws on every rank
    // Read into host copies first: a corrupt shard is found only by the ranks that read it, so one
    // status exchange makes every rank throw the same error, before any state of this trainer changed.
    std::vector<std::vector<float>> values(params_.size()), m_full(params_.size()), v_full(params_.size());
    with_host_world([&](auto& w) {
      read_tensors_collectively(ck, w, [&] {
        for (std::size_t i = 0; i < params_.size(); ++i) {
          nn::Parameter* p = params_[i];
          for (auto* full : {&values[i], &m_full[i], &v_full[i]}) full->assign(p->value.size(), 0.0f);
          const backend::Host<float> host{};
          read_parameter_shaped(ck, p->name, *p, std::span<float>(values[i]), host);
          read_parameter_shaped(ck, optim::adamw_m_name(p->name), *p, std::span<float>(m_full[i]), host);
          read_parameter_shaped(ck, optim::adamw_v_name(p->name), *p, std::span<float>(v_full[i]), host);
        }
      });
    });
    set_values(values);
    if (cfg_.zero >= 1) {
      for (std::size_t k = 0; k < grads_->pieces().size(); ++k) {
        const auto& pc = grads_->pieces()[k];
        state_.write_m(k, m_full[pc.param].data() + pc.tensor_begin);
        state_.write_v(k, v_full[pc.param].data() + pc.tensor_begin);
      }
    } else {
      for (std::size_t i = 0; i < params_.size(); ++i) {
        state_.write_m(i, m_full[i].data());
        state_.write_v(i, v_full[i].data());
      }
    }
    state_.set_step(s.step);
    rng_ = s.rng;
    fused_scale_ = 1.0f;  // checkpoints from before the fused update: the first step unscaled
    if (auto it = ck.metadata().find(fused_scale_key); it != ck.metadata().end())
      fused_scale_ = std::bit_cast<float>(io::parse_integer<std::uint32_t>(
          it->second, 0, std::numeric_limits<std::uint32_t>::max(), "checkpoint metadata \"" + std::string(fused_scale_key) + "\""));
    return s;
  }

  // Starts from GPT-2 weights in a Hugging Face safetensors file (train/hf_gpt2.hpp; checked
  // against the model config, errors name the tensor): every rank reads its own boxes. Optimizer
  // state starts fresh (zero moments, step 0); the Rng is this rank's, as constructed.
  void init_from_hf(const std::filesystem::path& file) {
    TRELLIS_CHECK(!(schedule_ && schedule_->local_learning), "Trainer: initialising from ", file.string(),
                  " under local learning is not supported (its local heads are not GPT-2 tensors)");
    HfGpt2File hf(file, cfg_.model);
    std::vector<std::vector<float>> values;
    for (nn::Parameter* p : params_) {
      std::vector<float>& host = values.emplace_back(p->value.size(), 0.0f);
      for (const auto& pc : p->pieces()) {
        std::vector<float> piece(static_cast<std::size_t>(io::shape_elements(pc.shape)));
        hf.read(p->name, Box{pc.offsets, pc.shape}, piece.data());
        scatter_piece(pc, piece, host);
      }
    }
    set_values(values);
    state_.reset();
  }

 private:
  // Where the AdamW moments live (TrainerConfig's offload fields).
  Offload offload() const {
    return {cfg_.offload_optimizer, cfg_.offload_dir, cfg_.offload_dir_cap_bytes, cfg_.offload_buffer_elements,
            cfg_.offload_update_thread, cfg_.offload_disk_prefetch, cfg_.offload_disk_readahead};
  }
  // The fused update's clip factor for the next step, as float bits (checkpoint metadata).
  static constexpr const char* fused_scale_key = "train.fused_clip_scale";

  static Mesh make_checked_mesh(C& world, const TrainerConfig& cfg) {
    check_config(cfg, world.size());
    return comm::make_mesh<trellis::pp, trellis::dp, trellis::cp, trellis::tp>(world, {cfg.pp, cfg.dp, cfg.cp, cfg.tp});
  }
  // The layers' context parallelism: the cp communicator and mode (hybrid: its two groups).
  nn::ContextParallel<C> context_parallel() {
    if (hybrid_) return nn::hybrid_context(*cp_comm_, *hybrid_);
    return {cp_comm_, cfg_.cp_mode};
  }
  // The ranks holding the same parameters: dp x cp (context-parallel ranks see other positions of
  // the same samples), and this rank's index among them.
  int replicas() const { return cfg_.dp * cfg_.cp; }
  // The ranks holding the same experts (dp / ep x cp; all replicas without ep).
  C& expert_replicas() const { return expert_replica_comm_ ? *expert_replica_comm_ : *replica_comm_; }
  // A sum over every expert tensor once (MoE models; a collective over the world then): each
  // rank's part, summed over the world, counts every expert once per replica holding it.
  double expert_sum(double local) {
    if (cfg_.model.moe_every == 0) return 0.0;
    return reduce_scalar(mesh_.world(), local) / (replicas() / cfg_.ep);
  }
  int replica_rank() const { return mesh_.template coord<trellis::dp>() * cfg_.cp + mesh_.template coord<trellis::cp>(); }

  void check_batch(const Batch& b) const {
    const index_t rows = dp_rows_of(cfg_, mesh_.template coord<trellis::dp>());
    TRELLIS_CHECK(b.seq_len == cfg_.seq && b.rows == rows, "Trainer (rank ", mesh_.rank(), "): batch of ", b.rows,
                  " x ", b.seq_len, " rows, expected ", rows, " x ", cfg_.seq,
                  cfg_.dp_rows.empty() ? " (global batch / dp x sequence length)" : " (dp_rows x sequence length)");
    TRELLIS_CHECK(b.segments.empty() || b.segments.size() == b.inputs.size(), "Trainer (rank ", mesh_.rank(),
                  "): ", b.segments.size(), " document ids for ", b.inputs.size(), " tokens");
  }
  // The loss normaliser: targets over every rank's tokens (each cp rank counts its positions).
  double global_token_count(const Batch& b) {
    double local = 0;
    if (cfg_.cp > 1) {
      for (auto t : MicrobatchInputs::local_positions(b.targets, cfg_.seq, shape_)) local += t >= 0;
      return reduce_scalar(*replica_comm_, local);
    }
    for (auto t : b.targets) local += t >= 0;
    return reduce_scalar(*replica_comm_, local);
  }
  // train: dropout on with this step's seed (evaluation: off). Dp rank d holds the global samples
  // from dp_first_row (as DataLoader), so masks follow the sample, not the rank.
  void set_microbatches(const Batch& b, double token_count, bool train) {
    auto ids = inputs_.cut(b, cfg_, shape_);
    nn::DropoutContext dropout;
    dropout.seed = dropout_seed(cfg_.seed, state_.step());
    dropout.first_sample = dp_first_row(cfg_, mesh_.template coord<trellis::dp>());
    dropout.train = train;
    stage_->set_batch(std::move(ids.tokens), std::move(ids.targets), token_count, dropout, std::move(ids.segments));
  }

  // pp = 1: per microbatch F through the chunks, then the fused backward (each unit's W right
  // after its B) through them in reverse, so the last microbatch's buckets start during its
  // backward.
  void run_local_loop() {
    const int chunks = static_cast<int>(models_.size());
    auto view = [](ActBuffer& b) { return std::span<act_t>(b.data(), b.size()); };
    for (int mb = 0; mb < cfg_.microbatches; ++mb) {
      ActBuffer in;
      for (int c = 0; c < chunks; ++c) {
        ActBuffer out = stage_->allocate(stage_->output_size(c));
        stage_->forward(mb, c, std::span<const act_t>(view(in)), view(out));
        in = std::move(out);
      }
      ActBuffer grad_out;
      for (int c = chunks - 1; c >= 0; --c) {
        ActBuffer grad_in = stage_->allocate(c > 0 ? stage_->input_size(c) : 0);
        stage_->backward(mb, c, std::span<const act_t>(view(grad_out)), view(grad_in));
        grad_out = std::move(grad_in);
      }
    }
  }

  // Whether this rank holds the first copy of parameter p: coordinate 0 of tp, and of dp and cp
  // when `over_dp`, where p's value is replicated over that axis. The norm counts first copies
  // over tp (it is summed over pp and tp; dp and cp replicas are equal); a checkpoint writes them
  // over all three (an expert tensor: coordinate 0 among the ranks holding the same experts).
  bool first_copy(const nn::Parameter& p, bool over_dp) const {
    const int replica = p.expert() ? expert_replicas().rank() : replica_rank();
    return (!over_dp || !p.sharding.value[nn::dp_axis].is_replicate() || replica == 0) &&
           (!p.sharding.value[nn::tp_axis].is_replicate() || mesh_.template coord<trellis::tp>() == 0);
  }
  // Every parameter's value (host copies, each parameter's local shape) set on this rank
  // (ZeRO-3: through the whole values, then kept in the shards).
  void set_values(const std::vector<std::vector<float>>& values) {
    if (values_) values_->summon();
    for (std::size_t i = 0; i < params_.size(); ++i) be_.upload(params_[i]->value.data(), values[i].data(), values[i].size());
    if (values_) values_->release_full(/*write_back=*/true);
  }

  // The models' unit hook (nn::UnitPhase). ZeRO-3: values gathered around a unit's forward and
  // backward_input, the next unit's prefetched (forward: units count down; backward: up to the last
  // that reads values, not the embedding), at an action's last unit the next action's first
  // (ParamShards::follow). A W: its begin binds ZeRO-2/3's gradient slot, its end: on_weight_end.
  void on_unit(int mb, int c, int u, nn::UnitPhase phase) {
    using P = nn::UnitPhase;
    const Model& m = *models_[static_cast<std::size_t>(c)];
    const bool embedding = m.stage().embedding && u == m.weight_units() - 1;
    const bool backward = phase == P::backward_begin || phase == P::backward_end;
    const bool last = backward ? u + 1 == m.weight_units() - (m.stage().embedding ? 1 : 0) : u == 0;  // of the action
    switch (phase) {
      case P::forward_begin:
      case P::backward_begin:
        if (!values_ || (embedding && backward)) return;  // its backward reads no values
        values_->need(c, u);
        if (!last)
          values_->prefetch(c, backward ? u + 1 : u - 1);
        else
          values_->prefetch_next(backward, mb, c);
        return;
      case P::forward_end:
      case P::backward_end:
        if (values_ && !(embedding && backward)) values_->done(c, u, last ? std::optional{std::pair{backward, mb}} : std::nullopt);
        return;
      case P::weight_begin:
        if (grads_) grads_->begin_unit(c, u);
        return;
      case P::weight_end:
        on_weight_end(c, u);
        return;
    }
  }
  // Unit u of chunk c finished one microbatch's W. Its gradients are final on this rank after its
  // last microbatch (ZeRO-2/3: after each, the slot's part): those Partial over tp are summed over
  // tp (nn/parameter.hpp), then its buckets start.
  void on_weight_end(int c, int u) {
    auto& done = unit_done_[static_cast<std::size_t>(c)][static_cast<std::size_t>(u)];
    const bool last = ++done == cfg_.microbatches;
    if (!last && cfg_.zero < 2) return;
    nn::reduce_tp_partial_grads(*tp_comm_, models_[static_cast<std::size_t>(c)]->weight_unit_parameters(u));
    if (grads_) {
      const int w_total = stage_->weights_done() + 1;  // + the W running now
      const bool compute_left = u + 1 < models_[static_cast<std::size_t>(c)]->weight_units() ||
                                w_total < cfg_.microbatches * static_cast<int>(models_.size());
      const int started = grads_->end_unit(c, u, last, cfg_.overlap_dp);
      overlapped_ += compute_left ? started : 0;
    }
    if (last && fused()) {  // the previous final unit's update, now that this one's reduction runs
      fused_pending_.emplace_back(c, u);
      while (fused_pending_.size() > (grads_ ? 1u : 0u)) {
        update_unit(fused_pending_.front().first, fused_pending_.front().second);
        fused_pending_.pop_front();
      }
    }
  }
  void finish_dp_reduction() {
    if (!grads_) return;
    const auto t0 = std::chrono::steady_clock::now();
    grads_->finish();
    exposed_reduce_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  pipe::ExecuteOptions::P2P p2p_mode() const {
    return cfg_.p2p.value_or(device_comm ? pipe::ExecuteOptions::P2P::batch : pipe::ExecuteOptions::P2P::isend);
  }
  float lr_now() const { return static_cast<float>(cfg_.lr(state_.step())); }

  // f(world) for the checkpoint agreement (host flags, strings; train/host_scalars.hpp).
  template <class F>
  decltype(auto) with_host_world(F&& f) {
    return with_host_comm(be_, mesh_.world(), std::forward<F>(f));
  }
  double reduce_scalar(C& c, double x, comm::ReduceOp op = comm::ReduceOp::sum) const {
    return train::reduce_scalar(be_, c, x, op);
  }

  // The global squared gradient norm without ZeRO (tp-replicated tensors and wte copies once; the
  // experts over the world, once per replica).
  double dense_squares() {
    return reduce_scalar(*pp_tp_comm_, be_.sum_of_squares(norm_spans_)) +
           expert_sum(cfg_.model.moe_every > 0 ? be_.sum_of_squares(expert_norm_spans_) : 0.0);
  }
  void plain_update(StepResult& r) {
    finish_update(r, dense_squares(), [&](float lr, float scale) {
      std::vector<std::span<float>> values;
      std::vector<std::span<const float>> grads;
      for (nn::Parameter* p : params_) {
        values.emplace_back(p->value.elements());
        grads.emplace_back(p->grad.elements());
      }
      update_all(lr, values, grads, decay_, scale);
    });
  }

  // ---- the optimizer step fused into the backward -------------------------------------------------
  bool fused() const { return cfg_.fused_update != TrainerConfig::FusedUpdate::off; }
  // AdamW for unit u of chunk c alone (c = -1: wte), once its reduction finished, at this step's
  // lr and the fused clip factor (1, or the previous step's).
  void update_unit(int c, int u) {
    if (grads_) grads_->wait_unit(c, u);
    std::vector<std::size_t> which;
    std::vector<std::span<float>> values;
    std::vector<std::span<const float>> grads;
    std::vector<float> decay;
    if (cfg_.zero >= 1) {
      which = grads_->pieces_of(c, u);
      for (std::size_t q : which) {
        values.push_back(piece_value(grads_->pieces()[q]));
        grads.push_back(grads_->piece_grad(grads_->pieces()[q]));
        decay.push_back(zdecay_[q]);
      }
    } else {
      if (c < 0)
        which.push_back(param_index(primary_wte_));
      else
        for (nn::Parameter* p : models_[static_cast<std::size_t>(c)]->weight_unit_parameters(u)) which.push_back(param_index(p));
      for (std::size_t i : which) {
        values.emplace_back(params_[i]->value.elements());
        grads.emplace_back(params_[i]->grad.elements());
        decay.push_back(decay_[i]);
      }
    }
    state_.update(cfg_.adamw, lr_now(), which, values, grads, decay, fused_scale_);
  }
  // After the schedule: the units still pending and wte updated, the step counted, the norm
  // reported (from the same gradients: the update does not change them) and the next step's factor.
  void finish_fused_update(StepResult& r) {
    for (auto [c, u] : fused_pending_) update_unit(c, u);
    fused_pending_.clear();
    if (primary_wte_) update_unit(-1, 0);
    r.grad_norm = std::sqrt(cfg_.zero >= 1 ? reduce_scalar(mesh_.world(), be_.sum_of_squares(norm_spans_))
                                           : dense_squares());
    r.clip_scale = fused_scale_;
    r.lr = lr_now();
    state_.advance_step();
    if (cfg_.zero == 1 || cfg_.zero == 2) grads_->gather_values();
    if (cfg_.fused_update == TrainerConfig::FusedUpdate::previous_clip)
      fused_scale_ = kernels::host::clip_scale(r.grad_norm, cfg_.clip);
  }
  std::size_t param_index(const nn::Parameter* p) const {
    const auto it = std::find(params_.begin(), params_.end(), p);
    TRELLIS_CHECK(it != params_.end(), "Trainer: parameter ", p->name, " is not one of this rank's");
    return static_cast<std::size_t>(it - params_.begin());
  }

  // One optimizer step over every tensor of the state (spans in B's memory), counted.
  void update_all(float lr, const std::vector<std::span<float>>& values, const std::vector<std::span<const float>>& grads,
                  const std::vector<float>& decay, float scale) {
    std::vector<std::size_t> all(values.size());
    std::iota(all.begin(), all.end(), std::size_t{0});
    state_.update(cfg_.adamw, lr, all, values, grads, decay, scale);
    state_.advance_step();
  }

  template <class F>
  void finish_update(StepResult& r, double sum_squares, F&& update) {
    r.grad_norm = std::sqrt(sum_squares);
    r.clip_scale = cfg_.clip > 0 ? kernels::host::clip_scale(r.grad_norm, cfg_.clip) : 1.0f;
    const float lr = lr_now();
    r.lr = lr;
    update(lr, r.clip_scale);
  }

  // Each virtual stage's local loss but the last's: a sum over the pipeline and dp x cp ranks.
  std::vector<double> local_losses() {
    std::vector<double> out;
    for (int vs = 0; vs + 1 < schedule_->virtual_stages(); ++vs) {
      const auto at = schedule_->locate(vs);
      const bool mine = at.rank == mesh_.template coord<trellis::pp>();
      out.push_back(reduce_scalar(*pp_replica_comm_, mine ? stage_->local_loss(at.chunk) : 0.0));
    }
    return out;
  }
  // ---- ZeRO-1/2/3 --------------------------------------------------------------------------------
  // AdamW on this rank's shard of each bucket only (moments for those only), then the buckets'
  // all-gather rebuilds the parameters (train/grad_buckets.hpp; ZeRO-3 keeps the shards).
  void sharded_update(StepResult& r) {
    finish_update(r, reduce_scalar(mesh_.world(), be_.sum_of_squares(norm_spans_)), [&](float lr, float scale) {
      std::vector<std::span<float>> values;
      std::vector<std::span<const float>> grads;
      for (const auto& pc : grads_->pieces()) {
        values.push_back(piece_value(pc));
        grads.push_back(grads_->piece_grad(pc));
      }
      update_all(lr, values, grads, zdecay_, scale);
    });
    if (!values_) grads_->gather_values();
  }
  // ZeRO: the values of the optimizer's piece (ZeRO-3: in the value shards).
  std::span<float> piece_value(const typename GradBuckets<C, B>::Piece& pc) {
    return values_ ? values_->piece_value(pc) : grads_->piece_value(pc);
  }

  // AdamW moments shaped like each parameter's local shard (ZeRO: gathered over dp).
  void full_moments(std::vector<std::vector<float>>& m, std::vector<std::vector<float>>& v) {
    m.assign(params_.size(), {});
    v.assign(params_.size(), {});
    for (std::size_t i = 0; i < params_.size(); ++i) {
      m[i].assign(params_[i]->value.size(), 0.0f);
      v[i].assign(params_[i]->value.size(), 0.0f);
    }
    if (cfg_.zero >= 1) {  // per bucket, every rank's moment shard gathered, each parameter cut out
      grads_->gather_moments(state_, m, v);
      return;
    }
    for (std::size_t i = 0; i < params_.size(); ++i) {
      state_.read_m(i, m[i].data());
      state_.read_v(i, v[i].data());
    }
  }

  TrainerConfig cfg_;
  Mesh mesh_;
  C* pp_comm_;
  C* replica_comm_;  // dp x cp: the ranks holding the same parameters (gradients summed, ZeRO shards)
  C* tp_comm_;
  C* cp_comm_;
  C* pp_replica_comm_;  // pp x dp x cp: the loss and token counts
  std::unique_ptr<nn::HybridComms<C>> hybrid_;  // cp_mode hybrid: the Ulysses groups and the ring across them
  C* pp_tp_comm_;
  std::unique_ptr<C> ep_comm_, expert_replica_comm_;  // ep > 1: an MoE layer's group; ranks with the same experts
  // Hybrid sharding: this rank's group of consecutive replicas; across the groups, the same group rank.
  std::unique_ptr<C> shard_group_comm_, across_groups_comm_;
  Rng rng_;
  B be_;  // shared with the models (a backend's copies share its stream, handles and memory registry)
  std::optional<pipe::Schedule> schedule_;
  std::optional<SavedActivations<C, B>> saved_;  // the chunks' saved activations (arena)
  std::vector<std::unique_ptr<Model>> models_;
  nn::TokenShape shape_{};
  MicrobatchInputs inputs_;  // the step's batch as each microbatch's ids (cp positions, balanced rows)
  std::unique_ptr<nn::GptPipelineStage<C, B>> stage_;
  std::vector<nn::Parameter*> params_;
  std::vector<int> chunk_of_;
  nn::Parameter* primary_wte_ = nullptr;
  bool holds_embedding_ = false;
  std::vector<float> norm_weight_, decay_;
  std::vector<std::span<const float>> norm_spans_;  // the gradients the global norm sums (experts apart, no ZeRO)
  std::vector<std::span<const float>> expert_norm_spans_;
  MoeStats<C, B> moe_stats_;  // this rank's MoE layers: auxiliary losses, expert load
  OptimizerState<B> state_;  // AdamW moments, in B's memory or offloaded to the host
  std::optional<GradBuckets<C, B>> grads_;  // dp buckets, ZeRO shards (none with one replica and no ZeRO)
  std::optional<ParamShards<C, B>> values_;  // ZeRO-3: the value shards and unit slots (uses grads_)
  std::vector<std::vector<int>> unit_done_;  // microbatches whose W finished each (chunk, unit)
  int overlapped_ = 0;
  double exposed_reduce_s_ = 0;
  std::vector<float> zdecay_;  // ZeRO: the weight-decay flag of each shard piece
  std::deque<std::pair<int, int>> fused_pending_;  // fused update: final units not yet updated
  float fused_scale_ = 1.0f;  // fused update: this step's clip factor (previous_clip: from the last norm)
};

}  // namespace trellis::train
