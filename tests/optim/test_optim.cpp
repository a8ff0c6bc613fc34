// optim: LR schedule vs its formula at hand-computed points, AdamW vs a double-precision
// reference written out here, clipping vs the formula (single rank and over thread ranks),
// ZeRO-1 partitioned updates == the replicated update, bit for bit.
#include <catch2/catch.hpp>

#include <cmath>
#include <numbers>
#include <thread>
#include <vector>

#include "trellis/optim.hpp"
#include "trellis/train/rng.hpp"

#if __has_include("trellis/comm/threads.hpp")
#include "trellis/comm/threads.hpp"
#define TRELLIS_TEST_HAVE_THREADS 1
#endif

using namespace trellis;
using namespace trellis::optim;

TEST_CASE("warm-up + cosine schedule follows the formula", "[optim][lr]") {
  WarmupCosine s{.max_lr = 1.0, .min_lr = 0.1, .warmup_steps = 10, .total_steps = 110};
  REQUIRE(s(0) == Approx(0.1));
  REQUIRE(s(4) == Approx(0.5));
  REQUIRE(s(9) == Approx(1.0));
  REQUIRE(s(10) == Approx(1.0));
  REQUIRE(s(60) == Approx(0.55));  // halfway: min + (max - min) / 2
  REQUIRE(s(35) == Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi * 0.25))));
  REQUIRE(s(110) == Approx(0.1));
  REQUIRE(s(1000) == Approx(0.1));
  for (std::int64_t t = 11; t < 110; ++t) REQUIRE(s(t) < s(t - 1));
  WarmupCosine no_warmup{.max_lr = 2.0, .min_lr = 0.0, .warmup_steps = 0, .total_steps = 4};
  REQUIRE(no_warmup(0) == Approx(2.0));
  REQUIRE(no_warmup(2) == Approx(1.0));
  REQUIRE(ConstantLR{0.3}(123) == 0.3);
  REQUIRE_THROWS_AS((WarmupCosine{.warmup_steps = 5, .total_steps = 5}(0)), Error);
  REQUIRE_THROWS_AS(s(-1), Error);
}

namespace {
// Plain double-precision AdamW for one tensor (the reference).
void adamw_reference(std::vector<double>& p, const std::vector<double>& g, std::vector<double>& m,
                     std::vector<double>& v, const AdamW& hp, double lr, int t, double decay_mult) {
  for (std::size_t i = 0; i < p.size(); ++i) {
    m[i] = hp.beta1 * m[i] + (1 - hp.beta1) * g[i];
    v[i] = hp.beta2 * v[i] + (1 - hp.beta2) * g[i] * g[i];
    double mhat = m[i] / (1 - std::pow(static_cast<double>(hp.beta1), t));
    double vhat = v[i] / (1 - std::pow(static_cast<double>(hp.beta2), t));
    p[i] = p[i] - lr * hp.weight_decay * decay_mult * p[i] - lr * mhat / (std::sqrt(vhat) + hp.eps);
  }
}
std::vector<float> randn(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  train::Rng r(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.normal() * scale);
  return v;
}
}  // namespace

TEST_CASE("AdamWState::update matches a double-precision AdamW", "[optim][adamw]") {
  const AdamW hp{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  const std::vector<index_t> sizes = {1000, 37, 70000};
  const std::vector<float> decay = {1.0f, 0.0f, 1.0f};
  AdamWState state(sizes);
  std::vector<std::vector<float>> params;
  std::vector<std::vector<double>> ref_p, ref_m, ref_v;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    params.push_back(randn(static_cast<std::size_t>(sizes[i]), 100 + i));
    ref_p.emplace_back(params.back().begin(), params.back().end());
    ref_m.emplace_back(params.back().size(), 0.0);
    ref_v.emplace_back(params.back().size(), 0.0);
  }
  WarmupCosine lr{.max_lr = hp.lr, .min_lr = 1e-3, .warmup_steps = 2, .total_steps = 5};
  for (int step = 0; step < 5; ++step) {
    std::vector<std::vector<float>> grads;
    std::vector<std::span<float>> ps;
    std::vector<std::span<const float>> gs;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      grads.push_back(randn(params[i].size(), 1000 * step + i, 0.5));
      ps.emplace_back(params[i]);
      gs.emplace_back(grads[i]);
    }
    const float lr_now = static_cast<float>(lr(step));
    state.update(hp, lr_now, ps, gs, decay);
    for (std::size_t i = 0; i < sizes.size(); ++i)
      adamw_reference(ref_p[i], std::vector<double>(grads[i].begin(), grads[i].end()), ref_m[i], ref_v[i], hp,
                      lr_now, step + 1, decay[i]);
  }
  REQUIRE(state.step() == 5);
  double worst = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    for (std::size_t k = 0; k < params[i].size(); ++k) {
      worst = std::max(worst, std::abs(params[i][k] - ref_p[i][k]));
      REQUIRE(state.m(i)[k] == Approx(ref_m[i][k]).margin(1e-6));
    }
  REQUIRE(worst < 2e-6);  // fp32 vs fp64 over 5 steps of size ~1e-2
  std::vector<std::span<float>> wrong = {params[0]};
  std::vector<std::span<const float>> wrong_g = {std::span<const float>(params[0])};
  REQUIRE_THROWS_WITH(state.update(hp, 1e-3f, wrong, wrong_g), Catch::Contains("state of 3 tensors"));
  REQUIRE_THROWS_AS(state.m(3), Error);
}

TEST_CASE("clip by global norm follows the formula", "[optim][clip]") {
  std::vector<float> a = {3, 0, 0}, b = {0, 4};  // norm 5
  std::vector<std::span<float>> grads = {a, b};
  SECTION("above max: scaled to max_norm") {
    auto r = clip_grad_norm(grads, 1.0, LocalSum{});
    REQUIRE(r.norm == Approx(5.0));
    REQUIRE(r.scale == Approx(1.0 / (5.0 + 1e-6)));
    REQUIRE(a[0] == Approx(0.6).epsilon(1e-6));
    REQUIRE(b[1] == Approx(0.8).epsilon(1e-6));
  }
  SECTION("below max: untouched") {
    auto r = clip_grad_norm(grads, 10.0, LocalSum{});
    REQUIRE(r.norm == Approx(5.0));
    REQUIRE(r.scale == 1.0f);
    REQUIRE(a[0] == 3.0f);
  }
  SECTION("non-finite norm is an error") {
    a[1] = std::nanf("");
    REQUIRE_THROWS_WITH(clip_grad_norm(grads, 1.0, LocalSum{}), Catch::Contains("not finite"));
  }
  SECTION("the reduction is what makes the norm global") {
    auto doubled = [](double local) { return 4 * local; };  // as if 4 ranks held copies
    REQUIRE(clip_factor<float>(std::vector<std::span<const float>>{a, b}, 100.0, doubled).norm == Approx(10.0));
  }
}

#ifdef TRELLIS_TEST_HAVE_THREADS
TEST_CASE("global norm over thread ranks == the single-rank norm", "[optim][clip]") {
  const auto full = randn(10001, 5);
  double ref = 0;
  for (float x : full) ref += static_cast<double>(x) * x;
  ref = std::sqrt(ref);
  comm::ThreadWorld world(3);
  std::vector<double> norms(3);
  world.run([&](auto& c) {
    auto part = shard::chunk(static_cast<index_t>(full.size()), c.size(), c.rank());
    std::vector<std::span<const float>> mine = {std::span<const float>(full).subspan(
        static_cast<std::size_t>(part.offset), static_cast<std::size_t>(part.size))};
    norms[static_cast<std::size_t>(c.rank())] = global_grad_norm<float>(mine, sum_over(c));
  });
  for (double n : norms) REQUIRE(n == Approx(ref).epsilon(1e-12));
}
#endif

TEST_CASE("ZeRO-1: partitions tile the flat buffer and partitioned AdamW == replicated", "[optim][zero]") {
  const std::vector<index_t> sizes = {50, 7, 0, 123, 20};
  const FlatLayout layout = pack_flat(sizes);
  REQUIRE(layout.total == 200);
  REQUIRE(layout.offsets == std::vector<index_t>{0, 50, 57, 57, 180});
  const AdamW hp{.lr = 1e-2f, .weight_decay = 0.1f};
  auto params0 = randn(200, 1);
  auto grads = randn(200, 2);

  // Replicated: one state over the whole buffer, one step.
  auto replicated = params0;
  AdamWState whole({200});
  std::vector<std::span<float>> wp = {replicated};
  std::vector<std::span<const float>> wg = {std::span<const float>(grads)};
  whole.update(hp, hp.lr, wp, wg);

  for (int dp : {1, 2, 3, 7}) {
    INFO("dp = " << dp);
    auto sharded = params0;
    index_t covered = 0;
    for (int r = 0; r < dp; ++r) {
      auto part = zero1_partition(layout.total, dp, r);
      REQUIRE(part.offset == covered);
      covered += part.size;
      auto pieces = pieces_in(layout, part);
      index_t in_part = 0;
      std::vector<index_t> piece_sizes;
      std::vector<std::span<float>> ps;
      std::vector<std::span<const float>> gs;
      for (const auto& p : pieces) {
        REQUIRE(p.partition_begin == in_part);
        in_part += p.size;
        piece_sizes.push_back(p.size);
        const auto flat = static_cast<std::size_t>(layout.offsets[p.tensor] + p.tensor_begin);
        ps.emplace_back(sharded.data() + flat, static_cast<std::size_t>(p.size));
        gs.emplace_back(grads.data() + flat, static_cast<std::size_t>(p.size));
      }
      REQUIRE(in_part == part.size);
      AdamWState mine(piece_sizes);
      mine.update(hp, hp.lr, ps, gs);
    }
    REQUIRE(covered == 200);
    REQUIRE(sharded == replicated);  // elementwise math: bit-identical
  }
  REQUIRE(pieces_in(layout, {45, 10}) ==
          std::vector<FlatPiece>{{0, 45, 0, 5}, {1, 0, 5, 5}});
  REQUIRE_THROWS_AS(pieces_in(layout, {190, 11}), Error);
  REQUIRE_THROWS_AS(zero1_partition(10, 2, 2), Error);
}
