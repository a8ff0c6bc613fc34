// GptPipelineStage: the GPT-2 stages held by one pipeline rank, as a trellis::pipe::Stage, so any
// schedule of pipe/ (GPipe, 1F1B, interleaved, zero-bubble, DualPipeV, ...) drives the model
// through pipe::execute. Chunk c of the rank is the GptModel built for the schedule's virtual
// stage held by (rank, c) (Schedule::virtual_stage), e.g. with GptStage::of(vs, p * v, layers).
//
// Per step: set_batch() gives the microbatches' tokens/targets, the global token count and the
// dropout context (seed, global sample offset, train/eval), then
// pipe::execute runs F/B/W; loss() is this rank's summed loss contributions (non-zero only where
// the last virtual stage lives). Afterwards the trainer sums the tied wte gradient over the
// ranks holding the first and last virtual stage (see GptModel::tied_wte).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <thread>
#include <vector>

#include "trellis/nn/gpt.hpp"
#include "trellis/shard/flat.hpp"

namespace trellis::nn {

// What a step's dropout masks depend on besides the layer and the token (nn/dropout.hpp).
struct DropoutContext {
  std::uint64_t seed = 0;    // the step's seed: a new one every step (train::dropout_seed)
  index_t first_sample = 0;  // global batch index of microbatch 0's first sample
  bool train = true;         // false: evaluation, no dropout
};

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
class GptPipelineStage {
 public:
  // Activations and their gradients between stages: the backend's activation type, in buffers of
  // the backend's memory (allocate: the pipe executor's buffers).
  using value_type = typename B::act_t;
  using model_type = GptModel<C, B>;
  using buffer_type = typename B::template buffer<value_type>;

  GptPipelineStage(std::vector<model_type*> chunks, const TokenShape& shape)
      : chunks_(std::move(chunks)), shape_(shape) {
    TRELLIS_CHECK(!chunks_.empty(), "GptPipelineStage: no model chunks");
    for (auto* m : chunks_) TRELLIS_CHECK(m != nullptr, "GptPipelineStage: null model chunk");
    local_losses_.assign(chunks_.size(), 0.0);
  }

  // tokens[mb], targets[mb]: (batch, seq) ids of microbatch mb (only read by the chunks holding
  // the embedding / the head); token_count: the loss normaliser for the whole step; dropout: the
  // step's seed and where microbatch 0 sits in the global batch (microbatch mb's samples follow
  // at first_sample + mb * batch), or train = false for evaluation.
  // segments[mb]: microbatch mb's packed documents' ids (TokenShape::segments); empty: not packed.
  void set_batch(std::vector<const std::int32_t*> tokens, std::vector<const std::int32_t*> targets, double token_count,
                 const DropoutContext& dropout = {}, std::vector<const std::int32_t*> segments = {}) {
    TRELLIS_CHECK(segments.empty() || segments.size() == tokens.size(), "GptPipelineStage: document ids for ",
                  segments.size(), " of ", tokens.size(), " microbatches");
    dropout_ = dropout;
    tokens_ = std::move(tokens);
    targets_ = std::move(targets);
    segments_ = std::move(segments);
    token_count_ = token_count;
    loss_ = 0.0;
    local_losses_.assign(chunks_.size(), 0.0);
    weights_done_ = 0;
  }
  // W passes (backward_weight, or the W inside backward) finished since set_batch.
  int weights_done() const { return weights_done_; }
  // The model's loss from this rank's last-stage chunk (0 elsewhere), summed over the microbatches
  // since set_batch; local_loss(chunk): the same for a local head's loss (local learning).
  double loss() const { return loss_; }
  double local_loss(int chunk) const { return local_losses_.at(static_cast<std::size_t>(chunk)); }
  const B& backend() const { return chunks_.front()->backend(); }
  buffer_type allocate(std::size_t n) const { return backend().template allocate<value_type>(n); }

  std::size_t input_size(int chunk) const {
    auto* m = model(chunk);
    return m->stage().embedding ? 0 : activation_size(*m);
  }
  std::size_t output_size(int chunk) const {
    auto* m = model(chunk);
    return m->stage().head ? 0 : activation_size(*m);
  }

  // A slow device simulated on the host (1: off): each weight unit's compute in a forward,
  // backward or W (between its hooks: waits for gathered values are not compute) is followed by a
  // sleep of (factor - 1) times it, before the next hook (which starts the unit's reductions); so
  // collectives between units (ZeRO-2/3, dp buckets) see the slow rank when a slow device would
  // show, not an action later. An action that reports no unit sleeps (factor - 1) times its whole
  // time at its end. Host timing: a device backend's kernels run asynchronously.
  void set_slowdown(double factor) {
    TRELLIS_CHECK(factor >= 1.0, "GptPipelineStage: a slowdown of ", factor, " (must be >= 1)");
    slowdown_ = factor;
  }

  void forward(int mb, int chunk, std::span<const value_type> in, std::span<value_type> out) {
    Slowed slowed(*this);
    auto* m = model(chunk);
    typename model_type::Input si;
    si.tokens = m->stage().embedding ? ids(tokens_, mb, "tokens") : nullptr;
    si.targets = m->stage().head || m->stage().local_head >= 0 ? ids(targets_, mb, "targets") : nullptr;
    si.activation = in.empty() ? nullptr : in.data();
    si.token_count = token_count_;
    const double l = m->forward(mb, shape_of(mb), si, out.empty() ? nullptr : out.data(), hook(mb, chunk));
    (m->stage().head ? loss_ : local_losses_.at(static_cast<std::size_t>(chunk))) += l;
  }
  void backward_input(int mb, int chunk, std::span<const value_type> grad_out, std::span<value_type> grad_in) {
    Slowed slowed(*this);
    model(chunk)->backward_input(mb, shape_of(mb), grad_out.empty() ? nullptr : grad_out.data(),
                                 grad_in.empty() ? nullptr : grad_in.data(), hook(mb, chunk));
  }
  // backward_input + backward_weight fused per unit (GptModel::backward), for a plain loop.
  void backward(int mb, int chunk, std::span<const value_type> grad_out, std::span<value_type> grad_in) {
    Slowed slowed(*this);
    model(chunk)->backward(mb, shape_of(mb), grad_out.empty() ? nullptr : grad_out.data(),
                           grad_in.empty() ? nullptr : grad_in.data(), hook(mb, chunk));
    ++weights_done_;
  }
  void backward_weight(int mb, int chunk) {
    Slowed slowed(*this);
    model(chunk)->backward_weight(mb, hook(mb, chunk));
    ++weights_done_;
  }

  // Sums the tied wte gradient over every pipeline rank that holds a wte (first and last virtual
  // stage) and leaves the sum in each. Collective over pp_comm (the ranks with this rank's tp
  // coordinate): every pipeline rank calls it, ranks without one contribute zeros. Chunks of one
  // rank built with a tied wte share one parameter (counted once); untied copies are summed.
  template <comm::Communicator P>
  void all_reduce_tied_wte_grad(P& pp_comm) {
    std::vector<Parameter*> copies;
    for (auto* m : chunks_)
      if (Parameter* w = m->tied_wte(); w && std::find(copies.begin(), copies.end(), w) == copies.end())
        copies.push_back(w);
    if (pp_comm.size() == 1 && copies.size() <= 1) return;
    // Over pp the gradient is Partial(sum) (the holders' contributions, zeros elsewhere) and leaves
    // as Replicate: the planner's step, an all-reduce (shard/flat.hpp).
    auto to_replicate = [&](float* grad, std::size_t n) {
      if (auto r = shard::start_flat_redistribute(pp_comm, shard::partial_code(comm::ReduceOp::sum),
                                                  shard::replicate_code(), grad, grad, n))
        r->wait();
    };
    if (copies.size() == 1) {  // in place
      Parameter* w = copies.front();
      to_replicate(w->grad.data(), w->grad.size());
      return;
    }
    const B& be = backend();
    const auto& cfg = chunks_.front()->config();
    auto& tp = chunks_.front()->tp();
    const auto n = static_cast<std::size_t>(shard::chunk(cfg.vocab, tp.size(), tp.rank()).size * cfg.width);
    auto sum = be.template allocate<float>(n);  // zeroed
    for (Parameter* w : copies) {
      TRELLIS_CHECK(w->grad.size() == n, "GptPipelineStage: wte copies of ", n, " and ", w->grad.size(), " elements");
      be.add(static_cast<index_t>(n), sum.data(), w->grad.data(), sum.data());
    }
    to_replicate(sum.data(), n);
    for (Parameter* w : copies) be.copy(w->grad.data(), sum.data(), n);
  }

  // Called around each weight unit of a chunk's forward, backward_input and backward_weight
  // (GptModel's units and UnitPhase) with (microbatch, chunk, unit, phase): a trainer binds
  // gradient storage and starts reductions from it, and binds gathered values (ZeRO-3).
  void set_unit_hook(std::function<void(int, int, int, UnitPhase)> hook) { unit_hook_ = std::move(hook); }

 private:
  // Around each action (set_slowdown): where no unit was slowed inside it, sleeps (factor - 1) x
  // its lifetime when it ends.
  struct Slowed {
    GptPipelineStage& stage;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    explicit Slowed(GptPipelineStage& s) : stage(s) { stage.units_slowed_ = 0; }
    ~Slowed() {
      if (stage.slowdown_ > 1.0 && stage.units_slowed_ == 0)
        std::this_thread::sleep_for((std::chrono::steady_clock::now() - start) * (stage.slowdown_ - 1.0));
    }
  };
  // Units may nest (a backward's W inside it): the compute since the last event inside a unit is
  // slowed before the next event's hook runs, and hooks are not compute.
  auto hook(int mb, int chunk) {
    return [this, mb, chunk](int unit, UnitPhase phase) {
      const bool begins =
          phase == UnitPhase::forward_begin || phase == UnitPhase::backward_begin || phase == UnitPhase::weight_begin;
      if (slowdown_ > 1.0 && unit_depth_ > 0) {
        std::this_thread::sleep_for((std::chrono::steady_clock::now() - unit_mark_) * (slowdown_ - 1.0));
        ++units_slowed_;
      }
      if (unit_hook_) unit_hook_(mb, chunk, unit, phase);
      unit_depth_ += begins ? 1 : -1;
      unit_mark_ = std::chrono::steady_clock::now();
    };
  }
  model_type* model(int chunk) const {
    TRELLIS_CHECK(chunk >= 0 && chunk < static_cast<int>(chunks_.size()), "GptPipelineStage: chunk ", chunk,
                  " of ", chunks_.size());
    return chunks_[static_cast<std::size_t>(chunk)];
  }
  TokenShape shape_of(int mb) const {
    TokenShape s = shape_;
    s.seed = dropout_.seed;
    s.first_sample = dropout_.first_sample + static_cast<index_t>(mb) * shape_.batch;
    s.train = dropout_.train;
    s.segments = segments_.empty() ? nullptr : segments_[static_cast<std::size_t>(mb)];
    return s;
  }
  std::size_t activation_size(model_type& m) const {
    return static_cast<std::size_t>(m.local_rows(shape_) * m.config().width);
  }
  static const std::int32_t* ids(const std::vector<const std::int32_t*>& v, int mb, const char* what) {
    TRELLIS_CHECK(mb >= 0 && mb < static_cast<int>(v.size()) && v[mb] != nullptr, "GptPipelineStage: no ", what,
                  " for microbatch ", mb, " (call set_batch)");
    return v[static_cast<std::size_t>(mb)];
  }

  std::vector<model_type*> chunks_;
  TokenShape shape_;
  std::vector<const std::int32_t*> tokens_, targets_, segments_;
  double token_count_ = 0;
  DropoutContext dropout_;
  double loss_ = 0;
  std::vector<double> local_losses_;
  int weights_done_ = 0;
  double slowdown_ = 1.0;
  std::chrono::steady_clock::time_point unit_mark_{};  // the last unit event's hook returned
  int unit_depth_ = 0;                                  // units begun and not ended
  int units_slowed_ = 0;                                // sleeps in the current action
  std::function<void(int, int, int, UnitPhase)> unit_hook_;
};

}  // namespace trellis::nn
