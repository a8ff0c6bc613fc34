// Vectorisable float math for the host kernels: exp, tanh and GELU written with plain arithmetic
// and bit casts, so that g++ turns loops calling them into SIMD code (libm's expf/tanhf are calls
// the compiler cannot vectorise without -ffast-math). Accuracy: exp within ~2 ulp on
// [-87, 88]; exp(x) = 0 for x < -87.3 (and for -inf), large inputs saturate at exp(88) (finite).
#pragma once

#include <bit>
#include <cstdint>
#include <cmath>

#include "trellis/core/config.hpp"

namespace trellis::kernels::host {

TRELLIS_FORCEINLINE float fast_exp(float x) {
  constexpr float log2e = 1.44269504088896341f;
  constexpr float ln2_hi = 0.693145751953125f;  // exact in float: r stays accurate
  constexpr float ln2_lo = 1.428606765330187045e-6f;
  const bool underflow = x < -87.3f;
  float xc = x > 88.0f ? 88.0f : x;  // 2^127 at most: the exponent bits stay finite
  xc = xc < -87.3f ? -87.3f : xc;
  // Round x log2(e) to the nearest integer n by adding 1.5 * 2^23 (pure float arithmetic, unlike
  // floorf, so loops vectorise); n then sits in the low mantissa bits of `shifted`.
  constexpr float round_magic = 12582912.0f;
  const float shifted = xc * log2e + round_magic;
  const float n = shifted - round_magic;
  float r = xc - n * ln2_hi;
  r = r - n * ln2_lo;  // |r| <= ln2/2
  // Degree-5 minimax polynomial for exp(r) (relative error 2.1e-7 in float arithmetic).
  float p = 8.297654800e-03f;
  p = p * r + 4.191538319e-02f;
  p = p * r + 1.666757464e-01f;
  p = p * r + 4.999889433e-01f;
  p = p * r + 9.999997020e-01f;
  p = p * r + 1.000000119e+00f;
  // 2^n: the low bits of `shifted` hold n + 2^22 + 2^23 (mod 2^9 after the shift, the constant
  // part vanishes), so shifting them into the exponent field and adding the bias gives 2^n.
  const std::uint32_t exponent_bits = (std::bit_cast<std::uint32_t>(shifted) << 23) + (127u << 23);
  const float y = p * std::bit_cast<float>(exponent_bits);
  return underflow ? 0.0f : y;
}

// tanh(u) = 1 - 2 / (exp(2u) + 1); absolute error ~1e-7 (relative error grows for |u| < 1e-4,
// where the GELU formulas multiply it by something small anyway).
TRELLIS_FORCEINLINE float fast_tanh(float u) { return 1.0f - 2.0f / (fast_exp(2.0f * u) + 1.0f); }

// GELU through the logistic form: 0.5 (1 + tanh(u)) = s = 1 / (1 + exp(-2u)), 1 - s = exp(-2u) s.
// Both tails stay accurate (no 1 + (-1) cancellation for very negative inputs), and nothing
// overflows to NaN: fast_exp saturates.
TRELLIS_FORCEINLINE float fast_gelu(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float s = 1.0f / (1.0f + fast_exp(-2.0f * u));
  return x * s;
}

TRELLIS_FORCEINLINE float fast_gelu_grad(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  const float e = fast_exp(-2.0f * u);
  const float s = 1.0f / (1.0f + e);
  const float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
  return s + 2.0f * x * s * (e * s) * du;
}

// Element conversions used by the host kernels' loads and stores.
template <class T>
TRELLIS_FORCEINLINE float to_float(T v) {
  return static_cast<float>(v);
}
template <class T>
TRELLIS_FORCEINLINE T from_float(float v) {
  return static_cast<T>(v);
}

}  // namespace trellis::kernels::host
