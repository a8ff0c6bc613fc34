// What a trainer reports of its Mixture-of-Experts layers (nn/moe.hpp): the step's auxiliary
// losses and the tokens routed to each expert, gathered over the ranks.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "trellis/nn/gpt.hpp"
#include "trellis/train/host_scalars.hpp"

namespace trellis::train {

template <comm::Communicator C, backend::Backend B>
class MoeStats {
 public:
  // A layer of this rank (its block index), weighted so that its auxiliary losses are a mean
  // over `forwards_per_step` forwards (microbatches x replicas).
  void add(int layer, nn::MoeMlp<C, B>* moe, int forwards_per_step) {
    moe->set_aux_weight(1.0f / static_cast<float>(forwards_per_step));
    layers_.emplace_back(layer, moe);
    forwards_ = forwards_per_step;
  }
  // Call before a step's forwards, then step_loss after them.
  void begin_step() { before_ = local_sum(); }
  // The step's auxiliary losses summed over the MoE layers, each a mean over the step's forwards:
  // a collective over `pp_replicas` (every rank's forwards, every pipeline stage's layers once).
  double step_loss(const B& be, C& pp_replicas) const {
    return reduce_scalar(be, pp_replicas, local_sum() - before_) / forwards_;
  }
  // Copies routed to each expert of every MoE layer of `model` since the last call, over all
  // ranks (counted on tp rank 0: the tp ranks route the same tokens): (layer, counts). A
  // collective over `world`; resets the layers' counters.
  std::vector<std::pair<int, std::vector<double>>> take_load(const B& be, C& world, const nn::GptConfig& model,
                                                             bool counting_rank) {
    std::vector<int> moe_layers;
    for (index_t i = 0; i < model.layers; ++i)
      if (model.is_moe_layer(i)) moe_layers.push_back(static_cast<int>(i));
    const auto E = static_cast<std::size_t>(model.experts);
    std::vector<double> counts(moe_layers.size() * E, 0.0);
    for (auto [layer, moe] : layers_) {
      const auto at = static_cast<std::size_t>(std::find(moe_layers.begin(), moe_layers.end(), layer) - moe_layers.begin());
      if (counting_rank)
        for (std::size_t e = 0; e < moe->load().size(); ++e) counts[at * E + e] += static_cast<double>(moe->load()[e]);
      moe->reset_load();
    }
    before_ = 0;
    with_host_comm(be, world, [&](auto& w) { w.all_reduce(counts.data(), counts.data(), counts.size(), comm::ReduceOp::sum); });
    std::vector<std::pair<int, std::vector<double>>> out;
    for (std::size_t l = 0; l < moe_layers.size(); ++l)
      out.emplace_back(moe_layers[l], std::vector<double>(counts.begin() + static_cast<std::ptrdiff_t>(l * E),
                                                          counts.begin() + static_cast<std::ptrdiff_t>((l + 1) * E)));
    return out;
  }

 private:
  double local_sum() const {
    double s = 0;
    for (auto [layer, moe] : layers_) s += moe->loss_sum();
    return s;
  }
  std::vector<std::pair<int, nn::MoeMlp<C, B>*>> layers_;
  int forwards_ = 1;
  double before_ = 0;
};

}  // namespace trellis::train
