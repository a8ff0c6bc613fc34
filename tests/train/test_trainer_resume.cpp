// Trainer checkpoints:
//  - resume: 6 steps straight == 3 steps, save, a NEW world/trainer loads, 3 more steps: losses
//    and final weights bitwise equal (tp2.pp2 zb_h1, dp2 ZeRO-1, dp2 m2 ZeRO-2, and with dropout 0.1:
//    tp2+sp.pp2 zb_h1 and dp2 m2, whose masks come from the restored step count; dp2.pp2 ZeRO-3);
//  - reshard: the tp2.pp2 checkpoint at step 3 loaded under dp2, pp4, one rank and dp2 ZeRO-1,
//    then 3 more steps: the same losses (1e-5 relative) and weights (1e-5 of each tensor's scale)
//    as the straight run (other layouts sum in another order, so not bitwise);
//  - ZeRO stages: a dp2 ZeRO-2 checkpoint continues under dp2 (no ZeRO), dp4 ZeRO-1 and dp2.pp2
//    ZeRO-3 and dp4 ZeRO-3 hybrid-sharded in groups of 2, whose checkpoints continue under ZeRO-2
//    again (1e-5, as a reshard); a hybrid dp4 ZeRO-3 run resumes bitwise;
//  - an MoE checkpoint (dp4 ep2 ZeRO-1) resumes bitwise and continues the same under one rank,
//    dp2 ep2, dp4 ep4 and dp2.tp2.pp2 ep2;
//  - refusals: another model shape or configuration; ranks that saved different data positions
//    or cannot open the checkpoint (every rank throws the same error).
#include <catch2/catch.hpp>

#include <algorithm>
#include <string>
#include <vector>

#include "temp_dir.hpp"
#include "test_trainer_support.hpp"
#include "trellis/train/checkpoint.hpp"

using namespace trainer_test;

namespace {

struct Straight {
  nn_test::Collector weights;
  RunResult run;
};

void straight(const Layout& l, Straight& s, int steps = 6) { train(with_layout(tiny_config(), l), steps, s.run, s.weights); }
// Three steps continued from the straight run's step-3 checkpoint (in another layout): the losses of
// its steps 4..6 and its final weights, 1e-5 relative (another layout sums in another order).
void check_continues(const Straight& s, const RunResult& r, const nn_test::Collector& w) {
  for (int i = 0; i < 3; ++i) {
    INFO("step " << 3 + i << ": " << r.losses[i] << " vs " << s.run.losses[3 + i]);
    CHECK(std::fabs(r.losses[i] - s.run.losses[3 + i]) <= 1e-5 * std::fabs(s.run.losses[3 + i]));
  }
  for (const auto& name : s.run.names) {
    INFO("tensor " << name);
    CHECK(nn_test::rel_error(w.get(name), s.weights.get(name)) <= 1e-5);
  }
}

// Three steps of layout l, saved under `dir` (their losses and weights are not needed).
void save_three_steps(const Layout& l, const std::filesystem::path& dir) {
  nn_test::Collector w;
  RunResult r;
  train(with_layout(tiny_config(), l), 3, r, w, {}, dir);
}

}  // namespace

TEST_CASE("resume continues bitwise", "[train][trainer][resume]") {
  for (const Layout& l :
       {Layout{.pp = 2, .tp = 2, .schedule = "zb_h1", .microbatches = 2}, Layout{.dp = 2, .zero = 1},
        Layout{.dp = 2, .zero = 2, .microbatches = 2}, Layout{.pp = 2, .dp = 2, .zero = 3, .schedule = "zb_h1", .microbatches = 2},
        Layout{.dp = 4, .zero = 3, .shard_degree = 2, .microbatches = 2},
        Layout{.pp = 2, .tp = 2, .sp = true, .schedule = "zb_h1", .microbatches = 2, .dropout = 0.1f},
        Layout{.dp = 2, .microbatches = 2, .dropout = 0.1f}}) {
    INFO("pp " << l.pp << " dp " << l.dp << " tp " << l.tp << " zero " << l.zero << " dropout " << l.dropout);
    Straight s;
    straight(l, s);
    TempDir dir("trainer-resume");
    nn_test::Collector w1, w2;
    RunResult first, second;
    train(with_layout(tiny_config(), l), 3, first, w1, {}, dir.path);
    auto latest = trellis::train::latest_checkpoint(dir.path);
    REQUIRE(latest.has_value());
    CHECK(latest->filename() == "step-00000003");
    train(with_layout(tiny_config(), l), 3, second, w2, *latest);
    for (int i = 0; i < 3; ++i) {
      CHECK(first.losses[i] == s.run.losses[i]);
      CHECK(second.losses[i] == s.run.losses[3 + i]);
    }
    for (const auto& name : s.run.names) {
      INFO("tensor " << name);
      CHECK(w2.get(name) == s.weights.get(name));
    }
  }
}

TEST_CASE("a checkpoint loads into other layouts and training continues the same",
          "[train][trainer][reshard]") {
  const Layout saved{.pp = 2, .tp = 2, .schedule = "1f1b", .microbatches = 2};
  Straight s;
  straight(saved, s);
  TempDir dir("trainer-reshard");
  save_three_steps(saved, dir.path);
  const auto ckpt = *trellis::train::latest_checkpoint(dir.path);
  for (const Layout& l : {Layout{.dp = 2}, Layout{.pp = 4, .schedule = "1f1b", .microbatches = 4}, Layout{},
                          Layout{.dp = 2, .zero = 1},
                          Layout{.pp = 2, .dp = 2, .schedule = "interleaved_1f1b", .microbatches = 2},
                          Layout{.dp = 2, .zero = 1, .cp = 2}, Layout{.tp = 2, .sp = true, .cp = 2},
                          Layout{.pp = 2, .dp = 2, .zero = 2, .schedule = "zb_h1", .microbatches = 2}}) {
    INFO("loaded into pp " << l.pp << " dp " << l.dp << " tp " << l.tp << " cp " << l.cp << " zero " << l.zero);
    nn_test::Collector w;
    RunResult r;
    train(with_layout(tiny_config(), l), 3, r, w, ckpt);
    check_continues(s, r, w);
  }
}

TEST_CASE("checkpoints move between ZeRO stages: a ZeRO-2 save loads into ZeRO-0, 1 and 3 and back",
          "[train][trainer][reshard][zero]") {
  const Layout zero2{.dp = 2, .zero = 2, .microbatches = 2};
  Straight s;
  straight(zero2, s);
  for (const Layout& other : {Layout{.dp = 2, .microbatches = 2}, Layout{.dp = 4, .zero = 1, .microbatches = 1},
                              Layout{.pp = 2, .dp = 2, .zero = 3, .schedule = "1f1b", .microbatches = 2},
                              Layout{.dp = 4, .zero = 3, .shard_degree = 2, .microbatches = 2}}) {
    INFO("the other layout: dp " << other.dp << " zero " << other.zero << " shard degree " << other.shard_degree);
    TempDir dir("trainer-zero-stages");
    save_three_steps(zero2, dir.path);
    nn_test::Collector w, w_back;
    RunResult r, back;
    train(with_layout(tiny_config(), other), 3, r, w, *trellis::train::latest_checkpoint(dir.path), dir.path);
    check_continues(s, r, w);
    // ... and the other stage's checkpoint of step 6 back into ZeRO-2: three more steps
    Straight longer;
    straight(zero2, longer, 9);
    train(with_layout(tiny_config(), zero2), 3, back, w_back, *trellis::train::latest_checkpoint(dir.path));
    for (int i = 0; i < 3; ++i)
      CHECK(std::fabs(back.losses[i] - longer.run.losses[6 + i]) <= 1e-5 * std::fabs(longer.run.losses[6 + i]));
    for (const auto& name : longer.run.names) {
      INFO("tensor " << name);
      CHECK(nn_test::rel_error(w_back.get(name), longer.weights.get(name)) <= 1e-5);
    }
  }
}

TEST_CASE("a checkpoint saved under context parallelism (dp2.cp2, ZeRO-1) loads into one rank",
          "[train][trainer][reshard][cp]") {
  const Layout saved{.dp = 2, .zero = 1, .cp = 2};
  Straight s;
  straight(Layout{}, s);
  TempDir dir("trainer-reshard-cp");
  save_three_steps(saved, dir.path);
  nn_test::Collector w;
  RunResult r;
  train(with_layout(tiny_config(), Layout{}), 3, r, w, *trellis::train::latest_checkpoint(dir.path));
  check_continues(s, r, w);
}

TEST_CASE("an MoE checkpoint saved under ep (dp4 ep2 ZeRO-1) resumes bitwise and loads into other layouts",
          "[train][trainer][reshard][moe]") {
  // Dropless, no load-balancing loss: the routing is per token, so layouts continue the same.
  const Layout saved{.dp = 4, .zero = 1, .moe = true, .ep = 2};
  Straight s;
  straight(saved, s);
  TempDir dir("trainer-reshard-moe");
  save_three_steps(saved, dir.path);
  const auto ckpt = *trellis::train::latest_checkpoint(dir.path);
  {  // the same layout: bitwise
    nn_test::Collector w;
    RunResult r;
    train(with_layout(tiny_config(), saved), 3, r, w, ckpt);
    for (int i = 0; i < 3; ++i) CHECK(r.losses[i] == s.run.losses[3 + i]);
    for (const auto& name : s.run.names) {
      INFO("tensor " << name);
      CHECK(w.get(name) == s.weights.get(name));
    }
  }
  for (const Layout& l : {Layout{.moe = true}, Layout{.dp = 2, .moe = true, .ep = 2},
                          Layout{.dp = 4, .moe = true, .ep = 4},
                          Layout{.pp = 2, .dp = 2, .tp = 2, .microbatches = 2, .moe = true, .ep = 2}}) {
    INFO("loaded into pp " << l.pp << " dp " << l.dp << " tp " << l.tp << " ep " << l.ep);
    nn_test::Collector w;
    RunResult r;
    train(with_layout(tiny_config(), l), 3, r, w, ckpt);
    check_continues(s, r, w);
  }
}

namespace {
// The error of loading the checkpoint under `root` into a trainer of `cfg` ("" when it loads).
std::string load_error(const TrainerConfig& cfg, const std::filesystem::path& root) {
  std::string error;
  nn_test::run_ranks(cfg.pp * cfg.dp * cfg.tp, [&](ThreadComm& comm) {
    Trainer<ThreadComm> t(comm, cfg);
    try {
      t.load(*trellis::train::latest_checkpoint(root));
    } catch (const trellis::Error& e) {
      if (comm.rank() == 0) error = e.what();
    }
  });
  return error;
}
bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

TEST_CASE("a checkpoint of another model shape is refused naming the tensor",
          "[train][trainer][reshard][errors]") {
  TempDir dir("trainer-shape");
  nn_test::Collector w;
  RunResult r;
  train(tiny_config(), 1, r, w, {}, dir.path);
  auto other = tiny_config();
  other.model.width = 64;
  const std::string e = load_error(other, dir.path);
  CHECK(has(e, "width: 32 in the checkpoint, 64 in this model"));
}

// A 2-layer checkpoint resumed with 1 layer used to load layer 0 and exit 0 (its next save held
// only layer 0); a change of heads changes no tensor shape at all.
TEST_CASE("a checkpoint of another model configuration is refused naming both values",
          "[train][trainer][reshard][errors]") {
  TempDir dir("trainer-config");
  auto two = tiny_config();
  two.model.layers = 2;
  {
    nn_test::Collector w;
    RunResult r;
    train(two, 1, r, w, {}, dir.path);
  }
  auto one = two;
  one.model.layers = 1;
  const std::string e = load_error(one, dir.path);
  CHECK(has(e, "step-00000001"));
  CHECK(has(e, "layers: 2 in the checkpoint, 1 in this model"));
  auto heads = two;
  heads.model.heads = 2;
  CHECK(has(load_error(heads, dir.path), "heads: 4 in the checkpoint, 2 in this model"));
  auto layout = two;  // another layout of the same model loads
  layout.tp = 2;
  CHECK(load_error(layout, dir.path).empty());

  SECTION("a checkpoint that did not record its model: tensors nothing loads are an error naming them") {
    const auto index_path = dir.path / "step-00000001" / "index.json";
    std::string index = trellis::io::read_whole_file(index_path), kept;
    std::size_t start = 0;
    while (start < index.size()) {  // drop every "model.*" metadata line
      std::size_t end = index.find('\n', start);
      end = end == std::string::npos ? index.size() : end + 1;
      const std::string line = index.substr(start, end - start);
      if (!has(line, "\"model.")) kept += line;
      start = end;
    }
    REQUIRE(kept.size() < index.size());
    trellis::io::write_file_atomically(index_path, kept);
    trellis::train::reseal_checkpoint_index(index_path);  // an older checkpoint, not a corrupt one
    const std::string old = load_error(one, dir.path);
    // layer 1: 12 GPT-2 tensors, each with its two AdamW moments; the first 4 names, sorted
    CHECK(has(old, "36 tensor(s) not loaded by this model"));
    CHECK(has(old, "\"h.1.attn.c_attn.bias\", \"h.1.attn.c_attn.weight\", \"h.1.attn.c_proj.bias\""));
    CHECK(load_error(two, dir.path).empty());
  }
}

// A data position edited in one rank's metadata (checksums recomputed, as a careful hand edit or
// a bug in a tool would leave it) used to load: that rank's dp group then trained on other
// batches, exit 0. Now every rank refuses it with the same message, in any layout.
TEST_CASE("ranks that saved different data positions: every rank refuses the checkpoint with the same error",
          "[train][trainer][resume][errors]") {
  TempDir dir("trainer-agree");
  const Layout saved{.dp = 2, .tp = 2};
  {
    nn_test::Collector w;
    RunResult r;
    train(with_layout(tiny_config(), saved), 1, r, w, {}, dir.path);
  }
  const auto step = dir.path / "step-00000001";
  const auto index_path = step / "index.json";
  namespace json = trellis::io::json;
  json::Value index = json::parse(trellis::io::read_whole_file(index_path));
  auto& rank3 = index.as_object().at("rank_metadata").as_array().at(3).as_object();
  REQUIRE(rank3.at("train.data").as_string() == "seed=99;next_batch=1");
  rank3["train.data"] = json::Value("seed=99;next_batch=2");
  trellis::io::write_file_atomically(index_path, json::dump(index, 1));
  trellis::train::reseal_checkpoint_index(index_path);

  std::vector<std::string> errors(4);
  nn_test::run_ranks(4, [&](ThreadComm& comm) {
    Trainer<ThreadComm> t(comm, with_layout(tiny_config(), saved));
    try {
      t.load(step);
    } catch (const trellis::Error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.message();
    }
  });
  for (const auto& e : errors) {
    INFO(e);
    CHECK(e == errors[0]);
    CHECK(has(e, step.string()));
    CHECK(has(e, "different data positions"));
    CHECK(has(e, "ranks 0-2: seed=99;next_batch=1; rank 3: seed=99;next_batch=2"));
  }
  // Another layout refuses it too (one rank reads only rank 0's state, but checks all).
  CHECK(has(load_error(tiny_config(), dir.path), "different data positions"));

  // One rank given a path that holds no checkpoint: every rank reports that rank's error.
  std::fill(errors.begin(), errors.end(), std::string());
  nn_test::run_ranks(4, [&](ThreadComm& comm) {
    Trainer<ThreadComm> t(comm, with_layout(tiny_config(), saved));
    try {
      t.load(comm.rank() == 2 ? dir.path / "nowhere" : step);
    } catch (const trellis::Error& e) {
      errors[static_cast<std::size_t>(comm.rank())] = e.message();
    }
  });
  for (const auto& e : errors) {
    INFO(e);
    CHECK(e == errors[0]);
    CHECK(has(e, "no checkpoint at"));
    CHECK(has(e, "(on rank(s) 2 of 4)"));
  }
}
