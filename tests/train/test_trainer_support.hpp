// Shared by the trainer tests: a tiny GPT config, deterministic token data, and a driver that
// trains a layout on thread ranks and returns the per-step losses and the final global weights
// (assembled from every rank's shards; replicas must agree).
#pragma once

#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "nn/support.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/train/data.hpp"
#include "trellis/train/trainer.hpp"

namespace trainer_test {

using trellis::index_t;
using trellis::comm::ThreadComm;
using trellis::train::Trainer;
using trellis::train::TrainerConfig;

// 4 layers (so pp2 x v2 and pp4 work), 4 heads, width 32, vocab 64, T 16, global batch 8.
inline TrainerConfig tiny_config() {
  TrainerConfig c;
  c.model.vocab = 64;
  c.model.positions = 16;
  c.model.layers = 4;
  c.model.heads = 4;
  c.model.width = 32;
  c.batch = 8;
  c.seq = 16;
  c.microbatches = 1;
  c.adamw.lr = 3e-3f;
  c.adamw.eps = 1e-5f;  // keeps Adam's sign-like first steps off gradients that are pure rounding
                        // noise (e.g. the key bias, whose true gradient is 0), so layouts compare
  c.lr = {.max_lr = 3e-3, .min_lr = 3e-4, .warmup_steps = 2, .total_steps = 10};
  c.clip = 0.5;  // small enough to clip in the first steps (the clip path is exercised)
  return c;
}

// A token stream with structure (a noisy periodic pattern) so the loss moves.
inline const std::vector<trellis::train::token_t>& tokens() {
  static const std::vector<trellis::train::token_t> t = [] {
    std::vector<trellis::train::token_t> v(4096);
    std::uint64_t x = 7;
    for (std::size_t i = 0; i < v.size(); ++i) {
      x = trellis::splitmix64(x);
      v[i] =
          static_cast<trellis::train::token_t>((i * 7 + (i / 13)) % 64 ^ ((x % 5 == 0) ? (x >> 20) % 64 : 0));
    }
    return v;
  }();
  return t;
}

// tokens() cut into short documents (2..12 tokens, mean ~6): the separator 0 starts each one,
// for the loader's packed mode (train/packing.hpp).
inline constexpr std::int64_t kPackSeparator = 0;
inline const std::vector<trellis::train::token_t>& document_tokens() {
  static const std::vector<trellis::train::token_t> t = [] {
    std::vector<trellis::train::token_t> v = tokens();
    std::size_t next = 0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i == next) {
        v[i] = static_cast<trellis::train::token_t>(kPackSeparator);
        next = i + 2 + trellis::splitmix64(i) % 11;
      } else if (v[i] == kPackSeparator) {
        v[i] = 1;
      }
    }
    return v;
  }();
  return t;
}

struct RunResult {
  std::vector<double> losses;
  std::vector<double> norms;
  nn_test::Collector* weights = nullptr;
  std::vector<std::string> names;
  float replica_diff = 0;
};

struct Layout {
  int pp = 1, dp = 1, tp = 1;
  bool sp = false;
  int zero = 0;  // ZeRO stage
  int shard_degree = 0;  // hybrid sharding: ZeRO over groups of this many replicas (0: all)
  std::string schedule = "1f1b";
  int microbatches = 1;
  float dropout = 0.0f;
  bool recompute = false;
  std::optional<trellis::pipe::Schedule> custom_schedule{};  // instead of `schedule` (pp > 1)
  bool batch_p2p = false;  // the pipe executor's sends/receives as one group (as on NCCL)
  bool packed = false;     // document_tokens() packed into rows (the loader's packed mode)
  int cp = 1;              // context parallel
  trellis::nn::CpMode cp_mode = trellis::nn::CpMode::ring;
  int cp_ulysses = 2;      // hybrid: Ulysses group size
  bool balance_documents = false;  // packed rows reordered for equal causal work per cp rank
  // Mixture of Experts: blocks 0 and 2 get 4 experts, top-2 (the z-loss on), split over ep.
  bool moe = false;
  int ep = 1;
  float capacity = 0.0f;  // 0: dropless
  float aux_loss = 0.0f;  // load-balancing coefficient
  bool overlap_off = false;  // dp buckets start after the schedule (TrainerConfig::overlap_dp off)
  std::vector<int> stage_layers{};   // uneven pipeline stages (blocks per stage)
  std::vector<double> rank_speed{};  // the balanced split for these pipeline speeds
  std::vector<index_t> dp_rows{};    // unequal dp shares of the global batch
  std::vector<double> dp_speed{};    // dp ranks' speeds (simulated with simulate_rank_speed)
};

inline TrainerConfig with_layout(TrainerConfig c, const Layout& l) {
  c.pp = l.pp;
  c.dp = l.dp;
  c.tp = l.tp;
  c.cp = l.cp;
  c.stage_layers = l.stage_layers;
  c.rank_speed = l.rank_speed;
  c.dp_rows = l.dp_rows;
  c.dp_speed = l.dp_speed;
  c.cp_mode = l.cp_mode;
  c.cp_ulysses = l.cp_ulysses;
  c.cp_balance_documents = l.balance_documents;
  c.options.sequence_parallel = l.sp;
  c.zero = l.zero;
  c.shard_degree = l.shard_degree;
  c.schedule = l.schedule;
  c.microbatches = l.microbatches;
  c.options.dropout = l.dropout;
  c.options.recompute = l.recompute;
  c.custom_schedule = l.custom_schedule;
  if (l.batch_p2p) c.p2p = trellis::pipe::ExecuteOptions::P2P::batch;
  c.overlap_dp = !l.overlap_off;
  c.poison_activations = true;  // a saved activation read before it is written turns the loss NaN
  if (l.moe) {
    c.model.moe_every = 2;
    c.model.experts = 4;
    c.model.moe_topk = 2;
    c.options.moe_capacity = l.capacity;
    c.options.moe_aux_loss = l.aux_loss;
    c.options.moe_z_loss = 1e-3f;
    c.ep = l.ep;
  }
  return c;
}

// Runs `steps` steps of layout l (optionally loading `load_from` first, saving to `save_to` after)
// on compute backend B (host fp32 by default; backend::Host<bfloat16> for the bf16 numerics;
// backend::DeviceChecked<...> for the discipline of device memory).
template <class B = trellis::backend::Host<float>>
void train(const TrainerConfig& cfg, int steps, RunResult& out, nn_test::Collector& weights,
                  const std::filesystem::path& load_from = {}, const std::filesystem::path& save_to = {},
                  bool packed = false) {
  const int ranks = cfg.pp * cfg.dp * cfg.tp * cfg.cp;
  std::mutex mutex;
  std::vector<double> losses, norms;
  trellis::comm::ThreadWorld world(ranks);
  world.run([&](ThreadComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(30000));
    Trainer<ThreadComm, B> t(comm, cfg);
    const int dp_rank = t.mesh().template coord<trellis::dp>();
    trellis::train::DataLoader loader(packed ? document_tokens() : tokens(), {cfg.batch, cfg.seq, 99, true, dp_rank, cfg.dp,
                                                                               packed ? kPackSeparator : -1, cfg.dp_rows});
    if (!load_from.empty()) loader.restore(t.load(load_from).data);
    std::vector<double> my_losses, my_norms;
    for (int s = 0; s < steps; ++s) {
      auto r = t.step(loader.next());
      my_losses.push_back(r.loss);
      my_norms.push_back(r.grad_norm);
    }
    if (!save_to.empty()) t.save(save_to, loader.state());
    auto put = [&](trellis::nn::Parameter* p) {  // host copy: the values may live in device memory
      const auto host = trellis::backend::download_vector(t.backend(), p->value.data(), p->value.size());
      for (index_t i = 0; i < p->numel(); ++i)
        weights.put(p->name, p->global_numel(), p->global_index(i), host[static_cast<std::size_t>(i)]);
    };
    t.with_parameters([&] {  // ZeRO-3: the values gathered for the call
      for (auto* p : t.parameters()) put(p);
      for (auto& m : t.chunks())  // every wte copy must equal the primary one
        for (auto* p : m->parameters())
          if (p->name == "wte.weight") put(p);
    });
    std::lock_guard<std::mutex> lock(mutex);
    if (comm.rank() == 0) {
      losses = my_losses;
      norms = my_norms;
    }
  });
  out.losses = losses;
  out.norms = norms;
  out.weights = &weights;
  out.names = weights.keys();
  out.replica_diff = weights.replica_diff();
}

}  // namespace trainer_test
