// One training step of the GPT-2 124M shape (12 layers, 12 heads, width 768, vocab 50257,
// T = 64, B = 4: 256 tokens) through train::Trainer on one host rank in fp32 (forward, backward,
// global-norm clip, AdamW over all 124 M parameters), side by side with, in the same run:
//  (a) the floor: the step's matrix products (c_attn, attn c_proj, c_fc, mlp c_proj per block
//      and the tied LM head, each forward product with its two backward products) as bare
//      cblas_sgemm calls of the same shapes; attention's T x T products (0.3 % of the FLOPs at
//      T = 64) and every non-GEMM pass (AdamW, norms, GELU, softmax) are not in the floor;
//  (b) PyTorch CPU training the same model for the same step (torch_gpt2_step.py, run with
//      $TRELLIS_PYTHON or python3) when `import torch` works there, in fp32 and under bf16 autocast
//      (fp32 weights, gradients and AdamW, as (c)); otherwise the row says so;
//  (c) Trainer<ThreadComm, backend::Host<bfloat16>>: bf16 compute, fp32 master weights, gradients
//      and AdamW (bf16 GEMMs on oneDNN where the CPU has AMX or AVX512-BF16, kernels/gemm_dnnl.hpp);
//  (d) the optimizer's memory floor: the 36 bytes per parameter an fp32 AdamW step moves (zero the
//      gradients, read them for the norm, AdamW's reads and writes) as plain parallel memcpy. At
//      256 tokens a step's GEMMs are only ~1.5 kFLOP per parameter, so this traffic is a large
//      share of any step: "sgemm + memory floor" is what no implementation can beat.
// (a), Trainer, (c) and (d) run round robin, one step each in turn, so a change of load on a shared
// machine touches them alike; each side's minimum and median are reported.
//   bench_trainer [--quick] [--iters N] [--json FILE]   (--quick: 4 layers, vocab 8192)
//
// --layout: a smaller GPT (default 8 layers, 4 heads, width 256, vocab 8192, T 128, global batch
// 16) on one thread rank against dp2 x tp2 x pp2 on 8 thread ranks (--schedule, default 1f1b;
// --microbatches, default 4) with ZeRO 0 to 3, and dp4 with ZeRO 0 to 3: step time, tokens/s,
// rank 0's weight, gradient and AdamW bytes (Trainer::memory), and the bytes each
// step puts on the wire per communicator (bench/support/counting_comm.hpp: ring model), summed
// over the ranks. All layouts start from the same weights, so their first-step losses agree.
//   bench_trainer --layout [--layers L] [--heads H] [--width C] [--vocab V] [--seq T] [--batch B]
//                 [--microbatches M] [--schedule S] [--iters N] [--json FILE]
#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "support/counting_comm.hpp"
#include "support/synthetic_batch.hpp"
#include "support/gpt_sgemm_floor.hpp"
#include "support/report.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/kernels/cpu_peak.hpp"
#include "trellis/kernels/thread_pool.hpp"
#include "trellis/pipe/simulate.hpp"
#include "trellis/train/metrics.hpp"
#include "trellis/train/trainer.hpp"

using namespace trellis;
using bench::make_batch;

namespace {

struct TorchResult {
  bool ok = false;
  double ms_min = 0, ms_median = 0;
  std::string note;
};


TorchResult run_torch(const nn::GptConfig& cfg, int seq, int batch, int iters, const char* autocast) {
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
                          std::to_string(iters) + " --autocast " + autocast + " 2>/dev/null";
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


// The memory traffic any fp32 AdamW step must make, as plain parallel memcpy: per parameter, the
// gradient zeroed (4 bytes), read for the global norm (4) and AdamW's reads of p, g, m, v (16) and
// writes of p, m, v (12): 36 bytes, i.e. 18 bytes copied. Buffers of 128 MiB (far beyond the
// caches) are copied round and round on the kernel pool's threads.
struct OptimizerMemoryFloor {
  explicit OptimizerMemoryFloor(double parameters)
      : bytes(static_cast<std::size_t>(18.0 * parameters)), src(chunk_bytes, 1), dst(chunk_bytes, 0) {}
  void run() {
    const std::size_t chunks = (bytes + chunk_bytes - 1) / chunk_bytes;
    constexpr std::int64_t pieces = 64;
    for (std::size_t c = 0; c < chunks; ++c) {
      const std::size_t n = std::min(chunk_bytes, bytes - c * chunk_bytes);
      kernels::host::parallel_for(pieces, [&](std::int64_t i) {
        const std::size_t a = n * static_cast<std::size_t>(i) / pieces, b = n * static_cast<std::size_t>(i + 1) / pieces;
        std::memcpy(dst.data() + a, src.data() + a, b - a);
      });
    }
  }
  static constexpr std::size_t chunk_bytes = std::size_t{128} << 20;
  std::size_t bytes;
  std::vector<unsigned char> src, dst;
};

struct LayoutResult {
  std::string name;
  int ranks = 1;
  double ms_min = 0, ms_median = 0;
  double first_loss = 0;
  // bytes on the wire per step, summed over the ranks (ring model), per communicator of the mesh
  double dp_bytes = 0, tp_bytes = 0, pp_bytes = 0, other_bytes = 0;
  double calls = 0;  // communicator calls per step, summed over the ranks
  double weight_mb = 0, grad_mb = 0, adamw_mb = 0;  // rank 0's weights, gradient storage, AdamW moments (Trainer::memory)
  // Saved activations per pipeline stage (its dp 0, tp 0 rank): the simulator's peak of live
  // (microbatch, chunk) activations, the arena's measured peak of slots held, the arena's capacity
  // and the measured peak of bytes held in saved tensors.
  struct Activations {
    int stage = 0, simulated_live = 0, measured_live = 0;
    double capacity_mb = 0, measured_mb = 0, slot_mb = 0;
  };
  std::vector<Activations> activations;
};

// One configuration on pp*dp*tp thread ranks: a step's wall time is the slowest rank's (a world
// barrier before and after each timed step), the communication counted over the timed steps.
LayoutResult run_layout(const std::string& name, const train::TrainerConfig& c, int warmup, int iters) {
  using Comm = bench::CountingComm<comm::ThreadComm>;
  LayoutResult res;
  res.name = name;
  res.ranks = c.pp * c.dp * c.tp;
  std::vector<double> times;
  std::vector<LayoutResult> per_rank(static_cast<std::size_t>(res.ranks));
  comm::ThreadWorld world(res.ranks);
  world.run([&](comm::ThreadComm& tc) {
    Comm comm(tc.split(0, tc.rank()));
    train::Trainer<Comm> trainer(comm, c);
    auto& mesh = trainer.mesh();
    const index_t rows = c.batch / c.dp;
    const train::Batch b = make_batch(rows, c.seq, c.model.vocab, mesh.template coord<trellis::dp>() * rows);
    auto all = [&]() -> std::vector<Comm*> {
      // The gradient reductions run over the replicas, dp x cp (cp 1 here); the loss over pp x dp x cp.
      return {&mesh.template comm<trellis::dp, trellis::cp>(), &mesh.template comm<trellis::tp>(),
              &mesh.template comm<trellis::pp>(), &mesh.template comm<trellis::pp, trellis::dp, trellis::cp>(),
              &mesh.template comm<trellis::pp, trellis::tp>(), &comm};
    };
    for (int i = 0; i < warmup; ++i) {
      const double loss = trainer.step(b).loss;
      if (i == 0 && comm.rank() == 0) res.first_loss = loss;
    }
    for (Comm* x : all()) x->reset_counters();
    for (int i = 0; i < iters; ++i) {
      comm.barrier();
      const double t0 = bench::now_seconds();
      trainer.step(b);
      comm.barrier();
      if (comm.rank() == 0) times.push_back(bench::now_seconds() - t0);
    }
    auto& mine = per_rank[static_cast<std::size_t>(comm.rank())];
    const auto v = all();
    mine.dp_bytes = v[0]->counters().bytes;
    mine.tp_bytes = v[1]->counters().bytes;
    mine.pp_bytes = v[2]->counters().bytes;
    mine.other_bytes = v[3]->counters().bytes + v[4]->counters().bytes + v[5]->counters().bytes;
    for (Comm* x : v) mine.calls += static_cast<double>(x->counters().calls);
    mine.calls -= 2.0 * iters;  // the timing barriers
    mine.weight_mb = static_cast<double>(trainer.memory().parameters) / 1e6;
    mine.grad_mb = static_cast<double>(trainer.memory().gradients) / 1e6;
    mine.adamw_mb = static_cast<double>(trainer.memory().optimizer) / 1e6;
    if (mesh.template coord<trellis::dp>() == 0 && mesh.template coord<trellis::tp>() == 0) {
      const auto& arena = trainer.activation_arena();
      const int pp_rank = mesh.template coord<trellis::pp>();
      LayoutResult::Activations a;
      a.stage = pp_rank;
      a.simulated_live = c.pp > 1 ? pipe::simulate(pipe::make_schedule(c.schedule, c.pp, c.microbatches))
                                        .peak_chunk_activations[static_cast<std::size_t>(pp_rank)]
                                  : 1;
      a.measured_live = arena.peak_held_slots();
      a.capacity_mb = static_cast<double>(arena.capacity_bytes()) / 1e6;
      a.measured_mb = static_cast<double>(arena.peak_held_bytes()) / 1e6;
      a.slot_mb = static_cast<double>(arena.slot_bytes(0)) / 1e6;
      mine.activations = {a};
    }
  });
  std::sort(times.begin(), times.end());
  res.ms_min = times.front() * 1e3;
  res.ms_median = times[times.size() / 2] * 1e3;
  for (const auto& r : per_rank) {
    res.activations.insert(res.activations.end(), r.activations.begin(), r.activations.end());
    res.dp_bytes += r.dp_bytes / iters;
    res.tp_bytes += r.tp_bytes / iters;
    res.pp_bytes += r.pp_bytes / iters;
    res.other_bytes += r.other_bytes / iters;
    res.calls += r.calls / iters;
  }
  res.weight_mb = per_rank[0].weight_mb;
  res.grad_mb = per_rank[0].grad_mb;
  res.adamw_mb = per_rank[0].adamw_mb;
  return res;
}

int layout_main(int argc, char** argv) {
  train::TrainerConfig c;
  c.model = {.vocab = bench::int_flag(argc, argv, "--vocab", 8192),
             .positions = 1024,
             .layers = bench::int_flag(argc, argv, "--layers", 8),
             .heads = bench::int_flag(argc, argv, "--heads", 4),
             .width = bench::int_flag(argc, argv, "--width", 256)};
  c.seq = bench::int_flag(argc, argv, "--seq", 128);
  c.batch = bench::int_flag(argc, argv, "--batch", 16);
  c.lr = {.max_lr = 3e-4, .min_lr = 3e-5, .warmup_steps = 0, .total_steps = 100};
  c.model.positions = std::max<index_t>(c.model.positions, c.seq);
  const int m = static_cast<int>(bench::int_flag(argc, argv, "--microbatches", 4));
  const std::string schedule = bench::flag_value(argc, argv, "--schedule", "1f1b");
  const int warmup = 1, iters = std::max(1, static_cast<int>(bench::int_flag(argc, argv, "--iters", 5)));
  const double tokens = static_cast<double>(c.batch * c.seq);

  struct Case {
    std::string name;
    int pp, dp, tp, microbatches;
    int zero;
  };
  const std::vector<Case> cases = {
      {"1 rank, m1", 1, 1, 1, 1, 0},
      {"1 rank, m" + std::to_string(m), 1, 1, 1, m, 0},
      {"dp2.tp2.pp2 " + schedule + " m" + std::to_string(m), 2, 2, 2, m, 0},
      {"dp2.tp2.pp2 " + schedule + " m" + std::to_string(m) + " zero1", 2, 2, 2, m, 1},
      {"dp2.tp2.pp2 " + schedule + " m" + std::to_string(m) + " zero2", 2, 2, 2, m, 2},
      {"dp2.tp2.pp2 " + schedule + " m" + std::to_string(m) + " zero3", 2, 2, 2, m, 3},
      {"dp4 m" + std::to_string(m), 1, 4, 1, m, 0},
      {"dp4 m" + std::to_string(m) + " zero1", 1, 4, 1, m, 1},
      {"dp4 m" + std::to_string(m) + " zero2", 1, 4, 1, m, 2},
      {"dp4 m" + std::to_string(m) + " zero3", 1, 4, 1, m, 3},
  };
  std::vector<LayoutResult> results;
  for (const auto& k : cases) {
    train::TrainerConfig ck = c;
    ck.pp = k.pp;
    ck.dp = k.dp;
    ck.tp = k.tp;
    ck.microbatches = k.microbatches;
    ck.zero = k.zero;
    ck.schedule = schedule;
    if (auto problems = train::config_problems(ck); !problems.empty()) {
      for (auto& p : problems) std::fprintf(stderr, "%s: %s\n", k.name.c_str(), p.c_str());
      return 1;
    }
    results.push_back(run_layout(k.name, ck, warmup, iters));
  }

  std::printf(
      "# GPT %lld layers, %lld heads, width %lld, vocab %lld, T %lld, global batch %lld (%.0f tokens), fp32, "
      "host thread ranks (%u hardware threads); %d timed steps after 1 warm-up\n",
      static_cast<long long>(c.model.layers), static_cast<long long>(c.model.heads),
      static_cast<long long>(c.model.width), static_cast<long long>(c.model.vocab), static_cast<long long>(c.seq),
      static_cast<long long>(c.batch), tokens, std::thread::hardware_concurrency(), iters);
  std::printf("# comm MB/step: bytes on the wire per step summed over the ranks (ring model), per communicator\n");
  std::printf("# weight MB, grad MB, AdamW MB: rank 0's weights (ZeRO-3: shards + unit slots + wte), gradient "
              "storage and AdamW moments (Trainer::memory)\n");
  std::printf("%-32s %5s %10s %10s %10s %9s %12s %9s %9s %9s %9s %8s %9s %8s %8s\n", "layout", "ranks", "ms min",
              "ms median", "tokens/s", "x 1 rank", "first loss", "dp MB", "tp MB", "pp MB", "other MB", "calls",
              "weight MB", "grad MB", "AdamW MB");
  const double base = results.front().ms_min;
  bench::JsonReport report("bench_trainer_layout");
  for (const auto& r : results) {
    std::printf("%-32s %5d %10.1f %10.1f %10.0f %9.2f %12.6f %9.1f %9.1f %9.1f %9.3f %8.0f %9.1f %8.1f %8.1f\n",
                r.name.c_str(), r.ranks, r.ms_min, r.ms_median, tokens / (r.ms_min / 1e3), r.ms_min / base,
                r.first_loss, r.dp_bytes / 1e6, r.tp_bytes / 1e6, r.pp_bytes / 1e6, r.other_bytes / 1e6, r.calls,
                r.weight_mb, r.grad_mb, r.adamw_mb);
    bench::Row row;
    row.add_text("layout", r.name)
        .add("ranks", static_cast<long long>(r.ranks))
        .add("ms_min", r.ms_min)
        .add("ms_median", r.ms_median)
        .add("tokens_per_s", tokens / (r.ms_min / 1e3), "%.0f")
        .add("over_one_rank", r.ms_min / base)
        .add("first_loss", r.first_loss, "%.6f")
        .add("dp_bytes_per_step", r.dp_bytes, "%.0f")
        .add("tp_bytes_per_step", r.tp_bytes, "%.0f")
        .add("pp_bytes_per_step", r.pp_bytes, "%.0f")
        .add("other_bytes_per_step", r.other_bytes, "%.0f")
        .add("calls_per_step", r.calls, "%.0f")
        .add("weight_mb_rank0", r.weight_mb)
        .add("grad_mb_rank0", r.grad_mb)
        .add("adamw_mb_rank0", r.adamw_mb);
    report.add(row);
  }
  std::printf("# saved activations per pipeline stage (nn/activation_arena.hpp): live = (microbatch, chunk) "
              "activations alive at once, F to W\n");
  std::printf("%-32s %5s %10s %10s %10s %12s %12s %9s\n", "layout", "stage", "sim live", "meas live", "slot MB",
              "arena MB", "measured MB", "meas/arena");
  for (const auto& r : results)
    for (const auto& a : r.activations) {
      std::printf("%-32s %5d %10d %10d %10.2f %12.2f %12.2f %9.3f\n", r.name.c_str(), a.stage, a.simulated_live,
                  a.measured_live, a.slot_mb, a.capacity_mb, a.measured_mb, a.measured_mb / a.capacity_mb);
      bench::Row row;
      row.add_text("layout", r.name)
          .add("stage", static_cast<long long>(a.stage))
          .add("simulated_live", static_cast<long long>(a.simulated_live))
          .add("measured_live", static_cast<long long>(a.measured_live))
          .add("arena_mb", a.capacity_mb)
          .add("measured_mb", a.measured_mb);
      report.add(row);
    }
  report.write(bench::json_path(argc, argv));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (bench::has_flag(argc, argv, "--layout")) return layout_main(argc, argv);
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

  // The C++ sides run round robin (floor, Trainer fp32, Trainer bf16, memory floor, then
  // again), so load changes on the shared machine touch each alike; PyTorch runs after them.
  const train::Batch b = make_batch(c.batch, c.seq, c.model.vocab);
  // The machine's peaks (kernels/cpu_peak.hpp) on the kernel pool's thread count: each row's step
  // time is also given as MFU against the fp32 and the bf16 peak.
  const kernels::host::CpuPeak machine = kernels::host::measure_cpu_peak(kernels::host::kernel_thread_count());
  double floor_s = 0, floor_med = 0, t_min = 0, t_med = 0, h_min = 0, h_med = 0;
  double mem_s = 0, mem_med = 0, parameters = 0;
  comm::ThreadWorld world(1);
  world.run([&](comm::ThreadComm& comm) {
    bench::GptSgemmFloor floor(c.model, static_cast<int>(tokens));
    train::Trainer<comm::ThreadComm> trainer(comm, c);
    // Trainer with bf16 compute (fp32 master weights, gradients and AdamW): same step. (Spelled
    // trellis::bfloat16: OpenBLAS' cblas.h declares a global bfloat16 typedef.)
    train::Trainer<comm::ThreadComm, backend::Host<trellis::bfloat16>> bf16(comm, c);
    parameters = trainer.global_parameter_count();
    OptimizerMemoryFloor memory(parameters);
    std::vector<std::function<void()>> sides = {[&] { floor.run(); }, [&] { trainer.step(b); },
                                                [&] { bf16.step(b); }, [&] { memory.run(); }};
    const auto t = bench::time_round_robin(sides, warmup, iters);
    std::tie(floor_s, floor_med) = t[0];
    std::tie(t_min, t_med) = t[1];
    std::tie(h_min, h_med) = t[2];
    std::tie(mem_s, mem_med) = t[3];
  });
  const TorchResult torch = run_torch(c.model, static_cast<int>(c.seq), static_cast<int>(c.batch), iters, "none");
  const TorchResult torch_bf16 = run_torch(c.model, static_cast<int>(c.seq), static_cast<int>(c.batch), iters, "bf16");

  const double gf = bench::gpt_gemm_flops(c.model, tokens);
  std::printf(
      "# GPT-2 %s: %lld layers, width %lld, vocab %lld, T %lld, B %lld, 1 host rank; Trainer step = "
      "F + B + W + clip + AdamW; %d timed rounds (sides in turn) after 1 warm-up\n",
      quick ? "(quick, reduced)" : "124M", static_cast<long long>(c.model.layers),
      static_cast<long long>(c.model.width), static_cast<long long>(c.model.vocab),
      static_cast<long long>(c.seq), static_cast<long long>(c.batch), iters);
  std::printf(
      "# floor (same run): the step's GEMMs as bare cblas_sgemm: %.1f ms = %.1f GFLOP/s over %.1f GFLOP\n",
      floor_s * 1e3, gf / floor_s / 1e9, gf / 1e9);
  // Model FLOPs of the step (6N + 12 L C T per token, as train_gpt's MFU) over the step time, as a
  // fraction of the machine's fp32 and bf16 peaks.
  const double model_flop =
      tokens * train::gpt_flops_per_token(parameters, static_cast<int>(c.model.layers),
                                          static_cast<int>(c.model.width), static_cast<int>(c.seq));
  std::printf("# machine peak: %s\n", machine.describe().c_str());
  std::printf("# MFU columns: %.1f model GFLOP per step / ms / peak; at peak a step takes %.1f ms (fp32), %.2f ms (bf16)\n",
              model_flop / 1e9, model_flop / machine.theoretical.fp32 * 1e3, model_flop / machine.theoretical.bf16 * 1e3);
  std::printf("%-30s %12s %12s %12s %10s %12s %10s %10s\n", "implementation", "ms min", "ms median", "tokens/s",
              "x floor", "x floor med", "MFU fp32", "MFU bf16");
  auto mfu = [&](double sec, bool bf16) { return 100.0 * model_flop / sec / machine.peak(bf16); };
  auto line = [&](const char* name, double mn, double md, bool whole_step = true) {  // floors: no MFU
    std::printf("%-30s %12.1f %12.1f %12.0f %10.2f %12.2f", name, mn * 1e3, md * 1e3, tokens / mn, mn / floor_s,
                md / floor_med);
    if (whole_step) std::printf(" %9.2f%% %9.2f%%\n", mfu(mn, false), mfu(mn, true));
    else std::printf(" %10s %10s\n", "-", "-");
  };
  line("cblas_sgemm floor", floor_s, floor_med, false);
  line("optimizer memory floor", mem_s, mem_med, false);
  line("sgemm + memory floor", floor_s + mem_s, floor_med + mem_med, false);
  line("trellis Trainer fp32", t_min, t_med);
  line("trellis Trainer bf16 compute", h_min, h_med);
  auto torch_line = [&](const char* name, const TorchResult& r) {
    if (r.ok)
      std::printf("%-30s %12.1f %12.1f %12.0f %10.2f %12.2f %9.2f%% %9.2f%%   (%s)\n", name, r.ms_min, r.ms_median,
                  tokens / (r.ms_min / 1e3), r.ms_min / 1e3 / floor_s, r.ms_median / 1e3 / floor_med,
                  mfu(r.ms_min / 1e3, false), mfu(r.ms_min / 1e3, true), r.note.c_str());
    else
      std::printf("%-30s %s\n", name, r.note.c_str());
  };
  torch_line("PyTorch CPU fp32", torch);
  torch_line("PyTorch CPU bf16 autocast", torch_bf16);
  std::printf("# optimizer memory floor: 36 bytes per parameter (%.1f M parameters) as parallel memcpy: %.1f GB/s\n",
              parameters / 1e6, 36.0 * parameters / mem_s / 1e9);
  std::printf("# Trainer bf16 / fp32: %.2f (min), %.2f (median)\n", h_min / t_min, h_med / t_med);
  std::printf("# Trainer fp32 / (sgemm + memory floor): %.2f (min), %.2f (median)\n", t_min / (floor_s + mem_s),
              t_med / (floor_med + mem_med));
  if (torch.ok)
    std::printf("# trellis / PyTorch fp32: Trainer fp32 %.2f\n", t_min * 1e3 / torch.ms_min);
  if (torch_bf16.ok)
    std::printf("# trellis / PyTorch bf16 autocast: Trainer bf16 %.2f; PyTorch bf16 / fp32 %.2f\n",
                h_min * 1e3 / torch_bf16.ms_min, torch.ok ? torch_bf16.ms_min / torch.ms_min : 0.0);

  bench::JsonReport report("bench_trainer");
  bench::Row row;
  row.add_text("model", quick ? "quick" : "gpt2-124M")
      .add("floor_ms", floor_s * 1e3)
      .add("floor_ms_median", floor_med * 1e3)
      .add("trellis_ms_min", t_min * 1e3)
      .add("trellis_ms_median", t_med * 1e3)
      .add("trellis_over_floor", t_min / floor_s)
      .add("bf16_ms_min", h_min * 1e3)
      .add("bf16_ms_median", h_med * 1e3)
      .add("bf16_over_floor", h_min / floor_s)
      .add("memory_floor_ms", mem_s * 1e3)
      .add("trellis_over_sgemm_and_memory_floor", t_min / (floor_s + mem_s))
      .add("peak_fp32_gflops", machine.theoretical.fp32 / 1e9)
      .add("peak_bf16_gflops", machine.theoretical.bf16 / 1e9)
      .add("fma_loop_gflops", machine.fma_flops / 1e9)
      .add("amx_loop_gflops", machine.amx_flops / 1e9)  // 0: the AMX loop did not run (CpuPeak::amx_skipped)
      .add("trellis_mfu_fp32_peak", mfu(t_min, false) / 100, "%.4f")
      .add("bf16_mfu_bf16_peak", mfu(h_min, true) / 100, "%.4f");
  if (torch.ok) row.add("torch_ms_min", torch.ms_min).add("trellis_over_torch", t_min * 1e3 / torch.ms_min);
  if (torch_bf16.ok)
    row.add("torch_bf16_ms_min", torch_bf16.ms_min).add("bf16_over_torch_bf16", h_min * 1e3 / torch_bf16.ms_min);
  report.add(row);
  report.write(bench::json_path(argc, argv));
  return 0;
}
