// The demo learns: train_gpt's default layout (dp2 x tp2 x pp2, 1f1b, 8 thread ranks) on the
// shipped corpus (bytes as tokens), with a faster model than the demo's (width 64, context 32,
// 50 steps), must bring the validation loss clearly below the unigram baseline (the best loss
// without context): val <= baseline - 0.15 nats/token. The baseline is computed independently
// from token counts (train::unigram_cross_entropy); at the start the loss is ~log(256) = 5.5.
#include <catch2/catch.hpp>
#include <cmath>

#include "test_trainer_support.hpp"

using namespace trainer_test;

TEST_CASE("dp2 x tp2 x pp2 learns the shipped corpus below the unigram baseline",
          "[train][trainer][learning]") {
  const auto all =
      trellis::train::load_text_as_bytes(std::string(TRELLIS_SOURCE_DIR) + "/data/tiny_corpus.txt");
  const auto [train_data, val_data] = trellis::train::train_val_split(all, 0.1);
  const double baseline = trellis::train::unigram_cross_entropy(train_data.tokens, val_data.tokens, 256);
  TrainerConfig c;
  c.model = {.vocab = 256, .positions = 32, .layers = 4, .heads = 4, .width = 64};
  c.pp = c.dp = c.tp = 2;
  c.schedule = "1f1b";
  c.microbatches = 2;
  c.batch = 16;
  c.seq = 32;
  c.adamw.lr = 3e-3f;
  const int steps = 50;
  c.lr = {.max_lr = 3e-3, .min_lr = 3e-4, .warmup_steps = 4, .total_steps = steps};
  double first = 0, last = 0, val = 0;
  trellis::comm::ThreadWorld world(8);
  world.run([&](ThreadComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(60000));
    Trainer<ThreadComm> t(comm, c);
    const int dp_rank = t.mesh().coord<trellis::dp>();
    trellis::train::DataLoader loader(train_data.tokens, {c.batch, c.seq, 1, true, dp_rank, c.dp});
    trellis::train::DataLoader val_loader(val_data.tokens, {c.batch, c.seq, 1, false, dp_rank, c.dp});
    double f = 0, l = 0;
    for (int s = 0; s < steps; ++s) {
      l = t.step(loader.next()).loss;
      if (s == 0) f = l;
    }
    double v = 0;
    const auto nb = val_loader.batches_per_epoch();
    for (index_t b = 0; b < nb; ++b) v += t.evaluate(val_loader.next());
    if (comm.rank() == 0) {
      first = f;
      last = l;
      val = v / static_cast<double>(nb);
    }
  });
  INFO("first loss " << first << ", last " << last << ", validation " << val << ", unigram baseline "
                     << baseline);
  CHECK(std::fabs(first - std::log(256.0)) < 0.3);
  CHECK(val <= baseline - 0.15);
}

// The MoE GPT learns too and uses its experts: blocks 0 and 2 with 4 experts, top-2, dropless,
// the Switch load-balancing loss, experts over ep 2 of dp 2 (with tp 2: 4 thread ranks), 50 steps.
// Validation below the unigram baseline by 0.15 nats as above; every expert of every MoE block gets
// at least 10 % of the routed copies over the run (uniform: 25 %); the load-balancing loss is
// reported (> 0) and near its minimum coef = 0.01 for a balanced router (at most twice it).
TEST_CASE("an MoE GPT (ep2) learns the shipped corpus and uses every expert", "[train][trainer][learning][moe]") {
  const auto all =
      trellis::train::load_text_as_bytes(std::string(TRELLIS_SOURCE_DIR) + "/data/tiny_corpus.txt");
  const auto [train_data, val_data] = trellis::train::train_val_split(all, 0.1);
  const double baseline = trellis::train::unigram_cross_entropy(train_data.tokens, val_data.tokens, 256);
  TrainerConfig c;
  c.model = {.vocab = 256, .positions = 32, .layers = 4, .heads = 4, .width = 64, .moe_every = 2, .experts = 4, .moe_topk = 2};
  c.options.moe_aux_loss = 0.01f;
  c.dp = c.tp = 2;
  c.ep = 2;
  c.microbatches = 2;
  c.batch = 16;
  c.seq = 32;
  c.adamw.lr = 3e-3f;
  const int steps = 50;
  c.lr = {.max_lr = 3e-3, .min_lr = 3e-4, .warmup_steps = 4, .total_steps = steps};
  double val = 0, aux = 0;
  std::vector<std::pair<int, std::vector<double>>> load;
  trellis::comm::ThreadWorld world(4);
  world.run([&](ThreadComm& comm) {
    comm.set_timeout(std::chrono::milliseconds(60000));
    Trainer<ThreadComm> t(comm, c);
    const int dp_rank = t.mesh().coord<trellis::dp>();
    trellis::train::DataLoader loader(train_data.tokens, {c.batch, c.seq, 1, true, dp_rank, c.dp});
    trellis::train::DataLoader val_loader(val_data.tokens, {c.batch, c.seq, 1, false, dp_rank, c.dp});
    double a = 0;
    for (int s = 0; s < steps; ++s) a = t.step(loader.next()).moe_aux_loss;
    auto l = t.take_expert_load();
    double v = 0;
    const auto nb = val_loader.batches_per_epoch();
    for (index_t b = 0; b < nb; ++b) v += t.evaluate(val_loader.next());
    if (comm.rank() == 0) {
      val = v / static_cast<double>(nb);
      aux = a;
      load = l;
    }
  });
  INFO("validation " << val << ", unigram baseline " << baseline << ", last aux loss " << aux);
  CHECK(val <= baseline - 0.15);
  CHECK(aux > 0.0);
  CHECK(aux <= 2 * 2 * 0.01);  // two MoE blocks, each at most twice its balanced minimum
  REQUIRE(load.size() == 2);
  for (const auto& [layer, counts] : load) {
    double total = 0;
    for (double n : counts) total += n;
    CHECK(total == Approx(double(steps) * c.batch * c.seq * c.model.moe_topk));  // every copy counted once
    for (std::size_t e = 0; e < counts.size(); ++e) {
      INFO("block " << layer << " expert " << e << ": " << counts[e] / total);
      CHECK(counts[e] / total >= 0.10);
    }
  }
}
