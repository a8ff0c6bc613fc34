// Host GEMM + epilogues against a triple loop in double, for every layout, transpose, epilogue,
// batch stride (packed, padded, broadcast) and element type, with alpha/beta accumulation.
// Tolerances: fp32 output 1e-4 abs + 1e-4 rel (k <= 64, |inputs| <= 1, fp32 accumulation);
// bfloat16 output adds its own rounding (2^-8 relative); half output 2^-11 relative.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <thread>
#include <type_traits>

#include "kernels/reference.hpp"
#include "trellis/kernels/gemm_host.hpp"

using namespace trellis;
using namespace trellis::kernels;
using trellis_test::random_vector;
using trellis_test::require_close;

namespace {

// Element (row, col) of a stored matrix.
std::int64_t at(const GemmArgs& g, std::int64_t r, std::int64_t c, std::int64_t ld) {
  return g.layout == Layout::row_major ? r * ld + c : c * ld + r;
}

struct Case {
  GemmArgs args;
  std::int64_t tile_rows = 0, tile_cols = 0;  // 0: the default tiling
  host::Bf16Product bf16_product = host::Bf16Product::automatic;
};

// What a call produced (matrix elements only, in (batch, row, col) order), for comparing two paths.
struct Outputs {
  std::vector<float> c, pre, bias_grad;
  host::GemmProduct product;
};

// Storage sizes for a batched operand.
std::int64_t storage(std::int64_t ld, std::int64_t rows, std::int64_t cols, const GemmArgs& g, std::int64_t stride,
                     std::int64_t batch) {
  const std::int64_t one = ld * (g.layout == Layout::row_major ? rows : cols);
  return one + stride * (batch - 1);
}

template <class TA, class TB, class TC, class E>
Outputs run_case(const Case& cs, E ep_template, double abs_tol, double rel_tol) {
  const GemmArgs& g = cs.args;
  constexpr auto kind = epilogue_traits<E>::kind;
  const std::int64_t lda = g.lda_or_packed(), ldb = g.ldb_or_packed(), ldc = g.ldc_or_packed();
  auto a = random_vector<TA>(storage(lda, g.a_rows(), g.a_cols(), g, g.stride_a, g.batch), 1);
  auto b = random_vector<TB>(storage(ldb, g.b_rows(), g.b_cols(), g, g.stride_b, g.batch), 2);
  auto c = random_vector<TC>(storage(ldc, g.m, g.n, g, g.stride_c, g.batch), 3);
  if (g.beta == 0.0f)
    for (auto& x : c) x = TC(std::numeric_limits<float>::quiet_NaN());  // must never be read
  auto bias = random_vector<float>(g.n, 4);
  auto pre_in = random_vector<float>(c.size(), 5, -3.0f, 3.0f);
  std::vector<float> pre_out(c.size(), -7.0f);
  std::vector<float> bias_grad = random_vector<float>(g.n, 6);
  const std::vector<float> bias_grad_before = bias_grad;

  // Reference in double from the same (rounded) inputs.
  std::vector<double> want_c(c.size()), want_pre(c.size(), -7.0), want_bgrad(g.n, 0.0);
  for (std::size_t i = 0; i < c.size(); ++i) want_c[i] = static_cast<float>(c[i]);
  for (std::int64_t bt = 0; bt < g.batch; ++bt)
    for (std::int64_t i = 0; i < g.m; ++i)
      for (std::int64_t j = 0; j < g.n; ++j) {
        double acc = 0.0;
        for (std::int64_t p = 0; p < g.k; ++p) {
          const double av = static_cast<float>(
              a[bt * g.stride_a + (g.op_a == Op::none ? at(g, i, p, lda) : at(g, p, i, lda))]);
          const double bv = static_cast<float>(
              b[bt * g.stride_b + (g.op_b == Op::none ? at(g, p, j, ldb) : at(g, j, p, ldb))]);
          acc += av * bv;
        }
        const std::int64_t ci = bt * g.stride_c + at(g, i, j, ldc);
        double x = g.alpha * acc + (g.beta == 0.0f ? 0.0 : g.beta * want_c[ci]);
        switch (kind) {
          case EpilogueKind::none: break;
          case EpilogueKind::bias: x += bias[j]; break;
          case EpilogueKind::relu: x = x > 0 ? x : 0; break;
          case EpilogueKind::bias_relu: x = x + bias[j] > 0 ? x + bias[j] : 0; break;
          case EpilogueKind::gelu: x = trellis_test::gelu_ref(x); break;
          case EpilogueKind::bias_gelu:
            want_pre[ci] = x + bias[j];
            x = trellis_test::gelu_ref(x + bias[j]);
            break;
          case EpilogueKind::dgelu:
          case EpilogueKind::dgelu_bias_grad: x *= trellis_test::gelu_grad_ref(pre_in[ci]); break;
          case EpilogueKind::bias_grad: break;
        }
        want_c[ci] = x;
        want_bgrad[j] += x;
      }

  E ep = ep_template;
  if constexpr (epilogue_traits<E>::has_bias) ep.bias = bias.data();
  if constexpr (epilogue_traits<E>::writes_pre) ep.pre_activation = pre_out.data();
  if constexpr (epilogue_traits<E>::reads_pre) ep.pre_activation = pre_in.data();
  if constexpr (epilogue_traits<E>::bias_grad) ep.bias_grad = bias_grad.data();
  host::GemmOptions options;
  options.tile_rows = cs.tile_rows;
  options.tile_cols = cs.tile_cols;
  options.bf16_product = cs.bf16_product;
  host::gemm(g, a.data(), b.data(), c.data(), ep, options);
  const host::GemmProduct product = host::last_gemm_product();

  // Only the matrix elements are compared; padding must be left alone (checked via NaN/-7 below).
  std::vector<float> got_c, got_pre;
  std::vector<double> ref_c, ref_pre;
  for (std::int64_t bt = 0; bt < g.batch; ++bt)
    for (std::int64_t i = 0; i < g.m; ++i)
      for (std::int64_t j = 0; j < g.n; ++j) {
        const std::int64_t ci = bt * g.stride_c + at(g, i, j, ldc);
        got_c.push_back(static_cast<float>(c[ci]));
        ref_c.push_back(want_c[ci]);
        got_pre.push_back(pre_out[ci]);
        ref_pre.push_back(want_pre[ci]);
      }
  const double out_rel = std::is_same_v<TC, bfloat16> ? 8e-3 : std::is_same_v<TC, half> ? 1e-3 : 0.0;
  require_close(got_c, ref_c, abs_tol + out_rel, rel_tol + out_rel, "C");
  if constexpr (epilogue_traits<E>::writes_pre) require_close(got_pre, ref_pre, abs_tol, rel_tol, "pre_activation");
  if constexpr (epilogue_traits<E>::bias_grad) {
    const bool acc = ep.accumulate;
    for (std::int64_t j = 0; j < g.n; ++j) want_bgrad[j] += acc ? bias_grad_before[j] : 0.0;
    require_close(bias_grad, want_bgrad, abs_tol * 10 + out_rel * 10, rel_tol + out_rel, "bias_grad");
  }
  // Padding between leading dimension and matrix width is untouched.
  if (g.beta == 0.0f && ldc > g.packed_ld(g.m, g.n)) {
    const std::int64_t pad_elem = at(g, g.layout == Layout::row_major ? 0 : g.m, g.layout == Layout::row_major ? g.n : 0, ldc);
    REQUIRE(std::isnan(static_cast<float>(c[pad_elem])));
  }
  return {got_c, got_pre, bias_grad, product};
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (Layout layout : {Layout::row_major, Layout::col_major})
    for (Op op_a : {Op::none, Op::transpose})
      for (Op op_b : {Op::none, Op::transpose})
        for (int variant = 0; variant < 3; ++variant) {
          Case cs;
          GemmArgs& g = cs.args;
          g = gemm_args(37, 29, 45, op_a, op_b, 1.0f, 0.0f, layout);
          if (variant == 1) {  // padded leading dimensions, alpha/beta accumulation, tiny ragged tiles
            g.lda = g.packed_ld(g.a_rows(), g.a_cols()) + 3;
            g.ldb = g.packed_ld(g.b_rows(), g.b_cols()) + 5;
            g.ldc = g.packed_ld(g.m, g.n) + 2;
            g.alpha = 0.75f;
            g.beta = 1.0f;
            cs.tile_rows = 16;
            cs.tile_cols = 8;
          }
          if (variant == 2) {  // strided batches; B shared by all batches (stride 0)
            g.batch = 3;
            g.ldc = g.packed_ld(g.m, g.n) + 1;
            g.packed();
            g.stride_b = 0;
            g.stride_c += 7;
            g.beta = 0.5f;
            cs.tile_rows = 8;
            cs.tile_cols = 16;
          }
          cases.push_back(cs);
        }
  return cases;
}

template <class TA, class TB, class TC>
void run_all_epilogues(double abs_tol, double rel_tol) {
  for (const Case& cs : all_cases()) {
    INFO("layout " << int(cs.args.layout) << " op_a " << int(cs.args.op_a) << " op_b " << int(cs.args.op_b)
                   << " batch " << cs.args.batch << " beta " << cs.args.beta);
    run_case<TA, TB, TC>(cs, epilogue::None{}, abs_tol, rel_tol);
    run_case<TA, TB, TC>(cs, epilogue::Bias<>{}, abs_tol, rel_tol);
    run_case<TA, TB, TC>(cs, epilogue::Relu{}, abs_tol, rel_tol);
    run_case<TA, TB, TC>(cs, epilogue::BiasRelu<>{}, abs_tol, rel_tol);
    run_case<TA, TB, TC>(cs, epilogue::Gelu{}, abs_tol, rel_tol);
    run_case<TA, TB, TC>(cs, epilogue::BiasGelu<>{}, abs_tol, rel_tol);
    run_case<TA, TB, TC>(cs, epilogue::DGelu<>{}, abs_tol, rel_tol);
    run_case<TA, TB, TC>(cs, epilogue::BiasGrad<>{}, abs_tol, rel_tol);
    run_case<TA, TB, TC>(cs, epilogue::BiasGrad<>{nullptr, true}, abs_tol, rel_tol);
    run_case<TA, TB, TC>(cs, epilogue::DGeluBiasGrad<>{}, abs_tol, rel_tol);
  }
}

}  // namespace

TEST_CASE("gemm fp32: layouts x transposes x epilogues x batches, alpha/beta", "[kernels][gemm]") {
  INFO("cblas: " << host::gemm_uses_cblas());
  run_all_epilogues<float, float, float>(1e-4, 1e-4);
}

TEST_CASE("gemm with half and bfloat16 operands and outputs (fp32 accumulation)", "[kernels][gemm]") {
  run_all_epilogues<half, half, float>(1e-4, 1e-4);
  run_all_epilogues<bfloat16, bfloat16, bfloat16>(1e-4, 1e-4);
  run_all_epilogues<bfloat16, float, half>(1e-4, 1e-4);
}

TEST_CASE("gemm with 16-bit epilogue vectors (bias, pre-activation)", "[kernels][gemm]") {
  const std::int64_t m = 20, n = 24, k = 16;
  auto a = random_vector<float>(m * k, 1), b = random_vector<float>(k * n, 2);
  auto bias = random_vector<bfloat16>(n, 3);
  std::vector<bfloat16> pre(m * n);
  std::vector<float> c(m * n);
  host::gemm(gemm_args(m, n, k), a.data(), b.data(), c.data(), epilogue::BiasGelu<bfloat16>{bias.data(), pre.data()});
  std::vector<double> want(m * n), want_pre(m * n);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (std::int64_t p = 0; p < k; ++p) acc += double(a[i * k + p]) * b[p * n + j];
      want_pre[i * n + j] = acc + float(bias[j]);
      want[i * n + j] = trellis_test::gelu_ref(acc + float(bias[j]));
    }
  require_close(c, want, 1e-4, 1e-4, "C");
  require_close(pre, want_pre, 1e-2, 8e-3, "bf16 pre_activation");
}

TEST_CASE("gemm degenerate shapes and bad arguments", "[kernels][gemm]") {
  std::vector<float> a(12, 1.0f), b(12, 1.0f), c(16, 2.0f), g(4, 5.0f);
  // k == 0: C = beta * C, and the bias gradient is the column sums of that.
  host::gemm(gemm_args(4, 4, 0, Op::none, Op::none, 1.0f, 0.5f), a.data(), b.data(), c.data(),
             epilogue::BiasGrad<>{g.data(), false});
  for (float x : c) REQUIRE(x == 1.0f);
  for (float x : g) REQUIRE(x == 4.0f);
  // m == 0 leaves an overwritten bias gradient at 0.
  host::gemm(gemm_args(0, 4, 3), a.data(), b.data(), c.data(), epilogue::BiasGrad<>{g.data(), false});
  for (float x : g) REQUIRE(x == 0.0f);
  auto bad = gemm_args(4, 4, 3);
  bad.lda = 2;  // < k for row-major A
  REQUIRE_THROWS_AS(host::gemm(bad, a.data(), b.data(), c.data()), Error);
  bad = gemm_args(4, 4, 3);
  bad.batch = 2;  // stride_c 0: batches would overwrite each other
  REQUIRE_THROWS_AS(host::gemm(bad, a.data(), b.data(), c.data()), Error);
  REQUIRE_THROWS_AS(host::gemm(gemm_args(4, 4, 3), a.data(), b.data(), c.data(), epilogue::Bias<>{nullptr}), Error);
  REQUIRE_THROWS_AS(host::gemm(gemm_args(-1, 4, 3), a.data(), b.data(), c.data()), Error);
}

TEST_CASE("gemm bias gradient is the same bits run to run", "[kernels][gemm]") {
  // Different tilings may round differently (each is checked against the reference above); two
  // runs with the same tiling must agree bit for bit.
  const std::int64_t m = 300, n = 33, k = 20;
  auto a = random_vector<float>(m * k, 7), b = random_vector<float>(k * n, 8);
  std::vector<float> c(m * n), g1(n), g2(n);
  host::GemmOptions opt;
  opt.tile_rows = 64;
  opt.tile_cols = 16;
  host::gemm(gemm_args(m, n, k), a.data(), b.data(), c.data(), epilogue::BiasGrad<>{g1.data()}, opt);
  host::gemm(gemm_args(m, n, k), a.data(), b.data(), c.data(), epilogue::BiasGrad<>{g2.data()}, opt);
  REQUIRE(g1 == g2);
}

TEST_CASE("gemm large enough for several default tiles vs reference", "[kernels][gemm]") {
  // 2100 x 300 x 24: four tiles of 528 rows (the last ragged) under the default tiling, run as
  // tasks on the thread pool.
  Case cs;
  cs.args = gemm_args(2100, 300, 24);
  run_case<float, float, float>(cs, epilogue::BiasGelu<>{}, 1e-4, 1e-4);
  run_case<float, float, float>(cs, epilogue::DGeluBiasGrad<>{}, 1e-4, 1e-4);
  cs.args.layout = Layout::col_major;
  run_case<float, float, bfloat16>(cs, epilogue::BiasGrad<>{}, 1e-4, 1e-4);
}

TEST_CASE("gemm gives the same bits on the thread pool and inline", "[kernels][gemm]") {
  // The tiling depends on the shape only, so a call that finds the pool busy (here: nested in a
  // parallel_for task) and runs every tile on its own thread must give the same C, pre-activation
  // and bias gradient as a call spread over the pool. 600 x 700 x 64 makes 8 default tiles.
  const std::int64_t m = 600, n = 700, k = 64;
  auto a = random_vector<float>(m * k, 11), b = random_vector<float>(k * n, 12), bias = random_vector<float>(n, 13);
  auto pre_in = random_vector<float>(m * n, 14, -3.0f, 3.0f);
  auto run = [&](std::vector<float>& c, std::vector<float>& pre, std::vector<float>& db) {
    c.assign(m * n, 0.0f), pre.assign(m * n, 0.0f), db.assign(n, 0.0f);
    host::gemm(gemm_args(m, n, k), a.data(), b.data(), c.data(), epilogue::BiasGelu<>{bias.data(), pre.data()});
    host::gemm(gemm_args(m, n, k, Op::none, Op::none, 1.0f, 1.0f), a.data(), b.data(), c.data(),
               epilogue::DGeluBiasGrad<>{pre_in.data(), 0, 0, db.data()});
  };
  std::vector<float> c1, pre1, db1, c2, pre2, db2;
  run(c1, pre1, db1);
  host::parallel_for(2, [&](std::int64_t i) {
    if (i == 0) run(c2, pre2, db2);
  });
  REQUIRE(c1 == c2);
  REQUIRE(pre1 == pre2);
  REQUIRE(db1 == db2);
}

// The generic-kernel check (kernels/blas_core.hpp) on faked core reports and CPU features.
TEST_CASE("a BLAS on kernels narrower than the CPU is reported, with the core type to set", "[kernels][gemm][blas]") {
  using trellis::kernels::host::blas_core_warning;
  using trellis::kernels::host::CpuFeatures;
  using trellis::kernels::host::recommended_openblas_core;
  const CpuFeatures amx{.avx2 = true, .avx512f = true, .avx512_bf16 = true, .amx_bf16 = true};
  const CpuFeatures skx{.avx2 = true, .avx512f = true};
  const CpuFeatures hsw{.avx2 = true};
  const CpuFeatures old{};
  CHECK(recommended_openblas_core(amx) == "Cooperlake");
  CHECK(recommended_openblas_core(skx) == "SkylakeX");
  CHECK(recommended_openblas_core(hsw) == "Haswell");
  CHECK(recommended_openblas_core(old).empty());
  // the case of issue #19: Debian's OpenBLAS 0.3.21 on a Sapphire Rapids Xeon reports Prescott
  const std::string w = blas_core_warning("Prescott", amx);
  CHECK_THAT(w, Catch::Contains("runs its Prescott kernels on a CPU with AVX-512 + BF16"));
  CHECK_THAT(w, Catch::Contains("OPENBLAS_CORETYPE=Cooperlake"));
  CHECK_THAT(blas_core_warning("Haswell", skx), Catch::Contains("OPENBLAS_CORETYPE=SkylakeX"));
  CHECK_THAT(blas_core_warning("Sandybridge", hsw), Catch::Contains("OPENBLAS_CORETYPE=Haswell"));
  // no warning: the right kernels, wider ones, an old CPU, or a core name the table does not know
  CHECK(blas_core_warning("Cooperlake", amx).empty());
  CHECK(blas_core_warning("SapphireRapids", amx).empty());
  CHECK(blas_core_warning("SkylakeX", hsw).empty());
  CHECK(blas_core_warning("Prescott", old).empty());
  CHECK(blas_core_warning("NeoverseV2", amx).empty());
  // BLIS (TRELLIS_BLAS=blis): BLIS 0.9.0 on a Sapphire Rapids Xeon picks "haswell"; the id to set
  // is looked up in the running library (0 for "skx" in 0.9), or the message says to look it up.
  using trellis::kernels::host::blis_arch_warning;
  using trellis::kernels::host::recommended_blis_arch;
  CHECK(recommended_blis_arch(amx) == "skx");
  CHECK(recommended_blis_arch(hsw) == "haswell");
  CHECK(recommended_blis_arch(old).empty());
  const std::string b = blis_arch_warning("haswell", amx, 0);
  CHECK_THAT(b, Catch::Contains("BLIS runs its haswell kernels on a CPU with AVX-512"));
  CHECK_THAT(b, Catch::Contains("BLIS_ARCH_TYPE=0 (this BLIS' id of \"skx\")"));
  CHECK_THAT(blis_arch_warning("sandybridge", hsw, 3), Catch::Contains("BLIS_ARCH_TYPE=3 (this BLIS' id of \"haswell\")"));
  CHECK_THAT(blis_arch_warning("generic", skx, -1), Catch::Contains("BLIS_ARCH_TYPE to this BLIS' id of \"skx\""));
  CHECK(blis_arch_warning("skx", amx, 0).empty());
  CHECK(blis_arch_warning("zen3", hsw, 3).empty());
  CHECK(blis_arch_warning("penryn", old, -1).empty());
  CHECK(blis_arch_warning("firestorm", amx, 0).empty());
  if (const auto& blis = trellis::kernels::host::blis_arch_api(); blis.name != nullptr) {
    // linked against BLIS: the lookup finds the ids of the names it reports
    CHECK(trellis::kernels::host::blis_arch_id(blis.name(0)) == 0);
    CHECK(trellis::kernels::host::blis_arch_id(blis.name(blis.query_id())) == blis.query_id());
    CHECK(trellis::kernels::host::blis_arch_id("no such arch") == -1);
  }
  // the live check runs (prints at most once) and this machine's features are self-consistent
  trellis::kernels::host::warn_if_generic_blas();
  const CpuFeatures here = trellis::kernels::host::cpu_features();
  CHECK((!here.avx512f || here.avx2));
  CHECK((!here.avx512_bf16 || here.avx512f));
}

// ---- bf16 x bf16 on oneDNN (kernels/gemm_dnnl.hpp) -------------------------------------------
// Each case runs twice, on the automatic path (oneDNN where linked and native) and forced through
// today's fp32 conversion; both are checked against the double reference (run_case) and against
// each other. bf16 products are exact in fp32, so the paths differ only in the fp32 summation
// order (fp32 C: 1e-5 abs + rel for k <= 64 and |inputs| <= 1) and, for bf16 C, by one bf16
// rounding of that (2^-8 relative).

namespace {

host::GemmProduct expected_bf16_product() {
  return host::dnnl_bf16_native() ? host::GemmProduct::dnnl_bf16 : host::GemmProduct::fp32;
}

template <class TC, class E>
void compare_bf16_paths(Case cs, E ep) {
  cs.bf16_product = host::Bf16Product::automatic;
  const Outputs fast = run_case<bfloat16, bfloat16, TC>(cs, ep, 1e-4, 1e-4);
  REQUIRE(fast.product == expected_bf16_product());
  cs.bf16_product = host::Bf16Product::convert_fp32;
  const Outputs ref = run_case<bfloat16, bfloat16, TC>(cs, ep, 1e-4, 1e-4);
  REQUIRE(ref.product == host::GemmProduct::fp32);
  const double out_rel = std::is_same_v<TC, bfloat16> ? 8e-3 : 0.0;
  require_close(fast.c, std::vector<double>(ref.c.begin(), ref.c.end()), 1e-5 + out_rel, 1e-5 + out_rel, "C: dnnl vs fp32 path");
  require_close(fast.pre, std::vector<double>(ref.pre.begin(), ref.pre.end()), 1e-5, 1e-5, "pre: dnnl vs fp32 path");
  require_close(fast.bias_grad, std::vector<double>(ref.bias_grad.begin(), ref.bias_grad.end()), 1e-4 + 10 * out_rel,
                1e-5 + out_rel, "bias_grad: dnnl vs fp32 path");
}

template <class TC>
void compare_bf16_paths_all_epilogues() {
  for (const Case& cs : all_cases()) {
    INFO("layout " << int(cs.args.layout) << " op_a " << int(cs.args.op_a) << " op_b " << int(cs.args.op_b)
                   << " batch " << cs.args.batch << " beta " << cs.args.beta << " alpha " << cs.args.alpha);
    compare_bf16_paths<TC>(cs, epilogue::None{});
    compare_bf16_paths<TC>(cs, epilogue::Bias<>{});
    compare_bf16_paths<TC>(cs, epilogue::Relu{});
    compare_bf16_paths<TC>(cs, epilogue::BiasRelu<>{});
    compare_bf16_paths<TC>(cs, epilogue::Gelu{});
    compare_bf16_paths<TC>(cs, epilogue::BiasGelu<>{});
    compare_bf16_paths<TC>(cs, epilogue::DGelu<>{});
    compare_bf16_paths<TC>(cs, epilogue::BiasGrad<>{});
    compare_bf16_paths<TC>(cs, epilogue::BiasGrad<>{nullptr, true});
    compare_bf16_paths<TC>(cs, epilogue::DGeluBiasGrad<>{});
  }
}

}  // namespace

TEST_CASE("bf16 gemm takes oneDNN's native bf16 kernels where the CPU has them", "[kernels][gemm][dnnl]") {
  const auto cpu = host::cpu_features();
  INFO("oneDNN implementation: '" << host::dnnl_bf16_implementation() << "', amx_bf16 " << cpu.amx_bf16
                                  << ", avx512_bf16 " << cpu.avx512_bf16);
#if defined(TRELLIS_HAS_DNNL)
  const char* env = std::getenv("TRELLIS_DNNL");
  if (!(env && std::string(env) == "0")) {
    REQUIRE(host::dnnl_bf16_native() == (cpu.amx_bf16 || cpu.avx512_bf16));
    if (cpu.amx_bf16) CHECK_THAT(host::dnnl_bf16_implementation(), Catch::Contains("amx"));
  }
#else
  REQUIRE_FALSE(host::dnnl_bf16_native());
  REQUIRE(host::dnnl_bf16_implementation().empty());
#endif
  // The path a call took is reported: bf16 x bf16 follows dnnl_bf16_native(), anything else is fp32.
  std::vector<bfloat16> a(64 * 32, bfloat16(0.5f)), b(32 * 48, bfloat16(0.25f));
  std::vector<float> af(a.size(), 0.5f), c(64 * 48);
  host::gemm(gemm_args(64, 48, 32), a.data(), b.data(), c.data());
  REQUIRE(host::last_gemm_product() == expected_bf16_product());
  for (float x : c) REQUIRE(x == 4.0f);  // 32 * 0.5 * 0.25, exact
  host::gemm(gemm_args(64, 48, 32), af.data(), b.data(), c.data());
  REQUIRE(host::last_gemm_product() == host::GemmProduct::fp32);
  host::gemm(gemm_args(64, 48, 0), a.data(), b.data(), c.data());
  REQUIRE(host::last_gemm_product() == host::GemmProduct::none);
}

TEST_CASE("bf16 gemm on oneDNN vs the fp32 path and the reference: every layout, transpose, epilogue",
          "[kernels][gemm][dnnl]") {
  compare_bf16_paths_all_epilogues<float>();
  compare_bf16_paths_all_epilogues<bfloat16>();
}

TEST_CASE("bf16 gemm on oneDNN, default tiles of a GPT-2 sized product, vs reference", "[kernels][gemm][dnnl]") {
  // 256 x 768 x 192 (two default tiles of 128 rows); k larger than above, so fp32 sums of 192 terms.
  Case cs;
  cs.args = gemm_args(256, 768, 192);
  compare_bf16_paths<float>(cs, epilogue::BiasGelu<>{});
  cs.args = gemm_args(256, 768, 192, Op::none, Op::transpose);
  compare_bf16_paths<bfloat16>(cs, epilogue::DGeluBiasGrad<>{});
  cs.args = gemm_args(768, 192, 256, Op::transpose, Op::none, 1.0f, 1.0f);  // a weight gradient, accumulated
  compare_bf16_paths<float>(cs, epilogue::None{});
}

#if defined(TRELLIS_HAS_DNNL)
TEST_CASE("pack_rows: op(A)'s rows made contiguous, 8 x 8 register blocks and scalar edges", "[kernels][gemm][dnnl]") {
  // Every (rows, k) pair around the 8-blocks' edges, from a transposed (si = 1, the SIMD path) and
  // a general strided source, against dst[i k + p] = src[i si + p sp] element by element.
  for (std::int64_t rows : {1, 7, 8, 9, 16, 37, 64}) {
    for (std::int64_t k : {1, 5, 8, 15, 16, 33}) {
      for (std::int64_t si : {1, 3}) {
        const std::int64_t sp = si == 1 ? rows + 5 : 1 + 3 * rows;  // padded ld
        std::vector<std::uint16_t> src(static_cast<std::size_t>(rows * si + k * sp + 8));
        for (std::size_t e = 0; e < src.size(); ++e) src[e] = static_cast<std::uint16_t>(e * 2654435761u >> 7);
        std::vector<std::uint16_t> dst(static_cast<std::size_t>(rows * k), 0xdead);
        host::detail::pack_rows(src.data(), si, sp, rows, k, dst.data());
        std::int64_t wrong = 0;
        for (std::int64_t i = 0; i < rows; ++i)
          for (std::int64_t p = 0; p < k; ++p) wrong += dst[i * k + p] != src[i * si + p * sp];
        INFO("rows " << rows << " k " << k << " si " << si);
        REQUIRE(wrong == 0);
      }
    }
  }
}
#endif

TEST_CASE("bf16 gemm from several threads at once gives each thread's serial bits", "[kernels][gemm][dnnl]") {
  // Thread ranks call gemm concurrently: the primitive cache, streams and scratchpads must hold.
  constexpr int threads = 4;
  struct Job {
    std::int64_t m, n, k;
    std::vector<bfloat16> a, b;
    std::vector<float> serial, concurrent;
  };
  std::vector<Job> jobs;
  for (int t = 0; t < threads; ++t) {
    Job j{96 + 32 * t, 80 + 16 * (t % 2), 64 + 8 * t, {}, {}, {}, {}};
    j.a = random_vector<bfloat16>(j.m * j.k, 20 + t);
    j.b = random_vector<bfloat16>(j.k * j.n, 30 + t);
    j.serial.assign(j.m * j.n, 0.0f);
    host::gemm(gemm_args(j.m, j.n, j.k), j.a.data(), j.b.data(), j.serial.data());
    jobs.push_back(std::move(j));
  }
  std::vector<std::thread> pool;
  std::vector<int> ok(threads, 1);
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      Job& j = jobs[t];
      for (int rep = 0; rep < 20; ++rep) {
        j.concurrent.assign(j.m * j.n, -1.0f);
        host::gemm(gemm_args(j.m, j.n, j.k), j.a.data(), j.b.data(), j.concurrent.data());
        if (j.concurrent != j.serial || host::last_gemm_product() != expected_bf16_product()) ok[t] = 0;
      }
    });
  for (auto& th : pool) th.join();
  for (int t = 0; t < threads; ++t) {
    INFO("thread " << t);
    REQUIRE(ok[t] == 1);
  }
}

// ---- grouped GEMM (host::grouped_gemm) ------------------------------------------------------
// One call over many GEMMs of different sizes (the experts of an MoE layer) must give, bit for
// bit, what one gemm call per group in order gives: the same tiles per group, the same bias-gradient
// order; and it must agree with a triple loop in double (tolerances as above).

namespace {

// One group's inputs, and its outputs twice: [0] for grouped_gemm, [1] for the gemm loop.
template <class TA, class TB, class TC>
struct GroupData {
  std::vector<TA> a;
  std::vector<TB> b;
  std::vector<TC> c[2];
  std::vector<float> bias, pre_in, pre_out[2], bias_grad[2];
};

template <class T>
bool same_bits(const std::vector<T>& x, const std::vector<T>& y) {
  return x.size() == y.size() && (x.empty() || std::memcmp(x.data(), y.data(), x.size() * sizeof(T)) == 0);
}

// Runs the groups `shapes` (with epilogue `ep_template`, its vectors filled in per group) both
// ways from the same inputs and requires the same bits in C, the pre-activation and the bias
// gradients. shared_bias_grad: every group adds to one bias-gradient vector (all n equal).
template <class TA, class TB, class TC, class E>
void require_grouped_same_bits(const std::vector<GemmArgs>& shapes, E ep_template, host::GemmOptions options = {},
                               bool shared_bias_grad = false) {
  using traits = epilogue_traits<E>;
  const std::size_t count = shapes.size();
  std::vector<GroupData<TA, TB, TC>> data(count);
  std::vector<GemmGroup<TA, TB, TC, E>> groups[2];
  std::vector<float> shared_grad[2];
  if (shared_bias_grad) shared_grad[0] = shared_grad[1] = random_vector<float>(shapes.at(0).n, 99);
  for (std::size_t i = 0; i < count; ++i) {
    const GemmArgs& g = shapes[i];
    GroupData<TA, TB, TC>& d = data[i];
    const auto seed = static_cast<std::uint32_t>(100 + 10 * i);
    const std::int64_t a_size = storage(g.lda_or_packed(), g.a_rows(), g.a_cols(), g, 0, 1);
    const std::int64_t b_size = storage(g.ldb_or_packed(), g.b_rows(), g.b_cols(), g, 0, 1);
    const std::int64_t c_size = storage(g.ldc_or_packed(), g.m, g.n, g, 0, 1);
    d.a = random_vector<TA>(std::max<std::int64_t>(a_size, 1), seed);
    d.b = random_vector<TB>(std::max<std::int64_t>(b_size, 1), seed + 1);
    d.c[0] = random_vector<TC>(std::max<std::int64_t>(c_size, 1), seed + 2);
    if (g.beta == 0.0f)
      for (auto& x : d.c[0]) x = TC(std::numeric_limits<float>::quiet_NaN());  // never read
    d.c[1] = d.c[0];
    d.bias = random_vector<float>(std::max<std::int64_t>(g.n, 1), seed + 3);
    d.pre_in = random_vector<float>(d.c[0].size(), seed + 4, -3.0f, 3.0f);
    d.pre_out[0] = d.pre_out[1] = std::vector<float>(d.c[0].size(), -7.0f);
    d.bias_grad[0] = d.bias_grad[1] = random_vector<float>(std::max<std::int64_t>(g.n, 1), seed + 5);
    for (int w = 0; w < 2; ++w) {
      E ep = ep_template;
      if constexpr (traits::has_bias) ep.bias = d.bias.data();
      if constexpr (traits::writes_pre) ep.pre_activation = d.pre_out[w].data();
      if constexpr (traits::reads_pre) ep.pre_activation = d.pre_in.data();
      if constexpr (traits::bias_grad) ep.bias_grad = shared_bias_grad ? shared_grad[w].data() : d.bias_grad[w].data();
      groups[w].push_back({g, d.a.data(), d.b.data(), d.c[w].data(), ep});
    }
  }
  host::grouped_gemm(groups[0], options);
  const host::GemmProduct grouped_product = host::last_gemm_product();
  host::GemmProduct loop_product = host::GemmProduct::none;
  for (const auto& g : groups[1]) {
    host::gemm(g.args, g.a, g.b, g.c, g.ep, options);
    if (loop_product == host::GemmProduct::none) loop_product = host::last_gemm_product();
  }
  REQUIRE(grouped_product == loop_product);
  for (std::size_t i = 0; i < count; ++i) {
    INFO("group " << i << ": m " << shapes[i].m << " n " << shapes[i].n << " k " << shapes[i].k);
    const GroupData<TA, TB, TC>& d = data[i];
    REQUIRE(same_bits(d.c[0], d.c[1]));
    REQUIRE(same_bits(d.pre_out[0], d.pre_out[1]));
    REQUIRE(same_bits(d.bias_grad[0], d.bias_grad[1]));
  }
  REQUIRE(same_bits(shared_grad[0], shared_grad[1]));
}

template <class TA, class TB, class TC>
void require_grouped_same_bits_all_epilogues(const std::vector<GemmArgs>& shapes, host::GemmOptions options = {}) {
  require_grouped_same_bits<TA, TB, TC>(shapes, epilogue::None{}, options);
  require_grouped_same_bits<TA, TB, TC>(shapes, epilogue::Bias<>{}, options);
  require_grouped_same_bits<TA, TB, TC>(shapes, epilogue::Relu{}, options);
  require_grouped_same_bits<TA, TB, TC>(shapes, epilogue::BiasRelu<>{}, options);
  require_grouped_same_bits<TA, TB, TC>(shapes, epilogue::Gelu{}, options);
  require_grouped_same_bits<TA, TB, TC>(shapes, epilogue::BiasGelu<>{}, options);
  require_grouped_same_bits<TA, TB, TC>(shapes, epilogue::DGelu<>{}, options);
  for (bool accumulate : {false, true}) {
    require_grouped_same_bits<TA, TB, TC>(shapes, epilogue::BiasGrad<>{nullptr, accumulate}, options);
    require_grouped_same_bits<TA, TB, TC>(shapes, epilogue::DGeluBiasGrad<>{nullptr, 0, 0, nullptr, accumulate}, options);
  }
}

// Routed rows per expert, skewed, with empty experts.
const std::vector<std::int64_t> skewed_rows = {0, 1, 37, 300, 5, 0, 129};

// Forward / backward-data shape: m varies (rows routed to the group), n and k shared.
std::vector<GemmArgs> row_groups(std::int64_t n, std::int64_t k, Op op_b = Op::none, float alpha = 1.0f,
                                 float beta = 0.0f, Layout layout = Layout::row_major) {
  std::vector<GemmArgs> shapes;
  for (std::int64_t m : skewed_rows) shapes.push_back(gemm_args(m, n, k, Op::none, op_b, alpha, beta, layout));
  return shapes;
}

// Weight-gradient shape dW_e = X_e^T dY_e: m = in, n = out, k = rows of each group (some 0).
std::vector<GemmArgs> weight_grad_groups(std::int64_t in, std::int64_t out, float beta) {
  std::vector<GemmArgs> shapes;
  for (std::int64_t k : skewed_rows) shapes.push_back(gemm_args(in, out, k, Op::transpose, Op::none, 1.0f, beta));
  return shapes;
}

host::GemmOptions small_tiles(std::int64_t rows, std::int64_t cols) {
  host::GemmOptions o;
  o.tile_rows = rows;
  o.tile_cols = cols;
  return o;
}

}  // namespace

TEST_CASE("grouped_gemm fp32: the bits of one gemm per group, skewed rows, every epilogue", "[kernels][gemm][grouped]") {
  // n = 520: the default tiling splits the larger groups (300 rows: two tiles of 160 rows, 129
  // rows: two tiles of 272 columns); the explicit small tiles give many ragged tiles per group.
  require_grouped_same_bits_all_epilogues<float, float, float>(row_groups(520, 64));
  require_grouped_same_bits_all_epilogues<float, float, float>(row_groups(70, 33), small_tiles(32, 24));
  // alpha/beta accumulation, transposed B, column-major
  require_grouped_same_bits_all_epilogues<float, float, float>(
      row_groups(96, 40, Op::transpose, 0.75f, 1.0f, Layout::col_major), small_tiles(16, 40));
  // groups adding to one shared bias-gradient vector, in group order
  require_grouped_same_bits<float, float, float>(row_groups(96, 40), epilogue::BiasGrad<>{nullptr, true},
                                                 small_tiles(64, 32), true);
}

TEST_CASE("grouped_gemm fp32: weight-gradient shape, k varies per group (some k = 0)", "[kernels][gemm][grouped]") {
  for (float beta : {0.0f, 1.0f}) {
    INFO("beta " << beta);
    require_grouped_same_bits<float, float, float>(weight_grad_groups(48, 80, beta), epilogue::None{});
    require_grouped_same_bits<float, float, float>(weight_grad_groups(48, 80, beta), epilogue::None{}, small_tiles(16, 32));
    require_grouped_same_bits<float, float, float>(weight_grad_groups(300, 600, beta), epilogue::None{});
    require_grouped_same_bits<float, float, float>(weight_grad_groups(48, 80, beta), epilogue::BiasGrad<>{nullptr, true});
    require_grouped_same_bits<float, float, float>(weight_grad_groups(48, 80, beta), epilogue::BiasGelu<>{});
  }
}

TEST_CASE("grouped_gemm with 16-bit operands: the bits of one gemm per group", "[kernels][gemm][grouped]") {
  // bf16 x bf16 -> fp32 on oneDNN where native, and forced through the fp32 copies.
  for (auto path : {host::Bf16Product::automatic, host::Bf16Product::convert_fp32}) {
    host::GemmOptions options;
    options.bf16_product = path;
    INFO("bf16 path " << int(path));
    require_grouped_same_bits<bfloat16, bfloat16, float>(row_groups(520, 64), epilogue::BiasGelu<>{}, options);
    require_grouped_same_bits<bfloat16, bfloat16, float>(row_groups(520, 64), epilogue::DGeluBiasGrad<>{}, options);
    require_grouped_same_bits<bfloat16, bfloat16, float>(weight_grad_groups(48, 80, 1.0f), epilogue::None{}, options);
  }
  // mixed 16-bit types, 16-bit C through the tile buffer
  require_grouped_same_bits<half, bfloat16, bfloat16>(row_groups(70, 33), epilogue::BiasGrad<>{}, small_tiles(32, 24));
  require_grouped_same_bits<bfloat16, float, half>(row_groups(70, 33, Op::transpose, 1.0f, 0.5f), epilogue::Bias<>{});
}

TEST_CASE("grouped_gemm vs a triple loop: mixed shapes, layouts, transposes, alpha/beta", "[kernels][gemm][grouped]") {
  // Independent of gemm: each group against its own double-precision reference.
  std::vector<GemmArgs> shapes = {
      gemm_args(37, 29, 45),
      gemm_args(0, 29, 45),
      gemm_args(300, 70, 24, Op::none, Op::transpose, 0.75f, 1.0f),
      gemm_args(33, 52, 0, Op::none, Op::none, 1.0f, 0.5f),  // k = 0: C = beta * C, then the epilogue
      gemm_args(5, 17, 64, Op::transpose, Op::none, 1.0f, 0.0f, Layout::col_major),
      gemm_args(129, 40, 31, Op::transpose, Op::transpose, 1.0f, 1.0f, Layout::col_major),
  };
  shapes[2].ldc = 75;  // padded C (and pre-activation)
  for (int which = 0; which < 2; ++which) {
    const std::size_t count = shapes.size();
    std::vector<std::vector<float>> a(count), b(count), c(count), bias(count), pre(count), grad(count);
    std::vector<std::vector<double>> want_c(count), want_pre(count), want_grad(count);
    std::vector<GemmGroup<float, float, float, epilogue::BiasGelu<>>> fwd;
    std::vector<GemmGroup<float, float, float, epilogue::DGeluBiasGrad<>>> bwd;
    for (std::size_t i = 0; i < count; ++i) {
      const GemmArgs& g = shapes[i];
      const std::int64_t lda = g.lda_or_packed(), ldb = g.ldb_or_packed(), ldc = g.ldc_or_packed();
      const auto seed = static_cast<std::uint32_t>(300 + 10 * i);
      a[i] = random_vector<float>(std::max<std::int64_t>(1, storage(lda, g.a_rows(), g.a_cols(), g, 0, 1)), seed);
      b[i] = random_vector<float>(std::max<std::int64_t>(1, storage(ldb, g.b_rows(), g.b_cols(), g, 0, 1)), seed + 1);
      c[i] = random_vector<float>(std::max<std::int64_t>(1, storage(ldc, g.m, g.n, g, 0, 1)), seed + 2);
      bias[i] = random_vector<float>(g.n, seed + 3);
      pre[i] = random_vector<float>(c[i].size(), seed + 4, -3.0f, 3.0f);  // read by DGelu, written by BiasGelu
      grad[i] = random_vector<float>(g.n, seed + 5);
      want_c[i].assign(c[i].begin(), c[i].end());
      want_pre[i].assign(pre[i].begin(), pre[i].end());
      want_grad[i].assign(grad[i].begin(), grad[i].end());  // accumulate = true below
      for (std::int64_t r = 0; r < g.m; ++r)
        for (std::int64_t j = 0; j < g.n; ++j) {
          double acc = 0.0;
          for (std::int64_t p = 0; p < g.k; ++p) {
            const double av = a[i][g.op_a == Op::none ? at(g, r, p, lda) : at(g, p, r, lda)];
            const double bv = b[i][g.op_b == Op::none ? at(g, p, j, ldb) : at(g, j, p, ldb)];
            acc += av * bv;
          }
          const std::int64_t ci = at(g, r, j, ldc);
          double x = g.alpha * acc + (g.beta == 0.0f ? 0.0 : g.beta * want_c[i][ci]);
          if (which == 0) {
            want_pre[i][ci] = x + bias[i][j];
            x = trellis_test::gelu_ref(x + bias[i][j]);
          } else {
            x *= trellis_test::gelu_grad_ref(pre[i][ci]);
            want_grad[i][j] += x;
          }
          want_c[i][ci] = x;
        }
      if (which == 0) fwd.push_back({g, a[i].data(), b[i].data(), c[i].data(), {bias[i].data(), pre[i].data()}});
      else bwd.push_back({g, a[i].data(), b[i].data(), c[i].data(), {pre[i].data(), 0, 0, grad[i].data(), true}});
    }
    if (which == 0) host::grouped_gemm(fwd);
    else host::grouped_gemm(bwd);
    for (std::size_t i = 0; i < count; ++i) {
      INFO((which == 0 ? "BiasGelu" : "DGeluBiasGrad") << ", group " << i);
      require_close(c[i], want_c[i], 1e-4, 1e-4, "C");
      require_close(pre[i], want_pre[i], 1e-4, 1e-4, "pre_activation");
      require_close(grad[i], want_grad[i], 1e-3, 1e-4, "bias_grad");
    }
  }
}

TEST_CASE("grouped_gemm refuses batched groups and names a bad group; no groups is a no-op", "[kernels][gemm][grouped]") {
  std::vector<float> a(64, 1.0f), b(64, 1.0f), c(64, 2.0f);
  using G = GemmGroup<float, float, float, epilogue::None>;
  std::vector<G> groups = {{gemm_args(4, 4, 4), a.data(), b.data(), c.data(), {}},
                           {gemm_args(2, 4, 4), a.data(), b.data(), c.data() + 16, {}}};
  groups[1].args.batch = 2;
  groups[1].args.packed();
  CHECK_THROWS_AS(host::grouped_gemm(groups), Error);
  CHECK_THROWS_WITH(host::grouped_gemm(groups), Catch::Contains("group 1 has batch = 2"));
  for (float x : c) REQUIRE(x == 2.0f);  // refused before anything ran
  groups[1].args = gemm_args(2, 4, 4);
  groups[1].args.lda = 3;  // < k
  CHECK_THROWS_WITH(host::grouped_gemm(groups),
                    Catch::Contains("grouped_gemm: group 1: ") && Catch::Contains("gemm: lda = 3 is smaller"));
  groups[1].c = nullptr;
  groups[1].args.lda = 0;
  CHECK_THROWS_WITH(host::grouped_gemm(groups),
                    Catch::Contains("grouped_gemm: group 1: ") && Catch::Contains("gemm: C is null"));
  host::grouped_gemm(std::vector<G>{});
  REQUIRE(host::last_gemm_product() == host::GemmProduct::none);
}
