// Trainer parity matrix (thread ranks, fp32): every layout trains 6 steps of the tiny GPT on the
// same global batches and must equal the single-rank run (the plain loop, microbatches 1):
//   loss per step: |loss - ref| <= 1e-5 |ref|;  grad norm: same 1e-5;
//   final weights: per tensor max |w - ref| <= 5e-5 * max |ref|   (after AdamW with clipping; see below)
// and the replicated copies (dp replicas, tp-replicated tensors, the wte copies of the first and
// last pipeline stage) must agree to 1e-6. Layouts: dp2; tp2; tp2+sp; pp2 with every schedule of
// pipe/ that trains the GPT (gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_h2, zb_v, dualpipe_v) at 4
// microbatches; dp2.tp2.pp2; ZeRO-1 (dp2, and dp2.tp2.pp2); dp2 with 2 microbatches.
// With dropout 0.1 (masks per global sample, nn/dropout.hpp) dp2, dp2 m2, tp2+sp, recompute, pp2
// and dp2.tp2+sp.pp2 equal the one-rank run with dropout, and dropout draws new masks every step.
// Host bf16 (backend::Host<bfloat16>: the CUDA backend's rounding points): every layout (cp ring,
// ulysses and hybrid included) against
// the one-rank bf16 run, and the one-rank bf16 run against fp32, with the tolerances stated there;
// two bf16 steps within the GPU test's tolerances of fp32.
// DeviceChecked (device-memory discipline on the host): nine layouts (one MoE: dp4.tp2+sp ep2
// ZeRO-1 with capacity and the load-balancing loss; one ZeRO-3) equal host fp32 bitwise.
// ZeRO-2 and ZeRO-3 ([zero]): against one rank in every layout; ZeRO-3 equals ZeRO-2 bitwise.
// Hybrid sharding ([hybrid]): ZeRO 1-3 over groups of replicas against one rank in every layout.
// Mixture of Experts: expert-parallel layouts against one rank or against the same layout without ep.
// Context parallel (ring attention): cp2, cp4, dp2.cp2 ZeRO-1, tp2+sp.cp2, pp2.cp2 zb_v, dp2 m2.cp2
// with dropout and recompute, cp2 packed, dp2.tp2+sp.pp2.cp2 packed equal one rank; Ulysses cp4,
// tp2+sp.cp2 ZeRO-1 packed, pp2.cp2 zb_h1; hybrid pp2.cp4, dp2 m2.cp4 with dropout, tp2+sp.cp4 packed.
// Balanced documents (packed rows reordered so every cp rank has the same causal work): cp2, cp4,
// dp2 m2.cp4 hybrid and tp2+sp.pp2.cp2 zb_h1 equal the one-rank packed run.
// Packed documents (the loader's packed mode): dp2 m2, tp2+sp with recompute, pp2 zb_h1 and
// dp2.tp2+sp.pp2 ZeRO-1 interleaved equal the one-rank packed run.
// Custom text schedules (pipe/text.hpp files): a hand-written 1F1B gives the losses of the 1f1b
// generator bitwise, a hand-written all-F-then-B-then-W one equals one rank; a bad one is refused.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "temp_dir.hpp"
#include "test_trainer_support.hpp"
#include "trellis/backend/device_checked.hpp"
#include "trellis/pipe/simulate.hpp"
#include "trellis/pipe/text.hpp"

using namespace trainer_test;

namespace {

constexpr int kSteps = 6;

constexpr float kDropout = 0.1f;

struct Reference {
  nn_test::Collector weights;
  RunResult run;
  Reference(float dropout, bool packed) {
    train(with_layout(tiny_config(), {.dropout = dropout}), kSteps, run, weights, {}, {}, packed);
  }
};
Reference& reference() {
  static Reference r(0.0f, false);
  return r;
}
Reference& dropout_reference() {
  static Reference r(kDropout, false);
  return r;
}
Reference& packed_reference() {
  static Reference r(0.0f, true);
  return r;
}


void check_against_reference(const Layout& l, const char* label) {
  INFO("layout " << label << " dropout " << l.dropout << " packed " << l.packed);
  REQUIRE(!(l.packed && l.dropout > 0));
  auto& ref = l.packed ? packed_reference() : l.dropout > 0 ? dropout_reference() : reference();
  REQUIRE(l.dropout == (l.dropout > 0 ? kDropout : 0.0f));
  nn_test::Collector weights;
  RunResult got;
  train(with_layout(tiny_config(), l), kSteps, got, weights, {}, {}, l.packed);
  REQUIRE(got.losses.size() == ref.run.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s) {
    INFO("step " << s << " loss " << got.losses[s] << " reference " << ref.run.losses[s]);
    CHECK(std::fabs(got.losses[s] - ref.run.losses[s]) <= 1e-5 * std::fabs(ref.run.losses[s]));
    CHECK(std::fabs(got.norms[s] - ref.run.norms[s]) <= 1e-5 * std::fabs(ref.run.norms[s]));
  }
  CHECK(got.replica_diff <= 1e-6f);
  REQUIRE(got.names == ref.run.names);
  for (const auto& name : got.names) {
    INFO("tensor " << name);
    CHECK(weights.complete(name));
    // 5e-5: Adam (eps 1e-5 here) turns the rounding noise of near-zero bias gradients into weight
    // differences; measured up to 1.4e-5 with OpenBLAS's Prescott kernels and 3.8e-5 with its
    // Cooperlake ones (dp2.tp2+sp.pp2 with dropout, h.2.mlp.c_proj.bias: 7e-7 absolute), since
    // the bias gradients are summed in 64-row blocks (kernels/elementwise_host.hpp column_sums).
    CHECK(nn_test::rel_error(weights.get(name), ref.weights.get(name)) <= 5e-5);
  }
}

// Layout l against layout ref (both trained here), with the tolerances above.
void check_layouts(const Layout& l, const Layout& ref_layout, const char* label) {
  INFO("layout " << label);
  nn_test::Collector weights, ref_weights;
  RunResult got, ref;
  train(with_layout(tiny_config(), l), kSteps, got, weights);
  train(with_layout(tiny_config(), ref_layout), kSteps, ref, ref_weights);
  REQUIRE(got.losses.size() == ref.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s) {
    INFO("step " << s << " loss " << got.losses[s] << " reference " << ref.losses[s]);
    CHECK(std::fabs(got.losses[s] - ref.losses[s]) <= 1e-5 * std::fabs(ref.losses[s]));
    CHECK(std::fabs(got.norms[s] - ref.norms[s]) <= 1e-5 * std::fabs(ref.norms[s]));
  }
  CHECK(got.replica_diff <= 1e-6f);
  REQUIRE(got.names == ref.names);
  for (const auto& name : got.names) {
    INFO("tensor " << name);
    CHECK(weights.complete(name));
    CHECK(nn_test::rel_error(weights.get(name), ref_weights.get(name)) <= 5e-5);
  }
}

// Two runs with the same bits: losses, norms and every weight.
void check_bitwise(const RunResult& got, nn_test::Collector& got_w, const RunResult& ref, nn_test::Collector& ref_w) {
  CHECK(got.losses == ref.losses);
  CHECK(got.norms == ref.norms);
  REQUIRE(got.names == ref.names);
  for (const auto& name : ref.names) {
    INFO("tensor " << name);
    CHECK(nn_test::rel_error(got_w.get(name), ref_w.get(name)) == 0.0);
  }
}

// 3 steps of `first` saved, then 3 of `then` loaded in a new world, equal 6 straight steps of
// `then` bit for bit.
void check_resumes_bitwise(const TrainerConfig& first, const TrainerConfig& then, const char* tag) {
  TempDir dir(tag);
  nn_test::Collector w6, w3, w33;
  RunResult six, half, second;
  train(then, 6, six, w6);
  train(first, 3, half, w3, {}, dir.path);
  train(then, 3, second, w33, *trellis::train::latest_checkpoint(dir.path));
  for (int i = 0; i < 3; ++i) CHECK(second.losses[i] == six.losses[3 + i]);
  for (const auto& name : six.names) CHECK(nn_test::rel_error(w33.get(name), w6.get(name)) == 0.0);
}

// A run whose ranks are slowed to their speeds (simulate_rank_speed: they sleep) gives the bits of
// the same run at full speed.
void check_slowed_ranks_change_no_bits(const TrainerConfig& c) {
  TrainerConfig slow = c;
  slow.simulate_rank_speed = true;
  nn_test::Collector w, sw;
  RunResult r, sr;
  train(c, 2, r, w);
  train(slow, 2, sr, sw);
  check_bitwise(sr, sw, r, w);
}

}  // namespace

TEST_CASE("the reference run learns and clips", "[train][trainer]") {
  auto& ref = reference();
  REQUIRE(ref.run.losses.size() == kSteps);
  CHECK(ref.run.losses.back() < ref.run.losses.front() - 0.1);
  CHECK(ref.run.norms.front() > tiny_config().clip);  // the clip path ran
  CHECK(ref.run.replica_diff == 0.0f);
}

TEST_CASE("data parallel and tensor parallel equal one rank", "[train][trainer][parity]") {
  check_against_reference({.dp = 2}, "dp2");
  check_against_reference({.dp = 2, .microbatches = 2}, "dp2 m2");
  check_against_reference({.tp = 2}, "tp2");
  check_against_reference({.tp = 2, .sp = true}, "tp2+sp");
}

// Uneven stages (devices of different speeds): an explicit split, and the balanced split for
// speeds 1 and 0.5 (pipe::balanced_split over the FLOP counts), equal one rank; the split is the
// one balanced_split picks, and a simulated slow rank changes no bits.
TEST_CASE("uneven pipeline stages equal one rank", "[train][trainer][parity][pipe][uneven]") {
  check_against_reference({.pp = 2, .schedule = "1f1b", .microbatches = 4, .stage_layers = {1, 3}}, "pp2 1+3");
  check_against_reference({.pp = 2, .schedule = "zb_h1", .microbatches = 4, .stage_layers = {3, 1}}, "pp2 3+1 zb_h1");
  check_against_reference({.pp = 2, .dp = 2, .schedule = "1f1b", .microbatches = 2, .rank_speed = {1.0, 0.5}},
                          "dp2.pp2 speeds 1, 0.5");
  TrainerConfig c = with_layout(tiny_config(), {.pp = 2, .schedule = "1f1b", .microbatches = 2, .rank_speed = {1.0, 0.5}});
  const auto split = trellis::train::pipeline_split(c);
  const auto k = trellis::train::layer_costs(c);
  CHECK(split == trellis::pipe::balanced_split(k.layers, c.rank_speed, k.fixed));
  CHECK(split[1] > 2);  // the slow second stage holds fewer than half the blocks
  trellis::comm::ThreadWorld(2).run([&](ThreadComm& comm) {
    Trainer<ThreadComm> t(comm, c);
    const auto& st = t.chunks().front()->stage();
    const int s = t.mesh().template coord<trellis::pp>();
    RANK_CHECK((st.first_layer == split[s] && st.end_layer == split[s + 1]));
  });
  check_slowed_ranks_change_no_bits(c);
}

// Unequal data-parallel shares (replicas of unequal speed): the same rows in other shares give
// the same gradients (the loss is the mean over the global batch's tokens; dropout masks follow
// the global sample), so every split equals one rank; a simulated slow dp rank changes no bits.
TEST_CASE("unequal dp shares equal one rank", "[train][trainer][parity][uneven]") {
  check_against_reference({.dp = 2, .dropout = 0.1f, .dp_rows = {6, 2}}, "dp2 rows 6+2, dropout");
  check_against_reference({.dp = 2, .microbatches = 2, .dp_rows = {2, 6}}, "dp2 m2 rows 2+6");
  check_against_reference({.dp = 2, .zero = 2, .microbatches = 2, .dp_rows = {4, 4}}, "dp2 ZeRO-2 rows 4+4");
  check_against_reference({.pp = 2, .dp = 2, .zero = 1, .schedule = "1f1b", .microbatches = 2, .dp_rows = {6, 2}},
                          "dp2.pp2 ZeRO-1 rows 6+2");
  check_against_reference({.dp = 4, .tp = 1, .zero = 3, .dp_rows = {1, 3, 2, 2}}, "dp4 ZeRO-3 rows 1+3+2+2");
  // what the Trainer and the loader refuse, naming it
  TrainerConfig bad = with_layout(tiny_config(), {.dp = 2, .microbatches = 2, .dp_rows = {5, 3}});
  CHECK_THAT(trellis::train::config_problems(bad).front(), Catch::Contains("--dp-rows needs --dp 2 row counts"));
  bad.dp_rows = {4, 4, 0};
  CHECK_THAT(trellis::train::config_problems(bad).front(), Catch::Contains("summing to 8"));
  CHECK_THROWS_WITH(trellis::train::DataLoader(tokens(), {8, 16, 1, true, 0, 2, -1, {5, 2}}),
                    Catch::Contains("2 dp shares summing to 7 rows"));
  // a slow dp rank simulated: the same bits
  TrainerConfig c = with_layout(tiny_config(), {.dp = 2, .dp_rows = {6, 2}, .dp_speed = {1.0, 0.5}});
  check_slowed_ranks_change_no_bits(c);
}

TEST_CASE("balanced_dp_rows: the shares whose slowest rank finishes first, in whole microbatches", "[train][uneven]") {
  using trellis::train::balanced_dp_rows;
  const std::vector<double> half{1.0, 0.5}, even{1, 1, 1, 1}, odd{3, 1, 1};
  CHECK(balanced_dp_rows(12, 1, half) == std::vector<index_t>{8, 4});
  CHECK(balanced_dp_rows(16, 2, half) == std::vector<index_t>{12, 4});  // 6 + 2 units; 5 + 3 takes as long
  CHECK(balanced_dp_rows(8, 1, even) == std::vector<index_t>{2, 2, 2, 2});
  CHECK(balanced_dp_rows(5, 1, odd) == std::vector<index_t>{3, 1, 1});
  const std::vector<double> tiny{1000.0, 1.0};
  CHECK(balanced_dp_rows(4, 2, tiny) == std::vector<index_t>{2, 2});  // every rank keeps one microbatch
  CHECK_THROWS_WITH(balanced_dp_rows(2, 2, half), Catch::Contains("cannot give each of 2 dp ranks one unit"));
  // brute force: the shares minimise the slowest rank's rows / speed
  for (index_t batch : {6, 10, 14})
    for (const auto& sp : {half, odd, std::vector<double>{0.2, 1.0, 0.7}}) {
      const auto got = balanced_dp_rows(batch, 1, sp);
      double got_t = 0, best = 1e30;
      index_t sum = 0;
      for (std::size_t i = 0; i < got.size(); ++i) got_t = std::max(got_t, static_cast<double>(got[i]) / sp[i]), sum += got[i];
      CHECK(sum == batch);
      std::vector<index_t> x(sp.size(), 1);
      std::function<void(std::size_t, index_t)> rec = [&](std::size_t i, index_t left) {
        if (i + 1 == sp.size()) {
          if (left < 1) return;
          x[i] = left;
          double t = 0;
          for (std::size_t j = 0; j < x.size(); ++j) t = std::max(t, static_cast<double>(x[j]) / sp[j]);
          best = std::min(best, t);
          return;
        }
        for (index_t k = 1; k < left; ++k) {
          x[i] = k;
          rec(i + 1, left - k);
        }
      };
      rec(0, batch);
      INFO("batch " << batch);
      CHECK(got_t <= best + 1e-12);
    }
}

TEST_CASE("pp2 with every schedule equals one rank", "[train][trainer][parity][pipe]") {
  for (const char* s : {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "zb_v", "dualpipe_v"})
    check_against_reference({.pp = 2, .schedule = s, .microbatches = 4}, s);
  // sends and receives posted as one group per run, as on NCCL (the receives these need paired)
  for (const char* s : {"interleaved_1f1b", "zb_v", "dualpipe_v"})
    check_against_reference({.pp = 2, .schedule = s, .microbatches = 4, .batch_p2p = true},
                            (std::string(s) + " grouped").c_str());
}

TEST_CASE("dp2 x tp2 x pp2 and ZeRO-1 equal one rank", "[train][trainer][parity]") {
  check_against_reference({.pp = 2, .dp = 2, .tp = 2, .schedule = "1f1b", .microbatches = 2}, "dp2.tp2.pp2");
  check_against_reference({.dp = 2, .zero = 1}, "dp2 zero1");
  check_against_reference(
      {.pp = 2, .dp = 2, .tp = 2, .sp = true, .zero = 1, .schedule = "zb_v", .microbatches = 2},
      "dp2.tp2+sp.pp2 zero1 zb_v");
}

// ZeRO-2: every microbatch's unit gradients reduce-scattered out of a slot, the shards summing
// the microbatches (train/grad_buckets.hpp). With one microbatch that is ZeRO-1's sum in ZeRO-1's
// order, so the bits agree; with several the order of the sums differs (within fp32 rounding).
TEST_CASE("ZeRO-2 equals one rank in every layout, and ZeRO-1 bitwise with one microbatch", "[train][trainer][parity][zero]") {
  check_against_reference({.dp = 2, .zero = 2}, "dp2 zero2");
  check_against_reference({.dp = 2, .zero = 2, .microbatches = 4}, "dp2 m4 zero2");
  check_against_reference({.dp = 4, .tp = 2, .sp = true, .zero = 2, .microbatches = 2}, "dp4.tp2+sp m2 zero2");
  check_against_reference({.pp = 2, .dp = 2, .tp = 2, .sp = true, .zero = 2, .schedule = "zb_v", .microbatches = 2},
                          "dp2.tp2+sp.pp2 zero2 zb_v");
  check_against_reference({.pp = 2, .dp = 2, .zero = 2, .schedule = "interleaved_1f1b", .microbatches = 4},
                          "dp2.pp2 zero2 interleaved m4");
  check_against_reference({.dp = 2, .zero = 2, .cp = 2}, "dp2.cp2 zero2");
  check_against_reference({.zero = 2, .packed = true, .cp = 2}, "cp2 zero2 packed (shards over cp)");
  check_against_reference({.dp = 2, .zero = 2, .dropout = kDropout, .recompute = true}, "dp2 zero2 dropout recompute");
  for (const Layout& l : {Layout{.dp = 2}, Layout{.pp = 2, .dp = 2, .schedule = "zb_h1", .microbatches = 1}}) {
    Layout one = l, two = l;
    one.zero = 1;
    two.zero = 2;
    nn_test::Collector w1, w2;
    RunResult r1, r2;
    train(with_layout(tiny_config(), one), kSteps, r1, w1);
    train(with_layout(tiny_config(), two), kSteps, r2, w2);
    INFO("pp " << l.pp);
    check_bitwise(r2, w2, r1, w1);
  }
}

// What ZeRO-2 keeps of the gradients: no packed buffer, two slots of the largest weight unit (a
// block here), this rank's shards and wte's whole gradient; a unit's gradient outside its W is
// unbound (reading it is an error, not stale data).
TEST_CASE("ZeRO-2 holds a shard and two unit slots of gradients, not the whole buffer", "[train][trainer][zero]") {
  const auto cfg1 = with_layout(tiny_config(), {.dp = 2, .zero = 1});
  const auto cfg2 = with_layout(tiny_config(), {.dp = 2, .zero = 2});
  nn_test::run_ranks(2, [&](ThreadComm& comm) {
    Trainer<ThreadComm> z1(comm, cfg1), z2(comm, cfg2);
    trellis::train::DataLoader loader(tokens(), {cfg2.batch, cfg2.seq, 99, true, comm.rank(), 2});
    const auto batch = loader.next();
    z2.step(batch);
    const auto& m = cfg2.model;
    const double W = static_cast<double>(m.width), V = static_cast<double>(m.vocab);
    const double block = 12 * W * W + 13 * W, wte = V * W, all = wte + m.positions * W + m.layers * block + 2 * W;
    RANK_CHECK(z2.chunks()[0]->parameter_buffer().grads().empty());
    RANK_CHECK(static_cast<double>(z1.chunks()[0]->parameter_buffer().grads().size()) >= all);
    // ZeRO-1: the packed buffer + shards of it; ZeRO-2: shards + wte + 2 slots, each a block's
    // gradients and their reduced half (padding: 16 floats per parameter at most, 12 a block)
    const double shards = static_cast<double>(z1.gradient_bytes()) / 4 -
                          static_cast<double>(z1.chunks()[0]->parameter_buffer().grads().size());
    RANK_CHECK(shards >= all / 2);
    RANK_CHECK(shards <= all / 2 + 16 * 40);
    const double z2_floats = static_cast<double>(z2.gradient_bytes()) / 4;
    RANK_CHECK(z2_floats >= shards + wte + 2 * 1.5 * block);
    RANK_CHECK(z2_floats <= shards + wte + 16 + 2 * 1.5 * (block + 12 * 16));
    for (auto* p : z2.parameters()) {  // (no INFO on rank threads: Catch2's streams are not thread-safe)
      if (p->name == "wte.weight")
        RANK_CHECK(p->grad.data() != nullptr);
      else
        RANK_CHECK_THROWS_WITH(static_cast<void>(p->grad[0]), Catch::Matchers::Contains("not bound"));
    }
  });
}

// ZeRO-3: the values sharded too, a unit's gathered around its forward and backward_input
// (train/param_shards.hpp). The gathered values are the shards' bits and the gradients and the
// update are ZeRO-2's, so ZeRO-3 equals ZeRO-2 bitwise, with or without prefetching.
TEST_CASE("ZeRO-3 equals one rank in every layout, and ZeRO-2 bitwise", "[train][trainer][parity][zero]") {
  check_against_reference({.dp = 2, .zero = 3}, "dp2 zero3");
  check_against_reference({.dp = 4, .tp = 2, .sp = true, .zero = 3, .microbatches = 2}, "dp4.tp2+sp m2 zero3");
  check_against_reference({.pp = 2, .dp = 2, .tp = 2, .sp = true, .zero = 3, .schedule = "zb_v", .microbatches = 2},
                          "dp2.tp2+sp.pp2 zero3 zb_v");
  check_against_reference({.pp = 2, .dp = 2, .zero = 3, .schedule = "interleaved_1f1b", .microbatches = 4},
                          "dp2.pp2 zero3 interleaved m4");
  check_against_reference({.dp = 2, .zero = 3, .cp = 2}, "dp2.cp2 zero3");
  check_against_reference({.dp = 2, .zero = 3, .dropout = kDropout, .recompute = true}, "dp2 zero3 dropout recompute");
  for (const Layout& l : {Layout{.dp = 2, .microbatches = 4}, Layout{.pp = 2, .dp = 2, .schedule = "zb_h1", .microbatches = 2},
                          Layout{.dp = 4, .microbatches = 2, .moe = true, .ep = 2}}) {
    Layout two = l, three = l;
    two.zero = 2;
    three.zero = 3;
    TrainerConfig no_prefetch = with_layout(tiny_config(), three);
    no_prefetch.prefetch_values = false;
    nn_test::Collector w2, w3, w3n;
    RunResult r2, r3, r3n;
    train(with_layout(tiny_config(), two), kSteps, r2, w2);
    train(with_layout(tiny_config(), three), kSteps, r3, w3);
    train(no_prefetch, kSteps, r3n, w3n);
    INFO("pp " << l.pp << " dp " << l.dp << " ep " << l.ep);
    check_bitwise(r3, w3, r2, w2);
    check_bitwise(r3n, w3n, r2, w2);
  }
}

// What ZeRO-3 keeps of the values: this rank's shards, two unit slots (a block each here) and
// wte's step buffer; outside a step no value is bound (a read is an error), inside
// with_parameters every one is, and equals the one-rank model's. Prefetching starts gathers
// ahead (counted), and off starts none.
TEST_CASE("ZeRO-3 holds a shard and two unit slots of values, not the whole model", "[train][trainer][zero]") {
  const auto cfg2 = with_layout(tiny_config(), {.dp = 2, .zero = 2});
  auto cfg3 = with_layout(tiny_config(), {.dp = 2, .zero = 3});
  nn_test::run_ranks(2, [&](ThreadComm& comm) {
    Trainer<ThreadComm> z2(comm, cfg2), z3(comm, cfg3);
    trellis::train::DataLoader loader(tokens(), {cfg3.batch, cfg3.seq, 99, true, comm.rank(), 2});
    const auto batch = loader.next();
    z2.step(batch);
    z3.step(batch);
    const auto& m = cfg3.model;
    const double W = static_cast<double>(m.width), V = static_cast<double>(m.vocab);
    const double block = 12 * W * W + 13 * W, wte = V * W, all = wte + m.positions * W + m.layers * block + 2 * W;
    const double full = static_cast<double>(z2.memory().parameters) / 4;  // ZeRO-2: the packed values
    RANK_CHECK(full >= all);
    RANK_CHECK(full <= all + 16 * 40);
    const double z3_floats = static_cast<double>(z3.memory().parameters) / 4;
    RANK_CHECK(z3_floats >= all / 2 + wte + 2 * block);
    RANK_CHECK(z3_floats <= all / 2 + 16 * 40 + wte + 2 * (block + 12 * 16));
    RANK_CHECK(z3.value_gathers().second > 0);
    // (no INFO on rank threads: Catch2's message streams are not thread-safe; the error names the parameter)
    for (auto* p : z3.parameters())
      RANK_CHECK_THROWS_WITH(static_cast<void>(p->value[0]), Catch::Matchers::Contains("not bound"));
    z3.with_parameters([&] {
      z2.with_parameters([&] {
        std::string differs;  // the first parameter whose values differ, if any
        for (std::size_t i = 0; i < z3.parameters().size() && differs.empty(); ++i) {
          const auto& a = z3.parameters()[i]->value;
          const auto& b = z2.parameters()[i]->value;
          if (!std::equal(a.begin(), a.end(), b.begin())) differs = z3.parameters()[i]->name;
        }
        RANK_CHECK(differs == "");
      });
    });
    cfg3.prefetch_values = false;
    Trainer<ThreadComm> off(comm, cfg3);
    off.step(batch);
    RANK_CHECK(off.value_gathers().second == 0);
  });
}

// ZeRO-3 across actions (ParamShards::follow): at an action's last unit the next action's first
// unit is prefetched, or kept gathered when it is the same unit (F then B at the head, or a middle
// stage's B then F at its top block). The expected counts come from walking the rank's F and B in
// order here: every unit an action reads is one gather unless kept; within an action every unit
// after the first is prefetched, and so is every action's first unit except the step's first and
// the kept ones. Bits: the ZeRO-2 comparisons above run these paths.
TEST_CASE("ZeRO-3 prefetches the next action's first unit and keeps the unit it ends on", "[train][trainer][zero]") {
  struct Counts {
    int gathers = 0, prefetched = 0;
  };
  // units: a chunk's weight units; embedding: whether it holds the embedding (its backward reads no values)
  const auto expected = [](const std::vector<std::pair<bool, int>>& actions, int units, bool embedding) {
    Counts n;
    int last_unit = -1;
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const bool backward = actions[i].first;
      const int reads = backward ? units - (embedding ? 1 : 0) : units;
      const int first = backward ? 0 : units - 1, last = backward ? reads - 1 : 0;
      const bool kept = i > 0 && first == last_unit;
      n.gathers += reads - (kept ? 1 : 0);
      n.prefetched += reads - 1 + (i > 0 && !kept ? 1 : 0);
      last_unit = last;
    }
    return n;
  };
  SECTION("pp 1: each microbatch's F then B") {
    auto cfg = with_layout(tiny_config(), {.dp = 2, .zero = 3, .microbatches = 2});
    const int units = cfg.model.layers + 2;  // embedding, blocks, head
    std::vector<std::pair<bool, int>> order;
    for (int mb = 0; mb < cfg.microbatches; ++mb) order.insert(order.end(), {{false, mb}, {true, mb}});
    const Counts want = expected(order, units, true);
    CHECK(want.gathers == 2 * (2 * units - 2));  // the head kept from each F for its B
    CHECK(want.prefetched == 2 * (2 * units - 3) + 1);
    nn_test::run_ranks(2, [&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, cfg);
      trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, comm.rank(), 2});
      t.step(loader.next());
      RANK_CHECK(t.value_gathers().first == want.gathers);
      RANK_CHECK(t.value_gathers().second == want.prefetched);
      auto off_cfg = cfg;
      off_cfg.prefetch_values = false;  // every unit gathered when needed, none kept
      Trainer<ThreadComm> off(comm, off_cfg);
      off.step(loader.next());
      RANK_CHECK(off.value_gathers().first == 2 * (2 * units - 1));
      RANK_CHECK(off.value_gathers().second == 0);
    });
  }
  SECTION("pp 2, 1f1b, 4 microbatches") {
    const auto cfg = with_layout(tiny_config(), {.pp = 2, .dp = 2, .zero = 3, .schedule = "1f1b", .microbatches = 4});
    const auto schedule = trellis::pipe::make_schedule("1f1b", 2, 4, 1);
    std::array<Counts, 2> want;
    for (int s = 0; s < 2; ++s) {
      std::vector<std::pair<bool, int>> order;
      for (const auto& a : schedule.ranks[static_cast<std::size_t>(s)])
        if (a.kind == trellis::pipe::ActionKind::forward || a.kind == trellis::pipe::ActionKind::backward_input)
          order.emplace_back(a.kind == trellis::pipe::ActionKind::backward_input, a.microbatch);
      want[static_cast<std::size_t>(s)] = expected(order, cfg.model.layers / 2 + 1, s == 0);
    }
    CHECK(want[1].gathers == 4 * 6 - 7);  // the last stage keeps its head (F to B) and its top block (B to F)
    nn_test::run_ranks(4, [&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, cfg);
      const int dp = t.mesh().coord<trellis::dp>();
      trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, dp, 2});
      t.step(loader.next());
      const Counts& w = want[static_cast<std::size_t>(t.mesh().coord<trellis::pp>())];
      RANK_CHECK(t.value_gathers().first == w.gathers);
      RANK_CHECK(t.value_gathers().second == w.prefetched);
    });
  }
}

// Hybrid sharding (TrainerConfig::shard_degree; FSDP's HYBRID_SHARD): ZeRO over groups of
// consecutive replicas, replicated across the groups, whose shards' gradients are all-reduced once
// a step. Against one rank (ZeRO-1, 2 and 3; with tp+sp, pp, cp, MoE; groups of one replica);
// ZeRO-2 and ZeRO-3 hybrid give the same bits (the same reductions); a dp4 rank in groups of 2
// holds exactly what a dp2 ZeRO rank holds.
TEST_CASE("hybrid sharding equals one rank in every layout, and holds a group's shard", "[train][trainer][parity][zero][hybrid]") {
  check_against_reference({.dp = 4, .zero = 1, .shard_degree = 2, .microbatches = 2}, "dp4 zero1 shard2 m2");
  check_against_reference({.dp = 4, .zero = 2, .shard_degree = 2, .microbatches = 2}, "dp4 zero2 shard2 m2");
  check_against_reference({.dp = 4, .zero = 3, .shard_degree = 2}, "dp4 zero3 shard2");
  check_against_reference({.dp = 4, .tp = 2, .sp = true, .zero = 3, .shard_degree = 2, .microbatches = 2},
                          "dp4.tp2+sp zero3 shard2 m2");
  check_against_reference({.pp = 2, .dp = 2, .tp = 2, .sp = true, .zero = 3, .shard_degree = 1, .schedule = "zb_h1",
                           .microbatches = 2},
                          "dp2.tp2+sp.pp2 zb_h1 zero3 shard1");
  check_against_reference({.dp = 2, .zero = 3, .shard_degree = 2, .cp = 2}, "dp2.cp2 zero3 shard2");
  check_layouts({.dp = 4, .zero = 3, .shard_degree = 2, .microbatches = 2, .moe = true, .ep = 2}, {.moe = true},
                "dp4 m2 ep2 zero3 shard2 (experts over their 2 replicas)");
  {
    nn_test::Collector w2, w3;
    RunResult r2, r3;
    train(with_layout(tiny_config(), {.pp = 2, .dp = 4, .zero = 2, .shard_degree = 2, .schedule = "zb_h1", .microbatches = 2}),
          kSteps, r2, w2);
    train(with_layout(tiny_config(), {.pp = 2, .dp = 4, .zero = 3, .shard_degree = 2, .schedule = "zb_h1", .microbatches = 2}),
          kSteps, r3, w3);
    INFO("dp4.pp2 zb_h1 m2 shard2: ZeRO-3 against ZeRO-2");
    check_bitwise(r3, w3, r2, w2);
  }
  const auto dp2 = with_layout(tiny_config(), {.dp = 2, .zero = 3});
  const auto hybrid = with_layout(tiny_config(), {.dp = 4, .zero = 3, .shard_degree = 2});
  const auto dp4 = with_layout(tiny_config(), {.dp = 4, .zero = 3});
  std::vector<trellis::train::MemoryUse> two(2), four(4), full(4);
  nn_test::run_ranks(2, [&](ThreadComm& comm) { two[static_cast<std::size_t>(comm.rank())] = Trainer<ThreadComm>(comm, dp2).memory(); });
  nn_test::run_ranks(4, [&](ThreadComm& comm) {
    four[static_cast<std::size_t>(comm.rank())] = Trainer<ThreadComm>(comm, hybrid).memory();
    full[static_cast<std::size_t>(comm.rank())] = Trainer<ThreadComm>(comm, dp4).memory();
  });
  for (std::size_t r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(four[r].parameters == two[r % 2].parameters);
    CHECK(four[r].gradients == two[r % 2].gradients);
    CHECK(four[r].optimizer == two[r % 2].optimizer);
    CHECK(four[r].optimizer > full[r].optimizer);  // twice dp4's shards, less padding
  }
}

// The optimizer step fused into the backward (TrainerConfig::fused_update): each weight unit's
// AdamW update as soon as its gradients are reduced. AdamW is elementwise, so without clipping it
// is the unfused step's arithmetic on the same gradients: the same bits in every layout.
TEST_CASE("fused update without clipping equals the unfused step bitwise", "[train][trainer][fused]") {
  using Fused = TrainerConfig::FusedUpdate;
  for (const Layout& l : {Layout{}, Layout{.dp = 2, .microbatches = 2}, Layout{.dp = 2, .zero = 1},
                          Layout{.dp = 2, .zero = 2, .microbatches = 2}, Layout{.tp = 2, .sp = true},
                          Layout{.dp = 2, .zero = 3, .microbatches = 2},
                          Layout{.dp = 4, .zero = 3, .shard_degree = 2, .microbatches = 2},
                          Layout{.pp = 2, .dp = 2, .schedule = "zb_v", .microbatches = 4},
                          Layout{.pp = 2, .schedule = "interleaved_1f1b", .microbatches = 4},
                          Layout{.dp = 2, .overlap_off = true},
                          Layout{.dp = 2, .moe = true, .ep = 2}}) {
    INFO("pp " << l.pp << " dp " << l.dp << " tp " << l.tp << " zero " << l.zero << " " << l.schedule << " ep " << l.ep);
    TrainerConfig plain = with_layout(tiny_config(), l), fused = plain;
    plain.clip = fused.clip = 0;
    fused.fused_update = Fused::unclipped;
    nn_test::Collector pw, fw;
    RunResult pr, fr;
    train(plain, kSteps, pr, pw);
    train(fused, kSteps, fr, fw);
    check_bitwise(fr, fw, pr, pw);
  }
}

// With the previous step's clip factor: against the same training written out in the test on one
// GptModel and an AdamWState (the first step unscaled, then min(1, clip / norm of the step
// before)); layouts against it within the parity tolerances; a resume carries the factor.
TEST_CASE("fused update with the previous step's clip factor equals its reference", "[train][trainer][fused]") {
  using Fused = TrainerConfig::FusedUpdate;
  TrainerConfig cfg = tiny_config();
  cfg.fused_update = Fused::previous_clip;
  RunResult ref;
  nn_test::Collector ref_w;
  std::vector<float> factors;
  nn_test::run_ranks(1, [&](ThreadComm& comm) {
    trellis::nn::GptModel<ThreadComm> model(cfg.model, comm, cfg.options);
    trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, 0, 1});
    std::vector<trellis::index_t> sizes;
    std::vector<float> decay;
    for (auto* p : model.parameters()) {
      sizes.push_back(p->numel());
      decay.push_back(p->global_shape.size() >= 2 ? 1.0f : 0.0f);
    }
    trellis::optim::AdamWState<> state(sizes);
    float factor = 1.0f;
    for (int s = 0; s < kSteps; ++s) {
      const auto b = loader.next();
      model.zero_grad();
      double count = 0;
      for (auto t : b.targets) count += t >= 0;
      const trellis::nn::TokenShape shape{cfg.batch, cfg.seq};
      ref.losses.push_back(model.forward(0, shape, {b.inputs.data(), nullptr, b.targets.data(), count}, nullptr));
      model.backward_input(0, shape, nullptr, nullptr);
      model.backward_weight(0);
      double squares = 0;
      std::vector<std::span<float>> values;
      std::vector<std::span<const float>> grads;
      for (auto* p : model.parameters()) {
        for (float g : p->grad) squares += static_cast<double>(g) * g;
        values.emplace_back(p->value.elements());
        grads.emplace_back(p->grad.elements());
      }
      factors.push_back(factor);
      state.update(cfg.adamw, static_cast<float>(cfg.lr(state.step())), values, grads, decay, factor);
      factor = std::min(1.0f, static_cast<float>(cfg.clip / (std::sqrt(squares) + 1e-6)));
    }
    for (auto* p : model.parameters())
      for (trellis::index_t i = 0; i < p->numel(); ++i) ref_w.put(p->name, p->global_numel(), p->global_index(i), p->value[i]);
  });
  REQUIRE(*std::min_element(factors.begin(), factors.end()) < 0.9f);  // the factor clips
  for (const Layout& l : {Layout{}, Layout{.dp = 2, .zero = 2, .microbatches = 2},
                          Layout{.pp = 2, .tp = 2, .schedule = "zb_h1", .microbatches = 2}}) {
    INFO("pp " << l.pp << " dp " << l.dp << " tp " << l.tp << " zero " << l.zero);
    nn_test::Collector w;
    RunResult r;
    TrainerConfig c = with_layout(cfg, l);
    train(c, kSteps, r, w);
    for (int s = 0; s < kSteps; ++s) {
      INFO("step " << s << " loss " << r.losses[s] << " reference " << ref.losses[s]);
      CHECK(std::fabs(r.losses[s] - ref.losses[s]) <= 1e-5 * std::fabs(ref.losses[s]));
    }
    for (const auto& name : w.keys()) {
      INFO("tensor " << name);
      CHECK(nn_test::rel_error(w.get(name), ref_w.get(name)) <= 5e-5);
    }
  }
  // Resume: 3 steps, save, 3 more in a new world equal 6 straight bitwise (the factor is saved).
  check_resumes_bitwise(with_layout(cfg, {.dp = 2}), with_layout(cfg, {.dp = 2}), "fused-resume");
}

// Offloaded optimizer state (TrainerConfig::offload_optimizer): the moments in host memory, the
// update on the CPU over staged copies. The host kernel is the host backends' own, so every
// layout gives the bits of the same run without offloading; on DeviceChecked too (the staging
// goes through the backend's download and upload); checkpoints move between the two.
TEST_CASE("offloaded optimizer state gives the same bits, and its bytes leave the device", "[train][trainer][offload]") {
  using Checked = trellis::backend::DeviceChecked<trellis::backend::Host<float>>;
  using Fused = TrainerConfig::FusedUpdate;
  auto fused = [](TrainerConfig c) {
    c.clip = 0;
    c.fused_update = Fused::unclipped;
    return c;
  };
  const auto tiny = tiny_config();
  for (const TrainerConfig& c :
       {with_layout(tiny, {}), with_layout(tiny, {.dp = 2, .zero = 1}), with_layout(tiny, {.dp = 2, .zero = 2, .microbatches = 2}),
        with_layout(tiny, {.pp = 2, .tp = 2, .sp = true, .schedule = "zb_v", .microbatches = 4}),
        with_layout(tiny, {.dp = 2, .moe = true, .ep = 2}), fused(with_layout(tiny, {.dp = 2, .zero = 2, .microbatches = 2})),
        with_layout(tiny, {.dp = 2, .zero = 3}),
        fused(with_layout(tiny, {.pp = 2, .schedule = "1f1b", .microbatches = 2}))}) {
    INFO("pp " << c.pp << " dp " << c.dp << " tp " << c.tp << " zero " << c.zero << " fused "
               << (c.fused_update != Fused::off));
    TrainerConfig off = c;
    off.offload_optimizer = true;
    nn_test::Collector w, ow;
    RunResult r, orr;
    train(c, kSteps, r, w);
    train(off, kSteps, orr, ow);
    check_bitwise(orr, ow, r, w);
  }
  {  // DeviceChecked: the staged update reaches values and gradients only through the backend
    TrainerConfig c = with_layout(tiny, {.dp = 2, .zero = 1}), off = c;
    off.offload_optimizer = true;
    nn_test::Collector w, ow;
    RunResult r, orr;
    train(c, 3, r, w);
    train<Checked>(off, 3, orr, ow);
    check_bitwise(orr, ow, r, w);
  }
  {  // an offloaded run's checkpoint continues without offloading, bitwise
    TrainerConfig c = with_layout(tiny, {.dp = 2, .zero = 1}), off = c;
    off.offload_optimizer = true;
    check_resumes_bitwise(off, c, "offload-resume");
  }
  // Bytes: the moments leave the backend's memory for the host tier (plus one update's staged
  // values and gradients: all of them unfused, one unit fused)
  nn_test::run_ranks(2, [&](ThreadComm& comm) {
    TrainerConfig c = with_layout(tiny, {.dp = 2, .zero = 1}), off = c, off_fused = fused(c);
    off.offload_optimizer = off_fused.offload_optimizer = true;
    Trainer<ThreadComm> plain(comm, c), offloaded(comm, off), offloaded_fused(comm, off_fused);
    trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, comm.rank(), 2});
    const auto batch = loader.next();
    offloaded.step(batch);
    offloaded_fused.step(batch);
    const auto moments = plain.memory().optimizer;
    RANK_CHECK(moments > 0);
    RANK_CHECK(plain.memory().host_optimizer == 0);
    RANK_CHECK(offloaded.memory().optimizer == 0);
    RANK_CHECK(offloaded.memory().host_optimizer == 2 * moments);  // + values and gradients of every shard
    const auto fused_host = offloaded_fused.memory().host_optimizer;
    RANK_CHECK(fused_host > moments);
    RANK_CHECK(fused_host < moments + moments / 2);  // one unit's shard staged at a time
  });
}

// Local learning (PPLL; the local_learning schedule): every stage but the last trains on a head of
// its own (LayerNorm + LM head: the tied wte or a matrix of its own) over its input as it came from
// the stage before, and no gradient crosses a stage boundary. Reference written in the test: the
// two stages as separate GptModels on one rank, stage 1 fed stage 0's output, each backward
// started from its own loss and nothing passed back (the last stage's head tied to stage 0's wte,
// as the Trainer's copy is through the tied sum). After one step the Trainer's gradients, the
// model's loss and stage 0's local loss equal the reference's (1e-5), for pp2 m2 and dp2.pp2 m2
// with either head; the same step under 1f1b gives stage 0 other gradients (the check can fail).
TEST_CASE("local learning: each stage's gradients come from its own loss only", "[train][trainer][local]") {
  using LocalHead = TrainerConfig::LocalHead;
  using Model = trellis::nn::GptModel<ThreadComm>;
  struct Grads {
    nn_test::Collector g;
    double loss = 0, local = 0;
  };
  auto trainer_grads = [](const TrainerConfig& c, Grads& out) {
    trellis::comm::ThreadWorld(c.pp * c.dp).run([&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, c);
      const int dp_rank = t.mesh().template coord<trellis::dp>();
      trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, dp_rank, c.dp});
      const auto r = t.step(loader.next());
      for (auto& m : t.chunks())
        for (auto* p : m->parameters()) out.g.put_grad(*p);
      if (comm.rank() == 0) {
        out.loss = r.loss;
        out.local = r.local_losses.empty() ? 0.0 : r.local_losses.front();
      }
    });
  };
  auto reference_grads = [](const TrainerConfig& c, Grads& out) {
    trellis::comm::ThreadWorld(1).run([&](ThreadComm& comm) {
      const int half = static_cast<int>(c.model.layers) / 2;
      trellis::nn::GptStage first{0, half, true, false, 0, c.local_head == LocalHead::tied}, last{half, -1, false, true};
      Model s0(c.model, comm, c.options, first);
      Model s1(c.model, comm, c.options, last, {}, &s0.embedding()->wte());
      trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, 0, 1});
      const auto b = loader.next();
      const index_t rows = c.batch / c.dp / c.microbatches;  // each microbatch as the Trainer cuts it
      const trellis::nn::TokenShape shape{rows, c.seq};
      const double count = static_cast<double>(b.targets.size());
      std::vector<float> act(static_cast<std::size_t>(rows * c.seq * c.model.width));
      auto none = [](int, trellis::nn::UnitPhase) {};
      for (index_t r0 = 0, mb = 0; r0 < c.batch; r0 += rows, ++mb) {
        const std::int32_t* in = b.inputs.data() + r0 * c.seq;
        const std::int32_t* tg = b.targets.data() + r0 * c.seq;
        out.local += s0.forward(static_cast<int>(mb), shape, {in, nullptr, tg, count}, act.data(), none);
        out.loss += s1.forward(static_cast<int>(mb), shape, {nullptr, act.data(), tg, count}, nullptr, none);
        s1.backward(static_cast<int>(mb), shape, nullptr, nullptr, none);
        s0.backward(static_cast<int>(mb), shape, nullptr, nullptr, none);
      }
      for (Model* m : {&s0, &s1})
        for (auto* p : m->parameters()) out.g.put_grad(*p);
    });
  };
  auto worst = [](const nn_test::Collector& got, const nn_test::Collector& ref, const std::string& prefix) {
    double err = 0;
    for (const auto& name : ref.keys())
      if (name.rfind(prefix, 0) == 0) err = std::max(err, static_cast<double>(nn_test::rel_error(got.get(name), ref.get(name))));
    return err;
  };
  for (LocalHead head : {LocalHead::tied, LocalHead::own})
    for (int dp : {1, 2}) {
      TrainerConfig c = with_layout(tiny_config(), {.pp = 2, .dp = dp, .schedule = "local_learning", .microbatches = 2});
      c.local_head = head;
      INFO("dp " << dp << " head " << (head == LocalHead::tied ? "tied" : "own"));
      Grads got, ref;
      trainer_grads(c, got);
      reference_grads(c, ref);
      for (const auto& name : ref.g.keys()) {
        INFO(name);
        REQUIRE(got.g.complete(name));
        CHECK(nn_test::rel_error(got.g.get(name), ref.g.get(name)) <= 1e-5);
      }
      CHECK(got.g.keys().size() == ref.g.keys().size());
      CHECK(got.g.complete(head == LocalHead::own ? "local_head.0.lm_head.weight" : "local_head.0.ln_f.weight"));
      CHECK(std::fabs(got.loss - ref.loss) <= 1e-5 * std::fabs(ref.loss));
      CHECK(std::fabs(got.local - ref.local) <= 1e-5 * std::fabs(ref.local));
      if (dp == 1 && head == LocalHead::tied) {  // 1f1b passes the last stage's gradient back
        TrainerConfig pipelined = c;
        pipelined.schedule = "1f1b";
        Grads passed_back;
        trainer_grads(pipelined, passed_back);
        CHECK(worst(passed_back.g, ref.g, "h.0.") > 1e-2);
      }
    }
  // No gradient message in the schedule; a checkpoint resumes bitwise.
  for (const auto& rank : trellis::pipe::local_learning(2, 4).ranks)
    for (const auto& a : rank)
      CHECK_FALSE((a.kind == trellis::pipe::ActionKind::send && a.direction == trellis::pipe::Direction::gradient));
  TrainerConfig own = with_layout(tiny_config(), {.pp = 2, .schedule = "local_learning", .microbatches = 2});
  own.local_head = LocalHead::own;
  check_resumes_bitwise(own, own, "local-resume");
}

// The offloaded update on its own thread (TrainerConfig::offload_update_thread, ZeRO-Offload's CPU
// step overlapping the backward): the worker holds the first unit's update back until the
// training thread has submitted the next unit's. Run on the training thread, the first update
// would wait for a submission that can only come after it (the probe gives up after 10 s and the
// check fails); the same bits either way.
TEST_CASE("the offloaded CPU update of a unit runs while the backward goes on", "[train][trainer][offload][overlap]") {
  using Fused = TrainerConfig::FusedUpdate;
  TrainerConfig c = with_layout(tiny_config(), {.dp = 2, .zero = 2, .microbatches = 2});
  c.clip = 0;
  c.fused_update = Fused::unclipped;
  c.offload_optimizer = true;
  for (bool thread : {true, false}) {
    TrainerConfig t = c;
    t.offload_update_thread = thread;
    nn_test::Collector w, ow;
    RunResult r, orr;
    TrainerConfig plain = c;
    plain.offload_optimizer = false;
    train(plain, kSteps, r, w);
    train(t, kSteps, orr, ow);
    INFO("update thread " << thread);
    check_bitwise(orr, ow, r, w);
  }
  nn_test::run_ranks(2, [&](ThreadComm& comm) {
    Trainer<ThreadComm> trainer(comm, c);
    auto& state = trainer.optimizer_state();
    std::atomic<bool> held{false}, released{false};
    state.set_update_probe([&](std::size_t job) {
      if (job != 0) return;
      held = true;
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (state.updates_submitted() < 2 && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      released = state.updates_submitted() >= 2;
    });
    trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, comm.rank(), 2});
    trainer.step(loader.next());
    RANK_CHECK(held.load());
    RANK_CHECK(released.load());
    RANK_CHECK(state.updates_submitted() >= 3);
  });
}

// Offloaded activations (TrainerConfig::offload_activations; nn/activation_arena.hpp's offloaded
// pools): each chunk keeps a few units' saved tensors on the device and the rest in host memory.
// Every layout gives the bits of the same run without offloading (the arena poisons each frame it
// hands out, and a read of a unit that is not computing throws, so a wrong fetch cannot pass);
// the device keeps frames x the largest unit, the host holds what the device held before, and
// every byte offloaded in a step is fetched back (copies synchronous). The copies run on the
// backend's copy queue by default (offload_activation_copy_queue): the rows above use it; a few
// layouts also run synchronous and on the queue over a simulated slow link, bitwise; the queue's
// write-backs after each forward are bounded and counted (see the bytes below).
TEST_CASE("offloaded activations give the same bits, and their bytes leave the device",
          "[train][trainer][offload][activations]") {
  using Fused = TrainerConfig::FusedUpdate;
  const auto tiny = tiny_config();
  auto offloaded = [](TrainerConfig c, int frames = 2) {
    c.offload_activations = true;
    c.offload_activation_frames = frames;
    return c;
  };
  TrainerConfig bad_link = offloaded(tiny);
  bad_link.offload_activation_simulated_gbps = -1;
  REQUIRE(trellis::train::config_problems(bad_link).size() == 1);
  CHECK_THAT(trellis::train::config_problems(bad_link)[0], Catch::Contains("bandwidth >= 0 GB/s"));
  TrainerConfig fused = with_layout(tiny, {.dp = 2, .zero = 3, .microbatches = 2});
  fused.clip = 0;
  fused.fused_update = Fused::unclipped;
  struct Row {
    TrainerConfig c;
    int frames;
  };
  for (const Row& row : {Row{with_layout(tiny, {}), 2}, Row{with_layout(tiny, {.microbatches = 2, .recompute = true}), 1},
                         Row{with_layout(tiny, {.dp = 2, .microbatches = 2, .dropout = 0.1f}), 2},
                         Row{with_layout(tiny, {.pp = 2, .schedule = "gpipe", .microbatches = 4}), 2},
                         Row{with_layout(tiny, {.pp = 2, .schedule = "1f1b", .microbatches = 4}), 1},
                         Row{with_layout(tiny, {.pp = 2, .schedule = "zb_h1", .microbatches = 4}), 2},
                         Row{with_layout(tiny, {.pp = 2, .schedule = "interleaved_1f1b", .microbatches = 4}), 3},
                         Row{with_layout(tiny, {.pp = 2, .tp = 2, .sp = true, .schedule = "zb_v", .microbatches = 4}), 2},
                         Row{with_layout(tiny, {.dp = 2, .zero = 3, .microbatches = 2}), 2}, Row{fused, 2},
                         Row{with_layout(tiny, {.cp = 2}), 2}, Row{with_layout(tiny, {.dp = 2, .moe = true, .ep = 2}), 2}}) {
    const TrainerConfig& c = row.c;
    INFO("pp " << c.pp << " " << c.schedule << " dp " << c.dp << " tp " << c.tp << " cp " << c.cp << " zero "
               << c.zero << " m" << c.microbatches << " frames " << row.frames);
    nn_test::Collector w, ow;
    RunResult r, orr;
    train(c, kSteps, r, w);
    train(offloaded(c, row.frames), kSteps, orr, ow);
    check_bitwise(orr, ow, r, w);
  }
  // The copies synchronous (the old policy), and on the queue over a SIMULATED slow host link (so
  // every copy is still running when the compute goes on): the same bits.
  for (const TrainerConfig& c : {with_layout(tiny, {}), with_layout(tiny, {.pp = 2, .schedule = "1f1b", .microbatches = 4}),
                                 with_layout(tiny, {.pp = 2, .schedule = "zb_h1", .microbatches = 4})}) {
    INFO("pp " << c.pp << " " << c.schedule);
    nn_test::Collector w, sw, lw;
    RunResult r, sr, lr;
    TrainerConfig sync = offloaded(c), slow = offloaded(c);
    sync.offload_activation_copy_queue = false;
    slow.offload_activation_simulated_gbps = 0.05;
    train(c, kSteps, r, w);
    train(sync, kSteps, sr, sw);
    train(slow, kSteps, lr, lw);
    check_bitwise(sr, sw, r, w);
    check_bitwise(lr, lw, r, w);
  }
  check_resumes_bitwise(offloaded(with_layout(tiny, {.pp = 2, .schedule = "1f1b", .microbatches = 2})),
                        with_layout(tiny, {.pp = 2, .schedule = "1f1b", .microbatches = 2}), "activations-resume");
  // Bytes, on the first pipeline rank of gpipe m4 (all four microbatches alive at once), copies
  // synchronous (the old policy: a region written back only when evicted) and on the queue
  nn_test::run_ranks(2, [&](ThreadComm& comm) {
    const TrainerConfig c = with_layout(tiny, {.pp = 2, .schedule = "gpipe", .microbatches = 4});
    TrainerConfig sync_c = offloaded(c);
    sync_c.offload_activation_copy_queue = false;
    Trainer<ThreadComm> plain(comm, c), off(comm, sync_c), queued(comm, offloaded(c));
    trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, 0, 1});
    const auto batch = loader.next();
    plain.step(batch);
    off.step(batch);
    queued.step(batch);
    const auto& q = queued.activation_arena();
    RANK_CHECK(queued.memory().activations == off.memory().activations);
    RANK_CHECK(queued.memory().host_activations == off.memory().host_activations);
    RANK_CHECK(q.peak_held_bytes() <= queued.memory().activations);
    // The queue changes when copies run, not which regions are in frames (eviction and prefetch
    // choices do not look at the host copies): the same fetches as the synchronous mode. Its
    // write-backs are the synchronous mode's (a region the unit wrote since its last copy is
    // copied before its frame is reused) made earlier: knowing the step's calls, it writes back
    // no region that stays in its frame until its backward, so the same bytes.
    RANK_CHECK(q.fetched_bytes() == off.activation_arena().fetched_bytes());
    RANK_CHECK(q.offloaded_bytes() == off.activation_arena().offloaded_bytes());
    RANK_CHECK(q.fetched_bytes() > 0);
    RANK_CHECK(q.fetched_bytes() <= q.offloaded_bytes());
    RANK_CHECK(q.host_held_bytes() == 0);
    RANK_CHECK(q.held_bytes() == 0);
    const auto& arena = off.activation_arena();
    RANK_CHECK(off.memory().activations == 2 * arena.slot_bytes(0));  // two frames (of the largest unit)
    RANK_CHECK(arena.slot_bytes(0) < plain.activation_arena().slot_bytes(0));
    RANK_CHECK(off.memory().activations < plain.memory().activations / 2);
    RANK_CHECK(off.memory().host_activations == plain.memory().activations);  // the host holds what the device did
    RANK_CHECK(plain.memory().host_activations == 0);
    RANK_CHECK(arena.peak_held_bytes() <= off.memory().activations);
    RANK_CHECK(arena.peak_held_bytes() + arena.peak_host_held_bytes() >= plain.activation_arena().peak_held_bytes());
    RANK_CHECK(arena.offloaded_bytes() > 0);
    RANK_CHECK(arena.fetched_bytes() == arena.offloaded_bytes());  // everything offloaded came back
    RANK_CHECK(arena.host_held_bytes() == 0);
    RANK_CHECK(arena.held_bytes() == 0);
    RANK_CHECK(arena.prefetches() > 0);
  });
}

// Which regions the copy queue writes back (train/saved_activations.hpp gives each pool its step's
// calls; ActivationArena::set_unit_calls): only those whose frame is taken before their backward.
// By hand, 1 rank, the tiny GPT's 4 layers, 2 frames: units head (0), blocks 3..0 (1..4),
// embedding (5); the forward runs 5..0, so after it the two frames hold unit 1 (the last block)
// and the head, and units 2..5 (the embedding and blocks 0..2) were evicted and written back
// with what their forward saved. With recompute that is, per microbatch of `rows` token rows,
// the embedding's token ids (rows int32) and 3 block inputs (rows x width floats), each rounded
// to the arena's 256 bytes; with 1 and 2 microbatches, 2 steps with an evaluation between them
// (the pool finds its calls again). Writing back every region after its forward adds the last
// block's input. On more layouts the queue writes back exactly what the synchronous mode does
// (at eviction only), and the same bits.
TEST_CASE("offloaded activations: the copy queue writes back only the regions that leave their frames",
          "[train][trainer][offload][activations]") {
  const auto tiny = tiny_config();
  for (int m : {1, 2}) {
    INFO("m" << m);
    TrainerConfig c = with_layout(tiny, {.microbatches = m, .recompute = true});
    c.offload_activations = true;
    c.offload_activation_frames = 2;
    nn_test::run_ranks(1, [&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, c);
      const std::size_t rows = static_cast<std::size_t>(c.batch / m * c.seq);
      auto round = [](std::size_t b) { return (b + 255) / 256 * 256; };
      const std::size_t block = round(rows * static_cast<std::size_t>(c.model.width) * sizeof(float)),
                        embedding = round(rows * sizeof(std::int32_t));
      RANK_CHECK(t.chunks()[0]->unit_saved_bytes(t.microbatch_shape()).size() == 6);
      const std::size_t must_leave = static_cast<std::size_t>(m) * (embedding + 3 * block);
      trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, 0, 1});
      const auto batch = loader.next();
      t.step(batch);
      const auto& a = t.activation_arena();
      RANK_CHECK(a.offloaded_bytes() == must_leave);
      RANK_CHECK(a.fetched_bytes() == must_leave);
      t.evaluate(batch);
      t.step(batch);
      RANK_CHECK(a.offloaded_bytes() == 2 * must_leave);
      RANK_CHECK(a.fetched_bytes() == 2 * must_leave);
    });
  }
  struct Row {
    Layout layout;
    int frames;
  };
  for (const Row& row : {Row{{.microbatches = 2}, 2}, Row{{.microbatches = 2, .recompute = true}, 1},
                         Row{{.pp = 2, .schedule = "1f1b", .microbatches = 4}, 2},
                         Row{{.pp = 2, .schedule = "zb_h1", .microbatches = 4}, 2},
                         Row{{.pp = 2, .schedule = "interleaved_1f1b", .microbatches = 4}, 2},
                         Row{{.pp = 2, .schedule = "zb_v", .microbatches = 4}, 3}}) {
    TrainerConfig c = with_layout(tiny, row.layout);
    c.offload_activations = true;
    c.offload_activation_frames = row.frames;
    TrainerConfig sync_c = c;
    sync_c.offload_activation_copy_queue = false;
    INFO("pp " << c.pp << " " << c.schedule << " m" << c.microbatches << " frames " << row.frames);
    nn_test::run_ranks(c.pp, [&](ThreadComm& comm) {
      Trainer<ThreadComm> queued(comm, c), sync(comm, sync_c);
      trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, 0, 1});
      for (int s = 0; s < 2; ++s) {
        const auto batch = loader.next();
        const double lq = queued.step(batch).loss, ls = sync.step(batch).loss;
        RANK_CHECK(lq == ls);
      }
      RANK_CHECK(queued.activation_arena().offloaded_bytes() == sync.activation_arena().offloaded_bytes());
      RANK_CHECK(queued.activation_arena().fetched_bytes() == sync.activation_arena().fetched_bytes());
    });
  }
}

// Evaluation with offloaded activations (Trainer::evaluate; SavedActivations::forward_only): no
// backward follows, so each unit's region is freed as its forward ends. Against the same trainer
// without offloading: the evaluation losses are the same bits, the arena copies 0 bytes each way
// during an evaluation (its counters do not move), holds nothing after it, and before any step
// (peaks not yet raised by training) it held at most one frame at a time (a forward's unit);
// a step after the evaluation still gives the plain run's bits.
TEST_CASE("evaluation with offloaded activations copies nothing and gives the same loss bits",
          "[train][trainer][offload][activations][eval]") {
  const auto tiny = tiny_config();
  struct Row {
    Layout layout;
    int frames;
  };
  for (const Row& row : {Row{{.microbatches = 2}, 2}, Row{{}, 1}, Row{{.pp = 2, .schedule = "1f1b", .microbatches = 4}, 2},
                         Row{{.pp = 2, .schedule = "interleaved_1f1b", .microbatches = 4}, 2}}) {
    const TrainerConfig c = with_layout(tiny, row.layout);
    TrainerConfig off_c = c;
    off_c.offload_activations = true;
    off_c.offload_activation_frames = row.frames;
    INFO("pp " << c.pp << " " << c.schedule << " m" << c.microbatches << " frames " << row.frames);
    nn_test::run_ranks(c.pp, [&](ThreadComm& comm) {
      Trainer<ThreadComm> plain(comm, c), off(comm, off_c);
      trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, 0, 1});
      const auto batch = loader.next();
      const auto& arena = off.activation_arena();
      const double e0_plain = plain.evaluate(batch), e0_off = off.evaluate(batch);  // collectives: outside RANK_CHECK
      RANK_CHECK(e0_off == e0_plain);
      RANK_CHECK(arena.offloaded_bytes() == 0);
      RANK_CHECK(arena.fetched_bytes() == 0);
      RANK_CHECK(arena.peak_host_held_bytes() == 0);
      std::size_t frame = 0;  // the largest frame of this rank's pools
      for (int p = 0; p < arena.pools(); ++p) frame = std::max(frame, arena.slot_bytes(p));
      RANK_CHECK(arena.peak_held_bytes() > 0);
      RANK_CHECK(arena.peak_held_bytes() <= frame);  // one unit's region at a time
      const double s1_plain = plain.step(batch).loss, s1_off = off.step(batch).loss;
      RANK_CHECK(s1_off == s1_plain);
      const std::size_t wrote = arena.offloaded_bytes(), read = arena.fetched_bytes();
      const double e1_plain = plain.evaluate(batch), e1_off = off.evaluate(batch);
      RANK_CHECK(e1_off == e1_plain);
      RANK_CHECK(arena.offloaded_bytes() == wrote);  // 0 bytes copied by the evaluation
      RANK_CHECK(arena.fetched_bytes() == read);
      RANK_CHECK(arena.held_bytes() == 0);
      RANK_CHECK(arena.host_held_bytes() == 0);
      const double s2_plain = plain.step(batch).loss, s2_off = off.step(batch).loss;
      RANK_CHECK(s2_off == s2_plain);
    });
  }
}

// The disk tier (TrainerConfig::offload_dir): the moments in a scratch file, each update streamed
// through host buffers of offload_buffer_elements (300 here: large tensors cut into several
// chunks, small ones coalesced into one). The same host kernel on each chunk: the bits of the run
// without offloading, in every layout, with the reads and writes prefetched on the tier's I/O
// thread reading 1, 2 (the default) and 5 chunks ahead (offload_disk_readahead) and synchronous
// (offload_disk_prefetch false); checkpoints move between the two; the bytes are the file's, the
// host buffers stay bounded (one chunk x 4; read D chunks ahead, x 2 (D + 1) + 2: the moments
// D + 1 times); a read-ahead of 0 is refused.
// Faults: a directory that cannot be made, or a cap below the moments' size (a full disk), is an
// error naming it before the first step; a read or a write that fails on the I/O thread (the
// probe's injected EIO / ENOSPC, one in a chunk of one tensor and one in a coalesced chunk) is
// that error on the training thread, naming the directory, the range (a coalesced chunk's first
// and last tensor) and errno; the checkpoint saved before them still resumes bitwise.
TEST_CASE("the optimizer state's disk tier gives the same bits, bounded buffers, and clear errors",
          "[train][trainer][offload][disk]") {
  using Fused = TrainerConfig::FusedUpdate;
  using trellis::train::DiskEvent;
  const auto tiny = tiny_config();
  TempDir dir("disk-tier");
  auto on_disk = [&](TrainerConfig c, bool prefetch = true, std::size_t chunk = 300, int readahead = 2) {
    c.offload_dir = dir.path / "moments";
    c.offload_buffer_elements = chunk;
    c.offload_disk_prefetch = prefetch;
    c.offload_disk_readahead = readahead;
    return c;
  };
  TrainerConfig fused = with_layout(tiny, {.dp = 2, .zero = 2, .microbatches = 2});
  fused.clip = 0;
  fused.fused_update = Fused::unclipped;
  for (const TrainerConfig& c : {with_layout(tiny, {}), with_layout(tiny, {.dp = 2, .zero = 1}),
                                 with_layout(tiny, {.dp = 2, .zero = 3, .microbatches = 2}), fused}) {
    nn_test::Collector w;
    RunResult r;
    train(c, kSteps, r, w);
    for (int readahead : {0, 1, 2, 5}) {  // 0: prefetch off (synchronous)
      INFO("dp " << c.dp << " zero " << c.zero << " fused " << (c.fused_update != Fused::off) << " read-ahead " << readahead);
      nn_test::Collector dw;
      RunResult dr;
      train(on_disk(c, readahead > 0, 300, std::max(readahead, 1)), kSteps, dr, dw);
      check_bitwise(dr, dw, r, w);
    }
  }
  TrainerConfig no_chunk = on_disk(tiny, true, 0);
  REQUIRE(trellis::train::config_problems(no_chunk).size() == 1);
  CHECK_THAT(trellis::train::config_problems(no_chunk)[0], Catch::Contains("offload_buffer_elements) must be >= 1"));
  TrainerConfig no_readahead = on_disk(tiny, true, 300, 0);
  REQUIRE(trellis::train::config_problems(no_readahead).size() == 1);
  CHECK_THAT(trellis::train::config_problems(no_readahead)[0], Catch::Contains("reads ahead at least 1 chunk"));
  check_resumes_bitwise(on_disk(with_layout(tiny, {.dp = 2, .zero = 1})), with_layout(tiny, {.dp = 2, .zero = 1}),
                        "disk-resume");
  check_resumes_bitwise(with_layout(tiny, {.dp = 2, .zero = 1}), on_disk(with_layout(tiny, {.dp = 2, .zero = 1}), false),
                        "disk-resume-back");
  nn_test::run_ranks(2, [&](ThreadComm& comm) {
    const TrainerConfig c = with_layout(tiny, {.dp = 2, .zero = 1});
    Trainer<ThreadComm> plain(comm, c), disk(comm, on_disk(c, true, 1000)), sync(comm, on_disk(c, false, 1000)),
        ahead1(comm, on_disk(c, true, 1000, 1)), ahead5(comm, on_disk(c, true, 1000, 5));
    trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, comm.rank(), 2});
    const auto batch = loader.next();
    for (int stepped = 0; stepped < 2; ++stepped) {  // the buffers are held from the start: counted before a step
      const auto moments = plain.memory().optimizer;
      RANK_CHECK(disk.memory().optimizer == 0);
      RANK_CHECK(disk.memory().disk_optimizer == moments);
      // read ahead D chunks: m and v (D + 1) times, values, gradients, of 1000 elements
      RANK_CHECK(disk.memory().host_optimizer == (2 * (2 + 1) + 2) * 1000 * sizeof(float));  // D = 2, the default
      RANK_CHECK(ahead1.memory().host_optimizer == (2 * (1 + 1) + 2) * 1000 * sizeof(float));
      RANK_CHECK(ahead5.memory().host_optimizer == (2 * (5 + 1) + 2) * 1000 * sizeof(float));
      RANK_CHECK(sync.memory().host_optimizer == 4 * 1000 * sizeof(float));  // m, v, values, gradients: one chunk
      for (auto* t : {&disk, &sync, &ahead1, &ahead5}) t->step(batch);
    }
    RANK_CHECK(std::filesystem::is_empty(dir.path / "moments"));  // the files are unlinked: nothing left behind
  });
  // Faults, with a checkpoint saved before them
  TempDir ckpt("disk-tier-ckpt");
  const TrainerConfig c = with_layout(tiny, {.dp = 2, .zero = 1});
  {
    nn_test::Collector w;
    RunResult r;
    train(c, 3, r, w, {}, ckpt.path);
  }
  const std::filesystem::path not_a_dir = dir.path / "a-file";
  { std::ofstream(not_a_dir) << "x"; }
  TrainerConfig bad_dir = on_disk(c), full = on_disk(c);
  bad_dir.offload_dir = not_a_dir / "moments";
  full.offload_dir_cap_bytes = 1000;
  nn_test::run_ranks(2, [&](ThreadComm& comm) {
    std::string e1, e2;
    try {
      Trainer<ThreadComm> t(comm, bad_dir);
    } catch (const trellis::Error& e) {
      e1 = e.what();
    }
    try {
      Trainer<ThreadComm> t(comm, full);
    } catch (const trellis::Error& e) {
      e2 = e.what();
    }
    RANK_CHECK_THAT(e1, Catch::Matchers::Contains("a-file/moments is not a directory and cannot be created"));
    RANK_CHECK_THAT(e2, Catch::Matchers::Contains("more than the 1000 bytes the directory may take (no space left)"));
  });
  // An I/O error on the I/O thread: the 5th chunk read of a step, or the last chunk write of the
  // first update (its error surfaces at the stream's end), or the first read or write of a
  // coalesced chunk (several tensors), fails as if pread / pwrite had. The error names the chunk:
  // its tensor and elements, or its first and last tensor. Every rank fails alike (no rank left
  // waiting in a collective).
  struct Injected {
    DiskEvent::Kind kind;
    int err;
    const char* says;
    bool coalesced;  // the first chunk of several tensors (else the 5th read, the last write)
  };
  for (const Injected& f : {Injected{DiskEvent::Kind::read, EIO, "reading", false},
                            Injected{DiskEvent::Kind::write, ENOSPC, "writing", false},
                            Injected{DiskEvent::Kind::read, EIO, "reading", true},
                            Injected{DiskEvent::Kind::write, ENOSPC, "writing", true}}) {
    INFO("injected " << f.says << (f.coalesced ? " in a coalesced chunk" : ""));
    nn_test::run_ranks(2, [&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, on_disk(c));
      trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, comm.rank(), 2});
      loader.restore(t.load(*trellis::train::latest_checkpoint(ckpt.path)).data);
      const auto training = std::this_thread::get_id();
      std::atomic<int> reads{0};
      std::atomic<bool> on_io_thread{false}, failed{false};
      std::mutex failed_mutex;
      trellis::train::DiskChunk failed_range;
      t.optimizer_state().disk_moments().set_probe([&](const DiskEvent& e) {
        if (e.kind != f.kind) return 0;
        const bool fail = f.coalesced ? e.range.tensors > 1 && !failed.exchange(true)
                                      : f.kind == DiskEvent::Kind::read ? ++reads == 5 : e.last;
        if (fail) {
          on_io_thread = std::this_thread::get_id() != training;
          std::lock_guard lock(failed_mutex);
          failed_range = e.range;
        }
        return fail ? f.err : 0;
      });
      std::string what;
      int rank = -1;
      try {
        t.step(loader.next());
      } catch (const trellis::Error& e) {
        what = e.what();
        rank = e.rank();
      }
      RANK_CHECK(on_io_thread.load());
      RANK_CHECK(rank == comm.rank());  // thrown on the I/O thread with the caller's rank
      std::lock_guard lock(failed_mutex);
      const trellis::train::DiskChunk& r = failed_range;
      if (f.coalesced) RANK_CHECK(r.tensors > 1);
      const std::string elements = "elements [" + std::to_string(r.at) + ", " + std::to_string(r.at + r.n) + ")";
      const std::string named = r.tensors > 1 ? "(m of tensors " + std::to_string(r.tensor) + " to " +
                                                    std::to_string(r.tensor + r.tensors - 1) + ": " + elements
                                              : "(m of tensor " + std::to_string(r.tensor) + ", " + elements;
      RANK_CHECK_THAT(what, Catch::Matchers::Contains("optimizer disk tier (" + (dir.path / "moments").string() + "): " +
                                                      f.says) &&
                                Catch::Matchers::Contains(named) && Catch::Matchers::Contains(std::strerror(f.err)));
    });  // the trainers (and their I/O threads) gone after the error: no hang
  }
  nn_test::Collector w6, w33, wd;
  RunResult six, after, after_disk;
  train(c, 6, six, w6);
  train(c, 3, after, w33, *trellis::train::latest_checkpoint(ckpt.path));  // the one saved before the faults
  train(on_disk(c), 3, after_disk, wd, *trellis::train::latest_checkpoint(ckpt.path));
  for (int i = 0; i < 3; ++i) CHECK(after.losses[i] == six.losses[3 + i]);
  for (int i = 0; i < 3; ++i) CHECK(after_disk.losses[i] == six.losses[3 + i]);
  check_bitwise(after_disk, wd, after, w33);
}

// Coalescing: a disk chunk runs on from one tensor into the next ones in the file (at most
// min(offload_buffer_elements, the largest tensor) elements). Chunks of 300, of 7 (chunks ending
// mid-tensor and running on into the next) and of 100000 (over the largest tensor: the bound is
// the largest tensor), coalesced or not (OptimizerState::set_disk_coalescing, the seam),
// prefetched or not, unfused and fused (a unit's parameters come in backward order; the update
// visits them in the file's), 1 rank: the bits of the run without offloading; the chunks
// streamed equal the count from the parameters' sizes (cap = min(chunk, largest); per update,
// ceil(total / cap) coalesced, the sum of ceil(n / cap) not; unfused one update of every
// tensor, fused one per unit: a block's, the head's ln_f, wpe, wte); the host buffers are 8 (4)
// chunks of cap (reading 2 chunks ahead, the default).
TEST_CASE("the disk tier coalesces consecutive tensors into one chunk, with the same bits",
          "[train][trainer][offload][disk]") {
  using Fused = TrainerConfig::FusedUpdate;
  TempDir dir("disk-coalesce");
  constexpr int steps = 3;
  struct Run {
    std::vector<double> losses;
    std::vector<std::vector<float>> values;
    std::vector<std::string> names;
    std::vector<std::size_t> sizes;
    std::uint64_t chunks = 0;
    std::size_t host = 0;
  };
  auto run = [&](const TrainerConfig& c, bool coalesce) {
    Run out;
    nn_test::run_ranks(1, [&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, c);
      if (!c.offload_dir.empty()) t.optimizer_state().set_disk_coalescing(coalesce);
      trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, 0, 1});
      for (int s = 0; s < steps; ++s) out.losses.push_back(t.step(loader.next()).loss);
      for (trellis::nn::Parameter* p : t.parameters()) {
        out.names.push_back(p->name);
        out.sizes.push_back(static_cast<std::size_t>(p->numel()));
        out.values.push_back(trellis::backend::download_vector(t.backend(), p->value.data(), p->value.size()));
      }
      if (!c.offload_dir.empty()) out.chunks = t.optimizer_state().disk_moments().chunks_streamed();
      out.host = t.memory().host_optimizer;
    });
    return out;
  };
  // The chunks of `steps` steps, from the sizes: per update, the tensors are adjacent in the file.
  auto expected_chunks = [&](const Run& r, std::size_t chunk, bool coalesce, bool fused) {
    const std::size_t cap = std::min(chunk, *std::max_element(r.sizes.begin(), r.sizes.end()));
    std::map<std::string, std::vector<std::size_t>> updates;  // fused: h.N, ln_f, wpe, wte
    for (std::size_t i = 0; i < r.names.size(); ++i) {
      const std::string& name = r.names[i];
      const std::string unit = !fused ? "all" : name.substr(0, name.find('.', name.rfind("h.", 0) == 0 ? 2 : 0));
      updates[unit].push_back(r.sizes[i]);
    }
    std::uint64_t n = 0;
    for (const auto& [unit, sizes] : updates) {
      std::size_t total = 0;
      for (std::size_t s : sizes) {
        total += s;
        if (!coalesce) n += (s + cap - 1) / cap;
      }
      if (coalesce) n += (total + cap - 1) / cap;
    }
    return n * steps;
  };
  struct Case {
    std::size_t chunk;
    bool coalesce, prefetch;
  };
  TrainerConfig unfused = with_layout(tiny_config(), {});
  TrainerConfig fused = unfused;
  fused.clip = 0;
  fused.fused_update = Fused::unclipped;
  for (const TrainerConfig& base : {unfused, fused}) {
    const bool is_fused = base.fused_update != Fused::off;
    const Run ref = run(base, true);
    REQUIRE(ref.names.size() > 40);  // 4 blocks of 12 tensors, and wte, wpe, ln_f
    for (const Case& k : {Case{300, true, true}, Case{300, true, false}, Case{7, true, true}, Case{100000, true, false},
                          Case{300, false, true}}) {
      INFO("fused " << is_fused << " chunk " << k.chunk << " coalesced " << k.coalesce << " prefetch " << k.prefetch);
      TrainerConfig c = base;
      c.offload_dir = dir.path;
      c.offload_buffer_elements = k.chunk;
      c.offload_disk_prefetch = k.prefetch;
      const Run got = run(c, k.coalesce);
      CHECK(got.losses == ref.losses);
      REQUIRE(got.names == ref.names);
      for (std::size_t i = 0; i < ref.names.size(); ++i) {
        INFO("tensor " << ref.names[i]);
        CHECK(got.values[i] == ref.values[i]);
      }
      CHECK(got.chunks == expected_chunks(ref, k.chunk, k.coalesce, is_fused));
      const std::size_t cap = std::min(k.chunk, *std::max_element(ref.sizes.begin(), ref.sizes.end()));
      CHECK(got.host == (k.prefetch ? 8 : 4) * cap * sizeof(float));  // read ahead 2: m, v 3 times, values, gradients
    }
    // The cases exercise coalescing: fewer chunks than the tensors' pieces (a step: 179 against 215 unfused).
    CHECK(expected_chunks(ref, 300, true, is_fused) < expected_chunks(ref, 300, false, is_fused));
  }
}

// The disk tier's overlap (offload_disk_prefetch): a probe (DiskMoments::set_probe, the tier's
// test seam) makes a rendezvous of each chunk's update with the reads and writes around it: the
// update of chunk j waits until the read of chunk j + 1 has begun, that read until the update of
// chunk j has begun, and the write of chunk j until the update of chunk j + 1 has begun. Only an
// implementation that reads ahead and writes behind on another thread while a chunk updates
// meets them; a synchronous one (prefetch off, or a read waited for as soon as it is queued)
// waits 5 s for a read that can only come after it, and the probe counts a timeout (then stops
// waiting, so that run costs 5 s once). No timing is measured: only the order of events.
TEST_CASE("the disk tier reads the next chunk and writes the last one back while a chunk updates",
          "[train][trainer][offload][disk]") {
  using trellis::train::DiskEvent;
  TempDir dir("disk-overlap");
  struct Rendezvous {
    std::mutex mutex;
    std::condition_variable cv;
    std::set<std::uint64_t> updating, reading;  // chunks whose update / read has begun
    int met = 0, timeouts = 0;
    bool gave_up = false;
    std::thread::id training;
    int off_thread = 0;  // reads and writes run on a thread other than the training one
    void await(std::unique_lock<std::mutex>& lock, const std::function<bool()>& pred) {
      if (gave_up) return;
      if (cv.wait_for(lock, std::chrono::seconds(5), pred)) {
        ++met;
      } else {
        ++timeouts;
        gave_up = true;
        cv.notify_all();
      }
    }
    int operator()(const DiskEvent& e) {
      std::unique_lock lock(mutex);
      if (e.kind != DiskEvent::Kind::update && std::this_thread::get_id() != training) ++off_thread;
      switch (e.kind) {
        case DiskEvent::Kind::update:
          updating.insert(e.chunk);
          cv.notify_all();
          if (!e.last) await(lock, [&] { return reading.count(e.chunk + 1) > 0; });
          break;
        case DiskEvent::Kind::read:
          reading.insert(e.chunk);
          cv.notify_all();
          if (!e.first) await(lock, [&] { return updating.count(e.chunk - 1) > 0; });
          break;
        case DiskEvent::Kind::write:
          if (!e.last) await(lock, [&] { return updating.count(e.chunk + 1) > 0; });
          break;
      }
      return 0;
    }
  };
  TrainerConfig c = with_layout(tiny_config(), {});
  c.offload_dir = dir.path;
  c.offload_buffer_elements = 300;
  for (bool prefetch : {true, false}) {
    INFO("prefetch " << prefetch);
    c.offload_disk_prefetch = prefetch;
    nn_test::run_ranks(1, [&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, c);
      Rendezvous r;
      r.training = std::this_thread::get_id();
      auto& disk = t.optimizer_state().disk_moments();
      disk.set_probe([&](const DiskEvent& e) { return r(e); });
      trellis::train::DataLoader loader(tokens(), {c.batch, c.seq, 99, true, 0, 1});
      for (int s = 0; s < 2; ++s) t.step(loader.next());
      disk.set_probe({});
      std::lock_guard lock(r.mutex);
      INFO("chunks " << disk.chunks_streamed() << " met " << r.met << " timeouts " << r.timeouts);
      RANK_CHECK(disk.chunks_streamed() > 20);  // two steps of many chunks
      if (prefetch) {
        RANK_CHECK(r.timeouts == 0);
        RANK_CHECK(r.met >= static_cast<int>(disk.chunks_streamed()));  // every chunk's rendezvous met
        RANK_CHECK(r.off_thread == static_cast<int>(2 * disk.chunks_streamed()));
      } else {  // what a synchronous update gives: this test cannot pass without the overlap
        RANK_CHECK(r.timeouts == 1);
        RANK_CHECK(r.off_thread == 0);
      }
    });
  }
}

TEST_CASE("packed documents: every layout equals one packed rank", "[train][trainer][parity][packed]") {
  // The packed run learns, and differs from the unpacked one (the documents reach the model).
  auto& ref = packed_reference();
  CHECK(ref.run.losses.back() < ref.run.losses.front() - 0.1);
  CHECK(std::fabs(ref.run.losses.front() - reference().run.losses.front()) > 1e-3);
  check_against_reference({.dp = 2, .microbatches = 2, .packed = true}, "dp2 m2 packed");
  check_against_reference({.tp = 2, .sp = true, .recompute = true, .packed = true}, "tp2+sp recompute packed");
  check_against_reference({.pp = 2, .schedule = "zb_h1", .microbatches = 4, .packed = true}, "pp2 zb_h1 packed");
  check_against_reference(
      {.pp = 2, .dp = 2, .tp = 2, .sp = true, .zero = 1, .schedule = "interleaved_1f1b", .microbatches = 2,
       .packed = true},
      "dp2.tp2+sp.pp2 zero1 interleaved packed");
}

TEST_CASE("context parallel (ring) in every layout equals one rank", "[train][trainer][parity][cp]") {
  check_against_reference({.cp = 2}, "cp2");
  check_against_reference({.cp = 4}, "cp4");
  check_against_reference({.dp = 2, .zero = 1, .cp = 2}, "dp2.cp2 zero1");
  check_against_reference({.tp = 2, .sp = true, .cp = 2}, "tp2+sp.cp2");
  check_against_reference({.pp = 2, .schedule = "zb_v", .microbatches = 2, .cp = 2}, "pp2.cp2 zb_v");
  check_against_reference({.dp = 2, .microbatches = 2, .dropout = kDropout, .recompute = true, .cp = 2},
                          "dp2 m2.cp2 dropout recompute");
  check_against_reference({.packed = true, .cp = 2}, "cp2 packed");
  check_against_reference({.pp = 2, .dp = 2, .tp = 2, .sp = true, .schedule = "1f1b", .microbatches = 2,
                           .packed = true, .cp = 2},
                          "dp2.tp2+sp.pp2.cp2 packed (16 ranks)");
}

TEST_CASE("balanced documents (rows reordered per document) equal one packed rank", "[train][trainer][parity][cp][packed]") {
  using trellis::nn::CpMode;
  check_against_reference({.packed = true, .cp = 2, .balance_documents = true}, "cp2 balanced");
  check_against_reference({.packed = true, .cp = 4, .balance_documents = true}, "cp4 balanced");
  check_against_reference({.dp = 2, .microbatches = 2, .packed = true, .cp = 4, .cp_mode = CpMode::hybrid,
                           .balance_documents = true},
                          "dp2 m2.cp4 hybrid balanced");
  check_against_reference({.pp = 2, .tp = 2, .sp = true, .schedule = "zb_h1", .microbatches = 2, .packed = true,
                           .cp = 2, .balance_documents = true},
                          "tp2+sp.pp2.cp2 zb_h1 balanced");
}

TEST_CASE("context parallel by Ulysses and hybrid equals one rank", "[train][trainer][parity][cp]") {
  using trellis::nn::CpMode;
  check_against_reference({.cp = 4, .cp_mode = CpMode::ulysses}, "cp4 ulysses");
  check_against_reference({.tp = 2, .sp = true, .zero = 1, .packed = true, .cp = 2, .cp_mode = CpMode::ulysses},
                          "tp2+sp.cp2 ulysses zero1 packed");
  check_against_reference({.pp = 2, .schedule = "1f1b", .microbatches = 2, .cp = 4, .cp_mode = CpMode::hybrid},
                          "pp2.cp4 hybrid (ulysses 2 x ring 2)");
  check_against_reference({.dp = 2, .microbatches = 2, .dropout = kDropout, .cp = 4, .cp_mode = CpMode::hybrid},
                          "dp2 m2.cp4 hybrid dropout");
  check_against_reference({.pp = 2, .schedule = "zb_h1", .microbatches = 4, .cp = 2, .cp_mode = CpMode::ulysses},
                          "pp2.cp2 ulysses zb_h1");
  check_against_reference({.tp = 2, .sp = true, .packed = true, .cp = 4, .cp_mode = CpMode::hybrid},
                          "tp2+sp.cp4 hybrid packed (8 ranks)");
}

TEST_CASE("context-parallel layouts that cannot split are refused saying what to change", "[train][trainer][cp][errors]") {
  using trellis::nn::CpMode;
  auto problems = [](const Layout& l) {
    std::string all;
    for (const auto& p : trellis::train::config_problems(with_layout(tiny_config(), l))) all += p + "\n";
    return all;
  };
  CHECK_THAT(problems({.cp = 3}), Catch::Contains("must be a multiple of 6"));
  CHECK_THAT(problems({.tp = 2, .cp = 4, .cp_mode = CpMode::ulysses}),
             Catch::Contains("the 2 heads must be a multiple of 4"));
  CHECK_THAT(problems({.cp = 4, .cp_mode = CpMode::hybrid, .cp_ulysses = 4}), Catch::Contains("1 < --cp-ulysses < --cp 4"));
  CHECK(problems({.cp = 4, .cp_mode = CpMode::hybrid}).empty());
  for (const Layout& l : {Layout{.balance_documents = true}, Layout{.cp = 2, .cp_mode = CpMode::ulysses, .balance_documents = true},
                          Layout{.dropout = 0.1f, .cp = 2, .balance_documents = true}})
    CHECK_THAT(problems(l), Catch::Contains("--cp-balance-docs") && Catch::Contains("ring or hybrid") &&
                                Catch::Contains("--dropout 0"));
  CHECK(problems({.cp = 2, .balance_documents = true}).empty());
}

// bf16 runs: losses and grad norms per step, final weights per tensor (max |w - ref| / max |ref|).
struct Bf16Tolerance {
  double loss, norm, weight;
};
void check_close(const RunResult& got, nn_test::Collector& got_w, const RunResult& ref, nn_test::Collector& ref_w,
                 Bf16Tolerance tol, const char* label) {
  INFO(label);
  REQUIRE(got.losses.size() == ref.losses.size());
  double worst_loss = 0, worst_norm = 0, worst_weight = 0;
  for (std::size_t s = 0; s < got.losses.size(); ++s) {
    worst_loss = std::max(worst_loss, std::fabs(got.losses[s] - ref.losses[s]) / std::fabs(ref.losses[s]));
    worst_norm = std::max(worst_norm, std::fabs(got.norms[s] - ref.norms[s]) / std::fabs(ref.norms[s]));
  }
  REQUIRE(got.names == ref.names);
  std::string worst_tensor;
  for (const auto& name : got.names) {
    CHECK(got_w.complete(name));
    const double e = nn_test::rel_error(got_w.get(name), ref_w.get(name));
    if (e > worst_weight) worst_weight = e, worst_tensor = name;
  }
  WARN(label << ": loss " << worst_loss << " norm " << worst_norm << " weights " << worst_weight << " ("
             << worst_tensor << ")");
  CHECK(worst_loss <= tol.loss);
  CHECK(worst_norm <= tol.norm);
  CHECK(worst_weight <= tol.weight);
  CHECK(got.replica_diff <= 1e-6f);
}

TEST_CASE("host bf16: every layout equals one bf16 rank, and bf16 tracks fp32", "[train][trainer][parity][bf16]") {
  using Bf16 = trellis::backend::Host<trellis::bfloat16>;
  nn_test::Collector ref_w, drop_w;
  RunResult ref, drop;
  train<Bf16>(tiny_config(), kSteps, ref, ref_w);
  train<Bf16>(with_layout(tiny_config(), {.dropout = kDropout}), kSteps, drop, drop_w);
  // Against fp32: bf16 activations (8 mantissa bits) move the losses a little (measured 7e-5) and
  // the weights more: AdamW's near-sign-like early steps (lr 3e-3 against init 0.007) turn rounding
  // noise in small gradients into whole +-lr steps (measured 9e-2 of max |w|, h.3.mlp.c_proj).
  const Bf16Tolerance vs_fp32{1e-3, 1e-2, 0.15};
  check_close(ref, ref_w, reference().run, reference().weights, vs_fp32, "bf16 vs fp32");
  check_close(drop, drop_w, dropout_reference().run, dropout_reference().weights, vs_fp32, "bf16 vs fp32, dropout");
  bool differs = false;  // the bf16 run is not the fp32 one
  for (int s = 0; s < kSteps; ++s) differs = differs || ref.losses[s] != reference().run.losses[s];
  CHECK(differs);
  // Layouts against one bf16 rank. dp and pp cut along samples and blocks: the activations are the
  // same bf16 values, only fp32 gradient sums differ. tp splits the GEMM reductions, so the
  // row-parallel outputs round differently. Measured (worst of the runs below): cut 1.9e-5 loss,
  // 4.3e-4 norm, 3.9e-3 weights; split 8.9e-5 loss, 3.8e-3 norm, 6.0e-2 weights (c_attn.bias).
  const Bf16Tolerance cut{1e-4, 2e-3, 1e-2}, split{5e-4, 1e-2, 0.1};
  auto run = [&](const Layout& l, const RunResult& r, nn_test::Collector& w, Bf16Tolerance tol, const char* label) {
    nn_test::Collector got_w;
    RunResult got;
    train<Bf16>(with_layout(tiny_config(), l), kSteps, got, got_w);
    check_close(got, got_w, r, w, tol, label);
  };
  run({.dp = 2, .microbatches = 2}, ref, ref_w, cut, "bf16 dp2 m2");
  run({.pp = 2, .schedule = "interleaved_1f1b", .microbatches = 4}, ref, ref_w, cut, "bf16 pp2 interleaved");
  run({.dp = 2, .zero = 1}, ref, ref_w, cut, "bf16 dp2 zero1");
  run({.dp = 2, .zero = 2, .microbatches = 2}, ref, ref_w, cut, "bf16 dp2 m2 zero2");
  run({.dp = 2, .zero = 3, .microbatches = 2}, ref, ref_w, cut, "bf16 dp2 m2 zero3");
  run({.tp = 2}, ref, ref_w, split, "bf16 tp2");
  run({.tp = 2, .sp = true}, ref, ref_w, split, "bf16 tp2+sp");
  run({.pp = 2, .dp = 2, .tp = 2, .sp = true, .zero = 1, .schedule = "zb_v", .microbatches = 2}, ref, ref_w, split,
      "bf16 dp2.tp2+sp.pp2 zero1 zb_v");
  run({.dp = 2, .dropout = kDropout, .recompute = true}, drop, drop_w, cut, "bf16 dp2 dropout recompute");
  run({.tp = 2, .sp = true, .dropout = kDropout}, drop, drop_w, split, "bf16 tp2+sp dropout");
  // Context parallel: the ring merges partial outputs and passes dK/dV accumulators in bf16 (more
  // roundings than one call); Ulysses runs the one-rank attention call on fewer heads. Measured:
  // ring cp2 2.5e-5 loss, 4.2e-3 norm, 3.4e-2 weights; ulysses cp4 1.0e-6, 1.9e-4, 7.8e-4; hybrid
  // cp4 2.8e-5, 2.5e-3, 4.1e-2: within the tp split's tolerance.
  using trellis::nn::CpMode;
  run({.cp = 2}, ref, ref_w, split, "bf16 cp2 ring");
  run({.cp = 4, .cp_mode = CpMode::ulysses}, ref, ref_w, split, "bf16 cp4 ulysses");
  run({.cp = 4, .cp_mode = CpMode::hybrid}, ref, ref_w, split, "bf16 cp4 hybrid");
  // Mixture of Experts (dropless, no load-balancing loss): ep over dp cuts along samples, so each
  // token meets the same bf16 values and routing as on one bf16 rank.
  nn_test::Collector moe_w;
  RunResult moe;
  train<Bf16>(with_layout(tiny_config(), {.moe = true}), kSteps, moe, moe_w);
  run({.dp = 2, .moe = true, .ep = 2}, moe, moe_w, cut, "bf16 dp2 ep2");
  run({.dp = 4, .zero = 1, .moe = true, .ep = 2}, moe, moe_w, cut, "bf16 dp4 ep2 zero1");
}

// The tolerances tests/gpu/test_trainer_cuda.cu gives backend::Cuda (two steps: losses within 5e-3
// relative, every trained tensor within 2e-2 norm-relative) hold for bf16 rounding alone, here
// against host fp32 rather than host bf16. Measured: losses 1.2e-5, weights at most 1.8 % (the
// zero-initialised biases; h.0.mlp.c_fc.bias), as FlatTrainer's 1.9 % with the same rounding.
TEST_CASE("host bf16: two steps within the GPU test's tolerances of fp32", "[train][trainer][bf16]") {
  const TrainerConfig cfg = tiny_config();
  RunResult fp32, bf16;
  nn_test::Collector fp32_w, bf16_w;
  train(cfg, 2, fp32, fp32_w);
  train<trellis::backend::Host<trellis::bfloat16>>(cfg, 2, bf16, bf16_w);
  for (int s = 0; s < 2; ++s) {
    INFO("step " << s << ": bf16 " << bf16.losses[s] << " fp32 " << fp32.losses[s]);
    CHECK(std::fabs(bf16.losses[s] - fp32.losses[s]) <= 5e-3 * std::fabs(fp32.losses[s]));
  }
  CHECK(bf16.losses != fp32.losses);  // the bf16 run is not the fp32 one
  REQUIRE(bf16.names == fp32.names);
  for (const auto& name : fp32.names) {
    const double err = nn_test::norm_relative(bf16_w.get(name), fp32_w.get(name));
    INFO(name << ": norm-relative weight error " << err);
    CHECK(err <= 2e-2);
  }
}

// backend::DeviceChecked: the host arithmetic under the discipline of device memory (every kernel
// argument a backend allocation, packed parameters and moments not host-readable). A layout run
// with it must equal the same layout on backend::Host bit for bit: that every layer, the pipe
// executor's buffers, the optimizer, ZeRO-1, ZeRO-3's gathers and the tied-wte sum reach memory only through the
// backend is what a CUDA run needs (zb_h1, interleaved and the zb_v layout post their sends and
// receives as one group, as the trainer does on NCCL).
TEST_CASE("device discipline: every layout runs on DeviceChecked and equals host fp32 bitwise",
          "[train][trainer][device]") {
  using Checked = trellis::backend::DeviceChecked<trellis::backend::Host<float>>;
  for (const Layout& l : {Layout{}, Layout{.dp = 2, .zero = 1}, Layout{.tp = 2, .sp = true},
                          Layout{.pp = 2, .schedule = "interleaved_1f1b", .microbatches = 4, .batch_p2p = true},
                          Layout{.pp = 2, .dp = 2, .schedule = "zb_h1", .microbatches = 4, .batch_p2p = true},
                          Layout{.pp = 2, .dp = 2, .tp = 2, .sp = true, .zero = 1, .schedule = "zb_v",
                                 .microbatches = 2, .batch_p2p = true},
                          Layout{.dp = 2, .dropout = kDropout, .recompute = true},
                          Layout{.pp = 2, .dp = 2, .zero = 2, .schedule = "zb_v", .microbatches = 4, .batch_p2p = true},
                          Layout{.pp = 2, .dp = 2, .zero = 3, .schedule = "1f1b", .microbatches = 2},
                          Layout{.dp = 4, .tp = 2, .sp = true, .zero = 1, .moe = true, .ep = 2, .capacity = 1.0f,
                                 .aux_loss = 0.01f}}) {
    INFO("pp " << l.pp << " dp " << l.dp << " tp " << l.tp << " zero " << l.zero << " " << l.schedule << " ep " << l.ep);
    nn_test::Collector host_w, checked_w;
    RunResult host, checked;
    train(with_layout(tiny_config(), l), 3, host, host_w);
    train<Checked>(with_layout(tiny_config(), l), 3, checked, checked_w);
    check_bitwise(checked, checked_w, host, host_w);
  }
}

TEST_CASE("device discipline: checkpoints save and load through the backend", "[train][trainer][device]") {
  // dp2 ZeRO-1 (moments gathered over dp, the commit's agreement staged through backend memory):
  // a DeviceChecked run resumed from the host run's checkpoint and a host run resumed from the
  // DeviceChecked one continue bit for bit alike.
  using Checked = trellis::backend::DeviceChecked<trellis::backend::Host<float>>;
  const TrainerConfig cfg = with_layout(tiny_config(), {.dp = 2, .zero = 1});
  TempDir host_dir("device-save-host"), checked_dir("device-save-checked");
  nn_test::Collector w1, w2, w3, w4;
  RunResult a, b, from_host, from_checked;
  train(cfg, 2, a, w1, {}, host_dir.path);
  train<Checked>(cfg, 2, b, w2, {}, checked_dir.path);
  REQUIRE(a.losses == b.losses);
  const auto host_ckpt = *trellis::train::latest_checkpoint(host_dir.path);
  const auto checked_ckpt = *trellis::train::latest_checkpoint(checked_dir.path);
  train<Checked>(cfg, 2, from_host, w3, host_ckpt);
  train(cfg, 2, from_checked, w4, checked_ckpt);
  CHECK(from_host.losses == from_checked.losses);
  CHECK(from_host.norms == from_checked.norms);
  for (const auto& name : from_host.names) CHECK(nn_test::rel_error(w3.get(name), w4.get(name)) == 0.0);
}

TEST_CASE("with dropout every layout equals one rank (masks per global sample)", "[train][trainer][parity][dropout]") {
  auto& ref = dropout_reference();
  REQUIRE(ref.run.losses.size() == kSteps);
  for (int s = 0; s < kSteps; ++s)  // the masks change the losses: the test is not vacuous
    CHECK(std::fabs(ref.run.losses[s] - reference().run.losses[s]) > 1e-4);
  check_against_reference({.dp = 2, .dropout = kDropout}, "dp2");
  check_against_reference({.dp = 2, .microbatches = 2, .dropout = kDropout}, "dp2 m2");
  check_against_reference({.tp = 2, .sp = true, .dropout = kDropout}, "tp2+sp");
  check_against_reference({.dropout = kDropout, .recompute = true}, "recompute");
  check_against_reference({.pp = 2, .schedule = "1f1b", .microbatches = 4, .dropout = kDropout}, "pp2 1f1b");
  check_against_reference({.pp = 2, .schedule = "zb_v", .microbatches = 4, .dropout = kDropout}, "pp2 zb_v");
  check_against_reference(
      {.pp = 2, .dp = 2, .tp = 2, .sp = true, .schedule = "1f1b", .microbatches = 2, .dropout = kDropout},
      "dp2.tp2+sp.pp2");
}

// With lr 0 the weights never move, so two steps on the same batch differ only by their masks.
// (Before the step seed existed every step drew step 0's masks and the losses were equal.)
TEST_CASE("dropout draws new masks every step; evaluate() has none", "[train][trainer][dropout]") {
  auto cfg = with_layout(tiny_config(), {.dp = 2, .dropout = 0.5f});
  cfg.lr.max_lr = cfg.lr.min_lr = 0.0;
  auto no_dropout = cfg;
  no_dropout.options.dropout = 0.0f;
  nn_test::run_ranks(2, [&](ThreadComm& comm) {
    Trainer<ThreadComm> t(comm, cfg), plain(comm, no_dropout);  // same init seed: same weights
    trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, t.mesh().coord<trellis::dp>(), cfg.dp});
    const auto batch = loader.next();
    const double eval_before = t.evaluate(batch);
    const double first = t.step(batch).loss, second = t.step(batch).loss;
    const double eval_after = t.evaluate(batch), eval_plain = plain.evaluate(batch);  // collectives: not in RANK_CHECK
    RANK_CHECK(std::fabs(first - second) > 1e-3 * std::fabs(first));
    // evaluation is deterministic and equals the same weights without dropout, exactly
    RANK_CHECK(eval_after == eval_before);
    RANK_CHECK(eval_after == eval_plain);
    // and the training steps did drop (their loss is not the dropout-free one)
    RANK_CHECK(std::fabs(first - eval_plain) > 1e-3);
  });
}

TEST_CASE("a text schedule from a file trains like the generator's", "[train][trainer][parity][pipe]") {
  // pp2, m4, the given schedule; the generator name is unused, and a name no generator has proves it.
  auto text_layout = [](const trellis::pipe::Schedule& s, float dropout = 0.0f) {
    return Layout{.pp = 2, .schedule = "no such generator", .microbatches = 4, .dropout = dropout, .custom_schedule = s};
  };
  TempDir dir("trainer-schedule");
  auto load = [&](const std::string& text) {
    const auto path = (dir.path / "schedule.txt").string();
    std::ofstream(path) << text;
    return trellis::pipe::load_schedule(path);
  };
  // Written by hand (compute actions only; the parser inserts the sends and receives).
  const auto mine = load(
      "# 1F1B for 2 ranks and 4 microbatches, by hand\n"
      "@ name=mine backward=full\n"
      "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3\n"
      "F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3\n");
  RunResult generated, custom;
  nn_test::Collector w1, w2;
  train(with_layout(tiny_config(), {.pp = 2, .schedule = "1f1b", .microbatches = 4}), kSteps, generated, w1);
  train(with_layout(tiny_config(), text_layout(mine)), kSteps, custom, w2);
  REQUIRE(custom.losses.size() == generated.losses.size());
  for (std::size_t s = 0; s < custom.losses.size(); ++s) CHECK(custom.losses[s] == generated.losses[s]);
  check_against_reference(text_layout(mine), "text 1F1B");
  // Another order than any generator's: every F, then every B, then every W (split backward).
  const auto deferred = load(
      "@ name=deferred backward=split\n"
      "F0 F1 F2 F3 B0 B1 B2 B3 W0 W1 W2 W3\n"
      "F0 F1 F2 F3 B0 B1 B2 B3 W0 W1 W2 W3\n");
  check_against_reference(text_layout(deferred), "text F-B-W");
  check_against_reference(text_layout(deferred, kDropout), "text F-B-W with dropout");
  // One that cannot run: rank 1 never runs W3.
  const auto broken = load("F0 F1 F2 F3 B0 B1 B2 B3 W0 W1 W2 W3\nF0 F1 F2 F3 B0 B1 B2 B3 W0 W1 W2\n");
  auto cfg = with_layout(tiny_config(), text_layout(broken));
  auto problems = trellis::train::config_problems(cfg);
  REQUIRE(problems.size() == 1);
  INFO(problems[0]);
  CHECK(problems[0].find("does not verify") != std::string::npos);
  CHECK(problems[0].find("rank 1: backward-weight of microbatch 3, chunk 0 (W3.0) never runs") != std::string::npos);
}

TEST_CASE("grouped point-to-point (as on NCCL) refuses a schedule that needs asynchronous sends",
          "[train][trainer][errors][pipe]") {
  // interleaved 1F1B with every receive right before its consumer deadlocks when every send waits
  // for its receive (verifier, rendezvous mode): refused at construction, not at the first step
  auto at_use = trellis::pipe::insert_communication(trellis::pipe::interleaved_1f1b(2, 4, 2),
                                                    trellis::pipe::CommPlacement::at_use);
  TrainerConfig cfg = with_layout(tiny_config(), {.pp = 2, .schedule = "custom", .microbatches = 4,
                                                  .custom_schedule = at_use, .batch_p2p = true});
  trellis::comm::ThreadWorld world(2);
  REQUIRE_THROWS_WITH(world.run([&](ThreadComm& comm) { Trainer<ThreadComm> t(comm, cfg); }),
                      Catch::Contains("schedule 'interleaved_1f1b' cannot run with grouped sends") &&
                          Catch::Contains("deadlock (rendezvous sends)") &&
                          Catch::Contains("insert_communication pairs"));
}

TEST_CASE("a layout the world cannot hold is refused before any work", "[train][trainer][errors]") {
  nn_test::run_ranks(4, [&](ThreadComm& comm) {
    auto c = with_layout(tiny_config(), {.pp = 2, .dp = 1, .tp = 1});
    try {
      Trainer<ThreadComm> t(comm, c);
      RANK_CHECK(false);
    } catch (const trellis::Error& e) {
      RANK_CHECK(std::string(e.what()).find("4 ranks but dp x tp x pp = 1 x 1 x 2") != std::string::npos);
    }
  });
}

// Vee placement: pipeline rank 0 holds the first and the last virtual stage; both chunks use one
// wte parameter (the embedding's), so the rank lists it once and holds no copy.
TEST_CASE("a rank holding the first and last stage shares one wte", "[train][trainer][pipe]") {
  auto cfg = with_layout(tiny_config(), {.pp = 2, .schedule = "zb_v", .microbatches = 2});
  nn_test::run_ranks(2, [&](ThreadComm& comm) {
    Trainer<ThreadComm> t(comm, cfg);
    int wte_listed = 0;
    for (auto* p : t.parameters()) wte_listed += p->name == "wte.weight";
    auto& chunks = t.chunks();
    RANK_CHECK(chunks.size() == 2);
    if (t.mesh().coord<trellis::pp>() == 0) {
      RANK_CHECK(wte_listed == 1);
      RANK_CHECK((chunks[0]->tied_wte() != nullptr && chunks[0]->tied_wte() == chunks[1]->tied_wte()));
    } else {
      RANK_CHECK(wte_listed == 0);
      RANK_CHECK((chunks[0]->tied_wte() == nullptr && chunks[1]->tied_wte() == nullptr));
    }
  });
}

// Saved activations: each chunk's arena pool has the slots the simulator says the schedule keeps
// alive (F to W) in that chunk, and the step uses every one and no more; the rank's measured peak
// of live (microbatch, chunk) slots equals the simulator's peak_chunk_activations; every slot is
// one microbatch's saved bytes; nothing is held after the step; the losses are finite (the
// arena is NaN-poisoned and the parity tests compare them with one rank).
TEST_CASE("activation arena: slots = the simulator's live microbatches, measured = arena", "[train][trainer][arena]") {
  const Layout layouts[] = {
      {.pp = 2, .schedule = "gpipe", .microbatches = 4},
      {.pp = 2, .schedule = "1f1b", .microbatches = 4},
      {.pp = 4, .schedule = "1f1b", .microbatches = 8},
      {.pp = 2, .schedule = "interleaved_1f1b", .microbatches = 4},
      {.pp = 2, .schedule = "zb_h1", .microbatches = 4},
      {.pp = 2, .schedule = "zb_v", .microbatches = 4},
      {.pp = 2, .schedule = "dualpipe_v", .microbatches = 4},
      {.pp = 2, .tp = 2, .sp = true, .schedule = "1f1b", .microbatches = 4, .recompute = true},
      {.dp = 2, .microbatches = 2},
  };
  for (const Layout& l : layouts) {
    auto cfg = with_layout(tiny_config(), l);
    INFO(l.schedule << " pp" << l.pp << " tp" << l.tp << " dp" << l.dp << " recompute " << l.recompute);
    const int v = l.schedule == "interleaved_1f1b" || l.schedule == "zb_v" || l.schedule == "dualpipe_v" ? 2 : 1;
    std::optional<trellis::pipe::Simulation> sim;
    if (l.pp > 1) sim = trellis::pipe::simulate(trellis::pipe::make_schedule(l.schedule, l.pp, l.microbatches, v));
    nn_test::run_ranks(l.pp * l.tp * l.dp, [&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, cfg);
      trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, t.mesh().coord<trellis::dp>(), cfg.dp});
      const auto r = t.step(loader.next());
      RANK_CHECK(std::isfinite(r.loss));
      const auto& arena = t.activation_arena();
      const int pp_rank = t.mesh().coord<trellis::pp>();
      std::size_t capacity = 0;
      RANK_CHECK(arena.pools() == static_cast<int>(t.chunks().size()));
      for (int c = 0; c < arena.pools(); ++c) {
        const int want = sim ? sim->peak_activations_by_chunk[pp_rank][c] : 1;
        RANK_CHECK(arena.slots(c) == want);
        RANK_CHECK(arena.peak_slots(c) == want);  // every slot used: none reserved for nothing
        RANK_CHECK(arena.slot_bytes(c) == trellis::nn::saved_round(t.chunks()[c]->saved_bytes(t.microbatch_shape())));
        capacity += static_cast<std::size_t>(want) * arena.slot_bytes(c);
      }
      RANK_CHECK(arena.capacity_bytes() == capacity);
      RANK_CHECK(arena.peak_held_slots() == (sim ? sim->peak_chunk_activations[pp_rank] : 1));
      RANK_CHECK(arena.peak_held_bytes() <= arena.capacity_bytes());
      RANK_CHECK(arena.held_bytes() == 0);
    });
  }
}

// Which dp all-reduces start while backward compute remains on the rank (StepResult counters):
// buckets start per weight unit (head, block, embedding) as its last W finishes, so at pp = 1
// (fused backward) every unit's but the embedding's; interleaved pp2 also the chunk that finishes
// first; 1f1b pp2 (one chunk) the units finished before the last W's end. Never the rank's last
// unit, nor wte (it waits for the tied sum).
TEST_CASE("data-parallel buckets start while backward compute remains", "[train][trainer][overlap]") {
  for (const Layout& l : {Layout{.dp = 2, .microbatches = 2},
                          Layout{.pp = 2, .dp = 2, .schedule = "interleaved_1f1b", .microbatches = 2},
                          Layout{.pp = 2, .dp = 2, .schedule = "1f1b", .microbatches = 2}}) {
    auto cfg = with_layout(tiny_config(), l);
    cfg.bucket_elements = 4096;
    INFO("pp " << l.pp << " schedule " << l.schedule);
    nn_test::run_ranks(cfg.pp * cfg.dp, [&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, cfg);
      trellis::train::DataLoader loader(
          tokens(), {cfg.batch, cfg.seq, 99, true, t.mesh().coord<trellis::dp>(), cfg.dp});
      auto r = t.step(loader.next());
      RANK_CHECK(r.buckets > 1);
      RANK_CHECK(r.buckets_overlapped > 0);
      RANK_CHECK(r.buckets_overlapped < r.buckets);  // the last unit's and wte's are not hidden
      // pp = 1: exactly two are not: wpe's (the last unit, 16 x 32 elements: one bucket) and wte's
      if (cfg.pp == 1) RANK_CHECK(r.buckets - r.buckets_overlapped == 2);
    });
  }
}

// Mixture of Experts (blocks 0 and 2: 4 experts, top-2, z-loss). Dropless routing without the
// load-balancing loss is per token, so every layout equals one rank; the load-balancing loss and
// the capacity are per forward (each rank's microbatch), so with them a layout with ep equals the
// same layout without ep.
TEST_CASE("MoE: expert parallel layouts equal one rank (dropless) or the same layout without ep", "[train][trainer][parity][moe]") {
  const Layout one{.moe = true};
  check_layouts({.dp = 2, .moe = true, .ep = 2}, one, "dp2 ep2");
  check_layouts({.dp = 4, .moe = true, .ep = 4}, one, "dp4 ep4");
  check_layouts({.dp = 4, .moe = true, .ep = 2}, one, "dp4 ep2 (two replicas of each expert)");
  check_layouts({.dp = 2, .tp = 2, .sp = true, .moe = true, .ep = 2}, one, "dp2.tp2+sp ep2");
  check_layouts({.pp = 2, .dp = 2, .schedule = "zb_h1", .microbatches = 2, .moe = true, .ep = 2}, one, "dp2.pp2 zb_h1 ep2");
  check_layouts({.dp = 4, .zero = 1, .moe = true, .ep = 2}, one, "dp4 ep2 zero1");
  check_layouts({.dp = 4, .zero = 2, .microbatches = 2, .moe = true, .ep = 2}, one, "dp4 m2 ep2 zero2");
  check_layouts({.dp = 2, .microbatches = 2, .cp = 2, .moe = true, .ep = 2}, one, "dp2 m2.cp2 ep2");
  // One rank's microbatches hold the rows of the dp ranks: the same forwards, so the per-forward
  // losses and capacities agree, and the auxiliary losses' weight (a mean over microbatches and
  // replicas) is checked across the two.
  check_layouts({.dp = 2, .moe = true, .ep = 2, .capacity = 1.0f, .aux_loss = 0.01f},
                {.microbatches = 2, .moe = true, .capacity = 1.0f, .aux_loss = 0.01f}, "dp2 ep2 aux capacity 1 vs m2");
  check_layouts({.dp = 4, .moe = true, .ep = 4, .aux_loss = 0.01f}, {.microbatches = 4, .moe = true, .aux_loss = 0.01f},
                "dp4 ep4 aux vs m4");
  for (float capacity : {0.0f, 1.0f}) {
    const std::string cap = capacity > 0 ? " capacity 1" : " dropless";
    check_layouts({.dp = 2, .moe = true, .ep = 2, .capacity = capacity, .aux_loss = 0.01f},
                  {.dp = 2, .moe = true, .capacity = capacity, .aux_loss = 0.01f}, ("dp2 ep2 aux" + cap).c_str());
    check_layouts({.dp = 4, .moe = true, .ep = 4, .capacity = capacity, .aux_loss = 0.01f},
                  {.dp = 4, .moe = true, .capacity = capacity, .aux_loss = 0.01f}, ("dp4 ep4 aux" + cap).c_str());
    check_layouts({.pp = 2, .dp = 2, .tp = 2, .microbatches = 2, .moe = true, .ep = 2, .capacity = capacity, .aux_loss = 0.01f},
                  {.pp = 2, .dp = 2, .tp = 2, .microbatches = 2, .moe = true, .capacity = capacity, .aux_loss = 0.01f},
                  ("dp2.tp2.pp2 ep2 aux" + cap).c_str());
  }
}

// The reported auxiliary loss and expert load count each microbatch once, also when a block's
// forward runs again in its backward (recompute) or a forward only evaluates.
TEST_CASE("MoE: recompute and evaluation leave the reported aux loss and expert load as they are", "[train][trainer][moe]") {
  struct Report {
    std::vector<double> aux;
    std::vector<std::pair<int, std::vector<double>>> load;
  };
  auto run = [](bool recompute) {
    Report out;
    const TrainerConfig cfg =
        with_layout(tiny_config(), {.microbatches = 2, .recompute = recompute, .moe = true, .capacity = 1.0f, .aux_loss = 0.01f});
    nn_test::run_ranks(1, [&](ThreadComm& comm) {
      Trainer<ThreadComm> t(comm, cfg);
      trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, 0, 1});
      for (int s = 0; s < 3; ++s) {
        out.aux.push_back(t.step(loader.next()).moe_aux_loss);
        t.evaluate(loader.next());  // forward only: not counted
      }
      out.load = t.take_expert_load();
    });
    return out;
  };
  const Report plain = run(false), recomputed = run(true);
  REQUIRE(plain.aux.size() == 3);
  for (std::size_t s = 0; s < plain.aux.size(); ++s) {
    CHECK(plain.aux[s] > 0.0);
    CHECK(recomputed.aux[s] == Approx(plain.aux[s]).epsilon(1e-6));
  }
  REQUIRE(plain.load.size() == 2);
  for (std::size_t l = 0; l < plain.load.size(); ++l) {
    double total = 0;
    for (double n : plain.load[l].second) total += n;
    CHECK(total == 3.0 * tiny_config().batch * tiny_config().seq * 2);  // 3 steps of top-2 copies, once each
    CHECK(recomputed.load[l].second == plain.load[l].second);
  }
}
