// cuBLASLt GEMM (kernels/gemm_cuda.hpp) against the host GEMM (kernels/gemm_host.hpp) on the same
// inputs: every layout/transpose combination, strided batches, alpha/beta, fp32/fp16/bf16, the
// host-compatible epilogues, the raw BGRADA/BGRADB epilogues (against plain sums), the plan cache
// and the refusals.
// Tolerances: fp32 inputs |err| <= 2e-4 + 1e-4|want| (k <= 96, values in [-1, 1]; cuBLASLt and the
// host sum in different orders); 16-bit inputs with fp32 C: 2e-3 + 2e-3|want|; 16-bit C: one
// rounding of the output differs at most by an ulp: 1e-2 + 1e-2|want| (bf16 ulp = 2^-8 relative).
#include <string>
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "support/gpu_test.hpp"
#include "trellis/kernels/gemm_cuda.hpp"
#include "trellis/kernels/gemm_host.hpp"

namespace k = trellis::kernels;
namespace ep = trellis::kernels::epilogue;
using trellis::bfloat16;
using thalf = trellis::half;  // cuda_fp16.h declares a global `half`
using trellis_gpu_test::Stream;
using trellis_gpu_test::random_vector;
using trellis_gpu_test::require_close;
using trellis_gpu_test::to_device;
using trellis_gpu_test::to_host;

namespace {

template <class TIn, class TOut>
struct Tolerance {
  static constexpr double abs = std::is_same_v<TOut, float> ? (std::is_same_v<TIn, float> ? 2e-4 : 2e-3) : 1e-2;
  static constexpr double rel = std::is_same_v<TOut, float> ? (std::is_same_v<TIn, float> ? 1e-4 : 2e-3) : 1e-2;
};

std::size_t elements(const k::GemmArgs& a, std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t stride) {
  std::int64_t one = a.layout == k::Layout::row_major ? (rows - 1) * ld + cols : (cols - 1) * ld + rows;
  return static_cast<std::size_t>((a.batch - 1) * stride + one);
}

// Runs host and CUDA GEMM with the same epilogue (built by make_ep from the pointers it is given)
// and compares C (and the epilogue's extra output, if any).
template <class TIn, class TOut>
void compare_plain(k::GemmArgs args, std::uint32_t seed) {
  Stream stream;
  k::cuda::GemmHandle handle;
  const std::size_t na = elements(args, args.a_rows(), args.a_cols(), args.lda_or_packed(), args.stride_a);
  const std::size_t nb = elements(args, args.b_rows(), args.b_cols(), args.ldb_or_packed(), args.stride_b);
  const std::size_t nc = elements(args, args.m, args.n, args.ldc_or_packed(), args.stride_c);
  auto a = random_vector<TIn>(na, seed);
  auto b = random_vector<TIn>(nb, seed + 1);
  auto c = random_vector<TOut>(nc, seed + 2);
  auto want = c;
  k::host::gemm(args, a.data(), b.data(), want.data());
  auto da = to_device(a, stream), db = to_device(b, stream), dc = to_device(c, stream);
  k::cuda::gemm(handle, args, da.data(), db.data(), dc.data(), stream);
  require_close(to_host(dc), want, Tolerance<TIn, TOut>::abs, Tolerance<TIn, TOut>::rel, "C");
}

}  // namespace

TEST_CASE("cuBLASLt GEMM matches the host GEMM: layouts, transposes, batches, alpha/beta", "[gpu][gemm]") {
  for (auto layout : {k::Layout::row_major, k::Layout::col_major}) {
    for (auto op_a : {k::Op::none, k::Op::transpose}) {
      for (auto op_b : {k::Op::none, k::Op::transpose}) {
        for (std::int64_t batch : {1, 3}) {
          k::GemmArgs args = k::gemm_args(37, 24, 40, op_a, op_b, 0.75f, batch == 1 ? 0.0f : 0.5f, layout);
          args.batch = batch;
          if (batch > 1) args.packed();
          DYNAMIC_SECTION("layout " << int(layout) << " op_a " << int(op_a) << " op_b " << int(op_b) << " batch "
                                    << batch) {
            compare_plain<float, float>(args, 11);
            compare_plain<bfloat16, bfloat16>(args, 12);
            compare_plain<bfloat16, float>(args, 13);
            compare_plain<thalf, thalf>(args, 14);
          }
        }
      }
    }
  }
}

TEST_CASE("cuBLASLt GEMM: padded leading dimensions and a broadcast (stride 0) operand", "[gpu][gemm]") {
  k::GemmArgs args = k::gemm_args(19, 32, 48);
  args.lda = 56, args.ldb = 40, args.ldc = 48;
  compare_plain<float, float>(args, 21);
  compare_plain<bfloat16, bfloat16>(args, 22);
  k::GemmArgs shared_b = k::gemm_args(16, 24, 32);
  shared_b.batch = 4;
  shared_b.packed();
  shared_b.stride_b = 0;  // one B for every batch
  compare_plain<thalf, float>(shared_b, 23);
}

namespace {
// Each host epilogue on both backends, row-major, bf16 or fp32 throughout.
template <class T>
void compare_epilogues(std::uint32_t seed) {
  constexpr double abs = std::is_same_v<T, float> ? 1e-3 : 2e-2;
  constexpr double rel = std::is_same_v<T, float> ? 1e-3 : 1e-2;
  Stream stream;
  k::cuda::GemmHandle handle;
  const std::int64_t m = 45, n = 64, kk = 48;
  k::GemmArgs args = k::gemm_args(m, n, kk);
  auto a = random_vector<T>(m * kk, seed), b = random_vector<T>(kk * n, seed + 1);
  auto bias = random_vector<T>(n, seed + 2), pre_in = random_vector<T>(m * n, seed + 3, -3.0f, 3.0f);
  auto da = to_device(a, stream), db = to_device(b, stream), dbias = to_device(bias, stream);
  auto dpre_in = to_device(pre_in, stream);
  std::vector<T> zeros(m * n, T(0.0f));

  auto run_both = [&](auto host_ep, auto cuda_ep, const char* name) {
    std::vector<T> want(m * n);
    k::host::gemm(args, a.data(), b.data(), want.data(), host_ep);
    auto dc = to_device(zeros, stream);
    k::cuda::gemm(handle, args, da.data(), db.data(), dc.data(), stream, cuda_ep);
    require_close(to_host(dc), want, abs, rel, name);
  };
  run_both(ep::None{}, ep::None{}, "none");
  run_both(ep::Bias<T>{bias.data()}, ep::Bias<T>{dbias.data()}, "bias");
  run_both(ep::Relu{}, ep::Relu{}, "relu");
  run_both(ep::BiasRelu<T>{bias.data()}, ep::BiasRelu<T>{dbias.data()}, "bias_relu");
  run_both(ep::Gelu{}, ep::Gelu{}, "gelu");
  run_both(ep::BiasGelu<T>{bias.data()}, ep::BiasGelu<T>{dbias.data()}, "bias_gelu");
  run_both(ep::DGelu<T>{pre_in.data()}, ep::DGelu<T>{dpre_in.data()}, "dgelu");

  SECTION("BiasGelu saves the pre-activation") {
    std::vector<T> want(m * n), want_pre(m * n);
    k::host::gemm(args, a.data(), b.data(), want.data(), ep::BiasGelu<T>{bias.data(), want_pre.data()});
    auto dc = to_device(zeros, stream), dpre = to_device(zeros, stream);
    k::cuda::gemm(handle, args, da.data(), db.data(), dc.data(), stream, ep::BiasGelu<T>{dbias.data(), dpre.data()});
    require_close(to_host(dc), want, abs, rel, "bias_gelu C");
    require_close(to_host(dpre), want_pre, abs, rel, "bias_gelu pre-activation");
  }
  SECTION("DGeluBiasGrad writes the column sums of its output") {
    std::vector<T> want(m * n), want_grad(n, T(0.0f));
    k::host::gemm(args, a.data(), b.data(), want.data(), ep::DGeluBiasGrad<T>{pre_in.data(), 0, 0, want_grad.data()});
    auto dc = to_device(zeros, stream);
    auto dgrad = to_device(std::vector<T>(n, T(5.0f)), stream);  // overwritten, not added to
    k::cuda::gemm(handle, args, da.data(), db.data(), dc.data(), stream,
                  ep::DGeluBiasGrad<T>{dpre_in.data(), 0, 0, dgrad.data()});
    require_close(to_host(dc), want, abs, rel, "dgelu_bgrad C");
    require_close(to_host(dgrad), want_grad, abs * 8, rel, "dgelu_bgrad bias_grad");
  }
}
}  // namespace

TEST_CASE("cuBLASLt epilogues match the host epilogues (fp32)", "[gpu][gemm][epilogue]") { compare_epilogues<float>(31); }
TEST_CASE("cuBLASLt epilogues match the host epilogues (bf16)", "[gpu][gemm][epilogue]") {
  compare_epilogues<bfloat16>(32);
}

TEST_CASE("cuBLASLt BGRADA / BGRADB give the sums over k of op(A) / op(B)", "[gpu][gemm][epilogue]") {
  // bf16 in and out (the configuration training uses; the bias gradient has C's type).
  Stream stream;
  k::cuda::GemmHandle handle;
  const std::int64_t m = 32, n = 40, kk = 24;
  for (auto layout : {k::Layout::row_major, k::Layout::col_major}) {
    // dW = X^T dY shape: op(A) = A^T.
    k::GemmArgs args = k::gemm_args(m, n, kk, k::Op::transpose, k::Op::none, 1.0f, 0.0f, layout);
    auto a = random_vector<bfloat16>(m * kk, 41), b = random_vector<bfloat16>(kk * n, 42);
    std::vector<bfloat16> want_c(m * n);
    k::host::gemm(args, a.data(), b.data(), want_c.data());
    std::vector<double> sum_a(m, 0.0), sum_b(n, 0.0);
    for (std::int64_t i = 0; i < m; ++i)  // A is stored k x m
      for (std::int64_t p = 0; p < kk; ++p) sum_a[i] += static_cast<float>(a[args.offset(p, i, args.lda_or_packed())]);
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t p = 0; p < kk; ++p) sum_b[j] += static_cast<float>(b[args.offset(p, j, args.ldb_or_packed())]);
    auto da = to_device(a, stream), db = to_device(b, stream);
    for (auto kind : {k::cuda::LtEpilogue::bgrad_a, k::cuda::LtEpilogue::bgrad_b}) {
      DYNAMIC_SECTION("layout " << int(layout) << " " << k::cuda::lt_epilogue_name(kind)) {
        const bool on_a = kind == k::cuda::LtEpilogue::bgrad_a;
        trellis::Buffer<bfloat16, trellis::Cuda> dc(m * n, stream), dgrad(on_a ? m : n, stream);
        k::cuda::LtEpilogueArgs lt;
        lt.kind = kind;
        lt.bias_grad = dgrad.data();
        if (layout == k::Layout::col_major) {
          // cuBLASLt (CUDA 13, H200) refuses BGRADA/BGRADB for this column-major problem; where it
          // does, the library must say so clearly (and where a later version accepts it, the
          // results are checked like the row-major ones).
          try {
            handle.run(args, trellis::DType::bf16, trellis::DType::bf16, da.data(), db.data(), dc.data(), lt, stream);
          } catch (const trellis::Error& e) {
            const std::string what = e.what();
            REQUIRE(what.find("does not support epilogue") != std::string::npos);
            REQUIRE(what.find(k::cuda::lt_epilogue_name(kind)) != std::string::npos);
            continue;
          }
        } else {
          handle.run(args, trellis::DType::bf16, trellis::DType::bf16, da.data(), db.data(), dc.data(), lt, stream);
        }
        require_close(to_host(dc), want_c, 1e-2, 1e-2, "C");
        std::vector<float> want(on_a ? sum_a.begin() : sum_b.begin(), on_a ? sum_a.end() : sum_b.end());
        require_close(to_host(dgrad), want, 2e-2, 1e-2, "bias_grad");
      }
    }
  }
}

TEST_CASE("cuBLASLt GELU_AUX writes gelu(AB) and saves AB", "[gpu][gemm][epilogue]") {
  Stream stream;
  k::cuda::GemmHandle handle;
  const std::int64_t m = 33, n = 48, kk = 32;
  k::GemmArgs args = k::gemm_args(m, n, kk);
  auto a = random_vector<float>(m * kk, 61), b = random_vector<float>(kk * n, 62);
  std::vector<float> want_gelu(m * n), want_pre(m * n);
  k::host::gemm(args, a.data(), b.data(), want_gelu.data(), ep::Gelu{});
  k::host::gemm(args, a.data(), b.data(), want_pre.data());
  auto da = to_device(a, stream), db = to_device(b, stream);
  trellis::Buffer<float, trellis::Cuda> dc(m * n, stream), daux(m * n, stream);
  k::cuda::LtEpilogueArgs lt;
  lt.kind = k::cuda::LtEpilogue::gelu_aux;
  lt.aux = daux.data();
  handle.run(args, trellis::DType::f32, trellis::DType::f32, da.data(), db.data(), dc.data(), lt, stream);
  require_close(to_host(dc), want_gelu, 1e-3, 1e-3, "gelu(AB)");
  require_close(to_host(daux), want_pre, 2e-4, 1e-4, "aux = AB");
}

TEST_CASE("cuBLASLt plan cache: one heuristic query per distinct problem", "[gpu][gemm]") {
  Stream stream;
  k::cuda::GemmHandle handle;
  k::GemmArgs args = k::gemm_args(64, 64, 64);
  trellis::Buffer<float, trellis::Cuda> a(64 * 64, stream), b(64 * 64, stream), c(64 * 64, stream);
  for (int i = 0; i < 3; ++i) k::cuda::gemm(handle, args, a.data(), b.data(), c.data(), stream);
  REQUIRE(handle.plan_count() == 1);
  REQUIRE(handle.heuristic_queries() == 1);
  k::cuda::gemm(handle, args, a.data(), b.data(), c.data(), stream, ep::Relu{});
  REQUIRE(handle.plan_count() == 2);
  k::GemmArgs other = k::gemm_args(32, 64, 64);
  k::cuda::gemm(handle, other, a.data(), b.data(), c.data(), stream);
  k::cuda::gemm(handle, other, a.data(), b.data(), c.data(), stream);
  REQUIRE(handle.plan_count() == 3);
  REQUIRE(handle.heuristic_queries() == 3);
  // A misaligned pointer is a different plan (cuBLASLt picks kernels by alignment).
  k::cuda::gemm(handle, other, a.data() + 1, b.data(), c.data(), stream);
  REQUIRE(handle.plan_count() == 4);
  TRELLIS_CHECK_CUDA(cudaStreamSynchronize(stream));
}

TEST_CASE("cuBLASLt GEMM refuses bad arguments with trellis::Error", "[gpu][gemm]") {
  Stream stream;
  k::cuda::GemmHandle handle;
  trellis::Buffer<float, trellis::Cuda> a(4096, stream), b(4096, stream), c(4096, stream), v(64, stream);
  k::GemmArgs args = k::gemm_args(16, 16, 16);
  k::GemmArgs bad_ld = args;
  bad_ld.lda = 8;
  REQUIRE_THROWS_AS(k::cuda::gemm(handle, bad_ld, a.data(), b.data(), c.data(), stream), trellis::Error);
  k::GemmArgs col = k::gemm_args(16, 16, 16, k::Op::none, k::Op::none, 1.0f, 0.0f, k::Layout::col_major);
  REQUIRE_THROWS_AS(k::cuda::gemm(handle, col, a.data(), b.data(), c.data(), stream, ep::Bias<float>{v.data()}),
                    trellis::Error);
  k::GemmArgs odd = k::gemm_args(16, 12, 16);  // aux leading dimension 12: not a multiple of 8
  REQUIRE_THROWS_AS(
      k::cuda::gemm(handle, odd, a.data(), b.data(), c.data(), stream, ep::BiasGelu<float>{v.data(), c.data()}),
      trellis::Error);
  REQUIRE_THROWS_AS(k::cuda::gemm(handle, args, a.data(), b.data(), c.data(), stream,
                                  ep::DGeluBiasGrad<float>{c.data(), 0, 0, v.data(), true}),
                    trellis::Error);
  k::GemmArgs no_k = k::gemm_args(16, 16, 0);  // the host handles k = 0; cuBLASLt does not
  REQUIRE_THROWS_AS(k::cuda::gemm(handle, no_k, a.data(), b.data(), c.data(), stream), trellis::Error);
  k::GemmArgs empty = k::gemm_args(0, 16, 16);  // empty C: a no-op, as on the host
  REQUIRE_NOTHROW(k::cuda::gemm(handle, empty, a.data(), b.data(), c.data(), stream));
  REQUIRE(handle.plan_count() == 0);
}
