// One training step of the GPT-2 124M shape (12 layers, 12 heads, width 768, vocab 50257,
// T = 64, B = 4: 256 tokens) through train::Trainer on one host rank in fp32 (forward, backward,
// global-norm clip, AdamW over all 124 M parameters), side by side with, in the same run:
//  (a) the floor: the step's matrix products (c_attn, attn c_proj, c_fc, mlp c_proj per block
//      and the tied LM head, each forward product with its two backward products) as bare
//      cblas_sgemm calls of the same shapes; attention's T x T products (0.3 % of the FLOPs at
//      T = 64) and every non-GEMM pass (AdamW, norms, GELU, softmax) are not in the floor;
//  (b) train::FlatTrainer (the one-device GPT of the CUDA path) on the host, fp32, same step;
//  (c) PyTorch CPU training the same model for the same step (torch_gpt2_step.py, run with
//      $TRELLIS_PYTHON or python3) when `import torch` works there; otherwise the row says so.
//   bench_trainer [--quick] [--iters N] [--json FILE]   (--quick: 4 layers, vocab 8192)
#include <cblas.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "support/gpt_sgemm_floor.hpp"
#include "support/report.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/train/flat_trainer.hpp"
#include "trellis/train/trainer.hpp"

using namespace trellis;

namespace {

struct TorchResult {
  bool ok = false;
  double ms_min = 0, ms_median = 0;
  std::string note;
};


TorchResult run_torch(const nn::GptConfig& cfg, int seq, int batch, int iters) {
  const char* env = std::getenv("TRELLIS_PYTHON");
  const std::string python = env ? env : "python3";
  TorchResult r;
  if (std::system((python + " -c 'import torch' >/dev/null 2>&1").c_str()) != 0) {
    r.note = "PyTorch not available (" + python + " cannot import torch; set TRELLIS_PYTHON)";
    return r;
  }
  const std::string cmd = python + " " + TRELLIS_BENCH_TRAIN_DIR + "/torch_gpt2_step.py --layers " +
                          std::to_string(cfg.layers) + " --heads " + std::to_string(cfg.heads) + " --width " +
                          std::to_string(cfg.width) + " --vocab " + std::to_string(cfg.vocab) + " --seq " +
                          std::to_string(seq) + " --batch " + std::to_string(batch) + " --iters " +
                          std::to_string(iters) + " 2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  std::string out;
  char buf[512];
  while (pipe && std::fgets(buf, sizeof buf, pipe.get())) out += buf;
  if (std::sscanf(out.c_str(), "{\"ms_min\": %lf, \"ms_median\": %lf", &r.ms_min, &r.ms_median) == 2) {
    r.ok = true;
    auto t = out.find("\"torch\": \"");
    r.note = t == std::string::npos ? "" : "torch " + out.substr(t + 10, out.find('"', t + 10) - t - 10);
  } else {
    r.note = "the PyTorch run failed: " + out;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = bench::has_flag(argc, argv, "--quick");
  train::TrainerConfig c;
  c.model = {
      .vocab = quick ? 8192 : 50257, .positions = 1024, .layers = quick ? 4 : 12, .heads = 12, .width = 768};
  c.seq = 64;
  c.batch = 4;
  c.microbatches = 1;
  c.lr = {.max_lr = 3e-4, .min_lr = 3e-5, .warmup_steps = 0, .total_steps = 100};
  // --iters N (default 5): timed repetitions of each side; the minimum is reported (the least
  // disturbed run on a shared machine), the median beside it.
  const int warmup = 1, iters = quick ? 2 : std::max(1, static_cast<int>(bench::int_flag(argc, argv, "--iters", 5)));
  const double tokens = static_cast<double>(c.batch * c.seq);

  const double floor_s = bench::gpt_sgemm_floor_seconds(c.model, static_cast<int>(tokens), warmup, iters);
  train::Batch b;
  b.rows = c.batch;
  b.seq_len = c.seq;
  b.inputs.resize(static_cast<std::size_t>(tokens));
  b.targets.resize(static_cast<std::size_t>(tokens));
  for (std::size_t i = 0; i < b.inputs.size(); ++i) {
    b.inputs[i] = static_cast<std::int32_t>((i * 7919) % c.model.vocab);
    b.targets[i] = static_cast<std::int32_t>((i * 104729 + 3) % c.model.vocab);
  }
  double t_min = 0, t_med = 0;
  comm::ThreadWorld world(1);
  world.run([&](comm::ThreadComm& comm) {
    train::Trainer<comm::ThreadComm> trainer(comm, c);
    std::tie(t_min, t_med) = bench::time_min_median([&] { trainer.step(b); }, warmup, iters);
  });
  // The one-device GPT (the CUDA path's model, docs/flat_gpt.md) on the host, fp32: same step.
  double f_min = 0, f_med = 0;
  {
    train::FlatTrainer<backend::Host<float>> flat(c);
    std::tie(f_min, f_med) = bench::time_min_median([&] { flat.step(b); }, warmup, iters);
  }
  const TorchResult torch = run_torch(c.model, static_cast<int>(c.seq), static_cast<int>(c.batch), iters);

  const double gf = bench::gpt_gemm_flops(c.model, tokens);
  std::printf(
      "# GPT-2 %s: %lld layers, width %lld, vocab %lld, T %lld, B %lld, fp32, 1 host rank; Trainer step = "
      "F + B + W + clip + AdamW\n",
      quick ? "(quick, reduced)" : "124M", static_cast<long long>(c.model.layers),
      static_cast<long long>(c.model.width), static_cast<long long>(c.model.vocab),
      static_cast<long long>(c.seq), static_cast<long long>(c.batch));
  std::printf(
      "# floor (same run): the step's GEMMs as bare cblas_sgemm: %.1f ms = %.1f GFLOP/s over %.1f GFLOP\n",
      floor_s * 1e3, gf / floor_s / 1e9, gf / 1e9);
  std::printf("%-28s %12s %12s %12s %10s\n", "implementation", "ms min", "ms median", "tokens/s", "x floor");
  std::printf("%-28s %12.1f %12s %12.0f %10.2f\n", "cblas_sgemm floor", floor_s * 1e3, "-", tokens / floor_s,
              1.0);
  std::printf("%-28s %12.1f %12.1f %12.0f %10.2f\n", "trellis Trainer", t_min * 1e3, t_med * 1e3,
              tokens / t_min, t_min / floor_s);
  std::printf("%-28s %12.1f %12.1f %12.0f %10.2f\n", "trellis FlatTrainer (host)", f_min * 1e3, f_med * 1e3,
              tokens / f_min, f_min / floor_s);
  if (torch.ok)
    std::printf("%-28s %12.1f %12.1f %12.0f %10.2f   (%s)\n", "PyTorch CPU", torch.ms_min, torch.ms_median,
                tokens / (torch.ms_min / 1e3), torch.ms_min / 1e3 / floor_s, torch.note.c_str());
  else
    std::printf("%-28s %s\n", "PyTorch CPU", torch.note.c_str());
  if (torch.ok)
    std::printf("# trellis / PyTorch: Trainer %.2f, FlatTrainer %.2f\n", t_min * 1e3 / torch.ms_min,
                f_min * 1e3 / torch.ms_min);

  bench::JsonReport report("bench_trainer");
  bench::Row row;
  row.add_text("model", quick ? "quick" : "gpt2-124M")
      .add("floor_ms", floor_s * 1e3)
      .add("trellis_ms_min", t_min * 1e3)
      .add("trellis_ms_median", t_med * 1e3)
      .add("trellis_over_floor", t_min / floor_s)
      .add("flat_ms_min", f_min * 1e3)
      .add("flat_over_floor", f_min / floor_s);
  if (torch.ok) row.add("torch_ms_min", torch.ms_min).add("trellis_over_torch", t_min * 1e3 / torch.ms_min);
  report.add(row);
  report.write(bench::json_path(argc, argv));
  return 0;
}
