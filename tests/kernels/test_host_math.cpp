// host::gelu_row and gelu_grad_row (the GEMM epilogues' GELU and its backward, explicit SIMD)
// against GPT-2's tanh formula evaluated in double with std::tanh, over a dense range and out to
// the largest floats, plus special values and the promise that an element's result does not
// depend on where it sits in a row.
// gelu_row, measured: max abs error 5.2e-7 (at x ~ 4.67, one ulp of the result); max relative
// error where |gelu(x)| >= 1e-3: 9.9e-7. The tolerances below are those figures rounded up.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/reference.hpp"
#include "trellis/kernels/host_math.hpp"

using namespace trellis::kernels;

namespace {

// gelu_tanh in double; its limits where the formula itself gives inf * 0.
double gelu_reference(float x) {
  if (std::isinf(x)) return x > 0 ? static_cast<double>(x) : 0.0;
  return trellis_test::gelu_ref(static_cast<double>(x));
}

std::vector<float> gelu_of(std::vector<float> x) {
  host::gelu_row(static_cast<std::int64_t>(x.size()), x.data(), nullptr, nullptr);
  return x;
}

}  // namespace

TEST_CASE("gelu_row vs the tanh formula in double: dense range and large |x|", "[kernels][host_math]") {
  std::vector<float> x;
  for (double v = -12.0; v <= 12.0; v += 1e-4) x.push_back(static_cast<float>(v));  // 240k points
  for (double v = 12.0; v < 3e38; v *= 1.01) x.push_back(static_cast<float>(v)), x.push_back(-static_cast<float>(v));
  x.push_back(std::numeric_limits<float>::max());
  x.push_back(-std::numeric_limits<float>::max());
  x.push_back(std::numeric_limits<float>::denorm_min());
  x.push_back(0.0f);
  const auto y = gelu_of(x);
  double worst_abs = 0, worst_rel = 0;
  float worst_abs_x = 0, worst_rel_x = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double want = gelu_reference(x[i]);
    const double err = std::fabs(static_cast<double>(y[i]) - want);
    REQUIRE(std::isfinite(y[i]));
    if (err > worst_abs) worst_abs = err, worst_abs_x = x[i];
    if (std::fabs(want) >= 1e-3 && err / std::fabs(want) > worst_rel)
      worst_rel = err / std::fabs(want), worst_rel_x = x[i];
  }
  INFO("max abs error " << worst_abs << " at x = " << worst_abs_x << ", max rel error " << worst_rel
                        << " at x = " << worst_rel_x);
  REQUIRE(worst_abs <= 6e-7);
  REQUIRE(worst_rel <= 1.2e-6);
}

TEST_CASE("gelu_row tails: exactly x above 10, ~0 below -10, inf and NaN", "[kernels][host_math]") {
  std::vector<float> x = {10.0f, 37.5f, 1e6f, 3e38f, std::numeric_limits<float>::infinity()};
  auto y = gelu_of(x);
  for (std::size_t i = 0; i < x.size(); ++i) REQUIRE(y[i] == x[i]);
  x = {-10.0f, -10.5f, -1e3f, -1e20f, -3e38f, -std::numeric_limits<float>::infinity()};
  y = gelu_of(x);
  for (float v : y) {
    REQUIRE(v <= 0.0f);
    REQUIRE(v >= -1.25e-37f);  // gelu(-10) = -1.2e-37; a saturated exp would give -x / exp(88) instead
  }
  y = gelu_of({std::numeric_limits<float>::quiet_NaN(), 1.0f});
  REQUIRE(std::isnan(y[0]));
  REQUIRE(y[1] == Approx(trellis_test::gelu_ref(1.0)).epsilon(1e-6));
}

TEST_CASE("gelu_row: bias and pre-activation; same bits wherever an element sits", "[kernels][host_math]") {
  // pre at every offset within a cache line: streaming stores start after a misaligned head.
  std::vector<float> pre_storage(200 + 16);
  for (std::int64_t n : {1, 3, 7, 8, 15, 16, 17, 31, 33, 100, 200}) {
    for (std::int64_t offset : {0, 1, 5, 8, 15}) {
      auto x =
          trellis_test::random_vector<float>(static_cast<std::size_t>(n), 11 + static_cast<std::uint32_t>(n), -6, 6);
      auto bias = trellis_test::random_vector<float>(static_cast<std::size_t>(n), 5, -1, 1);
      std::vector<float> c = x;
      std::fill(pre_storage.begin(), pre_storage.end(), -1.0f);
      float* pre = pre_storage.data() + offset;
      host::gelu_row(n, c.data(), bias.data(), pre);
      for (std::int64_t j = 0; j < n; ++j) {
        const float sum = x[j] + bias[j];
        REQUIRE(pre[j] == sum);
        // Alone, the element goes through the zero-padded path: the same bits as in the row.
        float alone = sum;
        host::gelu_row(1, &alone, nullptr, nullptr);
        REQUIRE(std::memcmp(&alone, &c[j], sizeof(float)) == 0);
      }
      REQUIRE(pre[n] == -1.0f);  // nothing written past the row
      if (offset > 0) REQUIRE(pre[-1] == -1.0f);
      // Without pre, and without bias: the same results.
      std::vector<float> c2(x.size());
      for (std::size_t j = 0; j < x.size(); ++j) c2[j] = x[j] + bias[j];
      host::gelu_row(n, c2.data(), nullptr, nullptr);
      REQUIRE(std::memcmp(c2.data(), c.data(), c.size() * sizeof(float)) == 0);
    }
  }
}

// Measured max abs error of gelu_grad_row: 2.2e-7 (at x ~ 1.55), over the same points.
TEST_CASE("gelu_grad_row vs the derivative of the tanh formula in double", "[kernels][host_math]") {
  std::vector<float> x;
  for (double v = -12.0; v <= 12.0; v += 1e-4) x.push_back(static_cast<float>(v));
  for (double v = 12.0; v < 3e38; v *= 1.01) x.push_back(static_cast<float>(v)), x.push_back(-static_cast<float>(v));
  x.push_back(std::numeric_limits<float>::infinity());
  x.push_back(-std::numeric_limits<float>::infinity());
  std::vector<float> dy(x.size(), 1.0f);
  host::gelu_grad_row(static_cast<std::int64_t>(x.size()), dy.data(), x.data());
  double worst = 0;
  float worst_x = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double want = std::isinf(x[i]) ? (x[i] > 0 ? 1.0 : 0.0) : trellis_test::gelu_grad_ref(x[i]);
    REQUIRE(std::isfinite(dy[i]));
    const double err = std::fabs(static_cast<double>(dy[i]) - want);
    if (err > worst) worst = err, worst_x = x[i];
  }
  INFO("max abs error " << worst << " at x = " << worst_x);
  REQUIRE(worst <= 3e-7);
  // The upstream gradient multiplies; NaN stays NaN; tails and positions as for gelu_row.
  for (std::int64_t n : {1, 5, 16, 19, 40}) {
    auto xs =
        trellis_test::random_vector<float>(static_cast<std::size_t>(n), 21 + static_cast<std::uint32_t>(n), -5, 5);
    auto g = trellis_test::random_vector<float>(static_cast<std::size_t>(n), 3, -2, 2);
    auto out = g;
    host::gelu_grad_row(n, out.data(), xs.data());
    for (std::int64_t j = 0; j < n; ++j) {
      float alone = g[j];
      host::gelu_grad_row(1, &alone, &xs[j]);
      REQUIRE(std::memcmp(&alone, &out[j], sizeof(float)) == 0);
      REQUIRE(out[j] == Approx(g[j] * trellis_test::gelu_grad_ref(xs[j])).margin(1e-6));
    }
  }
  float nan_x = std::numeric_limits<float>::quiet_NaN(), one = 1.0f;
  host::gelu_grad_row(1, &one, &nan_x);
  REQUIRE(std::isnan(one));
}
