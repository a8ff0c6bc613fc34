// backend::Host<float | bfloat16> and the Backend / CompatibleWith concepts.
//  - compile time: both host backends model Backend; a host backend agrees with ThreadComm and
//    refuses a communicator whose buffers live in CUDA memory;
//  - the head permutes against the index formula written out here (sequence-major rows), and their
//    round trip;
//  - Host<bfloat16>::convert rounds like bfloat16's own conversion (round to nearest even);
//  - workspace: queries answer 0 on the host, reserve_workspace only grows;
//  - backend::DeviceChecked: kernels refuse host pointers (naming the kernel and argument),
//    upload/download refuse swapped sides, buffers unregister when freed, results equal the inner
//    backend's, a kernel needing more workspace than reserved is refused, and parameters packed
//    with it refuse host element access; the grouped GEMM and MoE routing methods likewise (equal
//    to Host<float>'s bit for bit, host pointers refused, the dispatch plan's workspace checked).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>
#include <span>
#include <type_traits>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "trellis/backend.hpp"
#include "trellis/backend/device_checked.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/nn/parameter_buffer.hpp"

using namespace trellis;

namespace {

// A communicator type that names CUDA memory (only its space matters to CompatibleWith).
struct CudaSpaceComm {
  using space = trellis::Cuda;
};

static_assert(backend::Backend<backend::Host<float>>);
static_assert(backend::Backend<backend::Host<bfloat16>>);
static_assert(backend::CompatibleWith<backend::Host<float>, comm::ThreadComm>);
static_assert(backend::CompatibleWith<backend::Host<bfloat16>, comm::ThreadComm>);
static_assert(!backend::CompatibleWith<backend::Host<float>, CudaSpaceComm>);
static_assert(!backend::Backend<int>);

}  // namespace

TEST_CASE("head permutes follow the [batch, heads, seq, head_dim] formula", "[backend]") {
  const std::int64_t B = 3, T = 5, H = 2, D = 4, ld = 3 * H * D + 2;  // a q/k/v-packed row with padding
  backend::Host<float> be;
  const kernels::HeadsLayout l{B, T, H, D};
  std::vector<float> rows(static_cast<std::size_t>(B * T * ld));
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>(i) + 0.5f;
  const std::int64_t col0 = H * D;  // the k columns of the packed row
  std::vector<float> heads(static_cast<std::size_t>(l.elements()), -1.0f);
  be.rows_to_heads(l, rows.data() + col0, ld, heads.data());
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < T; ++t)
        for (std::int64_t d = 0; d < D; ++d) {
          const std::int64_t i = ((b * H + h) * T + t) * D + d;
          const std::int64_t r = t * B + b;  // the layers' sequence-major rows
          REQUIRE(heads[static_cast<std::size_t>(i)] == rows[static_cast<std::size_t>(r * ld + col0 + h * D + d)]);
          // the device kernels use HeadsLayout::row_offset: it must be the same map
          REQUIRE(l.row_offset(i, ld) == r * ld + h * D + d);
        }
  std::vector<float> back(rows.size(), 0.0f);
  be.heads_to_rows(l, heads.data(), back.data() + col0, ld);
  for (std::int64_t r = 0; r < B * T; ++r)
    for (std::int64_t c = 0; c < H * D; ++c)
      REQUIRE(back[static_cast<std::size_t>(r * ld + col0 + c)] == rows[static_cast<std::size_t>(r * ld + col0 + c)]);
  REQUIRE(back[0] == 0.0f);  // columns outside the heads are not written
}

TEST_CASE("Host<bfloat16>::convert rounds to nearest even like bfloat16", "[backend]") {
  backend::Host<bfloat16> be;
  // 1 + 2^-8 is halfway between two bf16 values: ties go to the even mantissa (1.0);
  // 1 + 3 * 2^-8 ties upward to 1 + 2^-6.
  const std::vector<float> x{1.0f + 0x1.0p-8f, 1.0f + 3 * 0x1.0p-8f, -2.5f, 3.0e-3f, 65504.0f};
  std::vector<bfloat16> y(x.size());
  be.convert(x.size(), x.data(), y.data());
  CHECK(static_cast<float>(y[0]) == 1.0f);
  CHECK(static_cast<float>(y[1]) == 1.0f + 0x1.0p-6f);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(y[i].bits == bfloat16(x[i]).bits);
}

TEST_CASE("host workspace: queries are 0 and reservations only grow", "[backend]") {
  backend::Host<float> be;
  kernels::AttentionArgs a;
  a.batch = 2, a.q_heads = a.kv_heads = 4, a.q_len = a.kv_len = 64, a.head_dim = 16;
  CHECK(be.attention_backward_workspace(a) == 0);
  CHECK(be.layernorm_backward_workspace(128, 64) == 0);
  CHECK(be.workspace_reserved() == 0);
  be.reserve_workspace(100);
  be.reserve_workspace(10);
  CHECK(be.workspace_reserved() == 100);
}

TEST_CASE("DeviceChecked: kernels take only backend memory, and compute like the inner backend", "[backend][device]") {
  using Checked = backend::DeviceChecked<backend::Host<float>>;
  static_assert(backend::CompatibleWith<Checked, comm::ThreadComm> && !Checked::host_readable);
  Checked be;
  const std::vector<float> a_host = {1, -2, 3, 4}, b_host = {0.5f, 0.25f, -1, 2};
  auto a = be.allocate<float>(4), b = be.allocate<float>(4), out = be.allocate<float>(4);
  CHECK(be.registry().allocations() == 3);
  be.upload(a.data(), a_host.data(), 4);
  be.upload(b.data(), b_host.data(), 4);
  be.add(index_t{4}, a.data(), b.data(), out.data());
  const auto got = backend::download_vector(be, out.data(), 4);
  std::vector<float> want(4);
  backend::Host<float>{}.add(index_t{4}, a_host.data(), b_host.data(), want.data());
  CHECK(got == want);
  CHECK(be.sum(out.data(), 4) == Approx(7.75));
  // a host pointer where the kernel needs device memory: refused, naming the kernel and argument
  std::vector<float> host(4);
  CHECK_THROWS_WITH(be.add(index_t{4}, a.data(), host.data(), out.data()),
                    Catch::Contains("add argument 2 of (a, b, out)") && Catch::Contains("not backend memory"));
  CHECK_THROWS_WITH(be.upload(host.data(), a.data(), 4), Catch::Contains("upload argument 1 of (dst)"));
  CHECK_THROWS_WITH(be.download(a.data(), b.data(), 4), Catch::Contains("download dst is backend memory"));
  CHECK_THROWS_WITH(be.copy(out.data(), host.data(), 4), Catch::Contains("copy argument 1 of (src)"));
  const std::vector<std::span<const float>> grads = {std::span<const float>(host)};
  CHECK_THROWS_WITH(be.sum_of_squares(grads), Catch::Contains("sum_of_squares"));
  // freed memory leaves the registry (a stale pointer is then refused like a host one)
  a = Checked::buffer<float>{};
  CHECK(be.registry().allocations() == 2);
  // copies of the backend share the registry (a model and its trainer hold copies)
  Checked copy = be;
  CHECK(copy.owns(b.data()));
  // workspace as on CUDA: a kernel whose query exceeds the shared reservation is refused
  auto sums = be.allocate<float>(2);
  CHECK(be.column_sums_workspace(2, 2) > 0);  // a stand-in size: the host kernel needs none
  CHECK_THROWS_WITH(be.column_sums(2, 2, 2, b.data(), sums.data()), Catch::Contains("column_sums needs") &&
                                                                      Catch::Contains("reserve_workspace"));
  copy.reserve_workspace(be.column_sums_workspace(2, 2));
  be.column_sums(2, 2, 2, b.data(), sums.data());  // b = (2, 2) rows {0.5, 0.25}, {-1, 2}
  CHECK(backend::download_vector(be, sums.data(), 2) == std::vector<float>{-0.5f, 2.25f});
}

TEST_CASE("DeviceChecked: packed parameters live in backend memory and refuse host access", "[backend][device]") {
  using Checked = backend::DeviceChecked<backend::Host<float>>;
  Checked be;
  nn::Parameter w = nn::make_parameter("w", {3, 5}), bias = nn::make_parameter("b", {5});
  for (index_t i = 0; i < w.numel(); ++i) w.value[static_cast<std::size_t>(i)] = static_cast<float>(i);
  bias.value.fill(-1.0f);
  std::vector<nn::Parameter*> order = {&bias, &w};
  nn::ParameterBuffer<Checked> packed(order, 16, be);
  CHECK(be.owns(w.value.data()));
  CHECK(be.owns(bias.grad.data()));
  CHECK_FALSE(w.value.host_readable());
  CHECK_THROWS_WITH(w.value[0], Catch::Contains("device memory"));
  CHECK_THROWS_WITH(bias.grad.fill(0.0f), Catch::Contains("device memory"));
  // the values were uploaded: a download gives them back
  const auto got = backend::download_vector(be, w.value.data(), w.value.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == static_cast<float>(i));
  CHECK(backend::download_vector(be, bias.value.data(), 5) == std::vector<float>(5, -1.0f));
  // on a host backend the same packing stays host-readable
  nn::Parameter h = nn::make_parameter("h", {4});
  std::vector<nn::Parameter*> host_order = {&h};
  nn::ParameterBuffer<> host_packed(host_order);
  CHECK(h.value.host_readable());
  CHECK(h.value[3] == 0.0f);
}

TEST_CASE("DeviceChecked: grouped GEMM and MoE routing take only backend memory, and equal Host's", "[backend][device][moe]") {
  using Checked = backend::DeviceChecked<backend::Host<float>>;
  using Group = kernels::GemmGroup<float, float, float, kernels::epilogue::None>;
  using BiasGroup = kernels::GemmGroup<float, float, float, kernels::epilogue::Bias<float>>;
  Checked be;
  backend::Host<float> host;
  auto up = [&](const auto& v) {
    using T = typename std::remove_cvref_t<decltype(v)>::value_type;
    auto b = be.template allocate<T>(v.size());
    be.upload(b.data(), v.data(), v.size());
    return b;
  };
  auto values = [](std::size_t n, float scale, float shift) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = scale * static_cast<float>((i * 7919 + 13) % 23) / 23.0f + shift;
    return v;
  };
  const index_t rows = 7, E = 4, d = 3;
  const int k = 2;
  const kernels::MoeRouteArgs route{rows, E, k, true};
  const std::size_t RE = static_cast<std::size_t>(rows * E), RK = static_cast<std::size_t>(rows * k);

  // route forward
  const auto logits_h = values(RE, 4.0f, -2.0f);
  auto logits = up(logits_h);
  auto probs = be.allocate<float>(RE), lse = be.allocate<float>(rows), gate = be.allocate<float>(RK);
  auto prob_sums = be.allocate<float>(E);
  auto expert = be.allocate<std::int32_t>(RK), routed = be.allocate<std::int32_t>(E);
  be.moe_route_forward(route, logits.data(), probs.data(), lse.data(), expert.data(), gate.data(), routed.data(),
                       prob_sums.data());
  std::vector<float> probs_h(RE), lse_h(rows), gate_h(RK), prob_sums_h(E);
  std::vector<std::int32_t> expert_h(RK), routed_h(E);
  host.moe_route_forward(route, logits_h.data(), probs_h.data(), lse_h.data(), expert_h.data(), gate_h.data(),
                         routed_h.data(), prob_sums_h.data());
  CHECK(backend::download_vector(be, probs.data(), RE) == probs_h);
  CHECK(backend::download_vector(be, lse.data(), lse.size()) == lse_h);
  CHECK(backend::download_vector(be, expert.data(), RK) == expert_h);
  CHECK(backend::download_vector(be, gate.data(), RK) == gate_h);
  CHECK(backend::download_vector(be, routed.data(), routed.size()) == routed_h);
  CHECK(backend::download_vector(be, prob_sums.data(), prob_sums.size()) == prob_sums_h);

  // dispatch plan (capacity 2 of up to 14 copies: some are dropped); refused without workspace
  const index_t capacity = 2;
  auto slot = be.allocate<std::int32_t>(RK), source_row = be.allocate<std::int32_t>(RK), kept = be.allocate<std::int32_t>(E);
  const std::size_t plan_bytes = be.moe_dispatch_plan_workspace(rows, k, E);
  CHECK(plan_bytes > 0);  // a stand-in: the host kernel needs none
  CHECK(host.moe_dispatch_plan_workspace(rows, k, E) == 0);
  CHECK(be.moe_dispatch_plan_workspace(rows, k, 2 * E) > plan_bytes);
  CHECK_THROWS_WITH(be.moe_dispatch_plan(rows, k, E, capacity, expert.data(), slot.data(), source_row.data(), kept.data()),
                    Catch::Contains("moe_dispatch_plan needs") && Catch::Contains("reserve_workspace"));
  be.reserve_workspace(plan_bytes);
  be.moe_dispatch_plan(rows, k, E, capacity, expert.data(), slot.data(), source_row.data(), kept.data());
  std::vector<std::int32_t> slot_h(RK), source_row_h(RK, 0), kept_h(E);
  host.moe_dispatch_plan(rows, k, E, capacity, expert_h.data(), slot_h.data(), source_row_h.data(), kept_h.data());
  CHECK(backend::download_vector(be, slot.data(), RK) == slot_h);
  CHECK(backend::download_vector(be, kept.data(), kept.size()) == kept_h);
  index_t sent = 0;
  for (auto v : kept_h) sent += v;
  REQUIRE(sent > 0);
  REQUIRE(sent < rows * k);  // the capacity dropped some copies
  source_row_h.resize(static_cast<std::size_t>(sent));
  CHECK(backend::download_vector(be, source_row.data(), source_row_h.size()) == source_row_h);

  // gather the kept copies' rows, combine, combine backward
  const auto x_h = values(static_cast<std::size_t>(rows * d), 2.0f, -1.0f);
  auto x = up(x_h);
  const std::size_t SD = static_cast<std::size_t>(sent * d);
  auto xp = be.allocate<float>(SD);
  be.gather_rows(sent, d, x.data(), source_row.data(), xp.data());
  std::vector<float> xp_h(SD);
  host.gather_rows(sent, d, x_h.data(), source_row_h.data(), xp_h.data());
  CHECK(backend::download_vector(be, xp.data(), SD) == xp_h);

  const auto y_h = values(SD, 1.5f, -0.5f);
  auto y = up(y_h);
  auto out = up(x_h);  // accumulate onto x
  be.moe_combine(rows, k, d, y.data(), slot.data(), gate.data(), out.data(), true);
  std::vector<float> out_h = x_h;
  host.moe_combine(rows, k, d, y_h.data(), slot_h.data(), gate_h.data(), out_h.data(), true);
  CHECK(backend::download_vector(be, out.data(), out_h.size()) == out_h);

  const auto dout_h = values(static_cast<std::size_t>(rows * d), 1.0f, -0.25f);
  auto dout = up(dout_h);
  auto dgate = be.allocate<float>(RK), dy = be.allocate<float>(SD);
  be.moe_combine_backward(rows, k, d, dout.data(), y.data(), slot.data(), gate.data(), dgate.data(), dy.data());
  std::vector<float> dgate_h(RK), dy_h(SD);
  host.moe_combine_backward(rows, k, d, dout_h.data(), y_h.data(), slot_h.data(), gate_h.data(), dgate_h.data(),
                            dy_h.data());
  CHECK(backend::download_vector(be, dgate.data(), RK) == dgate_h);
  CHECK(backend::download_vector(be, dy.data(), SD) == dy_h);

  // route backward, with the load-balancing and z-loss terms
  const auto aux_h = values(static_cast<std::size_t>(E), 0.1f, 0.0f);
  auto aux = up(aux_h);
  auto dlogits = be.allocate<float>(RE);
  be.moe_route_backward(route, probs.data(), lse.data(), expert.data(), gate.data(), dgate.data(), aux.data(), 0.01f,
                        dlogits.data());
  std::vector<float> dlogits_h(RE);
  host.moe_route_backward(route, probs_h.data(), lse_h.data(), expert_h.data(), gate_h.data(), dgate_h.data(),
                          aux_h.data(), 0.01f, dlogits_h.data());
  CHECK(backend::download_vector(be, dlogits.data(), RE) == dlogits_h);

  // grouped GEMM: three experts' rows (one empty), bias epilogue; then an fp32 accumulation with a
  // k = 0 group (no rows: C stays)
  const index_t H = 5;
  const std::vector<index_t> expert_rows = {3, 0, 4};
  const auto w_h = values(static_cast<std::size_t>(3 * d * H), 1.0f, -0.5f), b_h = values(static_cast<std::size_t>(3 * H), 0.5f, 0.0f);
  const auto xe_h = values(static_cast<std::size_t>(7 * d), 2.0f, -1.0f);
  auto w = up(w_h), bias = up(b_h), xe = up(xe_h);
  auto h = be.allocate<float>(static_cast<std::size_t>(7 * H));
  std::vector<float> h_h(static_cast<std::size_t>(7 * H));
  std::vector<BiasGroup> groups, groups_h;
  for (index_t e = 0, row = 0; e < 3; row += expert_rows[e], ++e) {
    const auto args = kernels::gemm_args(expert_rows[e], H, d);
    groups.push_back({args, xe.data() + row * d, w.data() + e * d * H, h.data() + row * H, {bias.data() + e * H}});
    groups_h.push_back({args, xe_h.data() + row * d, w_h.data() + e * d * H, h_h.data() + row * H, {b_h.data() + e * H}});
  }
  be.grouped_gemm(std::span<const BiasGroup>(groups));
  host.grouped_gemm(std::span<const BiasGroup>(groups_h));
  CHECK(backend::download_vector(be, h.data(), h_h.size()) == h_h);
  auto grad = up(w_h);  // accumulate into "weight gradients"
  std::vector<float> grad_h = w_h;
  std::vector<Group> wgrad, wgrad_h;
  for (index_t e = 0, row = 0; e < 3; row += expert_rows[e], ++e) {
    const auto args = kernels::gemm_args(d, H, expert_rows[e], kernels::Op::transpose, kernels::Op::none, 1.0f, 1.0f);
    wgrad.push_back({args, xe.data() + row * d, h.data() + row * H, grad.data() + e * d * H, {}});
    wgrad_h.push_back({args, xe_h.data() + row * d, h_h.data() + row * H, grad_h.data() + e * d * H, {}});
  }
  be.grouped_gemm(std::span<const Group>(wgrad));
  host.grouped_gemm(std::span<const Group>(wgrad_h));
  CHECK(backend::download_vector(be, grad.data(), grad_h.size()) == grad_h);

  // a host pointer in place of backend memory: refused by every new method
  std::vector<float> hf(64);
  std::vector<std::int32_t> hi(64);
  CHECK_THROWS_WITH(be.moe_route_forward(route, logits.data(), probs.data(), lse.data(), hi.data(), gate.data(),
                                         routed.data(), prob_sums.data()),
                    Catch::Contains("moe_route_forward argument 4") && Catch::Contains("not backend memory"));
  CHECK_THROWS_WITH(be.moe_dispatch_plan(rows, k, E, capacity, expert.data(), slot.data(), hi.data(), kept.data()),
                    Catch::Contains("moe_dispatch_plan argument 3"));
  CHECK_THROWS_WITH(be.gather_rows(sent, d, x.data(), hi.data(), xp.data()), Catch::Contains("gather_rows argument 2"));
  CHECK_THROWS_WITH(be.moe_combine(rows, k, d, y.data(), slot.data(), hf.data(), out.data(), false),
                    Catch::Contains("moe_combine argument 3"));
  CHECK_THROWS_WITH(be.moe_combine_backward(rows, k, d, hf.data(), y.data(), slot.data(), gate.data(), dgate.data(),
                                            dy.data()),
                    Catch::Contains("moe_combine_backward argument 1"));
  CHECK_THROWS_WITH(be.moe_route_backward(route, probs.data(), lse.data(), expert.data(), gate.data(), dgate.data(),
                                          hf.data(), 0.0f, dlogits.data()),
                    Catch::Contains("moe_route_backward argument 6"));
  std::vector<BiasGroup> bad = groups;
  bad[2].b = hf.data();
  CHECK_THROWS_WITH(be.grouped_gemm(std::span<const BiasGroup>(bad)), Catch::Contains("grouped_gemm argument 2"));
  bad = groups;
  bad[0].ep.bias = hf.data();
  CHECK_THROWS_WITH(be.grouped_gemm(std::span<const BiasGroup>(bad)), Catch::Contains("grouped_gemm epilogue"));
}

// Subnormals (core/subnormals.hpp): a thread that makes a backend::Host, the kernel pool's workers
// and a thread started after the backend flush them to zero, so a product below the smallest
// normal float is 0 on all of them (IEEE arithmetic, as a fresh thread without the mode computes
// it, keeps it: the check can fail), and a subnormal operand reads as 0.
TEST_CASE("the host backend flushes subnormals to zero on its threads", "[backend][host][subnormals]") {
#if defined(__x86_64__) || defined(_M_X64)
  auto flushes = [] {
    volatile float a = 1e-30f, b = 1e-10f, tiny = std::numeric_limits<float>::denorm_min();
    return a * b == 0.0f && tiny + 0.0f == 0.0f;
  };
  bool kept = false;
  std::thread([&] {  // the default mode keeps subnormals
    _mm_setcsr(_mm_getcsr() & ~0x8040u);
    kept = !flushes();
  }).join();
  CHECK(kept);
  _mm_setcsr(_mm_getcsr() & ~0x8040u);  // as a thread that never made a backend
  CHECK_FALSE(trellis::subnormals_flushed_on_this_thread());
  const trellis::backend::Host<float> be;
  CHECK(trellis::subnormals_flushed_on_this_thread());
  CHECK(flushes());
  std::atomic<int> flushed{0};
  trellis::kernels::host::kernel_pool().parallel_for(64, [&](std::int64_t) {
    flushed += flushes() ? 1 : 0;
    std::this_thread::sleep_for(std::chrono::microseconds(100));  // spread the tasks over the workers
  });
  CHECK(flushed.load() == 64);
  bool later = false;
  std::thread([&] { later = flushes(); }).join();
  CHECK(later);
#else
  WARN("flushing subnormals is x86-64 only so far: not checked");
#endif
}
