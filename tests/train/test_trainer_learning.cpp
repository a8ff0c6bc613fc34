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
