// AdamW (several tensors, several steps, 16-bit gradients) against the update written out in
// double, following torch.optim.AdamW; global norm against a double loop; clip factor by formula.
#include <catch2/catch.hpp>

#include <cmath>

#include "kernels/reference.hpp"
#include "trellis/kernels/adamw_host.hpp"

using namespace trellis;
using namespace trellis::kernels;
using trellis_test::random_vector;
using trellis_test::require_close;

TEST_CASE("adamw multi-tensor step vs double reference over 5 steps", "[kernels][adamw]") {
  const std::vector<std::size_t> sizes = {1, 100, 70000};  // one tensor spans several chunks
  kernels::AdamWConfig cfg;
  cfg.lr = 3e-3f, cfg.beta1 = 0.9f, cfg.beta2 = 0.95f, cfg.eps = 1e-8f, cfg.weight_decay = 0.1f;
  std::vector<std::vector<float>> p, g, m, v;
  std::vector<std::vector<double>> rp, rm, rv;
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    p.push_back(random_vector<float>(sizes[t], 10 + t));
    g.push_back(std::vector<float>(sizes[t]));
    m.push_back(std::vector<float>(sizes[t], 0.0f));
    v.push_back(std::vector<float>(sizes[t], 0.0f));
    rp.emplace_back(p[t].begin(), p[t].end());
    rm.emplace_back(sizes[t], 0.0);
    rv.emplace_back(sizes[t], 0.0);
  }
  const float decay_mult[] = {0.0f, 1.0f, 1.0f};
  const float grad_scale = 0.5f;
  for (int step = 1; step <= 5; ++step) {
    std::vector<kernels::AdamWTensor<float>> tensors;
    for (std::size_t t = 0; t < sizes.size(); ++t) {
      g[t] = random_vector<float>(sizes[t], 100 * step + t, -2.0f, 2.0f);
      tensors.push_back({p[t], g[t], m[t], v[t], decay_mult[t]});
      for (std::size_t e = 0; e < sizes[t]; ++e) {
        const double gr = grad_scale * double(g[t][e]);
        rm[t][e] = cfg.beta1 * rm[t][e] + (1 - double(cfg.beta1)) * gr;
        rv[t][e] = cfg.beta2 * rv[t][e] + (1 - double(cfg.beta2)) * gr * gr;
        const double mhat = rm[t][e] / (1 - std::pow(double(cfg.beta1), step));
        const double vhat = rv[t][e] / (1 - std::pow(double(cfg.beta2), step));
        rp[t][e] -= double(cfg.lr) * cfg.weight_decay * decay_mult[t] * rp[t][e];
        rp[t][e] -= double(cfg.lr) * mhat / (std::sqrt(vhat) + cfg.eps);
      }
    }
    host::adamw_step(tensors, cfg, step, grad_scale);
  }
  for (std::size_t t = 0; t < sizes.size(); ++t) {
    require_close(p[t], rp[t], 1e-6, 1e-5, "param");
    require_close(m[t], rm[t], 1e-7, 1e-5, "m");
    require_close(v[t], rv[t], 1e-8, 1e-5, "v");
  }
}

TEST_CASE("adamw with bfloat16 gradients equals fp32 gradients of the same values", "[kernels][adamw]") {
  auto g16 = random_vector<bfloat16>(5000, 3);
  std::vector<float> g32(g16.begin(), g16.end());
  auto p1 = random_vector<float>(5000, 4);
  auto p2 = p1;
  std::vector<float> m1(5000), v1(5000), m2(5000), v2(5000);
  kernels::AdamWConfig cfg;
  host::adamw_step(std::vector<kernels::AdamWTensor<bfloat16>>{{p1, g16, m1, v1}}, cfg, 1);
  host::adamw_step(std::vector<kernels::AdamWTensor<float>>{{p2, g32, m2, v2}}, cfg, 1);
  REQUIRE(p1 == p2);
  REQUIRE(v1 == v2);
}

TEST_CASE("adamw: an element's update does not depend on where its tensor starts", "[kernels][adamw]") {
  // ZeRO-1 updates pieces of the packed buffer that start anywhere; the replicated update runs the
  // whole tensors. Both must give the same bits (vector body, padded tail, bf16 gradients alike).
  const std::size_t n = 70003;  // chunks of 2^15 plus a tail shorter than any vector width
  auto g = random_vector<float>(n, 21, -2.0f, 2.0f);
  auto p_whole = random_vector<float>(n, 22);
  auto p_pieces = p_whole;
  std::vector<float> m_whole(n), v_whole(n), m_pieces(n), v_pieces(n);
  kernels::AdamWConfig cfg;
  cfg.weight_decay = 0.1f;
  const std::size_t cuts[] = {0, 5, 4099, 37000, n};
  for (int step = 1; step <= 3; ++step) {
    host::adamw_step(std::vector<kernels::AdamWTensor<float>>{{p_whole, g, m_whole, v_whole}}, cfg, step, 0.75f);
    std::vector<kernels::AdamWTensor<float>> pieces;
    for (int c = 0; c + 1 < 5; ++c) {
      const std::size_t b = cuts[c], len = cuts[c + 1] - cuts[c];
      pieces.push_back({std::span(p_pieces).subspan(b, len), std::span<const float>(g).subspan(b, len),
                        std::span(m_pieces).subspan(b, len), std::span(v_pieces).subspan(b, len)});
    }
    host::adamw_step(pieces, cfg, step, 0.75f);
  }
  REQUIRE(p_whole == p_pieces);
  REQUIRE(m_whole == m_pieces);
  REQUIRE(v_whole == v_pieces);
}

TEST_CASE("adamw rejects mismatched tensors and step 0", "[kernels][adamw]") {
  std::vector<float> p(4), g(3), m(4), v(4);
  REQUIRE_THROWS_AS(host::adamw_step(std::vector<kernels::AdamWTensor<float>>{{p, g, m, v}}, {}, 1), Error);
  std::vector<float> g4(4);
  REQUIRE_THROWS_AS(host::adamw_step(std::vector<kernels::AdamWTensor<float>>{{p, g4, m, v}}, {}, 0), Error);
}

TEST_CASE("global gradient norm (fp64) and clip factor", "[kernels][adamw]") {
  auto a = random_vector<float>(100003, 5, -3.0f, 3.0f), b = random_vector<float>(7, 6);
  std::vector<std::span<const float>> grads = {a, b};
  double want = 0;
  for (float x : a) want += double(x) * x;
  for (float x : b) want += double(x) * x;
  const double got = host::grad_norm_squared(grads);
  REQUIRE(std::fabs(got - want) <= 1e-9 * want);
  const double norm = std::sqrt(got);
  REQUIRE(host::clip_scale(norm, 2 * norm) == 1.0f);
  REQUIRE(std::fabs(host::clip_scale(norm, 1.0) - 1.0 / (norm + 1e-6)) <= 1e-6 / norm);
  REQUIRE_THROWS_AS(host::clip_scale(std::nan(""), 1.0), Error);
}
