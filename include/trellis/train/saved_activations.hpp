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
//     the current one computes); false: synchronous, each copy waited for at once.
#pragma once

#include <algorithm>
#include <cstddef>
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
  };
  static Options options(const TrainerConfig& c) {
    return {c.offload_activations, c.offload_activation_frames, c.poison_activations,
            nn::OffloadCopies{c.offload_activation_copy_queue,
                              backend::SimulatedCopyLink{c.offload_activation_simulated_gbps * 1e9, 0.0}}};
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
  }

  const nn::ActivationArena<B>& arena() const { return *arena_; }

  // The models' unit hook: microbatch mb, chunk c, unit u entering or leaving `phase`.
  void on_unit(int mb, int c, int u, nn::UnitPhase phase) {
    if (!offload_) return;
    using P = nn::UnitPhase;
    const int pool = pools_.at(static_cast<std::size_t>(c));
    switch (phase) {
      case P::forward_begin: arena_->begin_unit(pool, mb, u); return;
      case P::backward_begin:
      case P::weight_begin:
        arena_->begin_unit(pool, mb, u);
        arena_->prefetch(pool, mb, u + 1);  // the unit this pass meets next
        return;
      case P::forward_end: arena_->end_forward(pool, mb, u); return;
      case P::backward_end: arena_->end_unit(pool, mb, u); return;
      case P::weight_end: arena_->release_unit(pool, mb, u); return;
    }
  }

 private:
  std::unique_ptr<nn::ActivationArena<B>> arena_;  // pointer: the layers keep its address
  std::vector<int> pools_;                          // chunk c's pool
  bool offload_ = false;
};

}  // namespace trellis::train
