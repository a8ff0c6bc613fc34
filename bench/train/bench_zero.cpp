// ZeRO stages side by side: memory per rank against the ZeRO paper's formula, and step time on a
// simulated link with and without ZeRO-3's prefetch.
//
// --memory (default): GPT-2 124M (12 layers, width 768, vocab 50257), dp 4 on 4 thread ranks, T 64,
// one row per rank, fp32. For ZeRO 0..3, ZeRO-3 hybrid-sharded in groups of 2 (N = 2 in the
// formula: each group of 2 ranks holds one copy) and ZeRO-3 with the optimizer offloaded, one step, then
// rank 0's Trainer::memory() (measured: the bytes the trainer holds, counted by kind) beside
//   the formula: the ZeRO paper's per-rank model state for Adam, written for this fp32 trainer
//     (weights 4 bytes per parameter, gradients 4, moments 8: K = 8 instead of mixed precision's
//     2 + 2 + 12): stage 0 16 P, stage 1 8 P + 8 P/N, stage 2 4 P + 12 P/N, stage 3 16 P/N;
//   + what our implementation adds on top: ZeRO-1's reduced shards beside the whole gradient
//     buffer, ZeRO-2/3's two gradient slots (each a block and its reduced shard) and wte's whole
//     gradient, ZeRO-3's two value slots and wte's whole value during a step, and with the
//     optimizer offloaded the host copies of the values and gradients an update stages.
// "model" is everything the trainer holds for parameters, gradients and optimizer state, in
// device and host memory and on disk together (offloaded: the moments and the staging are host
// memory; the disk tier: the moments are a file, its bounded buffers host memory).
// The same columns for GPT-2 1.5B (48 layers, width 1600, 25 heads), counted from the shapes with
// the same formula and extras, NOT run (it does not fit this machine's memory at stage 0).
//
// --link: a smaller GPT (8 layers, 4 heads, width 256, vocab 8192, T 128, global batch 16), dp 4 on
// thread ranks whose communicator is comm::SimulatedLink (every collective held for latency +
// ring bytes / bandwidth: a SIMULATED link on the host, not a network). The bandwidth is set so
// that plain dp's modelled traffic is --share (0.5) of a step's measured compute. Per stage: the
// fastest step, the time rank 0 was blocked in communication, and the modelled traffic, for ZeRO
// 0..3, ZeRO-3 without prefetch and ZeRO-3 hybrid-sharded in groups of 2 (its traffic runs on the
// shard-group and across-group communicators, split off inside the trainer, so only its step time
// is reported; the simulated link has one bandwidth, so the faster link inside a node that makes
// hybrid sharding pay off is not modelled). Kernels run on one thread per rank.
//
// --activations: saved activations offloaded to host memory (TrainerConfig::offload_activations,
// two device frames per chunk) against the same run without, GPT-2 124M at T 256, one thread
// rank with 4 rows, and pp2 gpipe with 4 microbatches of 2 rows (every microbatch alive on the
// first stage before its backward). Per rank: the arena's device reserve and measured peak, the
// host memory it offloads to and its measured peak, the bytes copied each way in a step, and the
// fastest step of --iters (both tiers are RAM here, so the copies are memcpy, not PCIe).
//
// --activation-copies: the copies of offloaded activations synchronous against overlapped on the
// copy queue (TrainerConfig::offload_activation_copy_queue; backend::HostCopyQueue, a worker
// thread), on a SIMULATED host link of --act-gbps (0.5) GB/s: the queue holds each copy for
// bytes / bandwidth (both tiers are RAM here). The --link model (8 layers, width 256, vocab 8192,
// T 128) on one thread rank with one kernel thread, --rows (4) rows, 2 device frames: no offload,
// offload synchronous, offload on the copy queue, side by side; fastest of --iters steps after a
// warm-up, the bytes copied each way and the simulated link's time for them per step, the loss.
// --disk: the optimizer state's disk tier (TrainerConfig::offload_dir) with its reads and writes
// synchronous against prefetched (offload_disk_prefetch: the next --disk-readahead (2) chunks read
// and the last one written on the tier's I/O thread while a chunk updates), on a SIMULATED slow disk: the tier's
// probe (DiskMoments::set_probe, its test and bench seam) sleeps bytes / --disk-gbps (1 GB/s) before
// each chunk's pread / pwrite, one at a time as on one queue (the file itself is in the page
// cache). GPT-2 124M on one thread rank (one kernel thread), T 64, 1 row (so the update, AdamW
// over every parameter and its 2 GB of disk traffic, is much of the step), chunks of --chunk
// elements (1 << 20); fastest of --iters steps; the modelled disk time per step beside it. Each
// with the tier's chunks coalesced (consecutive tensors in one chunk, the default) and not (each
// chunk one tensor's: OptimizerState::set_disk_coalescing, the seam), with the chunks per step.
// --disk --small: the --link model instead (8 layers, width 256, vocab 8192, T 128, 1 row), whose
// biases and norms are a larger share of the chunks.
//   bench_zero [--memory | --link | --activations | --activation-copies [--act-gbps G] [--rows N] | --disk [--small]
//              | --update-thread [--rows N] [--passes N]] [--iters N] [--share S]
//              [--disk-gbps G] [--disk-readahead N] [--chunk N] [--json FILE]
#include <malloc.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "support/report.hpp"
#include "support/synthetic_batch.hpp"
#include "trellis/comm/simulated_link.hpp"
#include "trellis/comm/threads.hpp"
#include "trellis/kernels/thread_pool.hpp"
#include "trellis/train/trainer.hpp"

using namespace trellis;

namespace {

using bench::make_batch;

// Parameter counts of a GPT-2 shape: all, one block, wte.
struct Shape {
  double all, block, wte;
  explicit Shape(const nn::GptConfig& m) {
    const double W = static_cast<double>(m.width), V = static_cast<double>(m.vocab);
    block = 12 * W * W + 13 * W;
    wte = V * W;
    all = wte + static_cast<double>(m.positions) * W + static_cast<double>(m.layers) * block + 2 * W;
  }
};

// Bytes per rank: the paper's formula (fp32 Adam) and our additions on top of it.
struct Predicted {
  double formula = 0, extras = 0;
};
Predicted predict(const Shape& s, int zero, double n, bool offload = false) {
  Predicted p;
  const double P = s.all;
  switch (zero) {
    case 0: p.formula = 16 * P; break;
    case 1: p.formula = 8 * P + 8 * P / n; break;
    case 2: p.formula = 4 * P + 12 * P / n; break;
    default: p.formula = 16 * P / n; break;
  }
  if (zero == 1) p.extras += 4 * P / n;  // the reduced shards beside the whole gradient buffer
  if (zero >= 2) p.extras += 4 * (2 * (s.block + s.block / n) + s.wte);  // gradient slots + wte's gradient
  if (zero >= 3) p.extras += 4 * (2 * s.block + s.wte);                  // value slots + wte's value
  if (offload) p.extras += 4 * 2 * (zero >= 1 ? P / n : P);            // an unfused update's staged values + gradients
  return p;
}

double gb(double bytes) { return bytes / 1e9; }

// The process's resident memory (/proc/self/status, kB -> bytes): now (VmRSS) and its peak since
// the last reset (VmHWM; reset_peak_rss writes 5 to /proc/self/clear_refs). Linux only; -1 where
// not readable.
double status_bytes(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key + ":", 0) == 0) return 1024.0 * std::stod(line.substr(key.size() + 1));
  return -1;
}
void reset_peak_rss() {
  malloc_trim(0);  // what the allocator holds free goes back first, so the peak counts what is in use
  std::ofstream("/proc/self/clear_refs") << "5";
}

int memory_main(int argc, char** argv) {
  // Allocations of 1 MiB and more are mapped and unmapped directly (glibc otherwise raises this
  // threshold as large blocks are freed and keeps them resident in its arenas): the process's
  // resident size then follows what the trainers hold.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  train::TrainerConfig c;
  c.model = {.vocab = 50257, .positions = 1024, .layers = 12, .heads = 12, .width = 768};
  c.seq = 64;
  c.dp = 4;
  c.batch = 4;
  c.lr = {.max_lr = 3e-4, .min_lr = 3e-5, .warmup_steps = 0, .total_steps = 100};
  struct Case {
    std::string name;
    int zero;
    bool offload, disk;
    int shard_degree = 0;  // hybrid sharding: ZeRO over groups of this many ranks
  };
  const std::vector<Case> cases = {{"zero0", 0, false, false},
                                   {"zero1", 1, false, false},
                                   {"zero2", 2, false, false},
                                   {"zero3", 3, false, false},
                                   {"zero3 hybrid, groups of 2", 3, false, false, 2},
                                   {"zero3 + offload optimizer", 3, true, false},
                                   {"zero3 + optimizer on disk", 3, false, true}};
  const std::filesystem::path disk_dir = std::filesystem::temp_directory_path() / "trellis-bench-zero-moments";
  const Shape s124(c.model);
  std::printf("# GPT-2 124M (%.1f M parameters), dp 4 thread ranks, fp32, T 64, one row per rank: rank 0's bytes "
              "after one step (Trainer::memory)\n", s124.all / 1e6);
  std::printf("# formula: the ZeRO paper's model state per rank for fp32 Adam (16 P, 8 P + 8 P/N, 4 P + 12 P/N, "
              "16 P/N); extras: unit slots and wte kept whole (see the file's header)\n");
  std::printf("# RSS/rank, build and step: the process's resident peak (VmHWM) while the 4 trainers are built, and "
              "(reset after that) during one step, less its resident size before, over the 4 ranks: everything "
              "(activations, workspace, temporaries) included\n");
  std::printf("%-28s %9s %9s %9s %9s %9s %9s %11s %9s %9s %12s %10s %10s %8s\n", "case", "weights", "grads",
              "AdamW", "host opt", "disk opt", "act peak", "model (GB)", "formula", "+extras", "measured/f+e",
              "RSS build", "RSS step", "step s");
  bench::JsonReport report("bench_zero_memory");
  for (const auto& k : cases) {
    train::TrainerConfig ck = c;
    ck.zero = k.zero;
    ck.offload_optimizer = k.offload;
    ck.shard_degree = k.shard_degree;
    if (k.disk) ck.offload_dir = disk_dir;
    train::MemoryUse mem;
    double step_s = 0, build_peak = 0;
    const double rss0 = status_bytes("VmRSS");
    reset_peak_rss();
    comm::ThreadWorld(4).run([&](comm::ThreadComm& comm) {
      train::Trainer<comm::ThreadComm> t(comm, ck);
      const auto b = make_batch(1, c.seq, c.model.vocab, comm.rank());
      comm.barrier();
      if (comm.rank() == 0) {
        build_peak = (status_bytes("VmHWM") - rss0) / 4;
        reset_peak_rss();
      }
      comm.barrier();
      const double t0 = bench::now_seconds();
      t.step(b);
      comm.barrier();
      if (comm.rank() == 0) {
        step_s = bench::now_seconds() - t0;
        mem = t.memory();
      }
    });
    const double step_peak = (status_bytes("VmHWM") - rss0) / 4;
    const double model = static_cast<double>(mem.parameters + mem.gradients + mem.optimizer + mem.host_optimizer +
                                             mem.disk_optimizer);
    Predicted p = predict(s124, k.zero, k.shard_degree > 0 ? k.shard_degree : 4, k.offload);
    if (k.disk) p.extras += static_cast<double>(mem.host_optimizer);  // the disk tier's bounded buffers
    std::printf("%-28s %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %11.3f %9.3f %9.3f %12.4f %10.3f %10.3f %8.2f\n",
                k.name.c_str(), gb(static_cast<double>(mem.parameters)), gb(static_cast<double>(mem.gradients)),
                gb(static_cast<double>(mem.optimizer)), gb(static_cast<double>(mem.host_optimizer)),
                gb(static_cast<double>(mem.disk_optimizer)),
                gb(static_cast<double>(mem.activations_peak)), gb(model), gb(p.formula), gb(p.formula + p.extras),
                model / (p.formula + p.extras), gb(build_peak), gb(step_peak), step_s);
    bench::Row row;
    row.add_text("case", k.name)
        .add("weights_gb", gb(static_cast<double>(mem.parameters)))
        .add("gradients_gb", gb(static_cast<double>(mem.gradients)))
        .add("adamw_gb", gb(static_cast<double>(mem.optimizer)))
        .add("host_optimizer_gb", gb(static_cast<double>(mem.host_optimizer)))
        .add("disk_optimizer_gb", gb(static_cast<double>(mem.disk_optimizer)))
        .add("activations_peak_gb", gb(static_cast<double>(mem.activations_peak)))
        .add("model_state_gb", gb(model))
        .add("formula_gb", gb(p.formula))
        .add("formula_plus_extras_gb", gb(p.formula + p.extras))
        .add("rss_build_per_rank_gb", gb(build_peak))
        .add("rss_step_per_rank_gb", gb(step_peak))
        .add("step_s", step_s);
    report.add(row);
  }
  // GPT-2 1.5B: counted, not run.
  nn::GptConfig xl{.vocab = 50257, .positions = 1024, .layers = 48, .heads = 25, .width = 1600};
  const Shape sxl(xl);
  std::printf("# GPT-2 1.5B (%.0f M parameters), dp 4: COUNTED from the shapes (formula + extras), not run\n",
              sxl.all / 1e6);
  std::printf("%-28s %11s %9s %9s\n", "case", "formula", "+extras", "x zero0");
  const double base = predict(sxl, 0, 4).formula;
  for (int z = 0; z <= 3; ++z) {
    const Predicted p = predict(sxl, z, 4);
    std::printf("%-28s %11.2f %9.2f %9.3f\n", ("zero" + std::to_string(z)).c_str(), gb(p.formula),
                gb(p.formula + p.extras), (p.formula + p.extras) / base);
    bench::Row row;
    row.add_text("case", "gpt2-1.5B zero" + std::to_string(z) + " (counted)")
        .add("formula_gb", gb(p.formula))
        .add("formula_plus_extras_gb", gb(p.formula + p.extras));
    report.add(row);
  }
  report.write(bench::json_path(argc, argv));
  return 0;
}

// ---- step time on a simulated link ---------------------------------------------------------------

using Link = comm::SimulatedLink<comm::ThreadComm>;

struct LinkResult {
  double step_ms = 1e9, blocked_ms = 1e9, modelled_ms = 0;
  double loss = 0;
};

train::TrainerConfig link_config(int zero, bool prefetch, int shard_degree = 0) {
  train::TrainerConfig c;
  c.model = {.vocab = 8192, .positions = 128, .layers = 8, .heads = 4, .width = 256};
  c.seq = 128;
  c.batch = 16;
  c.dp = 4;
  c.zero = zero;
  c.prefetch_values = prefetch;
  c.shard_degree = shard_degree;
  c.lr = {.max_lr = 3e-4, .min_lr = 3e-5, .warmup_steps = 0, .total_steps = 100};
  return c;
}

LinkResult run_on_link(const train::TrainerConfig& c, const comm::LinkModel& model, int iters) {
  LinkResult res;
  comm::ThreadWorld(c.dp).run([&](comm::ThreadComm& world) {
    Link link(world.split(0, world.rank()), model);
    train::Trainer<Link> t(link, c);
    const index_t rows = c.batch / c.dp;
    const auto b = make_batch(rows, c.seq, c.model.vocab, world.rank() * rows);
    Link& replicas = t.mesh().template comm<trellis::dp, trellis::cp>();
    t.step(b);  // warm-up
    const double modelled0 = replicas.modelled_seconds();
    double best = 1e9, blocked = 1e9;
    for (int i = 0; i < iters; ++i) {
      world.barrier();
      const double b0 = replicas.blocked_seconds(), t0 = bench::now_seconds();
      const double loss = t.step(b).loss;
      const double dt = bench::now_seconds() - t0;
      best = std::min(best, dt);
      blocked = std::min(blocked, replicas.blocked_seconds() - b0);
      if (world.rank() == 0) res.loss = loss;
    }
    if (world.rank() == 0) {
      res.step_ms = best * 1e3;
      res.blocked_ms = blocked * 1e3;
      res.modelled_ms = (replicas.modelled_seconds() - modelled0) / iters * 1e3;
    }
  });
  return res;
}

int link_main(int argc, char** argv) {
  kernels::host::set_num_threads(1);
  const int iters = std::max(1, static_cast<int>(bench::int_flag(argc, argv, "--iters", 5)));
  const double share = std::stod(bench::flag_value(argc, argv, "--share", "0.5"));
  // Calibration: ZeRO-0's compute time and dp bytes per step on an infinitely fast link.
  const LinkResult probe = run_on_link(link_config(0, true), {.bandwidth = 1e15, .latency = 0}, iters);
  const double bytes = probe.modelled_ms / 1e3 * 1e15;
  const comm::LinkModel model{.bandwidth = bytes / (share * probe.step_ms / 1e3), .latency = 20e-6};
  std::printf("# GPT 8 layers, width 256, vocab 8192, T 128, global batch 16, dp 4 thread ranks on a SIMULATED "
              "link: %.3f GB/s bus bandwidth, 20 us latency (plain dp's traffic = %.2f of its %.1f ms compute); "
              "fastest of %d steps\n", model.bandwidth / 1e9, share, probe.step_ms, iters);
  std::printf("%-24s %10s %10s %12s %10s %12s\n", "case", "step ms", "x zero0", "blocked ms", "comm ms", "loss");
  struct Case {
    std::string name;
    int zero;
    bool prefetch;
    int shard_degree = 0;
  };
  const std::vector<Case> cases = {{"zero0", 0, true},          {"zero1", 1, true},
                                   {"zero2", 2, true},          {"zero3", 3, true},
                                   {"zero3 no prefetch", 3, false}, {"zero3 hybrid, groups of 2", 3, true, 2}};
  bench::JsonReport report("bench_zero_link");
  double base = 0;
  for (const auto& k : cases) {
    const LinkResult r = run_on_link(link_config(k.zero, k.prefetch, k.shard_degree), model, iters);
    if (base == 0) base = r.step_ms;
    if (k.shard_degree > 0)  // its traffic is on the trainer's own splits: not counted by `replicas`
      std::printf("%-24s %10.1f %10.2f %12s %10s %12.6f\n", k.name.c_str(), r.step_ms, r.step_ms / base, "n/a", "n/a",
                  r.loss);
    else
      std::printf("%-24s %10.1f %10.2f %12.1f %10.1f %12.6f\n", k.name.c_str(), r.step_ms, r.step_ms / base,
                  r.blocked_ms, r.modelled_ms, r.loss);
    bench::Row row;
    row.add_text("case", k.name)
        .add("step_ms", r.step_ms)
        .add("over_zero0", r.step_ms / base)
        .add("bandwidth_gb_s", model.bandwidth / 1e9);
    if (k.shard_degree == 0) row.add("blocked_ms", r.blocked_ms).add("modelled_comm_ms", r.modelled_ms);
    report.add(row);
  }
  report.write(bench::json_path(argc, argv));
  return 0;
}

}  // namespace

// ---- saved activations offloaded -------------------------------------------------------------

int activations_main(int argc, char** argv) {
  const int iters = static_cast<int>(bench::int_flag(argc, argv, "--iters", 3));
  struct Case {
    std::string name;
    int pp, microbatches;
    index_t batch;
  };
  std::printf("# GPT-2 124M, T 256, fp32 thread ranks: saved activations per rank, without and with "
              "--offload activations (2 device frames per chunk); GB; copies per step; fastest of %d steps\n",
              iters);
  std::printf("%-26s %4s %9s %11s %9s %11s %9s %9s %9s %10s\n", "case", "rank", "offload", "dev reserve",
              "dev peak", "host reserve", "host peak", "out/step", "in/step", "step ms");
  bench::JsonReport report("bench_zero_activations");
  for (const Case& k : {Case{"1 rank, 4 rows", 1, 1, 4}, Case{"pp2 gpipe, 4 x 2 rows", 2, 4, 8}}) {
    double base_ms = 0;
    for (bool offload : {false, true}) {
      train::TrainerConfig c;
      c.model = {.vocab = 50257, .positions = 1024, .layers = 12, .heads = 12, .width = 768};
      c.seq = 256;
      c.batch = k.batch;
      c.pp = k.pp;
      c.schedule = "gpipe";
      c.microbatches = k.microbatches;
      c.offload_activations = offload;
      c.lr = {.max_lr = 3e-4, .min_lr = 3e-5, .warmup_steps = 0, .total_steps = 100};
      std::vector<std::array<double, 7>> per_rank(static_cast<std::size_t>(k.pp));
      comm::ThreadWorld(k.pp).run([&](comm::ThreadComm& comm) {
        train::Trainer<comm::ThreadComm> t(comm, c);
        const auto b = make_batch(static_cast<int>(k.batch), c.seq, c.model.vocab, 0);
        double best = 1e9;
        std::size_t out0 = 0, in0 = 0;
        for (int i = 0; i < iters; ++i) {
          const auto& a = t.activation_arena();
          out0 = a.offloaded_bytes();
          in0 = a.fetched_bytes();
          comm.barrier();
          const double t0 = bench::now_seconds();
          t.step(b);
          comm.barrier();
          best = std::min(best, bench::now_seconds() - t0);
        }
        const auto& a = t.activation_arena();
        per_rank[static_cast<std::size_t>(comm.rank())] = {
            static_cast<double>(a.capacity_bytes()), static_cast<double>(a.peak_held_bytes()),
            static_cast<double>(a.host_capacity_bytes()), static_cast<double>(a.peak_host_held_bytes()),
            static_cast<double>(a.offloaded_bytes() - out0), static_cast<double>(a.fetched_bytes() - in0), best * 1e3};
      });
      for (int r = 0; r < k.pp; ++r) {
        const auto& v = per_rank[static_cast<std::size_t>(r)];
        if (!offload && r == 0) base_ms = v[6];
        std::printf("%-26s %4d %9s %11.3f %9.3f %11.3f %9.3f %9.3f %9.3f %10.1f%s\n", k.name.c_str(), r,
                    offload ? "on" : "off", gb(v[0]), gb(v[1]), gb(v[2]), gb(v[3]), gb(v[4]), gb(v[5]), v[6],
                    offload && r == 0 ? (" (" + std::to_string(v[6] / base_ms).substr(0, 5) + "x off)").c_str() : "");
        bench::Row row;
        row.add_text("case", k.name)
            .add("rank", static_cast<double>(r))
            .add("offload", offload ? 1.0 : 0.0)
            .add("device_reserve_gb", gb(v[0]))
            .add("device_peak_gb", gb(v[1]))
            .add("host_reserve_gb", gb(v[2]))
            .add("host_peak_gb", gb(v[3]))
            .add("offloaded_gb_per_step", gb(v[4]))
            .add("fetched_gb_per_step", gb(v[5]))
            .add("step_ms", v[6]);
        report.add(row);
      }
    }
  }
  report.write(bench::json_path(argc, argv));
  return 0;
}

// ---- offloaded activations: copies synchronous or on the copy queue (simulated host link) ----------

int activation_copies_main(int argc, char** argv) {
  kernels::host::set_num_threads(1);
  const int iters = std::max(1, static_cast<int>(bench::int_flag(argc, argv, "--iters", 3)));
  const double gbps = bench::double_flag(argc, argv, "--act-gbps", 0.5);
  train::TrainerConfig c = link_config(0, true);
  c.dp = 1;
  c.batch = bench::int_flag(argc, argv, "--rows", 4);
  std::printf("# GPT 8 layers, width 256, vocab 8192, T %d, %d rows, 1 thread rank (1 kernel thread): saved "
              "activations offloaded (2 device frames), copies on a SIMULATED host link of %.2f GB/s (each copy held "
              "for bytes / bandwidth; both tiers are RAM); fastest of %d steps after a warm-up\n",
              static_cast<int>(c.seq), static_cast<int>(c.batch), gbps, iters);
  std::printf("%-26s %10s %10s %10s %10s %16s %12s\n", "case", "step ms", "x none", "out MB", "in MB",
              "sim. link ms", "loss");
  bench::JsonReport report("bench_zero_activation_copies");
  struct Case {
    const char* name;
    bool offload, queue;
  };
  double base = 0;
  for (const Case& k : {Case{"no offload", false, false}, Case{"offload, synchronous", true, false},
                        Case{"offload, copy queue", true, true}}) {
    train::TrainerConfig ck = c;
    ck.offload_activations = k.offload;
    ck.offload_activation_copy_queue = k.queue;
    ck.offload_activation_simulated_gbps = k.offload ? gbps : 0.0;
    double best = 1e9, loss = 0, out = 0, in = 0;
    comm::ThreadWorld(1).run([&](comm::ThreadComm& comm) {
      train::Trainer<comm::ThreadComm> t(comm, ck);
      const auto b = make_batch(static_cast<int>(c.batch), c.seq, c.model.vocab, 0);
      t.step(b);  // warm-up
      const auto& a = t.activation_arena();
      const std::size_t out0 = a.offloaded_bytes(), in0 = a.fetched_bytes();
      for (int i = 0; i < iters; ++i) {
        const double t0 = bench::now_seconds();
        loss = t.step(b).loss;
        best = std::min(best, bench::now_seconds() - t0);
      }
      out = static_cast<double>(a.offloaded_bytes() - out0) / iters;
      in = static_cast<double>(a.fetched_bytes() - in0) / iters;
    });
    if (!k.offload) base = best;
    const double link_ms = k.offload ? (out + in) / (gbps * 1e9) * 1e3 : 0.0;
    std::printf("%-26s %10.1f %10.3f %10.2f %10.2f %16.1f %12.6f\n", k.name, best * 1e3, best / base, out / 1e6, in / 1e6,
                link_ms, loss);
    bench::Row row;
    row.add_text("case", k.name)
        .add("step_ms", best * 1e3)
        .add("over_no_offload", best / base)
        .add("offloaded_mb_per_step", out / 1e6)
        .add("fetched_mb_per_step", in / 1e6)
        .add("simulated_link_ms_per_step", link_ms)
        .add("simulated_link_gb_s", gbps)
        .add("loss", loss);
    report.add(row);
  }
  report.write(bench::json_path(argc, argv));
  return 0;
}

// ---- the optimizer state on a (simulated slow) disk, prefetched or not -----------------------------

int disk_main(int argc, char** argv) {
  kernels::host::set_num_threads(1);
  const int iters = std::max(1, static_cast<int>(bench::int_flag(argc, argv, "--iters", 3)));
  const double gbps = bench::double_flag(argc, argv, "--disk-gbps", 1.0);
  const auto chunk = static_cast<std::size_t>(bench::int_flag(argc, argv, "--chunk", 1 << 20));
  const int readahead = static_cast<int>(bench::int_flag(argc, argv, "--disk-readahead", 2));
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "trellis-bench-zero-disk";
  const bool small = bench::has_flag(argc, argv, "--small");
  train::TrainerConfig c = small ? link_config(0, true) : train::TrainerConfig{};
  if (small) {
    c.dp = 1;
  } else {
    c.model = {.vocab = 50257, .positions = 1024, .layers = 12, .heads = 12, .width = 768};
    c.seq = 64;
  }
  c.batch = 1;  // one row: the update (AdamW over every parameter, and its disk traffic) is much of the step
  c.lr = {.max_lr = 3e-4, .min_lr = 3e-5, .warmup_steps = 0, .total_steps = 100};
  c.offload_dir = dir;
  c.offload_buffer_elements = chunk;
  c.offload_disk_readahead = readahead;
  std::printf("# %s, T %d, 1 row, 1 thread rank (1 kernel thread): AdamW moments "
              "on disk in chunks of %zu elements, on a SIMULATED disk of %.2f GB/s (a sleep of bytes / bandwidth "
              "before each chunk's pread / pwrite; the file is in the page cache); prefetched: %d chunks read ahead; "
              "fastest of %d steps\n",
              small ? "GPT 8 layers, width 256, vocab 8192" : "GPT-2 124M", static_cast<int>(c.seq), chunk, gbps, readahead,
              iters);
  std::printf("%-34s %10s %12s %14s %12s %12s %14s\n", "case", "step ms", "x sync", "disk ms/step", "chunks/step", "host MB",
              "loss");
  bench::JsonReport report("bench_zero_disk");
  double base = 0;  // the synchronous step of the same chunking
  for (int kase = 0; kase < 4; ++kase) {
    const bool coalesce = kase >= 2, prefetch = kase % 2 == 1;  // per tensor, then coalesced; each sync first
    train::TrainerConfig ck = c;
    ck.offload_disk_prefetch = prefetch;
    double best = 1e9, loss = 0, disk_s = 0, host_mb = 0, chunks = 0;
    comm::ThreadWorld(1).run([&](comm::ThreadComm& comm) {
      train::Trainer<comm::ThreadComm> t(comm, ck);
      t.optimizer_state().set_disk_coalescing(coalesce);
      std::mutex mutex;
      double slept = 0;
      t.optimizer_state().disk_moments().set_probe([&](const train::DiskEvent& e) {
        if (e.kind == train::DiskEvent::Kind::update) return 0;
        const double s = 2.0 * static_cast<double>(e.range.n) * sizeof(float) / (gbps * 1e9);  // m and v
        std::this_thread::sleep_for(std::chrono::duration<double>(s));
        std::lock_guard lock(mutex);
        slept += s;
        return 0;
      });
      const auto b = make_batch(c.batch, c.seq, c.model.vocab, 0);
      t.step(b);  // warm-up
      const double slept0 = slept;
      const auto chunks0 = t.optimizer_state().disk_moments().chunks_streamed();
      for (int i = 0; i < iters; ++i) {
        const double t0 = bench::now_seconds();
        loss = t.step(b).loss;
        best = std::min(best, bench::now_seconds() - t0);
      }
      disk_s = (slept - slept0) / iters;
      chunks = static_cast<double>(t.optimizer_state().disk_moments().chunks_streamed() - chunks0) / iters;
      host_mb = static_cast<double>(t.memory().host_optimizer) / 1e6;
      comm.barrier();
    });
    if (!prefetch) base = best;
    const std::string name = std::string(prefetch ? "disk, prefetched" : "disk, synchronous") +
                             (coalesce ? ", coalesced" : ", per tensor");
    std::printf("%-34s %10.1f %12.3f %14.1f %12.0f %12.1f %14.6f\n", name.c_str(), best * 1e3, best / base, disk_s * 1e3,
                chunks, host_mb, loss);
    bench::Row row;
    row.add_text("case", name)
        .add("step_ms", best * 1e3)
        .add("chunks_per_step", chunks)
        .add("over_synchronous", best / base)
        .add("simulated_disk_ms_per_step", disk_s * 1e3)
        .add("simulated_disk_gb_s", gbps)
        .add("host_optimizer_mb", host_mb)
        .add("loss", loss);
    report.add(row);
  }
  report.write(bench::json_path(argc, argv));
  return 0;
}

// --update-thread: the offloaded optimizer's CPU update (ZeRO-Offload) on a thread of its own
// while the backward goes on (offload_update_thread, with the fused update: each unit updated as
// soon as its gradients are final) against the same update on the training thread, with the
// unoffloaded fused and unfused steps beside them. GPT-2 124M, T 64, --rows rows (4), one thread
// rank with ONE kernel thread, so the update thread has the second core to itself: it stands in
// for the CPU beside a GPU (on this host the "device" is the other core, and its copies are
// memcpy, not PCIe). Round robin: --passes rounds (3) of every case, each built once per round
// and timed for --iters steps (2) after a warm-up; the fastest step over all rounds.
int update_thread_main(int argc, char** argv) {
  kernels::host::set_num_threads(1);
  const int iters = std::max(1, static_cast<int>(bench::int_flag(argc, argv, "--iters", 2)));
  const int passes = std::max(1, static_cast<int>(bench::int_flag(argc, argv, "--passes", 3)));
  train::TrainerConfig c;
  c.model = {.vocab = 50257, .positions = 1024, .layers = 12, .heads = 12, .width = 768};
  c.seq = 64;
  c.batch = bench::int_flag(argc, argv, "--rows", 4);
  c.clip = 0;  // the fused update unclipped: it needs no global norm first
  c.lr = {.max_lr = 3e-4, .min_lr = 3e-5, .warmup_steps = 0, .total_steps = 100};
  struct Case {
    const char* name;
    bool fused, offload, thread;
  };
  const Case cases[] = {{"unfused, on the device", false, false, false},
                        {"fused, on the device", true, false, false},
                        {"fused, offloaded, training thread", true, true, false},
                        {"fused, offloaded, update thread", true, true, true},
                        {"unfused, offloaded", false, true, false}};
  constexpr std::size_t n = std::size(cases);
  std::array<double, n> best{}, loss{};
  best.fill(1e9);
  const auto b = make_batch(c.batch, c.seq, c.model.vocab, 0);
  for (int round = 0; round < passes; ++round)
    for (std::size_t k = 0; k < n; ++k) {
      train::TrainerConfig ck = c;
      ck.fused_update = cases[k].fused ? train::TrainerConfig::FusedUpdate::unclipped : train::TrainerConfig::FusedUpdate::off;
      ck.offload_optimizer = cases[k].offload;
      ck.offload_update_thread = cases[k].thread;
      comm::ThreadWorld(1).run([&](comm::ThreadComm& comm) {
        train::Trainer<comm::ThreadComm> t(comm, ck);
        t.step(b);  // warm-up
        for (int i = 0; i < iters; ++i) {
          const double t0 = bench::now_seconds();
          loss[k] = t.step(b).loss;
          best[k] = std::min(best[k], bench::now_seconds() - t0);
        }
      });
    }
  std::printf("# GPT-2 124M, T %d, %d rows, 1 thread rank with 1 kernel thread (the update thread has the other "
              "core: the CPU beside a SIMULATED device); fused: AdamW per unit in the backward, unclipped; "
              "fastest of %d rounds x %d steps (round robin)\n",
              static_cast<int>(c.seq), static_cast<int>(c.batch), passes, iters);
  std::printf("%-36s %10s %14s %12s\n", "case", "step ms", "x unfused", "loss");
  bench::JsonReport report("bench_zero_update_thread");
  for (std::size_t k = 0; k < n; ++k) {
    std::printf("%-36s %10.1f %14.3f %12.6f\n", cases[k].name, best[k] * 1e3, best[k] / best[0], loss[k]);
    bench::Row row;
    row.add_text("case", cases[k].name).add("step_ms", best[k] * 1e3).add("over_unfused", best[k] / best[0]).add("loss", loss[k]);
    report.add(row);
  }
  std::printf("# the update thread against the training thread (offloaded, fused): %.3f\n", best[3] / best[2]);
  report.write(bench::json_path(argc, argv));
  return 0;
}

int main(int argc, char** argv) {
  try {
    if (bench::has_flag(argc, argv, "--disk")) return disk_main(argc, argv);
    if (bench::has_flag(argc, argv, "--link")) return link_main(argc, argv);
    if (bench::has_flag(argc, argv, "--activation-copies")) return activation_copies_main(argc, argv);
    if (bench::has_flag(argc, argv, "--activations")) return activations_main(argc, argv);
    if (bench::has_flag(argc, argv, "--update-thread")) return update_thread_main(argc, argv);
    return memory_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_zero: %s\n", e.what());
    return 1;
  }
}
