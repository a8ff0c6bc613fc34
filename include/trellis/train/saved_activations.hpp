// train::SavedActivations: where a Trainer's chunks keep what the forward saves for the backward
// (nn/activation_arena.hpp), set up from the schedule and driven by the models' unit hook.
//   - One arena pool per chunk, with room for as many microbatches as the schedule keeps that
//     chunk's alive, F to W (the pipeline simulator counts them; pp = 1 runs one at a time), each
//     one microbatch's saved bytes (GptModel's formulas).
//   - offload (TrainerConfig::offload_activations): the pools are offloaded ones, the rooms in
//     host memory and `frames` device frames of the largest unit per chunk. A unit's region is
//     pinned while the unit computes (its forward, backward_input, W), freed after its W, and a
//     backward or W fetches the next unit's region while the current one computes.
//   - offload_activation_copy_queue (default): the copies overlap the compute on the backend's
//     copy queue (a unit's write-back starts once its forward is done, the next unit's fetch while
//     the current one computes); false: synchronous, each copy waited for at once. Each pool is
//     given the calls of a step (the schedule's actions, or pp = 1's loop: per microbatch the
//     forwards, then the fused backwards in reverse), so that a region is written back after its
//     forward only if its frame is taken before its backward (ActivationArena::set_unit_calls).
//   - evaluation (forward_only(), Trainer::evaluate): no backward follows, so an offloaded unit's
//     region is freed as its forward ends: nothing is copied to host memory and a chunk holds one
//     unit's saved tensors at a time.
#pragma once

#include <algorithm>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/nn/activation_arena.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/pipe/schedule.hpp"
#include "trellis/pipe/simulate.hpp"
#include "trellis/train/trainer_config.hpp"

namespace trellis::train {

template <class C, backend::Backend B>
class SavedActivations {
 public:
  struct Options {
    bool offload = false;
    int frames = 2;       // offload: device frames per chunk
    bool poison = false;  // tests: NaN in every slot or frame handed out
    nn::OffloadCopies copies{};
    int microbatches = 1;  // per step (pp = 1's loop)
  };
  static Options options(const TrainerConfig& c) {
    return {c.offload_activations, c.offload_activation_frames, c.poison_activations,
            nn::OffloadCopies{c.offload_activation_copy_queue,
                              backend::SimulatedCopyLink{c.offload_activation_simulated_gbps * 1e9, 0.0}},
            c.microbatches};
  }
  // schedule: null with pp = 1. Binds every chunk to its pool.
  SavedActivations(std::vector<std::unique_ptr<nn::GptModel<C, B>>>& models, const pipe::Schedule* schedule,
                   int pp_rank, const nn::TokenShape& shape, const Options& o, B be)
      : arena_(std::make_unique<nn::ActivationArena<B>>(std::move(be), o.copies)), offload_(o.offload) {
    std::vector<int> slots(models.size(), 1);
    if (schedule) slots = pipe::simulate(*schedule).peak_activations_by_chunk.at(static_cast<std::size_t>(pp_rank));
    for (std::size_t c = 0; c < models.size(); ++c) {
      const int vs = schedule ? schedule->virtual_stage(pp_rank, static_cast<int>(c)) : static_cast<int>(c);
      std::string name = "chunk " + std::to_string(c) + " (virtual stage " + std::to_string(vs) + ")";
      const int room = std::max(1, slots[c]);
      pools_.push_back(o.offload ? arena_->add_offloaded_pool(std::move(name), models[c]->unit_saved_bytes(shape), room,
                                                              o.frames)
                                 : arena_->add_pool(std::move(name), models[c]->saved_bytes(shape), room));
    }
    arena_->allocate(o.poison);
    for (std::size_t c = 0; c < models.size(); ++c) models[c]->set_saved_memory(arena_.get(), pools_[c]);
    if (o.offload) {
      auto calls = step_calls(models, schedule, pp_rank, shape, o.microbatches);
      for (std::size_t c = 0; c < models.size(); ++c) arena_->set_unit_calls(pools_[c], std::move(calls[c]));
    }
  }

  const nn::ActivationArena<B>& arena() const { return *arena_; }

  // While the returned guard lives the forwards are evaluation ones (no backward follows).
  [[nodiscard]] auto forward_only() {
    struct Guard {
      bool* on;
      ~Guard() { *on = false; }
    };
    forward_only_ = true;
    return Guard{&forward_only_};
  }

  // The models' unit hook: microbatch mb, chunk c, unit u entering or leaving `phase`.
  void on_unit(int mb, int c, int u, nn::UnitPhase phase) {
    if (!offload_) return;
    const int pool = pools_.at(static_cast<std::size_t>(c));
    if (forward_only_ && phase == nn::UnitPhase::forward_end) return arena_->release_unit(pool, mb, u);
    unit_calls(mb, u, phase, [&](const nn::UnitCall& call) { arena_->call(pool, call); });
  }

 private:
  // The arena calls of one unit hook.
  template <class F>
  static void unit_calls(int mb, int u, nn::UnitPhase phase, F&& call) {
    using P = nn::UnitPhase;
    using Op = nn::UnitCall::Op;
    switch (phase) {
      case P::forward_begin: return call({Op::begin, mb, u});
      case P::backward_begin:
      case P::weight_begin:
        call({Op::begin, mb, u});
        return call({Op::prefetch, mb, u + 1});  // the unit this pass meets next
      case P::forward_end: return call({Op::end_forward, mb, u});
      case P::backward_end: return call({Op::end, mb, u});
      case P::weight_end: return call({Op::release, mb, u});
    }
  }
  // Each chunk's arena calls in one step: the unit hooks of GptModel's forward (units last to
  // first), backward_input and backward_weight (first to last) and fused backward (each unit's W
  // inside its backward), in the order the schedule's compute actions (or pp = 1's loop) run them.
  static std::vector<std::vector<nn::UnitCall>> step_calls(std::vector<std::unique_ptr<nn::GptModel<C, B>>>& models,
                                                           const pipe::Schedule* schedule, int pp_rank,
                                                           const nn::TokenShape& shape, int microbatches) {
    using P = nn::UnitPhase;
    std::vector<std::vector<nn::UnitCall>> calls(models.size());
    auto run = [&](int mb, int c, std::initializer_list<P> phases, bool forward) {
      auto& out = calls.at(static_cast<std::size_t>(c));
      const int units = static_cast<int>(models[static_cast<std::size_t>(c)]->unit_saved_bytes(shape).size());
      for (int i = 0; i < units; ++i)
        for (P ph : phases) unit_calls(mb, forward ? units - 1 - i : i, ph, [&](const nn::UnitCall& x) { out.push_back(x); });
    };
    const auto F = {P::forward_begin, P::forward_end}, Bi = {P::backward_begin, P::backward_end},
               W = {P::weight_begin, P::weight_end},
               BW = {P::backward_begin, P::weight_begin, P::weight_end, P::backward_end};
    if (!schedule) {
      const int chunks = static_cast<int>(models.size());
      for (int mb = 0; mb < microbatches; ++mb) {
        for (int c = 0; c < chunks; ++c) run(mb, c, F, true);
        for (int c = chunks - 1; c >= 0; --c) run(mb, c, BW, false);
      }
      return calls;
    }
    for (const pipe::Action& a : schedule->ranks.at(static_cast<std::size_t>(pp_rank))) {
      if (a.kind == pipe::ActionKind::forward) run(a.microbatch, a.chunk, F, true);
      if (a.kind == pipe::ActionKind::backward_input) run(a.microbatch, a.chunk, Bi, false);
      if (a.kind == pipe::ActionKind::backward_weight) run(a.microbatch, a.chunk, W, false);
    }
    return calls;
  }

  std::unique_ptr<nn::ActivationArena<B>> arena_;  // pointer: the layers keep its address
  std::vector<int> pools_;                          // chunk c's pool
  bool offload_ = false;
  bool forward_only_ = false;  // evaluation: regions freed after their forward
};

}  // namespace trellis::train
