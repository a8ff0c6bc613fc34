// GPT-2 124M training throughput on one GPU: train::Trainer<comm::NcclComm, backend::Cuda>, the
// one model stack, on a one-rank NCCL communicator (bf16 compute, fp32 master weights, AdamW,
// clipping), synthetic tokens. Prints ms/step, tokens/s and MFU against the GPU's dense bf16 peak
// (989 TFLOP/s for H100/H200 SXM, 312 for A100; --peak-tflops to state another), model FLOPs as
// llm.c counts them: 6 N + 12 L C T per token. llm.c reports about 50% MFU for this model on an H100.
//   gpu_train_gpt2 [--json FILE] [--quick] [--batch B] [--seq T] [--peak-tflops P]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "support/cuda_device.hpp"
#include "support/report.hpp"
#include "trellis/backend/cuda.cuh"
#include "trellis/comm/nccl.hpp"
#include "trellis/train/metrics.hpp"
#include "trellis/train/trainer.hpp"

using trellis::bench::double_flag;
using trellis::bench::int_flag;

int main(int argc, char** argv) {
  const std::string json = trellis::bench::json_path(argc, argv);
  const bool quick = trellis::bench::has_flag(argc, argv, "--quick");
  const auto device = trellis::bench::first_cuda_device("gpu_train_gpt2");
  if (!device) return 0;
  const cudaDeviceProp& prop = *device;
  double peak = double_flag(argc, argv, "--peak-tflops", 0) * 1e12;
  const std::string name = prop.name;
  if (peak <= 0) peak = (name.find("H100") != std::string::npos || name.find("H200") != std::string::npos ||
                         name.find("H800") != std::string::npos || name.find("GH200") != std::string::npos)
                            ? 989e12
                            : (prop.major == 8 && prop.minor == 0 ? 312e12 : 0);

  trellis::train::TrainerConfig cfg;
  cfg.model = {.vocab = 50257, .positions = 1024, .layers = 12, .heads = 12, .width = 768};
  cfg.seq = int_flag(argc, argv, "--seq", 1024);
  cfg.batch = int_flag(argc, argv, "--batch", quick ? 4 : 16);
  cfg.microbatches = 1;
  cfg.adamw.lr = 6e-4f;
  cfg.lr = {.max_lr = 6e-4, .min_lr = 6e-5, .warmup_steps = 10, .total_steps = 1000};

  trellis::bench::JsonReport report("gpu_train_gpt2");
  {
    // One rank on GPU 0; the Trainer's kernels and collectives run on the communicator's stream, as
    // in train_gpt --backend cuda (examples/train_gpt/cuda_backend.cu).
    auto comms = trellis::comm::NcclComm::init_all(std::vector<int>{0}, "gpu_train_gpt2");
    auto& comm = comms.front();
    trellis::train::Trainer<trellis::comm::NcclComm, trellis::backend::Cuda> trainer(
        comm, cfg, trellis::backend::Cuda(comm.stream()));
    const double n_params = trainer.global_parameter_count();
    std::printf("# gpu_train_gpt2 on %s: GPT-2 124M (%.1fM parameters), B=%lld T=%lld, bf16 compute, fp32 master\n",
                prop.name, n_params / 1e6, (long long)cfg.batch, (long long)cfg.seq);
    // Synthetic tokens: a fixed pseudo-random stream (the work does not depend on the values).
    trellis::train::Batch batch;
    batch.rows = cfg.batch, batch.seq_len = cfg.seq;
    batch.inputs.resize(static_cast<std::size_t>(cfg.batch * cfg.seq));
    batch.targets.resize(batch.inputs.size());
    std::uint64_t x = 12345;
    for (std::size_t i = 0; i < batch.inputs.size(); ++i) {
      x = x * 6364136223846793005ULL + 1442695040888963407ULL;
      batch.inputs[i] = static_cast<std::int32_t>((x >> 33) % 50257);
    }
    for (std::size_t i = 0; i < batch.inputs.size(); ++i)
      batch.targets[i] = batch.inputs[(i + 1) % batch.inputs.size()];

    const int warmup = 2, steps = quick ? 3 : 10;
    double first_loss = 0, last_loss = 0;
    for (int s = 0; s < warmup; ++s) first_loss = trainer.step(batch).loss;
    TRELLIS_CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<double> times;
    for (int s = 0; s < steps; ++s) {
      const double t0 = trellis::bench::now_seconds();
      last_loss = trainer.step(batch).loss;
      // The loss is downloaded before the optimizer update, which is still queued: wait for it.
      TRELLIS_CHECK_CUDA(cudaDeviceSynchronize());
      times.push_back(trellis::bench::now_seconds() - t0);
    }
    std::sort(times.begin(), times.end());
    const double median = times[times.size() / 2];
    const double tokens = static_cast<double>(cfg.batch * cfg.seq);
    const double tok_s = tokens / median;
    const double fpt = trellis::train::gpt_flops_per_token(n_params, static_cast<int>(cfg.model.layers),
                                                           static_cast<int>(cfg.model.width), static_cast<int>(cfg.seq));
    const double mfu = peak > 0 ? fpt * tok_s / peak : 0;
    std::printf("%10s %12s %10s %12s %8s | loss %.4f -> %.4f (same batch repeated)\n", "ms/step", "tokens/s",
                "TFLOP/s", "peak TFLOP/s", "MFU", first_loss, last_loss);
    std::printf("%10.2f %12.0f %10.1f %12.0f %7.1f%%\n", median * 1e3, tok_s, fpt * tok_s / 1e12, peak / 1e12, mfu * 100);
    std::printf("dGELU epilogue: %s\n", trainer.backend().dgelu_fused() ? "fused into cuBLASLt" : "separate pass (cuBLASLt refused it)");
    trellis::bench::Row row;
    row.add("batch", (long long)cfg.batch).add("seq", (long long)cfg.seq).add("ms_per_step", median * 1e3, "%.3f");
    row.add("tokens_per_s", tok_s, "%.0f").add("model_tflops", fpt * tok_s / 1e12).add("peak_tflops", peak / 1e12);
    row.add("mfu", mfu, "%.4f").add("dgelu_fused", trainer.backend().dgelu_fused() ? 1LL : 0LL).add("loss_first", first_loss, "%.4f").add("loss_last", last_loss, "%.4f");
    report.add(row);
  }
  TRELLIS_CHECK_CUDA(cudaDeviceSynchronize());
  report.write(json);
  return 0;
}
