// Helpers shared by the kernel tests: seeded random fills and tolerance checks. The references
// themselves are written out plainly in each test.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

namespace trellis_test {

template <class T>
std::vector<T> random_vector(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<T> v(n);
  for (auto& x : v) x = T(dist(gen));
  return v;
}

inline double gelu_ref(double x) {
  const double s = std::sqrt(2.0 / 3.14159265358979323846);
  return 0.5 * x * (1.0 + std::tanh(s * (x + 0.044715 * x * x * x)));
}
inline double gelu_grad_ref(double x) {
  const double s = std::sqrt(2.0 / 3.14159265358979323846);
  const double u = s * (x + 0.044715 * x * x * x);
  const double t = std::tanh(u);
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * s * (1.0 + 3.0 * 0.044715 * x * x);
}

// |got - want| <= abs_tol + rel_tol * |want| for every element; reports the worst one.
template <class A, class B>
void require_close(const A& got, const B& want, double abs_tol, double rel_tol, const char* what = "") {
  REQUIRE(got.size() == want.size());
  double worst = 0.0;
  std::size_t worst_i = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double g = static_cast<double>(static_cast<float>(got[i]));
    const double w = static_cast<double>(want[i]);
    const double excess = std::fabs(g - w) - (abs_tol + rel_tol * std::fabs(w));
    if (!(excess <= worst) || std::isnan(g) != std::isnan(w)) {
      worst = std::isnan(excess) ? 1e30 : excess;
      worst_i = i;
    }
  }
  INFO(what << ": worst element " << worst_i << " got " << static_cast<float>(got[worst_i]) << " want "
            << static_cast<double>(want[worst_i]) << " (abs " << abs_tol << ", rel " << rel_tol << ")");
  REQUIRE(worst <= 0.0);
}

}  // namespace trellis_test
