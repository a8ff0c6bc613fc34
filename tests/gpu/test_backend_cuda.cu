// backend::Cuda's own pieces against backend::Host<bfloat16>: the head permutes (bitwise, both
// directions) and the workspace discipline (a kernel whose workspace was not reserved at set-up is
// refused). The layers and the Trainer on backend::Cuda: test_layers_cuda.cu, test_trainer_cuda.cu.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "support/gpu_test.hpp"
#include "trellis/backend/cuda.cuh"
#include "trellis/backend/host.hpp"

using CudaBackend = trellis::backend::Cuda;
using trellis_gpu_test::Stream;

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
