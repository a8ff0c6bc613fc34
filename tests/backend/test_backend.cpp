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
//    with it refuse host element access.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

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
