// Text generation from a checkpoint: the parameters (any saved layout) are read into a 1-rank
// GPT-2 (the checkpoint reshard path), which runs the blocks; ln_f and the tied LM head are
// applied here to the last position only, giving the next token's logits. Greedy at
// temperature 0, else sampling from softmax(logits / temperature) with the given Rng.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/rng.hpp"
#include "trellis/train/trainer.hpp"

namespace trellis::train {

template <comm::Communicator C>
class Generator {
 public:
  // one_rank: a communicator of size 1 (the model is whole here).
  Generator(const Checkpoint& ck, const nn::GptConfig& cfg, C& one_rank)
      : cfg_(cfg),
        model_(cfg, one_rank, nn::GptOptions{}, nn::GptStage{0, static_cast<int>(cfg.layers), true, false}) {
    TRELLIS_CHECK(one_rank.size() == 1, "Generator: needs a 1-rank communicator, got ", one_rank.size(),
                  " ranks");
    for (nn::Parameter* p : model_.parameters()) read_parameter_shaped(ck, p->name, *p, p->value);
    wte_ = ck.read_whole<float>("wte.weight");
    ln_w_ = ck.read_whole<float>("ln_f.weight");
    ln_b_ = ck.read_whole<float>("ln_f.bias");
  }

  // Logits (vocab) of the token after `tokens` (the last `positions` of them are used).
  std::vector<float> next_logits(const std::vector<std::int32_t>& tokens) {
    TRELLIS_CHECK(!tokens.empty(), "Generator: empty context");
    const std::size_t T = std::min<std::size_t>(tokens.size(), static_cast<std::size_t>(cfg_.positions));
    std::vector<std::int32_t> window(tokens.end() - static_cast<std::ptrdiff_t>(T), tokens.end());
    const index_t W = cfg_.width;
    std::vector<float> out(T * static_cast<std::size_t>(W));
    nn::StageInput in;
    in.tokens = window.data();
    nn::TokenShape shape{1, static_cast<index_t>(T)};
    shape.train = false;  // inference: no dropout, whatever options a caller's model was built with
    model_.forward(0, shape, in, out.data());
    model_.release(0);
    const float* x = out.data() + (T - 1) * static_cast<std::size_t>(W);  // rows are t * batch + b
    double mean = 0, var = 0;
    for (index_t c = 0; c < W; ++c) mean += x[c];
    mean /= static_cast<double>(W);
    for (index_t c = 0; c < W; ++c) var += (x[c] - mean) * (x[c] - mean);
    var /= static_cast<double>(W);
    const double rs = 1.0 / std::sqrt(var + cfg_.ln_eps);
    std::vector<float> h(static_cast<std::size_t>(W));
    for (index_t c = 0; c < W; ++c) h[c] = static_cast<float>((x[c] - mean) * rs) * ln_w_[c] + ln_b_[c];
    std::vector<float> logits(static_cast<std::size_t>(cfg_.vocab));
    for (index_t v = 0; v < cfg_.vocab; ++v) {
      double s = 0;
      for (index_t c = 0; c < W; ++c) s += static_cast<double>(h[c]) * wte_[v * W + c];
      logits[v] = static_cast<float>(s);
    }
    return logits;
  }

  std::int32_t pick(const std::vector<float>& logits, double temperature, Rng& rng) const {
    std::size_t best = 0;
    for (std::size_t i = 1; i < logits.size(); ++i)
      if (logits[i] > logits[best]) best = i;
    if (temperature <= 0) return static_cast<std::int32_t>(best);
    std::vector<double> p(logits.size());
    double z = 0;
    for (std::size_t i = 0; i < p.size(); ++i)
      z += (p[i] = std::exp((logits[i] - logits[best]) / temperature));
    double u = rng.uniform() * z;
    for (std::size_t i = 0; i < p.size(); ++i)
      if ((u -= p[i]) <= 0) return static_cast<std::int32_t>(i);
    return static_cast<std::int32_t>(best);
  }

  // `prompt` followed by n new tokens.
  std::vector<std::int32_t> generate(std::vector<std::int32_t> prompt, int n, double temperature, Rng& rng) {
    for (int i = 0; i < n; ++i) prompt.push_back(pick(next_logits(prompt), temperature, rng));
    return prompt;
  }

 private:
  nn::GptConfig cfg_;
  nn::GptModel<C> model_;
  std::vector<float> wte_, ln_w_, ln_b_;
};

}  // namespace trellis::train
