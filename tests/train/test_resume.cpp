// End to end on the shipped corpus with a bigram model (a 256 x 256 logit table): data loader,
// warm-up + cosine LR, global-norm clipping, AdamW, metrics, checkpoint. Checks that
//  - a run stopped, checkpointed (weights, AdamW moments, step, RNG, data position) and resumed
//    in fresh objects ends bit-identical to the uninterrupted run;
//  - validation loss ends well below the unigram baseline (the bigram model learns order).
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "train/temp_dir.hpp"
#include "trellis/optim.hpp"
#include "trellis/train.hpp"

using namespace trellis;
using namespace trellis::io;
using namespace trellis::train;

namespace {
constexpr int V = 256;

// Mean cross-entropy of the bigram table `w` (V x V, row = previous token) on a batch, and its
// gradient when `grad` is given.
double bigram_loss(const std::vector<float>& w, const Batch& b, std::vector<float>* grad) {
  const index_t n = b.rows * b.seq_len;
  double loss = 0;
  std::vector<double> p(V);
  for (index_t i = 0; i < n; ++i) {
    const float* row = w.data() + b.inputs[static_cast<std::size_t>(i)] * V;
    double mx = row[0];
    for (int k = 1; k < V; ++k) mx = std::max(mx, static_cast<double>(row[k]));
    double z = 0;
    for (int k = 0; k < V; ++k) z += (p[k] = std::exp(row[k] - mx));
    const int t = b.targets[static_cast<std::size_t>(i)];
    loss -= std::log(p[static_cast<std::size_t>(t)] / z);
    if (grad) {
      float* g = grad->data() + b.inputs[static_cast<std::size_t>(i)] * V;
      for (int k = 0; k < V; ++k) g[k] += static_cast<float>((p[k] / z - (k == t)) / static_cast<double>(n));
    }
  }
  return loss / static_cast<double>(n);
}

struct Run {
  std::vector<float> w = std::vector<float>(V * V, 0.0f);
  optim::AdamWState<> state{V * V};
  DataLoader loader;
  Rng rng;
  Run(std::span<const token_t> tokens, std::uint64_t seed)
      : loader(tokens, {.batch_rows = 8, .seq_len = 32, .seed = seed}), rng(seed, 1) {
    for (auto& x : w) x = static_cast<float>(0.02 * rng.normal());
  }
};

const optim::AdamW hp{.lr = 0.05f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.0f};
const optim::WarmupCosine schedule{.max_lr = 0.05, .min_lr = 0.005, .warmup_steps = 10, .total_steps = 150};

// Steps [from, to) of the run; returns the last loss.
double train_steps(Run& r, std::int64_t from, std::int64_t to, MetricsWriter* metrics = nullptr) {
  double loss = 0;
  std::vector<float> grad(V * V);
  for (std::int64_t step = from; step < to; ++step) {
    std::fill(grad.begin(), grad.end(), 0.0f);
    Batch b = r.loader.next();
    loss = bigram_loss(r.w, b, &grad);
    std::vector<std::span<float>> gs = {grad};
    auto clip = optim::clip_grad_norm(gs, 1.0, optim::LocalSum{});
    const double lr = schedule(step);
    std::vector<std::span<float>> ps = {r.w};
    std::vector<std::span<const float>> cg = {std::span<const float>(grad)};
    r.state.update(hp, static_cast<float>(lr), ps, cg);
    r.rng.next_u64();  // stands in for dropout etc.: its state must resume too
    if (metrics) metrics->write({.step = step, .loss = loss, .lr = lr, .grad_norm = clip.norm});
  }
  return loss;
}

void save(const Run& r, const std::filesystem::path& root, std::int64_t step) {
  CheckpointWriter w(root, step, 0, 1);
  const Shape shape = {V, V};
  w.add_whole<float>("bigram.weight", r.w, shape);
  add_adamw_moments(w, "bigram.weight", shape, full_box(shape), r.state.m(0), r.state.v(0));
  save_train_state(w, {.step = r.state.step(), .rng = r.rng, .data = r.loader.state()});
  w.finish();
  commit_checkpoint(root, step, 1);
}

void load(Run& r, const std::filesystem::path& root) {
  Checkpoint ck(root);
  const Shape shape = {V, V};
  ck.expect("bigram.weight", DType::f32, shape);
  ck.read("bigram.weight", DType::f32, full_box(shape), r.w.data());
  read_adamw_moments(ck, "bigram.weight", full_box(shape), r.state.m(0), r.state.v(0));
  TrainState s = load_train_state(ck);
  r.state.set_step(s.step);
  r.rng = s.rng;
  r.loader.restore(s.data);
}
}  // namespace

TEST_CASE("a resumed run is bit-identical to an uninterrupted one", "[resume]") {
  auto corpus = load_text_as_bytes(TRELLIS_SOURCE_DIR "/data/tiny_corpus.txt");
  auto [train, val] = train_val_split(corpus, 0.1);
  Run straight(train.tokens, 5);
  train_steps(straight, 0, 60);

  TempDir dir("resume");
  Run first(train.tokens, 5);
  train_steps(first, 0, 25);
  save(first, dir.path, 25);
  Run second(train.tokens, 99);  // different init and seed: everything must come from the checkpoint
  Run fresh(train.tokens, 5);    // (same seed as the run, so the loader accepts the position)
  load(fresh, dir.path);
  REQUIRE(fresh.state.step() == 25);
  train_steps(fresh, 25, 60);
  REQUIRE(fresh.w == straight.w);
  REQUIRE(fresh.rng == straight.rng);
  REQUIRE(std::vector<float>(fresh.state.v(0).begin(), fresh.state.v(0).end()) ==
          std::vector<float>(straight.state.v(0).begin(), straight.state.v(0).end()));
  REQUIRE_THROWS_WITH(load(second, dir.path), Catch::Contains("seed 5"));
}

TEST_CASE("bigram model's validation loss ends well below the unigram baseline", "[resume]") {
  auto corpus = load_text_as_bytes(TRELLIS_SOURCE_DIR "/data/tiny_corpus.txt");
  auto [train, val] = train_val_split(corpus, 0.1);
  const double baseline = unigram_cross_entropy(train.tokens, val.tokens, V);
  TempDir dir("bigram");
  Run r(train.tokens, 3);
  MetricsWriter metrics(dir.path / "metrics.jsonl");
  const double first_loss = train_steps(r, 0, 1);
  train_steps(r, 1, 150, &metrics);
  DataLoader val_loader(val.tokens, {.batch_rows = 8, .seq_len = 32, .shuffle = false});
  double val_loss = 0;
  const index_t batches = val_loader.batches_per_epoch();
  for (index_t i = 0; i < batches; ++i) val_loss += bigram_loss(r.w, val_loader.next(), nullptr);
  val_loss /= static_cast<double>(batches);
  INFO("first loss " << first_loss << ", val loss " << val_loss << ", unigram baseline " << baseline);
  REQUIRE(first_loss == Approx(std::log(256.0)).margin(0.05));  // near-uniform start
  REQUIRE(val_loss < baseline - 0.3);
  REQUIRE(read_metrics(dir.path / "metrics.jsonl").size() == 149);
}

TEST_CASE("GPT-2 parameter list: names, shapes and the published 124M count", "[resume][gpt2]") {
  auto params = gpt2_parameters({});
  REQUIRE(params.size() == 2 + 12 * 12 + 2);
  index_t total = 0;
  for (const auto& p : params) total += shape_elements(p.shape);
  REQUIRE(total == 124439808);  // GPT-2 small with the head tied to wte
  REQUIRE(params[0].name == "wte.weight");
  REQUIRE(params[0].shape == Shape{50257, 768});
  REQUIRE(params[4].name == "h.0.attn.c_attn.weight");
  REQUIRE(params[4].shape == Shape{768, 2304});
  REQUIRE(params[4].weight_decay);
  REQUIRE_FALSE(params[5].weight_decay);  // h.0.attn.c_attn.bias
  REQUIRE(params.back().name == "ln_f.bias");
}

TEST_CASE("train state keys are checked on load", "[resume]") {
  TempDir dir("state");
  std::vector<float> x = {1, 2};
  {
    CheckpointWriter w(dir.path, 4, 0, 1);
    w.add_whole<float>("x", x, {2});
    w.set_metadata("train.step", "4");
    w.finish();
    commit_checkpoint(dir.path, 4, 1);
  }
  REQUIRE_THROWS_WITH(load_train_state(Checkpoint(dir.path)), Catch::Contains("no \"train.rng\""));
  {
    CheckpointWriter w(dir.path, 5, 0, 1);
    w.add_whole<float>("x", x, {2});
    save_train_state(w, {.step = 5, .rng = Rng(3), .data = {.seed = 3, .next_batch = 9}});
    w.finish();
    commit_checkpoint(dir.path, 5, 1);
  }
  TrainState s = load_train_state(Checkpoint(dir.path));
  REQUIRE(s.step == 5);
  REQUIRE(s.rng == Rng(3));
  REQUIRE(s.data == DataState{3, 9});
  std::vector<float> m(2), v(2);
  REQUIRE_THROWS_WITH(read_adamw_moments(Checkpoint(dir.path), "x", full_box({2}), m, v), Catch::Contains("optimizer.m.x"));
}

TEST_CASE("numbers in a checkpoint's metadata are range-checked; errors name the checkpoint and field",
          "[resume][errors]") {
  TempDir dir("state-range");
  std::vector<float> x = {1, 2};
  auto save_with = [&](const std::string& key, const std::string& value) {
    CheckpointWriter w(dir.path, 5, 0, 1);
    w.add_whole<float>("x", x, {2});
    save_train_state(w, {.step = 5, .rng = Rng(3), .data = {.seed = 3, .next_batch = 9}});
    w.set_metadata(key, value);
    w.finish();
    commit_checkpoint(dir.path, 5, 1);
  };
  const std::string index = (dir.path / "step-00000005" / "index.json").string();
  struct Bad {
    std::string key, value, field;
  };
  for (const Bad& bad : {Bad{"train.step", "99999999999999999999", "train.step"},  // strtoll made it 2^63 - 1
                         Bad{"train.step", "-5", "train.step"}, Bad{"train.step", "5x", "train.step"},
                         Bad{"train.data", "seed=3;next_batch=-1", "next_batch"},  // %llu made it 2^64 - 1
                         Bad{"train.data", "seed=3;next_batch=9223372036854775808", "next_batch"},
                         Bad{"train.data", "seed=3", "train.data"}, Bad{"train.rng", "zz", "train.rng"}}) {
    INFO(bad.key << " = " << bad.value);
    save_with(bad.key, bad.value);
    REQUIRE_THROWS_WITH(load_train_state(Checkpoint(dir.path)),
                        Catch::Contains(index) && Catch::Contains(bad.key) && Catch::Contains(bad.field));
  }
  save_with("train.step", "5");
  REQUIRE(load_train_state(Checkpoint(dir.path)).step == 5);
}

TEST_CASE("step and world size in index.json are range-checked", "[resume][errors]") {
  TempDir dir("index-range");
  std::vector<float> x = {1, 2};
  for (int r = 0; r < 2; ++r) {
    CheckpointWriter w(dir.path, 5, r, 2);
    if (r == 0) w.add_whole<float>("x", x, {2});
    w.finish();
  }
  commit_checkpoint(dir.path, 5, 2);
  const auto index_path = dir.path / "step-00000005" / "index.json";
  const std::string index = read_whole_file(index_path);
  auto with = [&](const std::string& from, const std::string& to) {
    std::string changed = index;
    const auto pos = changed.find(from);
    REQUIRE(pos != std::string::npos);
    changed.replace(pos, from.size(), to);
    write_file_atomically(index_path, changed);
    reseal_checkpoint_index(index_path);  // the range checks, not the checksum, must catch these
  };
  with("\"world_size\": 2", "\"world_size\": 4294967298");  // an int cast made it 2
  REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains(index_path.string()) && Catch::Contains("world_size"));
  with("\"world_size\": 2", "\"world_size\": 0");
  REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains(index_path.string()) && Catch::Contains("world_size"));
  with("\"step\": 5", "\"step\": -5");
  REQUIRE_THROWS_WITH(Checkpoint(dir.path), Catch::Contains(index_path.string()) && Catch::Contains("step"));
  write_file_atomically(index_path, index);
  REQUIRE(Checkpoint(dir.path).world_size() == 2);
}
