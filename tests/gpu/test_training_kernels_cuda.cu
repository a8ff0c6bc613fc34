// CUDA training kernels against their host twins on the same inputs: LayerNorm / RMSNorm forward
// (with and without the fused residual) and backward, softmax cross-entropy forward / backward /
// fused in place (ignore index), embedding forward / backward (repeated tokens, vocab-sharded),
// GELU forward / backward, add, column sums, dropout masks (bitwise), multi-tensor AdamW (more tensors than one launch
// holds) and the global gradient norm.
// Tolerances: fp32 results 1e-5 + 1e-5|want| elementwise, 1e-4 relative for reductions (the
// summation orders differ); 16-bit results one rounding apart: 1e-2 + 8e-3|want| (bf16), 2e-3
// (fp16). Gradient sums over many rows: 1e-4 + 1e-4|want| in fp32.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "support/gpu_test.hpp"
#include "trellis/kernels/adamw_cuda.cuh"
#include "trellis/kernels/adamw_host.hpp"
#include "trellis/kernels/dropout_cuda.cuh"
#include "trellis/kernels/dropout_host.hpp"
#include "trellis/kernels/elementwise_cuda.cuh"
#include "trellis/kernels/elementwise_host.hpp"
#include "trellis/kernels/embedding_cuda.cuh"
#include "trellis/kernels/embedding_host.hpp"
#include "trellis/kernels/norms_cuda.cuh"
#include "trellis/kernels/norms_host.hpp"
#include "trellis/kernels/xent_cuda.cuh"
#include "trellis/kernels/xent_host.hpp"

namespace k = trellis::kernels;
using trellis::bfloat16;
using thalf = trellis::half;  // cuda_fp16.h declares a global `half`
using trellis::Buffer;
using trellis::Cuda;
using trellis_gpu_test::Stream;
using trellis_gpu_test::random_vector;
using trellis_gpu_test::require_close;
using trellis_gpu_test::to_device;
using trellis_gpu_test::to_host;

namespace {
template <class T>
constexpr double abs_tol() {
  return std::is_same_v<T, float> ? 1e-5 : (std::is_same_v<T, bfloat16> ? 1e-2 : 2e-3);
}
template <class T>
constexpr double rel_tol() {
  return std::is_same_v<T, float> ? 1e-5 : (std::is_same_v<T, bfloat16> ? 8e-3 : 2e-3);
}
}  // namespace

TEMPLATE_TEST_CASE("CUDA LayerNorm / RMSNorm match the host", "[gpu][norms]", float, bfloat16) {
  using T = TestType;
  Stream stream;
  const std::int64_t rows = 300, dim = 200;
  auto x = random_vector<T>(rows * dim, 1, -2.0f, 2.0f), res = random_vector<T>(rows * dim, 2);
  auto w = random_vector<float>(dim, 3, 0.5f, 1.5f), b = random_vector<float>(dim, 4);
  auto dout = random_vector<T>(rows * dim, 5);
  auto gx = to_device(x, stream);
  auto gres = to_device(res, stream);
  auto gw = to_device(w, stream);
  auto gb = to_device(b, stream);
  auto gdout = to_device(dout, stream);
  const float eps = 1e-5f;
  for (bool with_residual : {false, true}) {
    DYNAMIC_SECTION("layernorm, residual=" << with_residual) {
      std::vector<T> out(rows * dim), sum(rows * dim);
      std::vector<float> mean(rows), rstd(rows);
      k::host::layernorm_forward(rows, dim, x.data(), w.data(), b.data(), out.data(), mean.data(), rstd.data(), eps,
                                 with_residual ? res.data() : nullptr, with_residual ? sum.data() : nullptr);
      Buffer<T, Cuda> gout(rows * dim, stream), gsum(rows * dim, stream);
      Buffer<float, Cuda> gmean(rows, stream), grstd(rows, stream);
      k::cuda::layernorm_forward(rows, dim, gx.data(), gw.data(), gb.data(), gout.data(), gmean.data(), grstd.data(),
                                 eps, stream, with_residual ? gres.data() : nullptr,
                                 with_residual ? gsum.data() : nullptr);
      require_close(to_host(gout), out, abs_tol<T>(), rel_tol<T>(), "out");
      require_close(to_host(gmean), mean, 1e-5, 1e-4, "mean");
      require_close(to_host(grstd), rstd, 1e-5, 1e-4, "rstd");
      if (with_residual) require_close(to_host(gsum), sum, 0.0, 0.0, "sum_out");

      // Backward: dinput accumulated onto a prior value, dweight/dbias added to 0.25.
      const T* input_host = with_residual ? sum.data() : x.data();
      const T* input_dev = with_residual ? gsum.data() : gx.data();
      std::vector<T> dx = random_vector<T>(rows * dim, 6);
      std::vector<float> dw(dim, 0.25f), db(dim, 0.25f);
      auto gdx = to_device(dx, stream);
      auto gdw = to_device(dw, stream);
      auto gdb = to_device(db, stream);
      k::host::layernorm_backward(rows, dim, dout.data(), input_host, w.data(), mean.data(), rstd.data(), dx.data(),
                                  dw.data(), db.data(), true);
      const std::size_t ws = k::cuda::norm_backward_workspace_bytes(rows, dim);
      Buffer<char, Cuda> gws(ws, stream, false);
      k::cuda::layernorm_backward(rows, dim, gdout.data(), input_dev, gw.data(), gmean.data(), grstd.data(),
                                  gdx.data(), gdw.data(), gdb.data(), gws.data(), ws, stream, true);
      require_close(to_host(gdx), dx, abs_tol<T>() * 10, rel_tol<T>(), "dinput");
      require_close(to_host(gdw), dw, 1e-3, 1e-4, "dweight");
      require_close(to_host(gdb), db, 1e-3, 1e-4, "dbias");
    }
    DYNAMIC_SECTION("rmsnorm, residual=" << with_residual) {
      std::vector<T> out(rows * dim), sum(rows * dim);
      std::vector<float> rstd(rows);
      k::host::rmsnorm_forward(rows, dim, x.data(), w.data(), out.data(), rstd.data(), eps,
                               with_residual ? res.data() : nullptr, with_residual ? sum.data() : nullptr);
      Buffer<T, Cuda> gout(rows * dim, stream), gsum(rows * dim, stream);
      Buffer<float, Cuda> grstd(rows, stream);
      k::cuda::rmsnorm_forward(rows, dim, gx.data(), gw.data(), gout.data(), grstd.data(), eps, stream,
                               with_residual ? gres.data() : nullptr, with_residual ? gsum.data() : nullptr);
      require_close(to_host(gout), out, abs_tol<T>(), rel_tol<T>(), "out");
      require_close(to_host(grstd), rstd, 1e-5, 1e-4, "rstd");
      const T* input_host = with_residual ? sum.data() : x.data();
      const T* input_dev = with_residual ? gsum.data() : gx.data();
      std::vector<T> dx(rows * dim);
      std::vector<float> dw(dim, 0.0f);
      auto gdx = to_device(dx, stream);
      auto gdw = to_device(dw, stream);
      k::host::rmsnorm_backward(rows, dim, dout.data(), input_host, w.data(), rstd.data(), dx.data(), dw.data());
      const std::size_t ws = k::cuda::norm_backward_workspace_bytes(rows, dim);
      Buffer<char, Cuda> gws(ws, stream, false);
      k::cuda::rmsnorm_backward(rows, dim, gdout.data(), input_dev, gw.data(), grstd.data(), gdx.data(), gdw.data(),
                                gws.data(), ws, stream);
      require_close(to_host(gdx), dx, abs_tol<T>() * 10, rel_tol<T>(), "dinput");
      require_close(to_host(gdw), dw, 1e-3, 1e-4, "dweight");
    }
  }
  std::vector<char> small(16);
  REQUIRE_THROWS_AS(k::cuda::rmsnorm_backward(rows, dim, gdout.data(), gx.data(), gw.data(), gw.data(), gx.data(),
                                              gw.data(), small.data(), small.size(), stream),
                    trellis::Error);
}

TEMPLATE_TEST_CASE("CUDA softmax cross-entropy matches the host", "[gpu][xent]", float, bfloat16) {
  using T = TestType;
  Stream stream;
  const std::int64_t rows = 37, vocab = 5000, ld = 5008;
  auto logits = random_vector<T>(rows * ld, 11, -8.0f, 8.0f);
  std::vector<std::int32_t> targets(rows);
  for (std::int64_t r = 0; r < rows; ++r) targets[r] = static_cast<std::int32_t>((r * 997) % vocab);
  targets[3] = -1;  // ignored row
  targets[rows - 1] = static_cast<std::int32_t>(vocab - 1);
  auto glogits = to_device(logits, stream);
  auto gtargets = to_device(targets, stream);
  std::vector<float> loss(rows), lse(rows);
  k::host::softmax_xent_forward(rows, vocab, ld, logits.data(), targets.data(), loss.data(), lse.data());
  Buffer<float, Cuda> gloss(rows, stream), glse(rows, stream);
  k::cuda::softmax_xent_forward(rows, vocab, ld, glogits.data(), gtargets.data(), gloss.data(), glse.data(), stream);
  require_close(to_host(gloss), loss, 1e-4, 1e-5, "loss");
  require_close(to_host(glse), lse, 1e-4, 1e-5, "lse");
  REQUIRE(to_host(gloss)[3] == 0.0f);

  const float scale = 1.0f / rows;
  std::vector<T> grad(rows * vocab);
  k::host::softmax_xent_backward(rows, vocab, ld, logits.data(), targets.data(), lse.data(), scale, grad.data(), vocab);
  Buffer<T, Cuda> ggrad(rows * vocab, stream);
  k::cuda::softmax_xent_backward(rows, vocab, ld, glogits.data(), gtargets.data(), glse.data(), scale, ggrad.data(),
                                 vocab, stream);
  require_close(to_host(ggrad), grad, 1e-7 + abs_tol<T>() * 1e-3, rel_tol<T>() + 1e-5, "dlogits");

  SECTION("fused forward+backward in place") {
    auto inplace = logits;
    std::vector<float> loss2(rows);
    k::host::softmax_xent_forward_backward(rows, vocab, ld, inplace.data(), targets.data(), loss2.data(), scale,
                                           inplace.data(), ld);
    auto g = to_device(logits, stream);
    Buffer<float, Cuda> gl(rows, stream);
    k::cuda::softmax_xent_forward_backward(rows, vocab, ld, g.data(), gtargets.data(), gl.data(), scale, g.data(), ld,
                                           stream);
    require_close(to_host(gl), loss2, 1e-4, 1e-5, "loss");
    require_close(to_host(g), inplace, 1e-7 + abs_tol<T>() * 1e-3, rel_tol<T>() + 1e-5, "dlogits in place");
  }
}

TEST_CASE("CUDA vocab-parallel cross-entropy pieces match the host (two shards on one GPU)", "[gpu][xent]") {
  Stream stream;
  const std::int64_t rows = 29, vocab = 3000, split = 1234;  // shard 0: [0, 1234), shard 1: [1234, 3000)
  auto logits = random_vector<float>(rows * vocab, 51, -6.0f, 6.0f);
  std::vector<std::int32_t> targets(rows);
  for (std::int64_t r = 0; r < rows; ++r) targets[r] = static_cast<std::int32_t>((r * 389) % vocab);
  targets[5] = -1;
  std::vector<float> want_loss(rows), want_lse(rows);
  k::host::softmax_xent_forward(rows, vocab, vocab, logits.data(), targets.data(), want_loss.data(), want_lse.data());
  auto glogits = to_device(logits, stream);
  auto gtargets = to_device(targets, stream);
  const std::int64_t starts[2] = {0, split}, widths[2] = {split, vocab - split};
  Buffer<float, Cuda> gmax[2] = {Buffer<float, Cuda>(rows, stream), Buffer<float, Cuda>(rows, stream)};
  Buffer<float, Cuda> gsum[2] = {Buffer<float, Cuda>(rows, stream), Buffer<float, Cuda>(rows, stream)};
  Buffer<float, Cuda> gtarget[2] = {Buffer<float, Cuda>(rows, stream), Buffer<float, Cuda>(rows, stream)};
  for (int s = 0; s < 2; ++s)
    k::cuda::xent_partial_max(rows, widths[s], vocab, glogits.data() + starts[s], gmax[s].data(), stream);
  auto m0 = to_host(gmax[0]), m1 = to_host(gmax[1]);
  std::vector<float> global_max(rows);
  for (std::int64_t r = 0; r < rows; ++r) global_max[r] = std::max(m0[r], m1[r]);  // the all-reduce(max)
  auto gglobal_max = to_device(global_max, stream);
  for (int s = 0; s < 2; ++s) {
    k::cuda::xent_partial_sumexp(rows, widths[s], vocab, glogits.data() + starts[s], gglobal_max.data(),
                                 gsum[s].data(), stream);
    k::cuda::xent_partial_target(rows, widths[s], vocab, glogits.data() + starts[s], gtargets.data(), starts[s],
                                 gtarget[s].data(), stream);
  }
  auto s0 = to_host(gsum[0]), s1 = to_host(gsum[1]), t0 = to_host(gtarget[0]), t1 = to_host(gtarget[1]);
  std::vector<float> global_sum(rows), target_logit(rows);
  for (std::int64_t r = 0; r < rows; ++r) global_sum[r] = s0[r] + s1[r], target_logit[r] = t0[r] + t1[r];
  auto gglobal_sum = to_device(global_sum, stream);
  auto gtarget_logit = to_device(target_logit, stream);
  Buffer<float, Cuda> gloss(rows, stream), glse(rows, stream);
  k::cuda::xent_finish(rows, gglobal_max.data(), gglobal_sum.data(), gtarget_logit.data(), gtargets.data(),
                       gloss.data(), glse.data(), stream);
  require_close(to_host(gloss), want_loss, 1e-4, 1e-5, "loss");
  require_close(to_host(glse), want_lse, 1e-4, 1e-5, "lse");

  const float scale = 0.5f;
  for (int s = 0; s < 2; ++s) {
    std::vector<float> want(rows * widths[s]);
    k::host::xent_backward_sharded(rows, widths[s], vocab, logits.data() + starts[s], targets.data(), starts[s],
                                   want_lse.data(), scale, want.data(), widths[s]);
    Buffer<float, Cuda> got(rows * widths[s], stream);
    k::cuda::xent_backward_sharded(rows, widths[s], vocab, glogits.data() + starts[s], gtargets.data(), starts[s],
                                   glse.data(), scale, got.data(), widths[s], stream);
    require_close(to_host(got), want, 1e-6, 1e-4, "sharded dlogits");
  }
}

TEST_CASE("CUDA embedding matches the host (repeated tokens, positions, vocab shards)", "[gpu][embedding]") {
  Stream stream;
  k::EmbeddingArgs args;
  args.batch = 3, args.seq = 17, args.dim = 96, args.vocab_rows = 50, args.positions = 20;
  std::vector<std::int32_t> tokens(args.batch * args.seq);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 7) % 11);  // repeats
  auto wte = random_vector<float>(args.vocab_rows * args.dim, 21), wpe = random_vector<float>(args.positions * args.dim, 22);
  auto dout = random_vector<bfloat16>(tokens.size() * args.dim, 23);
  auto gtok = to_device(tokens, stream);
  auto gwte = to_device(wte, stream);
  auto gwpe = to_device(wpe, stream);
  auto gdout = to_device(dout, stream);
  for (bool sharded : {false, true}) {
    DYNAMIC_SECTION("sharded=" << sharded) {
      args.sharded = sharded;
      args.vocab_start = sharded ? 5 : 0;  // shard owns tokens 5..54: 0..4 are foreign
      std::vector<bfloat16> out(tokens.size() * args.dim);
      k::host::embedding_forward(args, tokens.data(), wte.data(), wpe.data(), out.data());
      Buffer<bfloat16, Cuda> gout(out.size(), stream);
      k::cuda::embedding_forward(args, gtok.data(), gwte.data(), gwpe.data(), gout.data(), stream);
      require_close(to_host(gout), out, 0.0, 0.0, "out");

      std::vector<float> dwte(wte.size(), 0.5f), dwpe(wpe.size(), -0.5f);
      auto gdwte = to_device(dwte, stream);
      auto gdwpe = to_device(dwpe, stream);
      k::host::embedding_backward(args, tokens.data(), dout.data(), dwte.data(), dwpe.data());
      k::cuda::embedding_backward(args, gtok.data(), gdout.data(), gdwte.data(), gdwpe.data(), stream);
      require_close(to_host(gdwte), dwte, 0.0, 0.0, "dwte (same order: bitwise)");
      require_close(to_host(gdwpe), dwpe, 0.0, 0.0, "dwpe (same order: bitwise)");
    }
  }
}

TEMPLATE_TEST_CASE("CUDA GELU, add and column sums match the host", "[gpu][elementwise]", float, bfloat16, thalf) {
  using T = TestType;
  Stream stream;
  const std::int64_t n = 100003;
  auto x = random_vector<T>(n, 31, -6.0f, 6.0f), dout = random_vector<T>(n, 32);
  auto gx = to_device(x, stream);
  auto gd = to_device(dout, stream);
  std::vector<T> y(n);
  k::host::gelu_forward(n, x.data(), y.data());
  Buffer<T, Cuda> gy(n, stream);
  k::cuda::gelu_forward(n, gx.data(), gy.data(), stream);
  require_close(to_host(gy), y, abs_tol<T>() + 1e-6, rel_tol<T>() + 1e-5, "gelu");

  auto dx = random_vector<T>(n, 33);
  auto gdx = to_device(dx, stream);
  k::host::gelu_backward(n, x.data(), dout.data(), dx.data(), true);
  k::cuda::gelu_backward(n, gx.data(), gd.data(), gdx.data(), stream, true);
  require_close(to_host(gdx), dx, abs_tol<T>() + 1e-6, rel_tol<T>() + 1e-5, "gelu backward (accumulate)");

  std::vector<T> sum(n);
  k::host::add(n, x.data(), dout.data(), sum.data());
  k::cuda::add(n, gx.data(), gd.data(), gy.data(), stream);
  require_close(to_host(gy), sum, 0.0, 0.0, "add (one rounding: bitwise)");

  const std::int64_t rows = 1000, cols = 70, ld = 77;
  auto m = random_vector<T>(rows * ld, 34);
  std::vector<float> sums(cols, 1.0f);
  k::host::column_sums(rows, cols, ld, m.data(), sums.data(), true);
  auto gm = to_device(m, stream);
  auto gs = to_device(std::vector<float>(cols, 1.0f), stream);
  const std::size_t ws = k::cuda::column_sums_workspace_bytes(rows, cols);
  Buffer<char, Cuda> gws(ws, stream, false);
  k::cuda::column_sums(rows, cols, ld, gm.data(), gs.data(), gws.data(), ws, stream, true);
  require_close(to_host(gs), sums, 1e-4, 1e-4, "column sums");
}

// The masks are one TRELLIS_HD hash (kernels/dropout.hpp): every kept element is scaled in fp32 and
// rounded once on both sides, so the results are the same bits.
TEMPLATE_TEST_CASE("CUDA dropout draws the host's masks", "[gpu][dropout]", float, bfloat16) {
  using T = TestType;
  Stream stream;
  k::DropoutArgs a;
  a.seed = 12345;
  a.site = trellis::name_hash("h.3.mlp");
  a.p = 0.1f;
  a.batch = 6;
  a.first_sample = 18;  // a microbatch of another dp rank
  a.row0 = 40;          // a sequence shard
  a.rows = 300;
  a.width = 96;
  auto x = random_vector<T>(a.rows * a.width, 41, -3.0f, 3.0f);
  auto gx = to_device(x, stream);
  k::host::dropout_apply(a, x.data());
  k::cuda::dropout_apply(a, gx.data(), stream);
  require_close(to_host(gx), x, 0.0, 0.0, "dropout (bitwise)");
  std::size_t zeros = 0;
  for (const T& v : x) zeros += static_cast<float>(v) == 0.0f;
  CHECK(static_cast<double>(zeros) / static_cast<double>(x.size()) == Approx(0.1).margin(0.02));
}

TEST_CASE("CUDA multi-tensor AdamW and grad norm match the host", "[gpu][adamw]") {
  Stream stream;
  const int tensors = 45;  // more than one launch holds (32)
  std::vector<std::vector<float>> p, m, v;
  std::vector<std::vector<bfloat16>> g;
  std::vector<Buffer<float, Cuda>> gp, gm, gv;
  std::vector<Buffer<bfloat16, Cuda>> gg;
  for (int t = 0; t < tensors; ++t) {
    std::size_t n = static_cast<std::size_t>(t == 7 ? 0 : 1 + (t * 3571) % 20000);  // one empty tensor
    p.push_back(random_vector<float>(n, 100 + t));
    m.push_back(random_vector<float>(n, 200 + t, -0.01f, 0.01f));
    v.push_back(random_vector<float>(n, 300 + t, 0.0f, 0.01f));
    g.push_back(random_vector<bfloat16>(n, 400 + t));
    gp.push_back(to_device(p.back(), stream));
    gm.push_back(to_device(m.back(), stream));
    gv.push_back(to_device(v.back(), stream));
    gg.push_back(to_device(g.back(), stream));
  }
  std::vector<k::AdamWTensor<bfloat16>> host_tensors, dev_tensors;
  std::vector<std::span<const bfloat16>> host_grads, dev_grads;
  for (int t = 0; t < tensors; ++t) {
    float decay = t % 3 == 0 ? 0.0f : 1.0f;
    host_tensors.push_back({p[t], g[t], m[t], v[t], decay});
    dev_tensors.push_back({{gp[t].data(), gp[t].size()}, {gg[t].data(), gg[t].size()}, {gm[t].data(), gm[t].size()},
                           {gv[t].data(), gv[t].size()}, decay});
    host_grads.emplace_back(g[t]);
    dev_grads.emplace_back(gg[t].data(), gg[t].size());
  }
  const double norm2 = k::host::grad_norm_squared(host_grads);
  Buffer<double, Cuda> gnorm(1, stream);
  const std::size_t ws = k::cuda::grad_norm_workspace_bytes(std::span<const std::span<const bfloat16>>(dev_grads));
  Buffer<char, Cuda> gws(ws, stream, false);
  k::cuda::grad_norm_squared(std::span<const std::span<const bfloat16>>(dev_grads), gnorm.data(), gws.data(), ws,
                             stream);
  const double got = to_host(gnorm)[0];
  REQUIRE(std::fabs(got - norm2) <= 1e-9 * norm2);

  k::AdamWConfig config;
  config.lr = 1e-3f, config.weight_decay = 0.1f;
  const float scale = k::host::clip_scale(std::sqrt(norm2), 1.0);
  for (std::int64_t step = 1; step <= 3; ++step) {
    k::host::adamw_step(host_tensors, config, step, scale);
    k::cuda::adamw_step(std::span<const k::AdamWTensor<bfloat16>>(dev_tensors), config, step, scale, stream);
  }
  for (int t = 0; t < tensors; ++t) {
    INFO("tensor " << t);
    require_close(to_host(gp[t]), p[t], 1e-6, 1e-5, "param");
    require_close(to_host(gm[t]), m[t], 1e-7, 1e-5, "m");
    require_close(to_host(gv[t]), v[t], 1e-9, 1e-5, "v");
  }
}
