// backend::Cuda's own pieces against backend::Host<bfloat16>: the head permutes (bitwise, both
// directions), the workspace discipline (a kernel whose workspace was not reserved at set-up is
// refused), the Mixture-of-Experts routing ops (kernels/moe_cuda.cuh: dispatch plans, counts and
// gathers exactly, fp32 arithmetic within rounding) and the grouped GEMM (empty and k = 0 groups
// included); the planner's calibration on this GPU (plan::BasicMeasuredRates<backend::Cuda>: a
// GEMM's time against CUDA events; plan::measure_link's device overload compiled on its buffers).
// The layers and the Trainer on backend::Cuda: test_layers_cuda.cu, test_trainer_cuda.cu.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "support/gpu_test.hpp"
#include "trellis/backend/cuda.cuh"
#include "trellis/backend/host.hpp"
#include "trellis/comm/communicator.hpp"
#include "trellis/plan/measured_link.hpp"
#include "trellis/plan/measured_rates.hpp"

using CudaBackend = trellis::backend::Cuda;
using HostBf16 = trellis::backend::Host<trellis::bfloat16>;
using trellis::bfloat16;
using trellis_gpu_test::require_close;
using trellis_gpu_test::Stream;
using trellis_gpu_test::to_device;
using trellis_gpu_test::to_host;
template <class T>
using DeviceBuffer = trellis::Buffer<T, trellis::Cuda>;

TEST_CASE("backend::Cuda head permutes equal backend::Host's", "[gpu][backend]") {
  Stream stream;
  CudaBackend gpu(stream);
  trellis::backend::Host<trellis::bfloat16> host;
  const std::int64_t B = 2, T = 7, H = 3, D = 8, ld = 3 * H * D;
  const auto values = trellis_gpu_test::random_vector<float>(static_cast<std::size_t>(B * T * ld), 5);
  std::vector<trellis::bfloat16> rows(values.begin(), values.end());
  const trellis::kernels::HeadsLayout l{B, T, H, D};
  std::vector<trellis::bfloat16> want(static_cast<std::size_t>(l.elements()));
  host.rows_to_heads(l, rows.data() + H * D, ld, want.data());
  auto d_rows = trellis_gpu_test::to_device(rows, stream);
  trellis::Buffer<trellis::bfloat16, trellis::Cuda> d_heads(want.size(), stream, true);
  gpu.rows_to_heads(l, d_rows.data() + H * D, ld, d_heads.data());
  const auto got = trellis_gpu_test::to_host(d_heads);
  for (std::size_t i = 0; i < want.size(); ++i) REQUIRE(got[i].bits == want[i].bits);
  // and back into zeroed rows: exactly the head columns reappear
  trellis::Buffer<trellis::bfloat16, trellis::Cuda> d_back(rows.size(), stream, true);
  gpu.heads_to_rows(l, d_heads.data(), d_back.data() + H * D, ld);
  const auto back = trellis_gpu_test::to_host(d_back);
  for (std::int64_t r = 0; r < B * T; ++r)
    for (std::int64_t c = 0; c < ld; ++c) {
      const auto i = static_cast<std::size_t>(r * ld + c);
      const bool head_column = c >= H * D && c < 2 * H * D;
      REQUIRE(back[i].bits == (head_column ? rows[i].bits : trellis::bfloat16(0.0f).bits));
    }
}

TEST_CASE("backend::Cuda refuses a kernel whose workspace was not reserved at set-up", "[gpu][backend]") {
  Stream stream;
  CudaBackend gpu(stream);
  const std::int64_t rows = 64, cols = 256;
  const std::size_t need = gpu.column_sums_workspace(rows, cols);
  REQUIRE(need > 0);
  trellis::Buffer<trellis::bfloat16, trellis::Cuda> x(static_cast<std::size_t>(rows * cols), stream, true);
  trellis::Buffer<float, trellis::Cuda> sums(static_cast<std::size_t>(cols), stream, true);
  CHECK_THROWS_WITH(gpu.column_sums(rows, cols, cols, x.data(), sums.data()),
                    Catch::Contains("column_sums needs") && Catch::Contains("reserve_workspace"));
  gpu.reserve_workspace(need);
  CHECK(gpu.workspace_reserved() >= need);
  CHECK_NOTHROW(gpu.column_sums(rows, cols, cols, x.data(), sums.data()));
  gpu.synchronize();
}

namespace {

std::vector<bfloat16> random_bf16(std::size_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  const auto v = trellis_gpu_test::random_vector<float>(n, seed, lo, hi);
  return std::vector<bfloat16>(v.begin(), v.end());
}

// Every routing op on one configuration: the forward on random logits, then the plan, gathers,
// combines and backward on the host's expert choices (so that plans compare exactly).
void compare_moe(std::int64_t rows, std::int64_t E, int k, bool normalize, std::int64_t capacity, std::int64_t d,
                 std::uint32_t seed) {
  INFO("rows " << rows << ", experts " << E << ", top-" << k << ", capacity " << capacity << ", cols " << d);
  Stream stream;
  CudaBackend gpu(stream);
  HostBf16 host;
  const trellis::kernels::MoeRouteArgs route{rows, E, k, normalize};
  const auto RE = static_cast<std::size_t>(rows * E), RK = static_cast<std::size_t>(rows * k);

  // route forward
  const auto logits = trellis_gpu_test::random_vector<float>(RE, seed, -3.0f, 3.0f);
  std::vector<float> probs(RE), lse(rows), gate(RK), prob_sums(E);
  std::vector<std::int32_t> expert(RK), routed(E);
  host.moe_route_forward(route, logits.data(), probs.data(), lse.data(), expert.data(), gate.data(), routed.data(),
                         prob_sums.data());
  auto d_logits = to_device(logits, stream);
  DeviceBuffer<float> d_probs(RE, stream), d_lse(rows, stream), d_gate(RK, stream), d_prob_sums(E, stream);
  DeviceBuffer<std::int32_t> d_expert(RK, stream), d_routed(E, stream);
  gpu.moe_route_forward(route, d_logits.data(), d_probs.data(), d_lse.data(), d_expert.data(), d_gate.data(),
                        d_routed.data(), d_prob_sums.data());
  require_close(to_host(d_probs), probs, 1e-6, 1e-5, "probs");
  require_close(to_host(d_lse), lse, 1e-5, 1e-6, "lse");
  // random logits: no two probabilities of a row within rounding of each other, so the choices agree
  CHECK(to_host(d_expert) == expert);
  require_close(to_host(d_gate), gate, 1e-6, 1e-5, "gate");
  CHECK(to_host(d_routed) == routed);
  require_close(to_host(d_prob_sums), prob_sums, 1e-4, 1e-5, "prob_sums (atomics: order not fixed)");

  // dispatch plan from the host's choices: exactly the host's
  std::vector<std::int32_t> slot(RK), source_row(std::max<std::size_t>(RK, 1)), kept(E);
  host.moe_dispatch_plan(rows, k, E, capacity, expert.data(), slot.data(), source_row.data(), kept.data());
  auto d_expert_h = to_device(expert, stream);
  DeviceBuffer<std::int32_t> d_slot(RK, stream), d_source_row(source_row.size(), stream), d_kept(E, stream);
  gpu.reserve_workspace(gpu.moe_dispatch_plan_workspace(rows, k, E));
  gpu.moe_dispatch_plan(rows, k, E, capacity, d_expert_h.data(), d_slot.data(), d_source_row.data(), d_kept.data());
  CHECK(to_host(d_slot) == slot);
  CHECK(to_host(d_kept) == kept);
  std::int64_t sent = 0;
  for (auto v : kept) sent += v;
  auto got_rows = to_host(d_source_row);
  got_rows.resize(static_cast<std::size_t>(sent));
  source_row.resize(static_cast<std::size_t>(sent));
  CHECK(got_rows == source_row);
  if (sent == 0) return;

  // gather (exact), combine (fp32, one rounding), combine backward, route backward
  const auto SD = static_cast<std::size_t>(sent * d), RD = static_cast<std::size_t>(rows * d);
  const auto x = random_bf16(RD, seed + 1);
  std::vector<bfloat16> xp(SD);
  host.gather_rows(sent, d, x.data(), source_row.data(), xp.data());
  auto d_x = to_device(x, stream);
  auto d_source = to_device(source_row, stream), d_slots = to_device(slot, stream);
  auto d_gates = to_device(gate, stream);
  DeviceBuffer<bfloat16> d_xp(SD, stream);
  gpu.gather_rows(sent, d, d_x.data(), d_source.data(), d_xp.data());
  const auto got_xp = to_host(d_xp);
  for (std::size_t i = 0; i < SD; ++i) REQUIRE(got_xp[i].bits == xp[i].bits);

  const auto y = random_bf16(SD, seed + 2);
  auto d_y = to_device(y, stream);
  for (bool accumulate : {false, true}) {
    for (bool weighted : {true, false}) {
      std::vector<bfloat16> out = x;
      host.moe_combine(rows, k, d, y.data(), slot.data(), weighted ? gate.data() : nullptr, out.data(), accumulate);
      auto d_out = to_device(x, stream);
      gpu.moe_combine(rows, k, d, d_y.data(), d_slots.data(), weighted ? d_gates.data() : nullptr, d_out.data(),
                      accumulate);
      require_close(to_host(d_out), out, 1e-2, 8e-3, "moe_combine");
    }
  }

  const auto dout = random_bf16(RD, seed + 3);
  std::vector<float> dgate(RK);
  std::vector<bfloat16> dy(SD);
  host.moe_combine_backward(rows, k, d, dout.data(), y.data(), slot.data(), gate.data(), dgate.data(), dy.data());
  auto d_dout = to_device(dout, stream);
  DeviceBuffer<float> d_dgate(RK, stream);
  DeviceBuffer<bfloat16> d_dy(SD, stream);
  gpu.moe_combine_backward(rows, k, d, d_dout.data(), d_y.data(), d_slots.data(), d_gates.data(), d_dgate.data(),
                           d_dy.data());
  require_close(to_host(d_dgate), dgate, 1e-4, 1e-4, "dgate");
  require_close(to_host(d_dy), dy, 1e-2, 8e-3, "dy");

  const auto aux = trellis_gpu_test::random_vector<float>(static_cast<std::size_t>(E), seed + 4, 0.0f, 0.1f);
  std::vector<float> dlogits(RE);
  host.moe_route_backward(route, probs.data(), lse.data(), expert.data(), gate.data(), dgate.data(), aux.data(), 0.01f,
                          dlogits.data());
  auto d_probs_h = to_device(probs, stream), d_lse_h = to_device(lse, stream), d_dgate_h = to_device(dgate, stream);
  auto d_aux = to_device(aux, stream);
  DeviceBuffer<float> d_dlogits(RE, stream);
  gpu.moe_route_backward(route, d_probs_h.data(), d_lse_h.data(), d_expert_h.data(), d_gates.data(), d_dgate_h.data(),
                         d_aux.data(), 0.01f, d_dlogits.data());
  require_close(to_host(d_dlogits), dlogits, 1e-5, 1e-4, "dlogits");
  gpu.moe_route_backward(route, d_probs_h.data(), d_lse_h.data(), d_expert_h.data(), d_gates.data(), d_dgate_h.data(),
                         nullptr, 0.0f, d_dlogits.data());
  host.moe_route_backward(route, probs.data(), lse.data(), expert.data(), gate.data(), dgate.data(), nullptr, 0.0f,
                          dlogits.data());
  require_close(to_host(d_dlogits), dlogits, 1e-5, 1e-4, "dlogits without loss terms");
}

}  // namespace

TEST_CASE("backend::Cuda MoE routing equals backend::Host<bfloat16>", "[gpu][backend][moe]") {
  compare_moe(300, 8, 2, true, -1, 96, 11);                 // dropless top-2
  compare_moe(300, 8, 2, true, 40, 96, 12);                 // capacity: some copies dropped
  compare_moe(257, 64, 1, false, 3, 40, 13);                // Switch top-1, more experts than lanes
  compare_moe(4099, 16, 2, true, 300, 8, 14);               // several sort tiles and route blocks
  compare_moe(33, 4, 3, true, 0, 16, 15);                   // capacity 0: every copy dropped
  compare_moe(0, 8, 2, true, -1, 16, 16);                   // no rows
}

TEST_CASE("backend::Cuda MoE dispatch plan on random expert ids, and its workspace rule", "[gpu][backend][moe]") {
  Stream stream;
  CudaBackend gpu(stream);
  const std::int64_t rows = 20000, E = 128;
  const int k = 2;
  std::mt19937 gen(7);
  std::uniform_int_distribution<int> pick(0, static_cast<int>(E) - 1);
  std::vector<std::int32_t> expert(static_cast<std::size_t>(rows * k));
  for (auto& e : expert) e = pick(gen) % 17 == 0 ? 5 : pick(gen);  // expert 5 overloaded
  auto d_expert = to_device(expert, stream);
  DeviceBuffer<std::int32_t> d_slot(expert.size(), stream), d_source_row(expert.size(), stream), d_kept(E, stream);
  const std::size_t need = gpu.moe_dispatch_plan_workspace(rows, k, E);
  REQUIRE(need > 0);
  CHECK_THROWS_WITH(gpu.moe_dispatch_plan(rows, k, E, -1, d_expert.data(), d_slot.data(), d_source_row.data(),
                                          d_kept.data()),
                    Catch::Contains("moe_dispatch_plan needs") && Catch::Contains("reserve_workspace"));
  gpu.reserve_workspace(need);
  for (std::int64_t capacity : {std::int64_t{-1}, std::int64_t{320}, std::int64_t{1}}) {
    INFO("capacity " << capacity);
    std::vector<std::int32_t> slot(expert.size()), source_row(expert.size()), kept(E);
    const std::int64_t total =
        trellis::kernels::host::moe_dispatch_plan(rows, k, E, capacity, expert.data(), slot.data(), source_row.data(),
                                                  kept.data());
    gpu.moe_dispatch_plan(rows, k, E, capacity, d_expert.data(), d_slot.data(), d_source_row.data(), d_kept.data());
    CHECK(to_host(d_slot) == slot);
    CHECK(to_host(d_kept) == kept);
    auto got = to_host(d_source_row);
    got.resize(static_cast<std::size_t>(total));
    source_row.resize(static_cast<std::size_t>(total));
    CHECK(got == source_row);
  }
}

TEST_CASE("backend::Cuda grouped_gemm equals backend::Host<bfloat16>", "[gpu][backend][moe]") {
  namespace k = trellis::kernels;
  namespace ep = trellis::kernels::epilogue;
  using k::Op;
  Stream stream;
  CudaBackend gpu(stream);
  HostBf16 host;
  const std::int64_t d = 64, H = 128;
  const std::vector<std::int64_t> expert_rows = {37, 0, 64, 5};
  const std::int64_t El = static_cast<std::int64_t>(expert_rows.size());
  std::int64_t R = 0;
  for (auto n : expert_rows) R += n;
  const auto x = random_bf16(static_cast<std::size_t>(R * d), 21), w1 = random_bf16(static_cast<std::size_t>(El * d * H), 22, -0.2f, 0.2f);
  const auto b1 = random_bf16(static_cast<std::size_t>(El * H), 23), w2 = random_bf16(static_cast<std::size_t>(El * H * d), 24, -0.2f, 0.2f);
  const auto b2 = random_bf16(static_cast<std::size_t>(El * d), 25), dy = random_bf16(static_cast<std::size_t>(R * d), 26);
  auto d_x = to_device(x, stream), d_w1 = to_device(w1, stream), d_b1 = to_device(b1, stream);
  auto d_w2 = to_device(w2, stream), d_b2 = to_device(b2, stream), d_dy = to_device(dy, stream);
  const std::size_t RH = static_cast<std::size_t>(R * H), RD = static_cast<std::size_t>(R * d);

  // for each expert e (first row `row`, n rows) a host and a device group
  auto both = [&](auto make_host, auto make_device, auto tag) {
    using G = decltype(tag);
    std::vector<G> hg, dg;
    for (std::int64_t e = 0, row = 0; e < El; row += expert_rows[e], ++e) {
      hg.push_back(make_host(e, row, expert_rows[e]));
      dg.push_back(make_device(e, row, expert_rows[e]));
    }
    host.grouped_gemm(std::span<const G>(hg));
    gpu.grouped_gemm(std::span<const G>(dg));
  };
  using GBiasGelu = k::GemmGroup<bfloat16, bfloat16, bfloat16, ep::BiasGelu<bfloat16>>;
  using GBias = k::GemmGroup<bfloat16, bfloat16, bfloat16, ep::Bias<bfloat16>>;
  using GDGelu = k::GemmGroup<bfloat16, bfloat16, bfloat16, ep::DGelu<bfloat16>>;
  using GNone = k::GemmGroup<bfloat16, bfloat16, bfloat16, ep::None>;
  using GF32 = k::GemmGroup<bfloat16, bfloat16, float, ep::None>;

  // forward: h = gelu(x W1 + b1) with the pre-activation saved, y = h W2 + b2
  std::vector<bfloat16> h(RH), pre(RH), y(RD);
  DeviceBuffer<bfloat16> d_h(RH, stream), d_pre(RH, stream), d_y(RD, stream);
  both([&](auto e, auto row, auto n) {
         return GBiasGelu{k::gemm_args(n, H, d), x.data() + row * d, w1.data() + e * d * H, h.data() + row * H,
                          {b1.data() + e * H, pre.data() + row * H}};
       },
       [&](auto e, auto row, auto n) {
         return GBiasGelu{k::gemm_args(n, H, d), d_x.data() + row * d, d_w1.data() + e * d * H, d_h.data() + row * H,
                          {d_b1.data() + e * H, d_pre.data() + row * H}};
       },
       GBiasGelu{});
  require_close(to_host(d_pre), pre, 3e-2, 2e-2, "pre-activation");
  require_close(to_host(d_h), h, 3e-2, 2e-2, "h");
  // the next products start from the host's values, so only this product's rounding differs
  d_h = to_device(h, stream);
  d_pre = to_device(pre, stream);
  both([&](auto e, auto row, auto n) {
         return GBias{k::gemm_args(n, d, H), h.data() + row * H, w2.data() + e * H * d, y.data() + row * d,
                      {b2.data() + e * d}};
       },
       [&](auto e, auto row, auto n) {
         return GBias{k::gemm_args(n, d, H), d_h.data() + row * H, d_w2.data() + e * H * d, d_y.data() + row * d,
                      {d_b2.data() + e * d}};
       },
       GBias{});
  require_close(to_host(d_y), y, 3e-2, 2e-2, "y");

  // backward: dh = (dy W2^T) gelu'(pre), dx = dh W1^T
  std::vector<bfloat16> dh(RH), dx(RD);
  DeviceBuffer<bfloat16> d_dh(RH, stream), d_dx(RD, stream);
  both([&](auto e, auto row, auto n) {
         return GDGelu{k::gemm_args(n, H, d, Op::none, Op::transpose), dy.data() + row * d, w2.data() + e * H * d,
                       dh.data() + row * H, {pre.data() + row * H}};
       },
       [&](auto e, auto row, auto n) {
         return GDGelu{k::gemm_args(n, H, d, Op::none, Op::transpose), d_dy.data() + row * d, d_w2.data() + e * H * d,
                       d_dh.data() + row * H, {d_pre.data() + row * H}};
       },
       GDGelu{});
  require_close(to_host(d_dh), dh, 3e-2, 2e-2, "dh");
  d_dh = to_device(dh, stream);
  both([&](auto e, auto row, auto n) {
         return GNone{k::gemm_args(n, d, H, Op::none, Op::transpose), dh.data() + row * H, w1.data() + e * d * H,
                      dx.data() + row * d, {}};
       },
       [&](auto e, auto row, auto n) {
         return GNone{k::gemm_args(n, d, H, Op::none, Op::transpose), d_dh.data() + row * H, d_w1.data() + e * d * H,
                      d_dx.data() + row * d, {}};
       },
       GNone{});
  require_close(to_host(d_dx), dx, 3e-2, 2e-2, "dx");

  // weight gradients accumulated in fp32 (beta 1); expert 1 has no rows: k = 0, its gradient stays
  auto grad = trellis_gpu_test::random_vector<float>(static_cast<std::size_t>(El * d * H), 27);
  auto d_grad = to_device(grad, stream);
  both([&](auto e, auto row, auto n) {
         return GF32{k::gemm_args(d, H, n, Op::transpose, Op::none, 1.0f, 1.0f), x.data() + row * d, dh.data() + row * H,
                     grad.data() + e * d * H, {}};
       },
       [&](auto e, auto row, auto n) {
         return GF32{k::gemm_args(d, H, n, Op::transpose, Op::none, 1.0f, 1.0f), d_x.data() + row * d,
                     d_dh.data() + row * H, d_grad.data() + e * d * H, {}};
       },
       GF32{});
  require_close(to_host(d_grad), grad, 2e-3, 2e-3, "fp32 weight gradients");

  // k = 0 with an epilogue and with beta other than 0 or 1: the device pass (gemm_without_product)
  {
    const std::int64_t m = 9, n = 24;
    const auto c0 = random_bf16(static_cast<std::size_t>(m * n), 28), bias = random_bf16(static_cast<std::size_t>(n), 29);
    auto want = c0;
    std::vector<bfloat16> want_pre(c0.size());
    const GBiasGelu hg{k::gemm_args(m, n, 0, Op::none, Op::none, 1.0f, 0.5f), nullptr, nullptr, want.data(),
                       {bias.data(), want_pre.data()}};
    host.grouped_gemm(std::span<const GBiasGelu>(&hg, 1));
    auto d_c = to_device(c0, stream), d_bias = to_device(bias, stream);
    DeviceBuffer<bfloat16> d_pre0(c0.size(), stream);
    const GBiasGelu dg{hg.args, nullptr, nullptr, d_c.data(), {d_bias.data(), d_pre0.data()}};
    gpu.grouped_gemm(std::span<const GBiasGelu>(&dg, 1));
    require_close(to_host(d_c), want, 1e-2, 8e-3, "k = 0 BiasGelu C");
    require_close(to_host(d_pre0), want_pre, 1e-2, 8e-3, "k = 0 BiasGelu pre-activation");
    // the kernel-level grouped GEMM refuses it without a device pass, naming the group
    k::cuda::GemmHandle handle;
    CHECK_THROWS_WITH(k::cuda::grouped_gemm(handle, std::span<const GBiasGelu>(&dg, 1), stream),
                      Catch::Contains("group 0") && Catch::Contains("k = 0"));
    // beta 0 and None: C zeroed (NaN in C is not read)
    std::vector<bfloat16> nan_c(c0.size(), bfloat16(std::numeric_limits<float>::quiet_NaN()));
    auto d_nan = to_device(nan_c, stream);
    const GNone zero{k::gemm_args(m, n, 0), nullptr, nullptr, d_nan.data(), {}};
    k::cuda::grouped_gemm(handle, std::span<const GNone>(&zero, 1), stream);
    for (const auto& v : to_host(d_nan)) REQUIRE(static_cast<float>(v) == 0.0f);
  }
  // an empty group with a bias-gradient epilogue zeroes its vector (unless accumulate)
  {
    using GDGeluBG = k::GemmGroup<bfloat16, bfloat16, bfloat16, ep::DGeluBiasGrad<bfloat16>>;
    auto d_bg = to_device(random_bf16(32, 30), stream);
    const GDGeluBG g{k::gemm_args(0, 32, 16), d_x.data(), d_w1.data(), d_h.data(), {d_pre.data(), 0, 0, d_bg.data(), false}};
    k::cuda::GemmHandle handle;
    k::cuda::grouped_gemm(handle, std::span<const GDGeluBG>(&g, 1), stream);
    for (const auto& v : to_host(d_bg)) REQUIRE(static_cast<float>(v) == 0.0f);
  }
  gpu.synchronize();
}

// A device communicator of one rank, as far as comm::Communicator asks (gpu.backend links no
// NCCL): it lets plan::measure_link's device overload compile on backend::Cuda's buffers. (Not in
// an anonymous namespace: nvcc warns of each member it does not see called.)
namespace measured_link_test {

struct OneDeviceRank {
  struct Request {
    void wait() {}
    bool test() { return true; }
  };
  using space = trellis::Cuda;
  using request_type = Request;
  int rank() const { return 0; }
  int size() const { return 1; }
  template <class... A> void all_reduce(A&&...) {}
  template <class... A> void reduce(A&&...) {}
  template <class... A> void broadcast(A&&...) {}
  template <class... A> void all_gather(A&&...) {}
  template <class... A> void reduce_scatter(A&&...) {}
  template <class... A> void all_to_all(A&&...) {}
  template <class... A> void all_to_allv(A&&...) {}
  template <class... A> void send(A&&...) {}
  template <class... A> void recv(A&&...) {}
  void barrier() {}
  template <class... A> Request all_reduce_async(A&&...) { return {}; }
  template <class... A> Request all_gather_async(A&&...) { return {}; }
  template <class... A> Request reduce_scatter_async(A&&...) { return {}; }
  template <class... A> Request isend(A&&...) { return {}; }
  template <class... A> Request irecv(A&&...) { return {}; }
  template <class... A> Request batch(A&&...) { return {}; }
  OneDeviceRank split(int, int) { return {}; }
  void set_timeout(std::chrono::milliseconds) {}
};
static_assert(trellis::comm::Communicator<OneDeviceRank> && trellis::backend::CompatibleWith<CudaBackend, OneDeviceRank>);

}  // namespace measured_link_test

TEST_CASE("plan::BasicMeasuredRates<backend::Cuda> times a GEMM as CUDA events do", "[gpu][backend][plan]") {
  namespace k = trellis::kernels;
  Stream stream;
  CudaBackend gpu(stream);
  const std::int64_t M = 2048, N = 768, K = 768;
  trellis::plan::BasicMeasuredRates<CudaBackend> measured(5, 1, gpu);
  const double seconds = measured.gemm(M, N, K, trellis::plan::GemmForm::nn);
  CHECK(measured.timings() == 1);
  CHECK(measured.gemm(M, N, K, trellis::plan::GemmForm::nn) == seconds);  // remembered, not timed again
  CHECK(measured.timings() == 1);

  // The reference: the same GEMM (bf16, nn, bias epilogue) after a 256 MB write, which leaves none
  // of it in L2, timed by events on the stream around it alone; the best of 5.
  const auto size = [](std::int64_t n) { return static_cast<std::size_t>(n); };
  const auto a = to_device(std::vector<bfloat16>(size(M * K), bfloat16(0.5f)), stream);
  const auto b = to_device(std::vector<bfloat16>(size(K * N), bfloat16(0.25f)), stream);
  const auto bias = to_device(std::vector<bfloat16>(size(N), bfloat16(0.125f)), stream);
  DeviceBuffer<bfloat16> c(size(M * N), stream);
  DeviceBuffer<float> flush(std::size_t{1} << 26, stream);
  const auto args = k::gemm_args(M, N, K);
  auto run = [&] { gpu.gemm(args, a.data(), b.data(), c.data(), k::epilogue::Bias<bfloat16>{bias.data()}); };
  run();  // warm-up: the cuBLASLt plan
  cudaEvent_t start = nullptr, stop = nullptr;
  TRELLIS_CHECK_CUDA(cudaEventCreate(&start));
  TRELLIS_CHECK_CUDA(cudaEventCreate(&stop));
  float best_ms = std::numeric_limits<float>::max();
  for (int r = 0; r < 5; ++r) {
    TRELLIS_CHECK_CUDA(cudaMemsetAsync(flush.data(), 0, flush.size() * sizeof(float), stream));
    TRELLIS_CHECK_CUDA(cudaEventRecord(start, stream));
    run();
    TRELLIS_CHECK_CUDA(cudaEventRecord(stop, stream));
    TRELLIS_CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    TRELLIS_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    best_ms = std::min(best_ms, ms);
  }
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  const double events = 1e-3 * best_ms;
  INFO("BasicMeasuredRates: " << seconds * 1e6 << " us; CUDA events: " << events * 1e6 << " us");
  CHECK(seconds >= 0.5 * events);
  CHECK(seconds <= 2.0 * events);

  // a device's rates: no thread copies (a rank has the device to itself), no host-side rates
  CHECK_THROWS_WITH(trellis::plan::BasicMeasuredRates<CudaBackend>(1, 2, gpu), Catch::Contains("concurrent = 2"));
  const trellis::plan::Rates rates = measured.rates();
  CHECK(!rates.host_adamw);
  CHECK(rates.collective_copy_bytes == 0);
  // measure_link over a device communicator: compiled on backend::Cuda's buffers; one rank refused
  measured_link_test::OneDeviceRank one;
  CHECK_THROWS_WITH(trellis::plan::measure_link(gpu, one), Catch::Contains("no link to measure"));
  gpu.synchronize();
}
