// Text generation from a checkpoint: the parameters (any saved layout) are read into a 1-rank
// GPT-2 with its embedding and its tied LM head (the checkpoint reshard path), which decodes
// through a KV cache (nn/kv_cache.hpp): the context is prefilled in one call, then each new token
// costs one row per layer. Logits come from the model's own ln_f and head. Greedy at temperature
// 0, else sampling from softmax(logits / temperature) with the given Rng.
//
// Positions are learned and absolute, so once the context is longer than cfg.positions the window
// of its last `positions` tokens shifts at every token and no cached row stays valid: the window
// is prefilled again (one forward over `positions` tokens per generated token, as without a
// cache). A context that does not extend the cached tokens (another prompt) is prefilled too.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/nn/gpt.hpp"
#include "trellis/nn/kv_cache.hpp"
#include "trellis/train/checkpoint.hpp"
#include "trellis/train/rng.hpp"
#include "trellis/train/trainer.hpp"

namespace trellis::train {

template <comm::Communicator C, backend::Backend B = backend::Host<float>>
  requires backend::CompatibleWith<B, C>
class Generator {
 public:
  // one_rank: a communicator of size 1 (the model is whole here).
  Generator(const Checkpoint& ck, const nn::GptConfig& cfg, C& one_rank, B be = {})
      : cfg_(cfg),
        model_(checked(cfg, one_rank), one_rank, nn::GptOptions{},
               nn::GptStage{0, static_cast<int>(cfg.layers), true, true}, be),
        cache_(model_.make_kv_cache(1)),
        logits_(static_cast<std::size_t>(cfg.vocab)) {
    for (nn::Parameter* p : model_.parameters()) read_parameter_shaped(ck, p->name, *p, p->value.elements(), model_.backend());
  }

  // Logits (vocab) of the token after `tokens` (the last `positions` of them are used).
  std::vector<float> next_logits(const std::vector<std::int32_t>& tokens) {
    TRELLIS_CHECK(!tokens.empty(), "Generator: empty context");
    const auto T = std::min<std::size_t>(tokens.size(), static_cast<std::size_t>(cfg_.positions));
    const auto window = tokens.end() - static_cast<std::ptrdiff_t>(T);
    const bool extends = cached_.size() <= T && std::equal(cached_.begin(), cached_.end(), window);
    if (!extends) {
      cache_.clear();
      cached_.clear();
    } else if (cached_.size() == T) {
      return logits_;  // the same context again
    }
    const std::size_t done = cached_.size();
    if (done == 0) ++prefills_;
    model_.decode(cache_, &*(window + static_cast<std::ptrdiff_t>(done)), static_cast<index_t>(T - done),
                  logits_.data());
    cached_.assign(window, tokens.end());
    return logits_;
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
    TRELLIS_CHECK(n >= 0, "Generator: ", n, " new tokens requested");
    for (std::size_t i = 0; i < prompt.size(); ++i)
      TRELLIS_CHECK(prompt[i] >= 0 && prompt[i] < cfg_.vocab, "Generator: prompt token ", i, " is ", prompt[i],
                    ", outside the vocabulary 0..", cfg_.vocab - 1);
    for (int i = 0; i < n; ++i) prompt.push_back(pick(next_logits(prompt), temperature, rng));
    return prompt;
  }

  // Prefills so far (the first call's, and one per context that did not extend the cached one):
  // how often the cache had to start again.
  std::size_t prefills() const { return prefills_; }

 private:
  static const nn::GptConfig& checked(const nn::GptConfig& cfg, C& one_rank) {
    TRELLIS_CHECK(one_rank.size() == 1, "Generator: needs a 1-rank communicator, got ", one_rank.size(), " ranks");
    return cfg;
  }

  nn::GptConfig cfg_;
  nn::GptModel<C, B> model_;
  nn::KvCache<B> cache_;
  std::vector<std::int32_t> cached_;  // the tokens whose K and V are in cache_, at positions 0..
  std::vector<float> logits_;         // of the token after cached_
  std::size_t prefills_ = 0;
};

}  // namespace trellis::train
