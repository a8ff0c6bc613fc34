// The CUDA trainer path (nn::FlatGpt / train::FlatTrainer with backend::Cuda: bf16 compute, fp32 master
// weights) against the host fp32 reference (nn::GptModel, train::Trainer on one thread rank):
//  - the same config and seed give bit-identical initial fp32 parameters on the device;
//  - one forward + backward: loss within 5e-3 relative, every gradient within 5e-2 norm-relative;
//  - two training steps (AdamW, clipping, LR schedule): both losses within 5e-3 relative and the
//    trained weights within 2e-2 norm-relative per tensor (5e-2 for the zero-initialised biases).
// The same tolerances hold for bf16 rounding alone: tests/train/test_flat_trainer.cpp runs the
// identical comparison with backend::Host<bfloat16> on the host.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "support/gpu_test.hpp"
#include "train/test_trainer_support.hpp"
#include "trellis/backend/cuda.cuh"
#include "trellis/nn/flat_gpt.hpp"
#include "trellis/train/flat_trainer.hpp"

using CudaBackend = trellis::backend::Cuda;
using trellis::nn::FlatGpt;
using trellis::train::FlatTrainer;
using trellis_gpu_test::Stream;
using namespace trainer_test;

using nn_test::norm_relative;

namespace {

// tiny_config with a head size the CUDA attention takes (64) and a sequence of one tile.
TrainerConfig cuda_tiny() {
  TrainerConfig c = tiny_config();
  c.model.layers = 2;
  c.model.heads = 2;
  c.model.width = 128;
  c.model.positions = 64;
  c.seq = 64;
  c.batch = 4;
  return c;
}

}  // namespace

TEST_CASE("CUDA FlatGpt: loss and gradients of one step match the host fp32 model", "[gpu][flat_gpt]") {
  const TrainerConfig cfg = cuda_tiny();
  trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, 0, 1});
  const auto batch = loader.next();
  const double count = static_cast<double>(batch.rows * batch.seq_len);

  std::map<std::string, std::vector<float>> ref_values, ref_grads;
  double ref_loss = 0;
  nn_test::run_ranks(1, [&](ThreadComm& comm) {
    trellis::nn::GptModel<ThreadComm> model(cfg.model, comm, cfg.options);
    trellis::nn::TokenShape shape{batch.rows, batch.seq_len, 0};
    // GptModel takes (batch, seq) tokens, as FlatGpt
    trellis::nn::StageInput in{batch.inputs.data(), nullptr, batch.targets.data(), count};
    ref_loss = model.forward(0, shape, in, nullptr);
    model.backward_input(0, shape, nullptr, nullptr);
    model.backward_weight(0);
    for (auto* p : model.parameters()) ref_values[p->name].assign(p->value.begin(), p->value.end()), ref_grads[p->name].assign(p->grad.begin(), p->grad.end());
  });

  Stream stream;
  FlatGpt<CudaBackend> gpu(cfg.model, cfg.options, CudaBackend(stream));
  for (const auto& t : gpu.tensors()) {
    INFO(t.name);
    CHECK(gpu.value(t.name) == ref_values.at(t.name));
  }
  gpu.zero_grad();
  const double loss = gpu.forward_backward({batch.rows, batch.seq_len}, batch.inputs.data(), batch.targets.data(), count);
  INFO("cuda loss " << loss << " host fp32 " << ref_loss);
  CHECK(std::fabs(loss - ref_loss) <= 5e-3 * std::fabs(ref_loss));
  for (const auto& t : gpu.tensors()) {
    const double err = norm_relative(gpu.grad(t.name), ref_grads.at(t.name));
    INFO(t.name << ": norm-relative gradient error " << err);
    CHECK(err <= 5e-2);
  }
}

TEST_CASE("CUDA FlatTrainer: two steps match the host Trainer within bf16 tolerance", "[gpu][flat_gpt][trainer]") {
  const TrainerConfig cfg = cuda_tiny();
  const int steps = 2;
  RunResult ref;
  nn_test::Collector ref_weights;
  train(cfg, steps, ref, ref_weights);

  Stream stream;
  FlatTrainer<CudaBackend> t(cfg, CudaBackend(stream));
  trellis::train::DataLoader loader(tokens(), {cfg.batch, cfg.seq, 99, true, 0, 1});
  for (int s = 0; s < steps; ++s) {
    const double loss = t.step(loader.next()).loss;
    INFO("step " << s << ": cuda " << loss << " host " << ref.losses[s]);
    CHECK(std::fabs(loss - ref.losses[s]) <= 5e-3 * std::fabs(ref.losses[s]));
  }
  for (const auto& ten : t.model().tensors()) {
    const double err = norm_relative(t.model().value(ten.name), ref_weights.get(ten.name));
    INFO(ten.name << ": norm-relative weight error " << err);
    CHECK(err <= 2e-2);
  }
}

TEST_CASE("backend::Cuda head permutes equal backend::Host's, both row orders", "[gpu][backend]") {
  Stream stream;
  CudaBackend gpu(stream);
  trellis::backend::Host<trellis::bfloat16> host;
  const std::int64_t B = 2, T = 7, H = 3, D = 8, ld = 3 * H * D;
  const auto values = trellis_gpu_test::random_vector<float>(static_cast<std::size_t>(B * T * ld), 5);
  std::vector<trellis::bfloat16> rows(values.begin(), values.end());
  for (auto order : {trellis::kernels::RowOrder::sequence_major, trellis::kernels::RowOrder::batch_major}) {
    const trellis::kernels::HeadsLayout l{B, T, H, D, order};
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
