// Embedding forward/backward against plain loops (and against the sum over vocab shards), GELU
// against the double tanh formula and finite differences, add and column sums against loops, the
// fp32 -> bf16 conversion against rounding to nearest even worked out in double.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/reference.hpp"
#include "trellis/kernels/elementwise_host.hpp"
#include "trellis/kernels/embedding_host.hpp"

using namespace trellis;
using namespace trellis::kernels;
using trellis_test::random_vector;
using trellis_test::require_close;

TEST_CASE("embedding forward and backward (repeated tokens) vs plain loops", "[kernels][embedding]") {
  kernels::EmbeddingArgs a;
  a.batch = 3, a.seq = 17, a.dim = 130, a.vocab_rows = 11, a.positions = 20;
  std::vector<std::int32_t> tokens(a.batch * a.seq);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * i + 3) % 11);
  auto wte = random_vector<float>(a.vocab_rows * a.dim, 1), wpe = random_vector<float>(a.positions * a.dim, 2);
  std::vector<float> out(tokens.size() * a.dim);
  host::embedding_forward(a, tokens.data(), wte.data(), wpe.data(), out.data());
  std::vector<double> want(out.size());
  for (std::int64_t i = 0; i < a.batch * a.seq; ++i)
    for (std::int64_t j = 0; j < a.dim; ++j)
      want[i * a.dim + j] = double(wte[tokens[i] * a.dim + j]) + wpe[(i % a.seq) * a.dim + j];
  require_close(out, want, 0, 1e-7, "embedding out");

  auto dout = random_vector<float>(out.size(), 3);
  std::vector<float> dwte(wte.size(), 1.0f), dwpe(wpe.size(), 2.0f);
  host::embedding_backward(a, tokens.data(), dout.data(), dwte.data(), dwpe.data());
  std::vector<double> want_wte(wte.size(), 1.0), want_wpe(wpe.size(), 2.0);
  for (std::int64_t i = 0; i < a.batch * a.seq; ++i)
    for (std::int64_t j = 0; j < a.dim; ++j) {
      want_wte[tokens[i] * a.dim + j] += dout[i * a.dim + j];
      want_wpe[(i % a.seq) * a.dim + j] += dout[i * a.dim + j];
    }
  require_close(dwte, want_wte, 1e-5, 1e-6, "dwte");
  require_close(dwpe, want_wpe, 1e-5, 1e-6, "dwpe");
  // Deterministic: the same accumulation again gives the same bits.
  std::vector<float> again(wte.size(), 1.0f);
  host::embedding_backward(a, tokens.data(), dout.data(), again.data(), static_cast<float*>(nullptr));
  REQUIRE(again == dwte);

  tokens[4] = 11;  // outside an unsharded table
  REQUIRE_THROWS_AS(host::embedding_forward(a, tokens.data(), wte.data(), wpe.data(), out.data()), Error);
}

TEST_CASE("vocab-sharded embedding: the sum over shards equals the full table", "[kernels][embedding]") {
  kernels::EmbeddingArgs full;
  full.batch = 2, full.seq = 9, full.dim = 16, full.vocab_rows = 10, full.positions = 9;
  std::vector<std::int32_t> tokens(full.batch * full.seq);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((5 * i + 1) % 10);
  auto wte = random_vector<float>(full.vocab_rows * full.dim, 4), wpe = random_vector<float>(full.seq * full.dim, 5);
  std::vector<float> want(tokens.size() * full.dim);
  host::embedding_forward(full, tokens.data(), wte.data(), wpe.data(), want.data());
  std::vector<double> sum(want.size(), 0.0);
  const std::int64_t starts[] = {0, 4, 10};
  auto dout = random_vector<float>(want.size(), 6);
  std::vector<float> dwte_full(wte.size(), 0.0f);
  host::embedding_backward(full, tokens.data(), dout.data(), dwte_full.data(), static_cast<float*>(nullptr));
  for (int r = 0; r < 2; ++r) {
    auto a = full;
    a.sharded = true, a.vocab_start = starts[r], a.vocab_rows = starts[r + 1] - starts[r];
    std::vector<float> part(want.size());
    host::embedding_forward(a, tokens.data(), wte.data() + starts[r] * full.dim, r == 0 ? wpe.data() : nullptr,
                            part.data());
    for (std::size_t i = 0; i < part.size(); ++i) sum[i] += part[i];
    std::vector<float> dpart(a.vocab_rows * a.dim, 0.0f);
    host::embedding_backward(a, tokens.data(), dout.data(), dpart.data(), static_cast<float*>(nullptr));
    REQUIRE(std::equal(dpart.begin(), dpart.end(), dwte_full.begin() + starts[r] * full.dim));
  }
  require_close(want, sum, 0, 1e-7, "sum over shards");
}

TEST_CASE("gelu forward/backward vs the double tanh formula and finite differences", "[kernels][elementwise]") {
  auto x = random_vector<float>(40000, 7, -8.0f, 8.0f);
  x[0] = 0.0f, x[1] = 1e-7f, x[2] = -20.0f, x[3] = 20.0f;
  std::vector<float> y(x.size()), dx(x.size());
  host::gelu_forward(static_cast<std::int64_t>(x.size()), x.data(), y.data());
  std::vector<double> want(x.size()), want_grad(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    want[i] = trellis_test::gelu_ref(x[i]);
    want_grad[i] = trellis_test::gelu_grad_ref(x[i]);
  }
  require_close(y, want, 1e-6, 1e-5, "gelu");
  auto ones = std::vector<float>(x.size(), 1.0f);
  host::gelu_backward(static_cast<std::int64_t>(x.size()), x.data(), ones.data(), dx.data());
  require_close(dx, want_grad, 1e-6, 1e-5, "gelu grad");
  for (double v : {-3.1, -0.7, 0.0, 0.4, 2.5}) {
    const double h = 1e-6;
    const double fd = (trellis_test::gelu_ref(v + h) - trellis_test::gelu_ref(v - h)) / (2 * h);
    float xv = static_cast<float>(v), one = 1.0f, g = 0.0f;
    host::gelu_backward(1, &xv, &one, &g);
    REQUIRE(std::fabs(g - fd) <= 1e-5);
  }
}

TEST_CASE("add and column sums vs loops", "[kernels][elementwise]") {
  const std::int64_t rows = 300, cols = 37, ld = 40;
  auto a = random_vector<float>(rows * ld, 8), b = random_vector<float>(rows * ld, 9);
  std::vector<float> c(a.size());
  host::add(static_cast<std::int64_t>(a.size()), a.data(), b.data(), c.data());
  for (std::size_t i = 0; i < a.size(); ++i) REQUIRE(c[i] == a[i] + b[i]);
  std::vector<float> sums(cols, 1.0f);
  host::column_sums(rows, cols, ld, a.data(), sums.data());
  std::vector<double> want(cols, 1.0);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) want[j] += a[i * ld + j];
  require_close(sums, want, 1e-5, 1e-5, "column sums");
}

namespace {
// The exact value of a float's bits, in double, by integer arithmetic (no float operation, so a
// flush-to-zero mode of the thread cannot touch subnormals); bf16 bits as the float bits << 16.
// The all-ones exponent maps to +-2^128: the next step above the largest finite value.
double exact_value(std::uint32_t bits) {
  const std::uint32_t exponent = (bits >> 23) & 0xffu, mantissa = bits & 0x7fffffu;
  const double magnitude = exponent == 0 ? std::ldexp(static_cast<double>(mantissa), -149)
                                         : std::ldexp(static_cast<double>(mantissa | 0x800000u), static_cast<int>(exponent) - 150);
  return (bits >> 31) ? -magnitude : magnitude;
}
// Round to nearest even by comparing the two bf16 neighbours' distances in double.
std::uint16_t bf16_reference(std::uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fff;        // NaN: canonical
  if ((bits & 0x7fffffffu) == 0x7f800000u) return static_cast<std::uint16_t>(bits >> 16);  // +-inf
  const auto lo = static_cast<std::uint16_t>(bits >> 16), hi = static_cast<std::uint16_t>(lo + 1);
  const double x = exact_value(bits), dlo = std::fabs(x - exact_value(std::uint32_t{lo} << 16)),
               dhi = std::fabs(exact_value(std::uint32_t{hi} << 16) - x);
  if (dlo != dhi) return dlo < dhi ? lo : hi;
  return (lo & 1u) ? hi : lo;  // a tie: the even one
}
}  // namespace

TEST_CASE("convert fp32 -> bf16: round to nearest even in double, NaN canonical, any length and offset",
          "[kernels][elementwise]") {
  // Bit patterns from every exponent (subnormals, the top of the range, inf, NaN), exact ties
  // (low half 0x8000) with odd and even upper halves, and the half-ulp below the overflow to inf.
  std::vector<std::uint32_t> bits = {0x00000000u, 0x80000000u, 0x00000001u, 0x00008000u, 0x00018000u, 0x3f808000u,
                                     0x3f818000u, 0x3f807fffu, 0x3f808001u, 0x7f7f7fffu, 0x7f7f8000u, 0x7f7fffffu,
                                     0xff7f8000u, 0x7f800000u, 0xff800000u, 0x7f800001u, 0xffc00000u, 0x7fffffffu};
  std::uint64_t state = 12345;
  while (bits.size() < 20011) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    auto b = static_cast<std::uint32_t>(state >> 32);
    if (bits.size() % 3 == 0) b = (b & 0xffff0000u) | 0x8000u;  // a tie
    bits.push_back(b);
  }
  std::vector<float> src(bits.size());
  std::memcpy(src.data(), bits.data(), bits.size() * sizeof(float));
  for (std::int64_t offset : {0, 1, 7}) {  // starts off the vector width, lengths with tails
    const std::int64_t n = static_cast<std::int64_t>(src.size()) - offset;
    std::vector<bfloat16> dst(static_cast<std::size_t>(n), bfloat16(from_bits, 0xabcd));
    host::convert(n, src.data() + offset, dst.data());
    std::int64_t wrong = 0, first = -1;
    for (std::int64_t i = 0; i < n; ++i)
      if (dst[i].bits != bf16_reference(bits[i + offset]) && wrong++ == 0) first = i + offset;
    INFO("offset " << offset << ", first wrong input bits 0x" << std::hex << (first >= 0 ? bits[first] : 0u));
    REQUIRE(wrong == 0);
  }
}

TEST_CASE("fast_exp against std::exp, including the saturating ends", "[kernels][elementwise]") {
  double worst = 0;
  for (float x = -87.0f; x < 88.0f; x += 0.0137f) {
    const double want = std::exp(double(x));
    worst = std::max(worst, std::fabs(host::fast_exp(x) - want) / want);
  }
  REQUIRE(worst < 5e-7);
  REQUIRE(host::fast_exp(-std::numeric_limits<float>::infinity()) == 0.0f);
  REQUIRE(host::fast_exp(-100.0f) == 0.0f);
  REQUIRE(std::isfinite(host::fast_exp(1000.0f)));
  REQUIRE(std::fabs(host::fast_gelu(-30.0f)) < 1e-30f);  // the far tail is ~0, not NaN
  REQUIRE(host::fast_gelu(30.0f) == 30.0f);
}
