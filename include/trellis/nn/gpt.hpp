// GPT-2 (Radford et al. 2019; the math of HF's GPT2LMHeadModel with dropout 0): token + learned
// position embedding, n pre-norm blocks (causal attention, tanh-GELU MLP), final LayerNorm, LM
// head tied to the token embedding, softmax cross-entropy. Tensor parallel (Megatron) with
// optional sequence parallelism, chunked communication overlap and per-block recompute.
//
// Pipeline stages: a GptModel is one stage, a contiguous range of blocks; the first stage holds
// the embedding, the last ln_f + LM head + loss. When first and last are different stages on
// different ranks both hold a copy of wte (same initial values); each accumulates its own part of
// wte's gradient, and the trainer must sum tied_wte()->grad over the {first, last} stage pair
// (all-reduce or send/recv) before the optimizer step, which then keeps the copies identical.
// When both stages live on one rank (vee schedules), the head stage is built with the embedding
// stage's wte (`tied_wte` argument) and both add into its one gradient: no copy.
//
// Weight units: backward_weight runs the head (ln_f and the LM head), the blocks last to first,
// then the embedding; a caller's hook hears when each unit starts (UnitPhase::weight_begin: a
// trainer may bind the unit's gradient storage) and is done (weight_end), so a trainer can start a
// unit's gradient reduction as soon as its last microbatch's W finished (weight_unit_parameters
// lists each unit's parameters, wte excluded: its gradient comes from two units). The same hook
// hears around every read of a unit's values (forward_begin/end, backward_begin/end: its forward,
// its backward_input), so a trainer may keep the values elsewhere and bind them only then (ZeRO-3);
// a W reads no values (its gradient is x^T dy), so W alone needs none.
//
// Stage I/O: activations between stages are the norm-region rows (local_rows x width; with sp
// only this rank's sequence shard), rows in sequence-major order (row = t * batch + b).
//
// Generation: decode() runs the same layers incrementally over a KV cache (nn/kv_cache.hpp).
//
// Parameter names and global shapes are GPT-2's (weights of linear layers stored in x out, as
// HF's Conv1D), so checkpoints map one to one.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "trellis/comm/mesh.hpp"
#include "trellis/nn/activation_arena.hpp"
#include "trellis/nn/block.hpp"
#include "trellis/nn/cross_entropy.hpp"
#include "trellis/nn/dropout.hpp"
#include "trellis/nn/embedding.hpp"
#include "trellis/nn/kv_cache.hpp"
#include "trellis/nn/layernorm.hpp"
#include "trellis/nn/parameter_buffer.hpp"

namespace trellis::nn {

// What a weight unit's hook hears, in order for one microbatch of one unit: forward_begin, _end
// (the forward reads the unit's values); backward_begin, [weight_begin, weight_end,] backward_end
// (backward_input reads the values; in a fused backward the unit's W runs inside); and, when W runs
// apart from B (zero-bubble schedules), weight_begin, weight_end later (W adds into the gradients).
// Every unit hears them all; the embedding's backward reads no values (wte's gradient comes from
// its W).
enum class UnitPhase { forward_begin, forward_end, backward_begin, backward_end, weight_begin, weight_end };

struct GptConfig {
  index_t vocab = 50257;
  index_t positions = 1024;  // n_positions (learned)
  index_t layers = 12;
  index_t heads = 12;
  index_t width = 768;       // n_embd
  float ln_eps = 1e-5f;
  // Mixture of Experts (nn/moe.hpp): block i's MLP is an MoE MLP of `experts` experts with top-k
  // routing when moe_every > 0 and i % moe_every == 0 (Megatron's moe_layer_freq); 0: dense.
  index_t moe_every = 0;
  index_t experts = 0;
  index_t moe_topk = 1;

  bool is_moe_layer(index_t i) const { return moe_every > 0 && i % moe_every == 0; }
};

struct GptOptions {
  bool sequence_parallel = false;
  int overlap_chunks = 1;    // > 1: Oases-style chunked overlap of tp collectives
  bool recompute = false;    // per-block activation recompute
  float dropout = 0.0f;      // embedding + residual dropout (GPT-2 embd/resid_pdrop); masks: nn/dropout.hpp
  std::uint64_t seed = 1234;
  float init_std = 0.02f;    // GPT-2: N(0, 0.02); c_proj weights scaled by 1/sqrt(2 * layers)
  std::size_t pack_alignment = 16;  // floats; each parameter's start in the packed buffers (nn/parameter_buffer.hpp)
  // false: gradients get no packed storage; the caller binds them around each weight unit's W
  // (the hook's UnitPhase::weight_begin; the Trainer's ZeRO-2 slots).
  bool packed_gradients = true;
  // MoE blocks (GptConfig::moe_every): capacity factor (0: dropless) and the auxiliary losses' coefficients.
  float moe_capacity = 0.0f;
  float moe_aux_loss = 0.01f;
  float moe_z_loss = 0.0f;

  // The MoE configuration of a model's MoE blocks.
  MoeConfig moe(const GptConfig& c) const {
    MoeConfig m;
    m.experts = static_cast<int>(c.experts);
    m.topk = static_cast<int>(c.moe_topk);
    m.capacity_factor = moe_capacity;
    m.aux_loss_coef = moe_aux_loss;
    m.z_loss_coef = moe_z_loss;
    return m;
  }
};

// Which part of the model this rank's stage holds.
struct GptStage {
  int first_layer = 0;
  int end_layer = -1;  // exclusive; -1: all layers
  bool embedding = true;
  bool head = true;
  // Local learning (PPLL): >= 0 on a stage other than the last, which then trains against a loss
  // of its own through a head of its own (a LayerNorm and an LM head, named local_head.<k>.*) and
  // still passes its output on; no gradient reaches it from the stages after it.
  // local_head_tied: the LM head is the tied wte (a copy summed with the others, as the last
  // stage's); false: a (vocab, width) matrix of its own, local_head.<k>.lm_head.weight.
  int local_head = -1;
  bool local_head_tied = true;

  // Stage `stage` of `stages`, blocks split by the library's uneven rule (earlier stages get the
  // extra block).
  static GptStage of(int stage, int stages, index_t layers) {
    TRELLIS_CHECK(stages >= 1 && stage >= 0 && stage < stages, "GptStage::of: stage ", stage, " of ", stages);
    const auto c = shard::chunk(layers, stages, stage);
    return {static_cast<int>(c.offset), static_cast<int>(c.offset + c.size), stage == 0, stage == stages - 1};
  }
  // Stage `stage` of a split given as bounds (stages + 1 entries: stage s holds blocks
  // [bounds[s], bounds[s + 1]); pipe::split_layers, pipe::balanced_split).
  static GptStage of(int stage, const std::vector<int>& bounds) {
    const int stages = static_cast<int>(bounds.size()) - 1;
    TRELLIS_CHECK(stages >= 1 && stage >= 0 && stage < stages && bounds[stage] < bounds[stage + 1],
                  "GptStage::of: stage ", stage, " of a split into ", stages, " (every stage needs a block)");
    return {bounds[stage], bounds[stage + 1], stage == 0, stage == stages - 1};
  }
};

// What a stage consumes: tokens (first stage) or the previous stage's activation (Act: the
// backend's activation type, in its memory); targets and the global token count (last stage).
// Token ids and targets are host arrays.
template <class Act>
struct StageInputOf {
  const std::int32_t* tokens = nullptr;   // (batch, seq)
  const Act* activation = nullptr;        // (local_rows, width)
  const std::int32_t* targets = nullptr;  // (batch, seq)
  double token_count = 0;                 // loss normaliser: tokens over all dp ranks and microbatches
};
using StageInput = StageInputOf<float>;

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class GptModel {
 public:
  using backend_type = B;
  using act_t = typename B::act_t;
  using Input = StageInputOf<act_t>;

  // tp_comm: the tensor-parallel communicator (size 1 for no tp); be: the compute backend.
  // tied_wte: for a head stage without the embedding, the wte of this rank's embedding stage (its
  // LM head then reads and adds into it; the parameter is not this model's); nullptr: own copy.
  // cp: the context-parallel communicator and mode (nn/context_parallel.hpp); default: none. The
  // microbatches' TokenShape must then carry this rank's split (cp_rank, cp_size).
  // ep: the expert-parallel group MoE blocks split their experts over (default: none).
  GptModel(const GptConfig& cfg, C& tp_comm, const GptOptions& opt = {}, GptStage stage = {}, B be = {},
           Parameter* tied_wte = nullptr, ContextParallel<C> cp = {}, ExpertParallel<C> ep = {})
      : cfg_(cfg), opt_(opt), stage_(stage), be_(std::move(be)), cp_(cp) {
    if (stage_.end_layer < 0) stage_.end_layer = static_cast<int>(cfg.layers);
    TRELLIS_CHECK(0 <= stage_.first_layer && stage_.first_layer <= stage_.end_layer && stage_.end_layer <= cfg.layers,
                  "GptModel: stage blocks [", stage_.first_layer, ", ", stage_.end_layer, ") outside 0..", cfg.layers);
    tp_.comm = &tp_comm;
    tp_.sequence_parallel = opt.sequence_parallel;
    tp_.overlap_chunks = opt.overlap_chunks;
    tp_.check();
    const auto vocab_rows = shard::chunk(cfg.vocab, tp_.size(), tp_.rank());
    if (stage_.embedding) embedding_ = std::make_unique<VocabParallelEmbedding<C, B>>(cfg.vocab, cfg.positions, cfg.width, tp_, be_);
    BlockConfig bc{cfg.width, cfg.heads, 4 * cfg.width, cfg.ln_eps, opt.recompute, opt.dropout, {}};
    drop_embedding_ = Dropout(opt.dropout, "wte+wpe");
    TRELLIS_CHECK(cfg.moe_every >= 0 && (cfg.moe_every == 0 || cfg.experts >= 1), "GptModel: moe_every ",
                  cfg.moe_every, " with ", cfg.experts, " experts");
    for (int i = stage_.first_layer; i < stage_.end_layer; ++i) {
      BlockConfig block = bc;
      if (cfg.is_moe_layer(i)) block.moe = opt.moe(cfg);
      blocks_.push_back(std::make_unique<TransformerBlock<C, B>>("h." + std::to_string(i), block, tp_, be_, cp_, ep));
    }
    TRELLIS_CHECK(!(stage_.head && stage_.local_head >= 0), "GptModel: the last stage's head is the model's, not a local one");
    if (stage_.head || stage_.local_head >= 0) {
      const std::string prefix = stage_.local_head >= 0 ? "local_head." + std::to_string(stage_.local_head) + "." : "";
      ln_f_ = std::make_unique<LayerNorm<C, B>>(prefix + "ln_f", cfg.width, tp_, cfg.ln_eps, be_);
      Parameter* wte = nullptr;
      if (stage_.local_head >= 0 && !stage_.local_head_tied) {
        local_lm_ = std::make_unique<Parameter>(make_parameter(prefix + "lm_head.weight", {cfg.vocab, cfg.width}, {},
                                                               ParamSharding::tp_sharded(0), tp_.size(), tp_.rank()));
        wte = local_lm_.get();
      } else if (embedding_) {
        wte = &embedding_->wte();
      } else if (tied_wte) {
        TRELLIS_CHECK(tied_wte->name == "wte.weight" && tied_wte->sharding == ParamSharding::tp_sharded(0) &&
                          tied_wte->shard_offsets[0] == vocab_rows.offset && tied_wte->numel() == vocab_rows.size * cfg.width,
                      "GptModel: the tied wte given to a head stage is not this rank's wte shard");
        wte = shared_wte_ = tied_wte;
      } else {
        head_wte_ = std::make_unique<Parameter>(
            make_parameter("wte.weight", {cfg.vocab, cfg.width}, {}, ParamSharding::tp_sharded(0), tp_.size(), tp_.rank()));
        wte = head_wte_.get();
      }
      head_ = std::make_unique<VocabParallelLMHeadLoss<C, B>>(wte, wte->shard_offsets[0], cfg.width, tp_, be_);
    }
    init_parameters();
    // Packed in backward order (the reverse of parameters()): the gradients that become final
    // first come first, so a dp bucket of consecutive parameters is one range of grads().
    auto order = parameters();
    std::reverse(order.begin(), order.end());
    buffer_ = ParameterBuffer<B>(order, opt.pack_alignment, be_,
                                 opt.packed_gradients ? ParameterBuffer<B>::Gradients::packed
                                                      : ParameterBuffer<B>::Gradients::external);
  }

  const GptConfig& config() const { return cfg_; }
  const GptStage& stage() const { return stage_; }
  const B& backend() const { return be_; }
  TensorParallel<C>& tp() { return tp_; }
  index_t local_rows(const TokenShape& shape) const { return tp_.local_rows(shape); }

  // This stage's parameters in GPT-2 order (wte, wpe, h.i.*, ln_f.*); a head-only stage lists
  // its own wte copy last (not a tied one: that belongs to the embedding stage).
  std::vector<Parameter*> parameters() {
    std::vector<Parameter*> out;
    auto add = [&](Parameter& p) { out.push_back(&p); };
    if (embedding_) embedding_->for_each_parameter(add);
    for (auto& b : blocks_) b->for_each_parameter(add);
    if (ln_f_) ln_f_->for_each_parameter(add);
    if (local_lm_) out.push_back(local_lm_.get());
    if (head_wte_) out.push_back(head_wte_.get());
    return out;
  }
  Parameter* find(const std::string& name) {
    for (Parameter* p : parameters())
      if (p->name == name) return p;
    return nullptr;
  }
  // The wte held by this stage (embedding or LM-head copy), or nullptr.
  Parameter* tied_wte() {
    if (embedding_) return &embedding_->wte();
    return shared_wte_ ? shared_wte_ : head_wte_.get();
  }
  // True when wte's gradient must be summed with another stage's (first != last stage).
  bool wte_grad_needs_stage_reduction() const { return stage_.embedding != stage_.head; }
  void zero_grad() { buffer_.zero_grads(); }
  // Sums over tp the gradients backward leaves Partial over tp (LayerNorm's under sequence
  // parallelism; nn/parameter.hpp), after the last backward of a step. The Trainer does it per
  // weight unit instead (weight_unit_parameters), as soon as a unit's last W is done.
  void reduce_tp_partial_grads() { nn::reduce_tp_partial_grads(*tp_.comm, parameters()); }
  // This stage's parameters as two flat buffers (values, gradients), in backward order.
  ParameterBuffer<B>& parameter_buffer() { return buffer_; }

  // This stage's Mixture-of-Experts MLPs with their layer index, first block to last.
  std::vector<std::pair<int, MoeMlp<C, B>*>> moe_layers() {
    std::vector<std::pair<int, MoeMlp<C, B>*>> out;
    for (std::size_t i = 0; i < blocks_.size(); ++i)
      if (blocks_[i]->moe()) out.emplace_back(stage_.first_layer + static_cast<int>(i), blocks_[i]->moe());
    return out;
  }

  VocabParallelEmbedding<C, B>* embedding() { return embedding_.get(); }
  TransformerBlock<C, B>& block(int i) { return *blocks_.at(static_cast<std::size_t>(i - stage_.first_layer)); }
  LayerNorm<C, B>* ln_f() { return ln_f_.get(); }

  // Runs the stage's forward for microbatch mb. Returns the loss contribution (last stage: sum of
  // token losses / in.token_count), else writes `output` (local_rows x width, B's memory) and
  // returns 0. unit_hook(u, forward_begin / forward_end) around each unit (embedding first).
  double forward(int mb, const TokenShape& shape, const Input& in, act_t* output) {
    return forward(mb, shape, in, output, [](int, UnitPhase) {});
  }
  template <class F>
  double forward(int mb, const TokenShape& shape, const Input& in, act_t* output, F&& unit_hook) {
    shape.check_segments("GptModel::forward");
    cp_.check(shape, "GptModel::forward");
    TRELLIS_CHECK(shape.full_seq() <= cfg_.positions, "GptModel::forward: sequence length ", shape.full_seq(),
                  " exceeds the ", cfg_.positions, " learned positions");
    const index_t n = tp_.local_rows(shape) * cfg_.width;
    auto x = allocate(n), y = allocate(n);
    int unit = weight_units() - 1;  // units count from the head: the forward meets them last first
    if (embedding_) {
      TRELLIS_CHECK(in.tokens != nullptr, "GptModel::forward: the first stage needs tokens");
      unit_hook(unit, UnitPhase::forward_begin);
      {
        auto r = be_.range("embedding forward");
        embedding_->forward(mb, shape, in.tokens, x.data());
        drop_embedding_.apply(be_, shape, tp_.first_local_row(shape), tp_.local_rows(shape), cfg_.width, x.data());
      }
      unit_hook(unit--, UnitPhase::forward_end);
    } else {
      TRELLIS_CHECK(in.activation != nullptr, "GptModel::forward: stage without embedding needs an input activation");
      be_.copy(x.data(), in.activation, x.size());
    }
    for (auto& b : blocks_) {
      unit_hook(unit, UnitPhase::forward_begin);
      b->forward(mb, shape, x.data(), y.data());
      unit_hook(unit--, UnitPhase::forward_end);
      std::swap(x, y);
    }
    if (!stage_.head) {  // the next stage's input (a local head's stage also computes its loss)
      TRELLIS_CHECK(output != nullptr, "GptModel::forward: stage without head needs an output buffer");
      be_.copy(output, x.data(), x.size());
      if (!head_) return 0.0;
    }
    TRELLIS_CHECK(in.targets != nullptr, "GptModel::forward: a stage with a head needs targets");
    unit_hook(unit, UnitPhase::forward_begin);
    double loss = 0.0;
    {
      auto r = be_.range("head forward");  // ln_f, the tied LM head and the loss
      ln_f_->forward(mb, shape, x.data(), y.data());
      loss = head_->forward(mb, shape, y.data(), in.targets, in.token_count);
    }
    unit_hook(unit, UnitPhase::forward_end);
    return loss;
  }

  // doutput: gradient of this stage's output (ignored on the last stage, whose output is the
  // loss, seeded with d loss = 1); dinput: gradient of its input (not written on the first stage).
  // unit_hook(u, backward_begin / backward_end) around each unit (head first).
  void backward_input(int mb, const TokenShape& shape, const act_t* doutput, act_t* dinput) {
    run_backward(mb, shape, doutput, dinput, false, [](int, UnitPhase) {});
  }
  template <class F>
  void backward_input(int mb, const TokenShape& shape, const act_t* doutput, act_t* dinput, F&& unit_hook) {
    run_backward(mb, shape, doutput, dinput, false, unit_hook);
  }
  // backward_input and backward_weight fused unit by unit (each unit's W right after its B, the
  // order of a plain backward pass): the gradients of the last units become final while the
  // first ones still run, so a trainer's reductions overlap the rest of the backward.
  // unit_hook(u, phase) around each unit's backward and, inside it, its W; the results equal
  // backward_input + backward_weight.
  template <class F>
  void backward(int mb, const TokenShape& shape, const act_t* doutput, act_t* dinput, F&& unit_hook) {
    run_backward(mb, shape, doutput, dinput, true, unit_hook);
  }

  // Adds microbatch mb's weight gradients and frees its saved activations, unit by unit (head,
  // blocks last to first, embedding); unit_hook(u, weight_begin) before unit u, (u, weight_end)
  // after it.
  void backward_weight(int mb) {
    backward_weight(mb, [](int, UnitPhase) {});
  }
  template <class F>
  void backward_weight(int mb, F&& unit_hook) {
    int unit = 0;
    if (head_) {
      unit_hook(unit, UnitPhase::weight_begin);
      {
        auto r = be_.range("head backward_weight");
        head_->backward_weight(mb);
        ln_f_->backward_weight(mb);
      }
      unit_hook(unit++, UnitPhase::weight_end);
    }
    for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) {
      unit_hook(unit, UnitPhase::weight_begin);
      (*it)->backward_weight(mb);
      unit_hook(unit++, UnitPhase::weight_end);
    }
    if (embedding_) {
      unit_hook(unit, UnitPhase::weight_begin);
      {
        auto r = be_.range("embedding backward_weight");
        embedding_->backward_weight(mb);
      }
      unit_hook(unit++, UnitPhase::weight_end);
    }
    saved_.release(mb);
  }
  // Units of backward_weight and the parameters of each (in packing order; wte in none).
  int weight_units() const {
    return (head_ ? 1 : 0) + static_cast<int>(blocks_.size()) + (embedding_ ? 1 : 0);
  }
  std::vector<Parameter*> weight_unit_parameters(int unit) {
    std::vector<Parameter*> out;
    auto add = [&](Parameter& p) {
      if (p.name != "wte.weight") out.push_back(&p);
    };
    int u = 0;
    if (head_ && u++ == unit) {
      ln_f_->for_each_parameter(add);
      if (local_lm_) add(*local_lm_);
    }
    for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it)
      if (u++ == unit) (*it)->for_each_parameter(add);
    if (embedding_ && u++ == unit) embedding_->for_each_parameter(add);
    TRELLIS_CHECK(unit >= 0 && unit < u, "GptModel: weight unit ", unit, " of ", u);
    std::reverse(out.begin(), out.end());  // packing (backward) order
    return out;
  }

  // Scratch the backend's kernels need for microbatches of `shape` (CUB style, asked at set-up):
  // the largest of the norms' backward (rows x width), the attention backward (this rank's heads,
  // and the layer's own call: under cp ulysses the whole sequence over heads / cp of them),
  // the bias-gradient column sums (rows x 4 width, the widest bias) and MoE blocks' own. Full rows and full widths
  // bound every layer's call from above (sequence-parallel and tp-local calls are smaller; the
  // queries grow with both). reserve_workspace(shape) reserves it before the first step.
  std::size_t workspace_bytes(const TokenShape& shape) const {
    const index_t rows = shape.rows(), W = cfg_.width;
    kernels::AttentionArgs a;
    a.batch = shape.batch;
    a.q_heads = a.kv_heads = shard::chunk(cfg_.heads, tp_.size(), tp_.rank()).size;
    a.q_len = a.kv_len = shape.seq;
    a.head_dim = W / cfg_.heads;
    a.causal = true;
    std::size_t bytes = std::max(be_.layernorm_backward_workspace(rows, W), be_.column_sums_workspace(rows, 4 * W));
    if (!blocks_.empty()) {
      bytes = std::max(bytes, be_.attention_backward_workspace(a));
      bytes = std::max(bytes, be_.attention_backward_workspace(blocks_.front()->attn().attention_call(shape)));
    }
    for (auto& b : blocks_)  // MoE blocks: the dispatch plan, the experts' bias sums (nn/moe.hpp)
      if (b->moe()) bytes = std::max(bytes, b->moe()->workspace_bytes(shape));
    return bytes;
  }
  void reserve_workspace(const TokenShape& shape) { be_.reserve_workspace(workspace_bytes(shape)); }

  // Drops microbatch mb's saved activations without computing gradients (after a forward used
  // only for evaluation).
  void release(int mb) {
    if (head_) {
      head_->release(mb);
      ln_f_->release(mb);
    }
    for (auto& b : blocks_) b->release(mb);
    if (embedding_) embedding_->release(mb);
    saved_.release(mb);
  }

  // Saved activations (nn/activation_arena.hpp): every layer of this stage keeps what a microbatch
  // saves in `pool` of `arena`, a slot per microbatch, freed after the microbatch's last W (or
  // release). saved_bytes(shape) is one microbatch's slot: the sum of the layers' formulas.
  // Unbound (the default), layers hold their own buffers.
  void set_saved_memory(ActivationArena<B>* arena, int pool) {
    saved_ = SavedMemory<B>(arena, pool);
    if (embedding_) embedding_->set_saved_memory(saved_);
    for (auto& b : blocks_) b->set_saved_memory(saved_);
    if (ln_f_) ln_f_->set_saved_memory(saved_);
    if (head_) head_->set_saved_memory(saved_);
  }
  std::size_t saved_bytes(const TokenShape& shape) const {
    std::size_t bytes = 0;
    if (embedding_) bytes += embedding_->saved_bytes(shape);
    for (auto& b : blocks_) bytes += b->saved_bytes(shape);
    if (ln_f_) bytes += ln_f_->saved_bytes(shape);
    if (head_) bytes += head_->saved_bytes(shape);
    return bytes;
  }
  // The same bytes per weight unit, in unit order (head, blocks last to first, embedding): the
  // regions of an offloaded arena pool (ActivationArena::add_offloaded_pool).
  std::vector<std::size_t> unit_saved_bytes(const TokenShape& shape) const {
    std::vector<std::size_t> bytes;
    if (head_) bytes.push_back(ln_f_->saved_bytes(shape) + head_->saved_bytes(shape));
    for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) bytes.push_back((*it)->saved_bytes(shape));
    if (embedding_) bytes.push_back(embedding_->saved_bytes(shape));
    return bytes;
  }

  // Microbatch states still held anywhere in the stage (0 after every W: no leak).
  std::size_t saved_microbatches() const {
    std::size_t n = 0;
    if (embedding_) n += embedding_->saved_microbatches();
    for (auto& b : blocks_) n += b->saved_microbatches();
    if (ln_f_) n += ln_f_->saved_microbatches();
    if (head_) n += head_->saved_microbatches();
    return n;
  }

  // ---- generation: incremental decoding with a KV cache (nn/kv_cache.hpp) ----------------------
  // A cache for `batch` sequences of up to `capacity` positions (0: cfg.positions), this rank's heads.
  KvCache<B> make_kv_cache(index_t batch, index_t capacity = 0) const {
    TRELLIS_CHECK(capacity <= cfg_.positions, "GptModel::make_kv_cache: capacity ", capacity, " exceeds the ",
                  cfg_.positions, " learned positions");
    const index_t local_width = shard::chunk(cfg_.heads, tp_.size(), tp_.rank()).size * (cfg_.width / cfg_.heads);
    return KvCache<B>(be_, static_cast<index_t>(blocks_.size()), batch, capacity > 0 ? capacity : cfg_.positions,
                      local_width);
  }

  // Appends n_new tokens per sequence (tokens: (cache.batch(), n_new) row-major host ids, at
  // positions cache.length()..) and writes the logits of the last new position of every sequence
  // to `logits` (host, (cache.batch(), vocab) fp32, the FULL vocabulary on every tp rank). The
  // first call on an empty cache is the prefill (the whole prompt in one call), later calls decode.
  // Runs the model's own layers (embedding, blocks through their caches, ln_f, the tied LM head)
  // in inference mode: no dropout, no saved state. Needs the whole model on this stage (embedding
  // and head); tensor parallel over this stage's tp group (heads, hidden units and vocabulary
  // shards as in training; every tp rank calls it with the same tokens). Sequence parallelism is
  // not used here: rows are replicated over tp, whatever the option.
  void decode(KvCache<B>& cache, const std::int32_t* tokens, index_t n_new, float* logits) {
    TRELLIS_CHECK(embedding_ && head_, "GptModel::decode: needs the whole model on one stage (embedding and head)");
    TRELLIS_CHECK(cache.layers() == static_cast<index_t>(blocks_.size()), "GptModel::decode: a cache of ",
                  cache.layers(), " layers for ", blocks_.size(), " blocks");
    const DecodeStep step = cache.next(n_new);
    const index_t W = cfg_.width, batch = step.batch, V = cfg_.vocab;
    auto x = allocate(step.rows() * W), y = allocate(step.rows() * W);
    embedding_->infer(step, tokens, x.data());
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      blocks_[i]->decode(step, cache.layer(static_cast<index_t>(i)), x.data(), y.data());
      std::swap(x, y);
    }
    cache.advance(step);
    const act_t* last = x.data() + (n_new - 1) * batch * W;  // the last position's rows (row = t * batch + b)
    auto h = allocate(batch * W), out = allocate(batch * V);
    ln_f_->infer(batch, last, h.data());
    head_->logits(h.data(), batch, out.data());
    if constexpr (std::is_same_v<act_t, float>) {
      be_.download(logits, out.data(), out.size());
    } else {
      std::vector<act_t> host(out.size());
      be_.download(host.data(), out.data(), host.size());
      for (std::size_t i = 0; i < host.size(); ++i) logits[i] = static_cast<float>(host[i]);
    }
  }

 private:
  template <class F>
  void run_backward(int mb, const TokenShape& shape, const act_t* doutput, act_t* dinput, bool with_weights,
                    F&& unit_hook) {
    const index_t n = tp_.local_rows(shape) * cfg_.width;
    auto g = allocate(n), h = allocate(n);
    int unit = 0;
    if (head_) {
      unit_hook(unit, UnitPhase::backward_begin);
      {
        auto r = be_.range("head backward_input");
        head_->backward_input(mb, shape, h.data());
        ln_f_->backward_input(mb, shape, h.data(), g.data());
      }
      if (with_weights) {
        unit_hook(unit, UnitPhase::weight_begin);
        {
          auto r = be_.range("head backward_weight");
          head_->backward_weight(mb);
          ln_f_->backward_weight(mb);
        }
        unit_hook(unit, UnitPhase::weight_end);
      }
      unit_hook(unit++, UnitPhase::backward_end);
    } else {
      TRELLIS_CHECK(doutput != nullptr, "GptModel::backward_input: stage without head needs the output gradient");
      be_.copy(g.data(), doutput, g.size());
    }
    for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) {
      unit_hook(unit, UnitPhase::backward_begin);
      (*it)->backward_input(mb, shape, g.data(), h.data());
      std::swap(g, h);
      if (with_weights) {
        unit_hook(unit, UnitPhase::weight_begin);
        (*it)->backward_weight(mb);
        unit_hook(unit, UnitPhase::weight_end);
      }
      unit_hook(unit++, UnitPhase::backward_end);
    }
    if (embedding_) {  // its backward_input keeps dy for W and reads no values (ZeRO-3 gathers none)
      unit_hook(unit, UnitPhase::backward_begin);
      {
        auto r = be_.range("embedding backward_input");
        drop_embedding_.apply(be_, shape, tp_.first_local_row(shape), tp_.local_rows(shape), cfg_.width, g.data());
        embedding_->backward_input(mb, shape, g.data());
      }
      if (with_weights) {
        unit_hook(unit, UnitPhase::weight_begin);
        {
          auto r = be_.range("embedding backward_weight");
          embedding_->backward_weight(mb);
        }
        unit_hook(unit, UnitPhase::weight_end);
      }
      unit_hook(unit++, UnitPhase::backward_end);
    } else if (dinput != nullptr) {  // null: no stage before wants it (local learning)
      be_.copy(dinput, g.data(), g.size());
    }
    if (with_weights) saved_.release(mb);
  }

  // Temporaries of one call, written in full before they are read: not zeroed.
  typename B::template buffer<act_t> allocate(index_t n) const {
    return be_.template scratch<act_t>(static_cast<std::size_t>(n));
  }

  void init_parameters() {
    const float proj_std = opt_.init_std / std::sqrt(2.0f * static_cast<float>(cfg_.layers));
    for (Parameter* p : parameters()) {
      const std::string& nm = p->name;
      auto ends_with = [&](const std::string& suffix) {
        return nm.size() >= suffix.size() && nm.compare(nm.size() - suffix.size(), suffix.size(), suffix) == 0;
      };
      if (nm.find(".ln_") != std::string::npos || nm.rfind("ln_f", 0) == 0) continue;  // ones / zeros already
      if (ends_with(".bias")) continue;                                                 // zeros
      init_normal(*p, opt_.seed, ends_with("c_proj.weight") ? proj_std : opt_.init_std);
    }
  }

  GptConfig cfg_;
  GptOptions opt_;
  GptStage stage_;
  B be_;
  TensorParallel<C> tp_;
  ContextParallel<C> cp_;
  std::unique_ptr<VocabParallelEmbedding<C, B>> embedding_;
  Dropout drop_embedding_;
  std::vector<std::unique_ptr<TransformerBlock<C, B>>> blocks_;
  std::unique_ptr<LayerNorm<C, B>> ln_f_;
  std::unique_ptr<Parameter> head_wte_;
  std::unique_ptr<Parameter> local_lm_;  // a local head's own LM matrix (local_head_tied = false)
  Parameter* shared_wte_ = nullptr;  // the embedding stage's wte on this rank (not ours)
  std::unique_ptr<VocabParallelLMHeadLoss<C, B>> head_;
  ParameterBuffer<B> buffer_;
  SavedMemory<B> saved_;
};

// This rank's GPT-2 stage on a device mesh: tensor parallel over mesh.comm<tp>(); with a pp axis,
// stage mesh.coord<pp>() of mesh.size<pp>() (one chunk per rank; build the models yourself with
// GptStage::of for interleaved/V schedules). Data parallelism (a dp axis) does not change the
// model: the trainer reduces gradients over mesh.comm<dp>().
template <class B = backend::Host<float>, class C, class... Axes>
GptModel<C, B> make_gpt_stage(const GptConfig& cfg, comm::Mesh<C, Axes...>& mesh, const GptOptions& opt = {},
                              B be = {}) {
  static_assert((std::is_same_v<Axes, trellis::tp> || ...), "make_gpt_stage: the mesh needs a tp axis (size 1 is fine)");
  GptStage stage;
  if constexpr ((std::is_same_v<Axes, trellis::pp> || ...))
    stage = GptStage::of(mesh.template coord<trellis::pp>(), mesh.template size<trellis::pp>(), cfg.layers);
  return GptModel<C, B>(cfg, mesh.template comm<trellis::tp>(), opt, stage, std::move(be));
}

}  // namespace trellis::nn
