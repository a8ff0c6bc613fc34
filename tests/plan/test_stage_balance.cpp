// plan::stage_speeds (a cluster's device speeds as the trainer's pipeline and dp speeds) against
// brute force and hand cases, plan::stage_costs against the trainer's own FLOP count, and
// train_gpt's --cluster / --stage-costs flags.
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "train_gpt/flags.hpp"
#include "train_gpt/plan_auto.hpp"
#include "trellis/plan/search.hpp"
#include "trellis/plan/stage_balance.hpp"

using namespace trellis;

namespace {

train::TrainerConfig layout(int pp, int dp, int cp, int tp) {
  train::TrainerConfig c;
  c.model = {.vocab = 512, .positions = 128, .layers = 8, .heads = 8, .width = 256};
  c.seq = 128;
  c.batch = 16;
  c.pp = pp;
  c.dp = dp;
  c.cp = cp;
  c.tp = tp;
  return c;
}

// One node of `devices` devices (default: one per speed) with these speeds (or none).
plan::Cluster with_speeds(std::vector<double> speed, int devices = 0) {
  plan::Cluster c;
  c.name = "speeds";
  c.devices_per_node = devices > 0 ? devices : static_cast<int>(speed.size());
  c.device = {.name = "test", .memory_bytes = 64e9, .peak_flops_fp32 = 1e12, .peak_flops_bf16 = 1e12,
              .memory_bandwidth = 1e11};
  c.intra_node = c.inter_node = {.bandwidth = 1e11, .latency = 5e-6};
  c.speed = std::move(speed);
  return c;
}

bool has(const std::vector<std::string>& problems, const std::string& text) {
  for (const auto& p : problems)
    if (p.find(text) != std::string::npos) return true;
  return false;
}

}  // namespace

TEST_CASE("stage_speeds: hand cases on the trainer's mesh (pp, dp, cp, tp)", "[balance]") {
  using V = std::vector<double>;
  // pp 2 x dp 2: ranks 0, 1 are stage 0 (dp 0, 1), ranks 2, 3 stage 1
  auto s = plan::stage_speeds(layout(2, 2, 1, 1), with_speeds({1, 1, 0.5, 0.5}));
  CHECK(s.rank_speed == V{1, 0.5});
  CHECK(s.dp_speed == V{1, 1});
  CHECK(plan::StageSpeeds::uneven(s.dp_speed).empty());
  CHECK(plan::StageSpeeds::uneven(s.rank_speed) == V{1, 0.5});
  s = plan::stage_speeds(layout(2, 2, 1, 1), with_speeds({1, 0.5, 1, 0.5}));
  CHECK(s.rank_speed == V{1, 1});
  CHECK(s.dp_speed == V{1, 0.5});
  // tp 2 inside a stage: the slowest of the pair sets the stage's pace
  s = plan::stage_speeds(layout(2, 1, 1, 2), with_speeds({1, 0.25, 1, 1}));
  CHECK(s.rank_speed == V{0.25, 1});
  // one slow device of four in pp 2 x dp 2: its replica's share shrinks on every stage
  s = plan::stage_speeds(layout(2, 2, 1, 1), with_speeds({1, 1, 1, 0.5}));
  CHECK(s.rank_speed == V{1, 1});
  CHECK(s.dp_speed == V{1, 0.5});
  // no speeds in the file: all equal
  s = plan::stage_speeds(layout(2, 2, 1, 1), with_speeds({}, 4));
  CHECK(s.rank_speed == V{1, 1});
  CHECK(s.dp_speed == V{1, 1});
  CHECK_THROWS_WITH(plan::stage_speeds(layout(2, 2, 1, 1), with_speeds({1, 1, 1})),
                    Catch::Contains("3 devices") && Catch::Contains("4 ranks: one device per rank"));
}

TEST_CASE("stage_speeds: never above a device group's speed, each dp speed the most that allows; exact when the "
          "speeds factor",
          "[balance]") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> u(0.1, 2.0);
  std::uniform_int_distribution<int> n(1, 3);
  for (int trial = 0; trial < 300; ++trial) {
    const int pp = n(rng), dp = n(rng), cp = n(rng) == 3 ? 2 : 1, tp = n(rng) == 3 ? 2 : 1, inner = cp * tp;
    const bool factored = trial % 2 == 0;
    std::vector<double> a(static_cast<std::size_t>(pp)), b(static_cast<std::size_t>(dp));
    for (auto& x : a) x = u(rng);
    for (auto& x : b) x = u(rng);
    // device speeds; the reference group speed g(p, d): the least of its cp x tp devices
    std::vector<double> speed, group;
    for (int p = 0; p < pp; ++p)
      for (int d = 0; d < dp; ++d) {
        const double g = factored ? a[static_cast<std::size_t>(p)] * b[static_cast<std::size_t>(d)] : u(rng);
        group.push_back(g);
        for (int i = 0; i < inner; ++i) speed.push_back(i == inner / 2 ? g : g * (1 + u(rng)));  // one at g, the rest faster
      }
    const auto s = plan::stage_speeds(layout(pp, dp, cp, tp), with_speeds(speed));
    INFO("trial " << trial << ": pp " << pp << " dp " << dp << " cp " << cp << " tp " << tp);
    REQUIRE(s.rank_speed.size() == static_cast<std::size_t>(pp));
    REQUIRE(s.dp_speed.size() == static_cast<std::size_t>(dp));
    const double g00 = group.front(), r00 = s.rank_speed[0] * s.dp_speed[0];
    for (int d = 0; d < dp; ++d) {
      bool tight = false;  // some stage limits dp rank d: its speed could not be any higher
      for (int p = 0; p < pp; ++p) {
        const double product = s.rank_speed[static_cast<std::size_t>(p)] * s.dp_speed[static_cast<std::size_t>(d)];
        const double g = group[static_cast<std::size_t>(p * dp + d)];
        CHECK(product <= g * (1 + 1e-12));
        tight = tight || product >= g * (1 - 1e-12);
        if (factored) CHECK(product / r00 == Approx(g / g00).epsilon(1e-12));  // the same ratios as the devices'
      }
      CHECK(tight);
    }
  }
}

TEST_CASE("stage_costs: with GEMM and attention rates of FLOPs alone it is 3 R / peak x the trainer's FLOP count",
          "[balance]") {
  // F + B + W of a GEMM is 3x its forward FLOPs, and so is attention's forward + backward with
  // the backward at 2x: then the cost model's block and head are the FLOP count layer_costs uses
  // (forward per token) x 3 x rows / peak. Nothing else costs here.
  const double peak = 1e12;
  plan::Rates r;
  r.gemm = [&](double m, double n, double k, plan::GemmForm) { return 2 * m * n * k / peak; };
  r.attention_forward = [&](double b, double h, double t, double d) { return 2 * b * h * t * t * d / peak; };
  r.attention_backward = [&](double b, double h, double t, double d) { return 4 * b * h * t * t * d / peak; };
  r.layernorm = [](double, double, bool) { return 0.0; };
  r.gelu = [](double, bool) { return 0.0; };
  r.cross_entropy = [](double, double, bool) { return 0.0; };
  r.memory = [](double) { return 0.0; };
  r.adamw = [](double) { return 0.0; };
  for (const std::string schedule : {"1f1b", "local_learning"}) {
    train::TrainerConfig c = layout(4, 1, 1, 1);
    c.schedule = schedule;
    c.microbatches = 4;
    const double rows = static_cast<double>(c.batch) / c.microbatches * static_cast<double>(c.seq);
    const train::LayerCosts flops = train::layer_costs(c, schedule == "local_learning");
    const train::LayerCosts timed = plan::stage_costs(c, with_speeds({1, 1, 1, 1}), r);
    INFO(schedule);
    REQUIRE(timed.layers.size() == flops.layers.size());
    REQUIRE(timed.fixed.size() == flops.fixed.size());
    for (std::size_t i = 0; i < flops.layers.size(); ++i)
      CHECK(timed.layers[i] == Approx(3 * rows / peak * flops.layers[i]).epsilon(1e-12));
    for (std::size_t i = 0; i < flops.fixed.size(); ++i)
      CHECK(timed.fixed[i] == Approx(3 * rows / peak * flops.fixed[i]).epsilon(1e-12));
  }
  // a memory pass costs: the embedding appears on the first stage, the head's norms on the last
  r.memory = [](double bytes) { return bytes * 1e-10; };
  const train::TrainerConfig c = layout(2, 1, 1, 1);
  const train::LayerCosts timed = plan::stage_costs(c, with_speeds({1, 1}), r);
  CHECK(timed.fixed[0] > 0);
  CHECK(timed.fixed[1] > 3 * 2 * 128.0 * 8 * 512 * 256 / peak);

  // MoE blocks (0, 2, 4, 6 of the 8) cost as predict_step costs them: each stage's blocks and
  // fixed work equal its per-stage times
  train::TrainerConfig moe = c;
  moe.model.moe_every = 2;
  moe.model.experts = 4;
  moe.model.moe_topk = 2;
  const train::LayerCosts moe_timed = plan::stage_costs(moe, with_speeds({1, 1}), r);
  const plan::StepCost moe_step = plan::predict_step(moe, with_speeds({1, 1}), r);
  CHECK(moe_timed.layers[0] != moe_timed.layers[1]);
  for (int v = 0; v < 2; ++v) {
    double sum = moe_timed.fixed[static_cast<std::size_t>(v)];
    for (int l = 4 * v; l < 4 * v + 4; ++l) sum += moe_timed.layers[static_cast<std::size_t>(l)];
    CHECK(sum == Approx(moe_step.stage[static_cast<std::size_t>(v)].total()).epsilon(1e-12));
  }
}

// Context parallelism in every mode is costed as predict_step costs it: its per-stage times (one
// microbatch, an even split: blocks x block + the stage's fixed work) equal stage_costs'. On nodes of
// 2 devices with a slower link between them, hybrid cp4 (u 2) has its all-to-alls inside a node and
// its ring across: a block costed with one link for both would differ.
TEST_CASE("stage_costs: ring, Ulysses and hybrid context parallelism as predict_step costs them", "[balance]") {
  const plan::Rates r = plan::cluster_rates(with_speeds({1}), plan::Precision::fp32);
  for (const auto& [mode, cp] : {std::pair{nn::CpMode::ring, 2}, std::pair{nn::CpMode::ulysses, 2},
                                 std::pair{nn::CpMode::hybrid, 4}}) {
    train::TrainerConfig c = layout(2, 1, cp, 1);
    c.cp_mode = mode;
    c.cp_ulysses = 2;
    plan::Cluster cluster = with_speeds(std::vector<double>(static_cast<std::size_t>(2 * cp), 1.0), 2);
    cluster.nodes = cp;
    cluster.inter_node = {.bandwidth = 1e9, .latency = 2e-5};
    INFO(nn::to_string(mode));
    REQUIRE(train::config_problems(c).empty());
    const train::LayerCosts timed = plan::stage_costs(c, cluster, r);
    const plan::StepCost cost = plan::predict_step(c, cluster, r);
    REQUIRE(cost.stage.size() == 2);
    CHECK(cost.stage[0].total() == Approx(4 * timed.layers[0] + timed.fixed[0]).epsilon(1e-12));
    CHECK(cost.stage[1].total() == Approx(4 * timed.layers[7] + timed.fixed[1]).epsilon(1e-12));
  }
}

TEST_CASE("stage_costs in the config: the split weighs them; bad ones are refused", "[balance]") {
  train::TrainerConfig c = layout(2, 1, 1, 1);
  c.rank_speed = {1, 1};
  c.stage_costs = train::LayerCosts{std::vector<double>(8, 1.0), {0.0, 4.0}};
  // stages of a and 8 - a blocks, the second with 4 more: max(a, 12 - a) is least at a = 6
  CHECK(train::pipeline_split(c) == std::vector<int>{0, 6, 8});
  CHECK(train::config_problems(c).empty());
  c.stage_costs->fixed = {0.0};
  CHECK(has(train::config_problems(c), "stage costs need --layers 8 block costs and --pp 2 stage costs"));
  c.stage_costs->fixed = {0.0, std::numeric_limits<double>::quiet_NaN()};
  CHECK(has(train::config_problems(c), "finite and >= 0"));
}

TEST_CASE("train_gpt --cluster and --stage-costs: speeds from the file, costs timed, the flags checked", "[balance]") {
  auto problems_of = [](std::vector<std::string> args) { return train_gpt::problems(train_gpt::parse_flags(args)); };
  CHECK(has(problems_of({"--pp", "2", "--cluster", "x.json", "--rank-speed", "1,1"}), "--cluster gives the ranks' speeds"));
  CHECK(has(problems_of({"--stage-costs", "timed"}), "--stage-costs must be flops or measured"));
  CHECK(has(problems_of({"--stage-costs", "measured"}), "needs --pp > 1 and --rank-speed or --cluster"));
  CHECK(has(problems_of({"--pp", "2", "--rank-speed", "1,0.5", "--stage-costs", "measured", "--mpi"}),
            "times the host kernels of thread ranks"));
  CHECK(has(problems_of({"--plan", "auto", "--ranks", "2", "--stage-costs", "measured"}), "does not model"));

  const auto dir = std::filesystem::temp_directory_path() / ("trellis_stage_balance_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto file = dir / "slow_second_stage.json";
  plan::Cluster cl = with_speeds({1, 1, 0.5, 0.5});
  cl.name = "two fast, two slow";
  std::ofstream(file) << plan::to_json(cl);
  const std::vector<std::string> args = {"--pp", "2", "--dp", "2", "--layers", "8", "--width", "64", "--heads", "2",
                                         "--vocab", "64", "--context", "32", "--batch", "8", "--cluster", file.string()};
  train_gpt::Options o = train_gpt::parse_flags(args);
  CHECK(train_gpt::problems(o).empty());
  o = train_gpt::apply_balance(o, false);
  CHECK(o.cluster.empty());
  CHECK(o.rank_speed == std::vector<double>{1, 0.5});
  CHECK(o.dp_speed.empty());  // both dp replicas of each stage are equal: equal shares
  CHECK(train_gpt::problems(o).empty());
  const train::TrainerConfig c = train_gpt::trainer_config(o);
  const std::vector<double> speeds{1, 0.5};
  CHECK(train::pipeline_split(c) == pipe::balanced_split(train::layer_costs(c).layers, speeds, train::layer_costs(c).fixed));
  CHECK(train::pipeline_split(c)[1] > 4);  // the fast stage takes more blocks

  // tp 2 over a fast and a slow device: one group at the slow one's pace, kept for the simulation
  const auto pair = dir / "fast_and_slow.json";
  std::ofstream(pair) << plan::to_json(with_speeds({1, 0.5}));
  o = train_gpt::apply_balance(train_gpt::parse_flags({"--tp", "2", "--layers", "2", "--width", "64", "--heads", "2",
                                                       "--vocab", "64", "--context", "32", "--batch", "8",
                                                       "--cluster", pair.string(), "--simulate-rank-speed"}),
                               false);
  CHECK(o.rank_speed.empty());
  CHECK(o.dp_speed == std::vector<double>{0.5});
  CHECK(o.simulate_rank_speed);
  CHECK(train_gpt::problems(o).empty());
  // --plan auto takes the file's speeds: a layout of the 2 ranks, made uneven for them
  o = train_gpt::apply_plan(train_gpt::parse_flags({"--plan", "auto", "--ranks", "2", "--layers", "4", "--width", "64",
                                                    "--heads", "2", "--vocab", "64", "--context", "32", "--batch", "8",
                                                    "--cluster", pair.string()}));
  CHECK(o.dp * o.tp * o.pp * o.cp == 2);  // cp2 too, when its timed rates come out fastest
  if (o.dp == 2) CHECK(o.dp_rows.size() == 2);
  if (o.pp == 2) CHECK(o.stage_layers.size() == 2);
  CHECK_THROWS_WITH(train_gpt::apply_plan(train_gpt::parse_flags({"--plan", "auto", "--ranks", "3", "--cluster",
                                                                  pair.string()})),
                    Catch::Contains("2 devices for --ranks 3"));

  // measured: times this machine's kernels (a small shape: quick) into costs of the right sizes
  std::vector<std::string> timed = args;
  timed.insert(timed.end(), {"--stage-costs", "measured"});
  o = train_gpt::apply_balance(train_gpt::parse_flags(timed), false);
  REQUIRE(o.measured_costs);
  CHECK(o.measured_costs->layers.size() == 8);
  CHECK(o.measured_costs->fixed.size() == 2);
  CHECK(o.measured_costs->layers.front() > 0);
  CHECK(o.measured_costs->fixed.back() > 0);  // the head
  CHECK(train_gpt::problems(o).empty());
  CHECK(train::config_problems(train_gpt::trainer_config(o)).empty());
  // with MoE blocks (0, 2, 4, 6: 4 experts, top-2), each timed as its own kind: an MoE block's
  // router and two experts' MLPs per token cost more than a dense block's MLP
  // (stage speeds by --rank-speed: a cluster file's speeds could give the dp replicas unequal
  // shares, which MoE models refuse)
  const std::vector<std::string> moe = {"--pp", "2", "--dp", "2", "--layers", "8", "--width", "64", "--heads", "2",
                                        "--vocab", "64", "--context", "32", "--batch", "8", "--rank-speed", "1,0.5",
                                        "--stage-costs", "measured", "--experts", "4", "--topk", "2", "--moe-every", "2"};
  for (const std::string& p : train_gpt::problems(train_gpt::parse_flags(moe))) FAIL_CHECK(p);
  o = train_gpt::apply_balance(train_gpt::parse_flags(moe), false);
  REQUIRE(o.measured_costs);
  REQUIRE(o.measured_costs->layers.size() == 8);
  for (std::size_t l = 0; l < 8; l += 2) {
    CHECK(o.measured_costs->layers[l] > o.measured_costs->layers[l + 1]);
    CHECK(o.measured_costs->layers[l] == o.measured_costs->layers[0]);  // the same kind, timed once
    CHECK(o.measured_costs->layers[l + 1] == o.measured_costs->layers[1]);
  }
  CHECK(train::config_problems(train_gpt::trainer_config(o)).empty());
  std::filesystem::remove_all(dir);
}

TEST_CASE("search on a cluster of mixed speeds: pipelines get uneven splits, the best of every split", "[balance]") {
  // 2 nodes of 2; the second node 2x slower
  plan::Cluster cl = with_speeds({1, 1, 0.5, 0.5});
  cl.nodes = 2;
  cl.devices_per_node = 2;
  cl.inter_node = {.bandwidth = 1e10, .latency = 2e-5};
  const plan::Rates rates = plan::cluster_rates(cl, plan::Precision::fp32);
  train::TrainerConfig base = layout(1, 1, 1, 1);
  base.model.vocab = 4096;  // a head worth some blocks
  plan::SearchSpace space;
  space.max_microbatches = 8;
  space.zero = {0};
  space.recompute = {false};
  space.sequence_parallel = {false};
  space.schedules = {"gpipe", "1f1b"};
  const plan::Plan pruned = plan::search(base, cl, rates, space, 400);
  const plan::Plan all = plan::search(base, cl, rates, space, 400, false);
  REQUIRE(pruned.best.size() == all.best.size());
  int piped = 0;
  for (std::size_t i = 0; i < all.best.size(); ++i) {
    const train::TrainerConfig& c = all.best[i].config;
    CHECK(pruned.best[i].cost.step == all.best[i].cost.step);
    if (c.pp == 1) {
      CHECK(c.stage_layers.empty());
      continue;
    }
    INFO(plan::train_gpt_flags(c));
    REQUIRE(c.stage_layers.size() == static_cast<std::size_t>(c.pp));
    CHECK(plan::train_gpt_flags(c).find("--stage-layers ") != std::string::npos);
    if (c.pp != 2) continue;
    ++piped;
    CHECK(c.stage_layers[0] > c.stage_layers[1]);  // the fast node's stage takes more blocks
    if (c.microbatches == 1) CHECK(c.stage_layers[0] == 7);  // a chain: all but one block on the fast node
    // every split of the 8 blocks, predicted: the balanced one is the fastest
    double best = 1e300;
    for (int first = 1; first < 8; ++first) {
      train::TrainerConfig split = c;
      split.stage_layers = {first, 8 - first};
      best = std::min(best, plan::predict_step(split, cl, rates).step);
    }
    CHECK(all.best[i].cost.step == Approx(best).epsilon(1e-12));
  }
  CHECK(piped >= 4);  // dp 2 x pp 2 and pp 2 x tp 2, two schedules, several microbatch counts
}

TEST_CASE("balance_for_speeds: 4 stages of mixed speeds, against every split of 12 blocks", "[balance]") {
  plan::Cluster cl = with_speeds({1, 0.5, 1, 0.75});
  const plan::Rates rates = plan::cluster_rates(cl, plan::Precision::fp32);
  for (const std::string schedule : {"gpipe", "1f1b", "zb_h1"})
    for (int m : {1, 4, 16}) {
      train::TrainerConfig c = layout(4, 1, 1, 1);
      c.model.layers = 12;
      c.model.vocab = 4096;
      c.schedule = schedule;
      c.microbatches = m;
      REQUIRE(plan::balance_for_speeds(c, cl, rates));
      const double chosen = plan::predict_step(c, cl, rates).step;
      double best = 1e300, even = 0;
      for (int a = 1; a <= 9; ++a)
        for (int b = 1; a + b <= 10; ++b)
          for (int d = 1; a + b + d <= 11; ++d) {
            train::TrainerConfig t = c;
            t.stage_layers = {a, b, d, 12 - a - b - d};
            const double step = plan::predict_step(t, cl, rates).step;
            best = std::min(best, step);
            if (a == 3 && b == 3 && d == 3) even = step;
          }
      INFO(schedule << " m " << m << ": " << plan::train_gpt_flags(c));
      CHECK(chosen < even);
      CHECK(chosen == Approx(best).epsilon(1e-12));  // the best of all 165 splits (a local search: here, not always)
    }
  train::TrainerConfig same = layout(4, 1, 1, 1);
  CHECK_FALSE(plan::balance_for_speeds(same, with_speeds({1, 1, 1, 1}), rates));  // one pace: the even split stays
  CHECK(same.stage_layers.empty());
}

TEST_CASE("dp replicas of mixed speeds: the pace by rows and speeds, the balanced shares the best of every split",
          "[balance]") {
  const plan::Cluster cl = with_speeds({1, 0.5});
  const plan::Rates rates = plan::cluster_rates(cl, plan::Precision::fp32);
  train::TrainerConfig c = layout(1, 2, 1, 1);
  c.model.vocab = 4096;
  // the pace: the replicas' rows over their speed, the slowest sets it (mean share 8 rows)
  c.dp_rows = {12, 4};
  CHECK(plan::pipeline_rank_pace(c, cl) == std::vector<double>{1 / 1.5});  // max(12/8/1, 4/8/0.5)
  c.dp_rows = {8, 8};
  const double equal_given = plan::predict_step(c, cl, rates).step;
  c.dp_rows.clear();
  CHECK(plan::pipeline_rank_pace(c, cl) == std::vector<double>{0.5});
  CHECK(plan::predict_step(c, cl, rates).step == equal_given);  // equal shares written out: the same step

  for (int m : {1, 2, 4}) {
    train::TrainerConfig t = c;
    t.microbatches = m;
    const double equal = plan::predict_step(t, cl, rates).step;
    REQUIRE(plan::balance_for_speeds(t, cl, rates));
    REQUIRE(t.dp_rows.size() == 2);
    CHECK(t.dp_rows[0] > t.dp_rows[1]);
    const double chosen = plan::predict_step(t, cl, rates).step;
    double best = 1e300;
    for (index_t r = m; r < 16; r += m) {  // every share of 16 rows in whole microbatches
      train::TrainerConfig u = t;
      u.dp_rows = {r, 16 - r};
      best = std::min(best, plan::predict_step(u, cl, rates).step);
    }
    INFO("m " << m << ": " << plan::train_gpt_flags(t));
    CHECK(chosen == Approx(best).epsilon(1e-12));
    CHECK(chosen < 0.8 * equal);  // the slow replica no longer sets the pace with half the rows
    CHECK(plan::train_gpt_flags(t).find("--dp-rows " + std::to_string(t.dp_rows[0]) + "," +
                                        std::to_string(t.dp_rows[1])) != std::string::npos);
    std::istringstream words(plan::train_gpt_flags(t));
    std::vector<std::string> args;
    for (std::string w; words >> w;) args.push_back(w);
    CHECK(train_gpt::trainer_config(train_gpt::parse_flags(args)).dp_rows == t.dp_rows);
  }
  // dp 2 x pp 2, the second replica slow on both stages: shares, and then the stages go at one pace
  train::TrainerConfig both = layout(2, 2, 1, 1);
  both.microbatches = 2;
  REQUIRE(plan::balance_for_speeds(both, with_speeds({1, 0.5, 1, 0.5}), rates));
  CHECK(both.dp_rows.size() == 2);
  CHECK(both.stage_layers.empty());
}
