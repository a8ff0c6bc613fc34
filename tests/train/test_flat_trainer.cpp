// train::FlatTrainer (the one-device trainer the CUDA backend runs) against train::Trainer, fp32 on
// the host: same config, same data => the same losses for 6 steps (1e-5 relative) and the same final
// weights (1e-4 norm-relative per tensor), on one rank and data parallel over 2 thread ranks with
// 2 microbatches; with bf16 activations (backend::Host<bfloat16>, the CUDA path's rounding) within the
// GPU test's tolerances; layouts it cannot run are refused before any work.
#include <catch2/catch.hpp>

#include <cmath>
#include <mutex>
#include <string>
#include <vector>

#include "temp_dir.hpp"
#include "test_trainer_support.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/train/flat_trainer.hpp"

using trellis::comm::ThreadComm;
namespace backend = trellis::backend;
using trellis::train::FlatTrainer;
using namespace trainer_test;

using nn_test::norm_relative;

namespace {

struct FlatRun {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;
};

template <class Ops = backend::Host<float>>
FlatRun train_flat(const TrainerConfig& cfg, int steps) {
  FlatRun out;
  std::mutex mutex;
  trellis::comm::ThreadWorld world(cfg.dp);
  world.run([&](ThreadComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(30000));
    FlatTrainer<Ops> t(cfg);
    trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, comm.rank(), cfg.dp});
    std::vector<double> losses;
    for (int s = 0; s < steps; ++s) {
      const auto r = t.step(loader.next(), &comm);
      losses.push_back(r.loss);
      // dp: one reduction per block started during the backward, then wte/wpe and ln_f
      const int layers = static_cast<int>(cfg.model.layers);
      std::lock_guard<std::mutex> lock(mutex);
      CHECK(r.buckets == (cfg.dp > 1 ? layers + 2 : 0));
      CHECK(r.buckets_overlapped == (cfg.dp > 1 ? layers : 0));
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (comm.rank() == 0) {
      out.losses = losses;
      for (const auto& ten : t.model().tensors()) out.weights[ten.name] = t.model().value(ten.name);
    }
  });
  return out;
}

void compare(const Layout& layout) {
  const TrainerConfig cfg = with_layout(tiny_config(), layout);
  const int steps = 6;
  RunResult ref;
  nn_test::Collector ref_weights;
  train(cfg, steps, ref, ref_weights);
  const FlatRun flat = train_flat(cfg, steps);
  REQUIRE(flat.losses.size() == ref.losses.size());
  for (int s = 0; s < steps; ++s) {
    INFO("step " << s << ": flat " << flat.losses[s] << " trainer " << ref.losses[s]);
    CHECK(std::fabs(flat.losses[s] - ref.losses[s]) <= 1e-5 * std::fabs(ref.losses[s]));
  }
  CHECK(ref.losses.back() < ref.losses.front());  // it trains
  for (const auto& [name, w] : flat.weights) {
    const auto want = ref_weights.get(name);
    INFO(name);
    REQUIRE(want.size() == w.size());
    CHECK(norm_relative(w, want) <= 1e-4);
  }
}

}  // namespace

TEST_CASE("FlatTrainer equals Trainer on one rank", "[train][flat]") { compare({}); }

TEST_CASE("FlatTrainer data parallel (2 ranks, 2 microbatches) equals Trainer", "[train][flat][dp]") {
  Layout l;
  l.dp = 2;
  l.microbatches = 2;
  compare(l);
}

// The GPU test's tolerances (tests/gpu/test_flat_gpt_cuda.cu) for bf16 rounding alone, on the host.
TEST_CASE("FlatTrainer with bf16 activations: two steps within bf16 tolerance of Trainer", "[train][flat][bf16]") {
  const TrainerConfig cfg = tiny_config();
  RunResult ref;
  nn_test::Collector ref_weights;
  train(cfg, 2, ref, ref_weights);
  const FlatRun flat = train_flat<backend::Host<trellis::bfloat16>>(cfg, 2);
  for (int s = 0; s < 2; ++s) {
    INFO("step " << s << ": bf16 " << flat.losses[s] << " fp32 " << ref.losses[s]);
    CHECK(std::fabs(flat.losses[s] - ref.losses[s]) <= 5e-3 * std::fabs(ref.losses[s]));
  }
  for (const auto& [name, w] : flat.weights) {
    const double err = norm_relative(w, ref_weights.get(name));
    INFO(name << ": norm-relative weight error " << err);
    CHECK(err <= 2e-2);
  }
}

// Checkpoints go both ways: a tp2 x dp2 Trainer checkpoint resumes in FlatTrainer, and a FlatTrainer
// checkpoint resumes in a tp2 Trainer, each continuing with the losses of an uninterrupted run.
TEST_CASE("FlatTrainer checkpoints interoperate with Trainer layouts", "[train][flat][checkpoint]") {
  TempDir dir("flat_ckpt");
  Layout tp2;
  tp2.tp = 2;
  tp2.dp = 2;
  const TrainerConfig cfg = tiny_config(), cfg_tp2 = with_layout(cfg, tp2);
  RunResult first, second;
  nn_test::Collector w1, w2;
  train(cfg_tp2, 3, first, w1, {}, dir.path / "a");
  train(cfg_tp2, 3, second, w2, dir.path / "a");  // resumed by the same layout: the reference

  std::vector<double> flat_losses;
  {
    FlatTrainer<backend::Host<float>> t(cfg);
    trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, 0, 1});
    loader.restore(t.load(dir.path / "a").data);
    CHECK(t.step_count() == 3);
    for (int s = 0; s < 3; ++s) flat_losses.push_back(t.step(loader.next()).loss);
    t.save(dir.path / "b", loader.state());
  }
  for (int s = 0; s < 3; ++s) {
    INFO("step " << 3 + s << ": flat " << flat_losses[s] << " trainer " << second.losses[s]);
    CHECK(std::fabs(flat_losses[s] - second.losses[s]) <= 1e-5 * std::fabs(second.losses[s]));
  }
  // FlatTrainer's checkpoint (step 6) resumed by a tp2 Trainer and by FlatTrainer agree.
  RunResult third;
  nn_test::Collector w3;
  train(cfg_tp2, 2, third, w3, dir.path / "b");
  FlatTrainer<backend::Host<float>> t(cfg);
  trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, 0, 1});
  loader.restore(t.load(dir.path / "b").data);
  for (int s = 0; s < 2; ++s) {
    const double l = t.step(loader.next()).loss;
    CHECK(std::fabs(l - third.losses[s]) <= 1e-5 * std::fabs(third.losses[s]));
  }
}

TEST_CASE("FlatTrainer refuses layouts it cannot run", "[train][flat][errors]") {
  TrainerConfig c = tiny_config();
  c.tp = 2;
  CHECK_THROWS_WITH(FlatTrainer<backend::Host<float>>(c), Catch::Contains("use --pp 1 --tp 1"));
  c = tiny_config();
  c.zero1 = true;
  CHECK_THROWS_WITH(FlatTrainer<backend::Host<float>>(c), Catch::Contains("--zero1 is not supported"));
  c = tiny_config();
  c.model.heads = 3;
  CHECK_THROWS_WITH(FlatTrainer<backend::Host<float>>(c), Catch::Contains("not divisible by --heads 3"));
}
