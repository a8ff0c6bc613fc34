// half / bfloat16 conversions: against an independent double-precision rounding reference, and
// (where the CUDA headers exist) bit for bit against cuda_fp16.h / cuda_bf16.h host conversions.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "trellis/core/dtype.hpp"

#if defined(TRELLIS_TEST_WITH_CUDA_FP16)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

using tbf16 = trellis::bfloat16;
using thalf = trellis::half;

namespace {
float from_u32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Decodes a 16-bit pattern plainly, by the format's definition, in double.
double decode_half(std::uint16_t h) {
  int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
  double s = sign ? -1.0 : 1.0;
  if (exponent == 31) return mantissa ? std::numeric_limits<double>::quiet_NaN() : s * INFINITY;
  if (exponent == 0) return s * std::ldexp(mantissa, -24);
  return s * std::ldexp(1024 + mantissa, exponent - 25);
}

// Reference rounding: the representable value nearest to x, ties to the even pattern, found by
// bisection over the ordered set of finite non-negative patterns (independent of the bit tricks).
template <class Decode>
std::uint16_t reference_round(double x, Decode decode, std::uint16_t max_finite, double overflow_at) {
  if (std::isnan(x)) return 0x7fff;
  std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  double a = std::fabs(x);
  if (a >= overflow_at) return sign | static_cast<std::uint16_t>(max_finite + 1);  // Inf
  std::uint16_t lo = 0, hi = max_finite;
  while (hi - lo > 1) {
    std::uint16_t mid = static_cast<std::uint16_t>((lo + hi) / 2);
    if (decode(mid) <= a) lo = mid; else hi = mid;
  }
  double dl = a - decode(lo), dh = decode(hi) - a;
  std::uint16_t pick = (dl < dh || (dl == dh && (lo & 1) == 0)) ? lo : hi;
  if (decode(hi) <= a) pick = hi;
  return sign | pick;
}

double decode_bf16(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  return static_cast<double>(from_u32(u));
}
}  // namespace

TEST_CASE("16-bit to float is exact for every pattern", "[dtype]") {
  for (std::uint32_t p = 0; p < 65536; ++p) {
    auto bits = static_cast<std::uint16_t>(p);
    double expect = decode_half(bits);
    float got = thalf(trellis::from_bits, bits);
    if (std::isnan(expect)) {
      REQUIRE(std::isnan(got));
    } else {
      REQUIRE(static_cast<double>(got) == expect);
    }
    float gb = tbf16(trellis::from_bits, bits);
    double eb = decode_bf16(bits);
    if (std::isnan(eb)) REQUIRE(std::isnan(gb)); else REQUIRE(static_cast<double>(gb) == eb);
  }
}

TEST_CASE("float to half/bfloat16 rounds to nearest even (sampled against a reference)", "[dtype]") {
  // Every 4099th float pattern (a prime stride visits all exponents and many mantissas), both
  // signs, plus hand-picked edge cases.
  const double half_overflow = 65520.0;  // halfway between 65504 and 2^16: ties to even -> Inf
  const double bf16_overflow = static_cast<double>(from_u32(0x7f7f8000u));
  auto check = [&](float f) {
    thalf h(f);
    tbf16 b(f);
    INFO("float bits " << std::hex << [&] { std::uint32_t u; std::memcpy(&u, &f, 4); return u; }());
    REQUIRE(h.bits == reference_round(f, decode_half, 0x7bff, half_overflow));
    REQUIRE(b.bits == reference_round(f, decode_bf16, 0x7f7f, bf16_overflow));
  };
  for (std::uint64_t u = 0; u < (1ull << 32); u += 4099) check(from_u32(static_cast<std::uint32_t>(u)));
  const float edges[] = {0.0f, -0.0f, 1.0f, 65504.0f, 65519.99f, 65520.0f, 1e-8f, 2.98023224e-8f,
                         2.98023225e-8f, 5.96046448e-8f, 6.103515625e-05f, 6.1035e-05f,
                         INFINITY, -INFINITY, NAN, 3.3895314e38f, 1.0009765625f, 1.00048828125f,
                         1.00146484375f, std::numeric_limits<float>::denorm_min(),
                         std::numeric_limits<float>::max()};
  for (float f : edges) check(f);
}

TEST_CASE("rounding ties go to even", "[dtype]") {
  // 1 + 2^-11 is exactly halfway between half(1) and the next half: rounds down to even.
  REQUIRE(thalf(1.00048828125f).bits == 0x3c00);
  // 1 + 3 * 2^-11 is halfway between 1+2^-10 (odd) and 1+2^-9 (even): rounds up.
  REQUIRE(thalf(1.00146484375f).bits == 0x3c02);
  // bfloat16: 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to even (1).
  REQUIRE(tbf16(1.00390625f).bits == 0x3f80);
  REQUIRE(tbf16(1.01171875f).bits == 0x3f82);
  REQUIRE(thalf(NAN).bits == 0x7fff);
  REQUIRE(thalf(65520.0f).bits == 0x7c00);
  REQUIRE(thalf(-1e10f).bits == 0xfc00);
  REQUIRE(thalf(5.96046448e-8f).bits == 0x0001);  // smallest subnormal
  REQUIRE(thalf(2.98023224e-8f).bits == 0x0000);  // exactly half of it: ties to even (0)
}

#if defined(TRELLIS_TEST_WITH_CUDA_FP16)
TEST_CASE("bit for bit equal to cuda_fp16.h / cuda_bf16.h host conversions", "[dtype][cuda]") {
  for (std::uint64_t u = 0; u < (1ull << 32); u += 257) {
    float f = from_u32(static_cast<std::uint32_t>(u));
    __half ch = __float2half_rn(f);
    __nv_bfloat16 cb = __float2bfloat16_rn(f);
    std::uint16_t hb, bb;
    std::memcpy(&hb, &ch, 2);
    std::memcpy(&bb, &cb, 2);
    INFO("float bits " << std::hex << u);
    REQUIRE(thalf(f).bits == hb);
    REQUIRE(tbf16(f).bits == bb);
  }
  for (std::uint32_t p = 0; p < 65536; ++p) {
    auto bits = static_cast<std::uint16_t>(p);
    __half_raw chr; chr.x = bits; __half ch(chr);
    __nv_bfloat16_raw cbr; cbr.x = bits; __nv_bfloat16 cb(cbr);
    float a = __half2float(ch), b = thalf(trellis::from_bits, bits);
    float c = __bfloat162float(cb), d = tbf16(trellis::from_bits, bits);
    REQUIRE(std::memcmp(&a, &b, 4) == 0);
    REQUIRE(std::memcmp(&c, &d, 4) == 0);
  }
}
#endif

TEST_CASE("dtype tags", "[dtype]") {
  STATIC_REQUIRE(trellis::dtype_v<float> == trellis::DType::f32);
  STATIC_REQUIRE(trellis::dtype_v<const trellis::bfloat16> == trellis::DType::bf16);
  STATIC_REQUIRE(trellis::dtype_size(trellis::DType::f16) == 2);
  STATIC_REQUIRE(trellis::Element<std::int64_t>);
  STATIC_REQUIRE(!trellis::Element<char*>);
}
