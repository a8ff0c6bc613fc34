// Vectorisable float math for the host kernels: exp, tanh and GELU written with plain arithmetic
// and bit casts, so that g++ turns loops calling them into SIMD code (libm's expf/tanhf are calls
// the compiler cannot vectorise without -ffast-math). Accuracy: exp within ~2 ulp on
// [-87, 88]; exp(x) = 0 for x < -87.3 (and for -inf), large inputs saturate at exp(88) (finite).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "trellis/core/config.hpp"
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && defined(__SSE__)
#include <immintrin.h>  // at file scope: inside a namespace it would hide the intrinsics from later headers
#endif

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

// ---- GELU over rows, explicit SIMD ---------------------------------------------------------------
// A loop over fast_gelu vectorises, but g++ 12 if-converts the clamps into masked copies of the
// whole exp path (it folds exp(88) into a constant branch: up to three divisions per vector). The
// row kernels below spell the vectors out with GCC/clang vector extensions, so every element costs
// the same straight-line code: 1.7x faster than the fast_gelu loop (measured 0.19 vs 0.33 ns per
// element on one AVX-512 core, L2-resident rows). Under nvcc (or other compilers) they run the
// scalar fast_gelu instead.
//
// Formula: gelu(x) = x / (1 + exp(t)), t = -2 sqrt(2/pi) (x + 0.044715 x^3), with x clamped below
// at -10 (gelu(-10) = -1.2e-37, so every x < -10 gives ~0 instead of a saturated exp's -x/exp(88))
// and t clamped below at -87 (exp(-87) vanishes next to 1, so large x give exactly x). The clamps
// keep NaN: a NaN x stays NaN. Max abs error vs the tanh formula in double: 5.2e-7 (1 ulp at
// x ~ 4.7), tested in tests/kernels/test_host_math.cpp.
// -DTRELLIS_HOST_SIMD=0 forces the scalar loops.
#ifndef TRELLIS_HOST_SIMD
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define TRELLIS_HOST_SIMD 1
#else
#define TRELLIS_HOST_SIMD 0
#endif
#endif

#if TRELLIS_HOST_SIMD
namespace simd {
// As wide as the target's vector registers, so no vector crosses a function boundary it cannot
// be passed in (no -Wpsabi changes of ABI).
#if defined(__AVX512F__)
inline constexpr int width = 16;
#elif defined(__AVX__)
inline constexpr int width = 8;
#else
inline constexpr int width = 4;
#endif
typedef float vfloat __attribute__((vector_size(width * sizeof(float))));
typedef std::uint32_t vuint __attribute__((vector_size(width * sizeof(float))));

TRELLIS_FORCEINLINE vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
TRELLIS_FORCEINLINE void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }
TRELLIS_FORCEINLINE vfloat splat(float s) { return vfloat{} + s; }
// Store that bypasses the caches (p aligned to a whole vector); streaming_fence() orders such
// stores before later ones, so other threads see them once the writer has synchronised.
TRELLIS_FORCEINLINE void store_streaming(float* p, vfloat v) {
#if defined(__AVX512F__)
  _mm512_stream_ps(p, v);
#elif defined(__AVX__)
  _mm256_stream_ps(p, v);
#elif defined(__SSE__)
  _mm_stream_ps(p, v);
#else
  store(p, v);
#endif
}
TRELLIS_FORCEINLINE void streaming_fence() {
#if defined(__SSE__)
  _mm_sfence();
#endif
}

// Correctly rounded square root of every lane (IEEE, as std::sqrt; no errno, so no scalar path).
TRELLIS_FORCEINLINE vfloat sqrt(vfloat x) {
#if defined(__AVX512F__)
  // The zero-masked form: _mm512_sqrt_ps starts from an "undefined" register that g++ 12 warns of.
  return _mm512_maskz_sqrt_ps(static_cast<__mmask16>(0xFFFF), x);
#elif defined(__AVX__)
  return _mm256_sqrt_ps(x);
#elif defined(__SSE__)
  return _mm_sqrt_ps(x);
#else
  for (int l = 0; l < width; ++l) x[l] = std::sqrt(x[l]);
  return x;
#endif
}

// x must lie in [-87, 87.4] (no clamping here; the caller clamps).
TRELLIS_FORCEINLINE vfloat exp_in_range(vfloat x) {
  constexpr float log2e = 1.44269504088896341f;
  constexpr float ln2 = 0.693147182464599609375f;  // float(ln 2): off by 1.9e-9, n * that < 3e-7
  constexpr float round_magic = 12582912.0f;      // 1.5 * 2^23, as in fast_exp
  const vfloat shifted = x * log2e + round_magic;
  const vfloat n = shifted - round_magic;
  const vfloat r = x - n * ln2;
  vfloat p = r * 8.297654800e-03f + 4.191538319e-02f;  // fast_exp's degree-5 minimax polynomial
  p = p * r + 1.666757464e-01f;
  p = p * r + 4.999889433e-01f;
  p = p * r + 9.999997020e-01f;
  p = p * r + 1.000000119e+00f;
  const vuint exponent_bits = (std::bit_cast<vuint>(shifted) << 23) + (127u << 23);
  return p * std::bit_cast<vfloat>(exponent_bits);
}

TRELLIS_FORCEINLINE vfloat gelu(vfloat x) {
  constexpr float two_k = -1.5957691216057308f;            // -2 sqrt(2/pi)
  constexpr float two_k_cubic = -1.5957691216057308f * 0.044715f;
  const vfloat floor_x = splat(-10.0f);
  const vfloat xc = x < floor_x ? floor_x : x;             // NaN stays NaN
  vfloat t = xc * (two_k + two_k_cubic * (xc * xc));       // <= 87.31 at xc = -10
  const vfloat floor_t = splat(-87.0f);
  t = t > floor_t ? t : floor_t;                           // NaN (only from a NaN x) -> -87
  return xc / (1.0f + exp_in_range(t));
}

// d gelu / dx = s (1 + 2 x e s du/dx), s = 1 / (1 + e), e = exp(t) as in gelu(). x is clamped to
// [-10, 10]: outside, the derivative is 1 or 0 to float precision (and x^3 cannot overflow).
TRELLIS_FORCEINLINE vfloat gelu_grad(vfloat x) {
  constexpr float k = 0.7978845608028654f;  // sqrt(2/pi)
  constexpr float two_k = -2.0f * k, two_k_cubic = -2.0f * k * 0.044715f, k_cubic_3 = k * 3.0f * 0.044715f;
  const vfloat floor_x = splat(-10.0f), ceil_x = splat(10.0f);
  vfloat xc = x < floor_x ? floor_x : x;  // NaN stays NaN
  xc = xc > ceil_x ? ceil_x : xc;
  const vfloat x2 = xc * xc;
  const vfloat e = exp_in_range(xc * (two_k + two_k_cubic * x2));  // |t| <= 87.31
  const vfloat s = 1.0f / (1.0f + e);
  const vfloat du = k + k_cubic_3 * x2;
  return s * (1.0f + 2.0f * xc * (e * s) * du);
}
}  // namespace simd
#endif

// c[j] = gelu(c[j] + bias[j]) for j < n; bias may be null (no bias); pre (may be null) receives
// the pre-activation c[j] + bias[j]. Every element gets the same bits wherever it sits in the row.
// pre is written with streaming stores: it is read only by the backward pass, much later, so its
// cache lines need not be read first nor kept (measured, one core, the 1024 x 3072 output of an
// sgemm: 0.90 -> 0.71 ms; 4096 x 3072: 4.4 -> 2.9 ms).
inline void gelu_row(std::int64_t n, float* TRELLIS_RESTRICT c, const float* TRELLIS_RESTRICT bias,
                     float* TRELLIS_RESTRICT pre) {
#if TRELLIS_HOST_SIMD
  constexpr std::int64_t w = simd::width;
  // Elements [j, j + count), count <= w, through one zero-padded vector: the same code as the rest.
  auto partial = [&](std::int64_t j, std::int64_t count) {
    float cbuf[w] = {}, bbuf[w] = {}, pbuf[w] = {};
    const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(float);
    std::memcpy(cbuf, c + j, bytes);
    simd::vfloat x = simd::load(cbuf);
    if (bias) {
      std::memcpy(bbuf, bias + j, bytes);
      x += simd::load(bbuf);
    }
    if (pre) {
      simd::store(pbuf, x);
      std::memcpy(pre + j, pbuf, bytes);
    }
    simd::store(cbuf, simd::gelu(x));
    std::memcpy(c + j, cbuf, bytes);
  };
  std::int64_t j = 0;
  if (pre) {
    // Streaming stores need pre + j aligned to a whole vector: the first few elements go alone.
    const auto misaligned = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(pre) / sizeof(float) % w);
    if (misaligned != 0) {
      j = std::min(n, w - misaligned);
      partial(0, j);
    }
    if (bias) {
      for (; j + w <= n; j += w) {
        const simd::vfloat x = simd::load(c + j) + simd::load(bias + j);
        simd::store_streaming(pre + j, x);
        simd::store(c + j, simd::gelu(x));
      }
    } else {
      for (; j + w <= n; j += w) {
        const simd::vfloat x = simd::load(c + j);
        simd::store_streaming(pre + j, x);
        simd::store(c + j, simd::gelu(x));
      }
    }
    simd::streaming_fence();
  } else if (bias) {
    for (; j + w <= n; j += w) simd::store(c + j, simd::gelu(simd::load(c + j) + simd::load(bias + j)));
  } else {
    for (; j + w <= n; j += w) simd::store(c + j, simd::gelu(simd::load(c + j)));
  }
  if (j < n) partial(j, n - j);
#else
  for (std::int64_t j = 0; j < n; ++j) {
    const float x = c[j] + (bias ? bias[j] : 0.0f);
    if (pre) pre[j] = x;
    c[j] = fast_gelu(x < -10.0f ? -10.0f : x);  // the same clamp as simd::gelu (NaN stays NaN)
  }
#endif
}

// c[j] *= gelu'(x[j]) for j < n (the backward of GELU; x is the forward's pre-activation).
inline void gelu_grad_row(std::int64_t n, float* TRELLIS_RESTRICT c, const float* TRELLIS_RESTRICT x) {
#if TRELLIS_HOST_SIMD
  constexpr std::int64_t w = simd::width;
  std::int64_t j = 0;
  for (; j + w <= n; j += w) simd::store(c + j, simd::load(c + j) * simd::gelu_grad(simd::load(x + j)));
  if (j < n) {
    const std::int64_t rest = n - j;
    float cbuf[w] = {}, xbuf[w] = {};
    std::memcpy(cbuf, c + j, rest * sizeof(float));
    std::memcpy(xbuf, x + j, rest * sizeof(float));
    simd::store(cbuf, simd::load(cbuf) * simd::gelu_grad(simd::load(xbuf)));
    std::memcpy(c + j, cbuf, rest * sizeof(float));
  }
#else
  for (std::int64_t j = 0; j < n; ++j) {
    const float xc = x[j] < -10.0f ? -10.0f : (x[j] > 10.0f ? 10.0f : x[j]);  // as simd::gelu_grad
    c[j] *= fast_gelu_grad(xc);
  }
#endif
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
