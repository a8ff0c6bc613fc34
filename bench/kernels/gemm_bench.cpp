// Host GEMM + fused epilogue vs bare cblas_sgemm of the same shape, timed alternately in one run.
// Shapes are GPT-2 small's linear layers (n/k in {768, 3072, 50257}). The "unfused" column is
// cblas_sgemm followed by a separate pass of the same epilogue code over the whole output (same
// threads): what fusing saves. Columns: min and median seconds; ratio = fused / bare (min and median).
// With --threads N both OpenBLAS and the kernel thread pool use N threads; on a loaded machine
// `--threads 1` also gives meaningful process-CPU-time ratios (cpu_r), which preemption by other
// processes does not inflate. --repeat R runs R times the default repetitions of every shape (more
// samples for the medians on a noisy machine). The bare call runs on OpenBLAS' own threads
// (openblas_set_num_threads before each call); trellis runs single-threaded sgemm calls on tiles
// of its kernel pool. Each variant is timed in runs of back-to-back calls, each run after 0.2 s of
// untimed calls of the same variant: OpenBLAS' workers spin for OPENBLAS_THREAD_TIMEOUT after a
// call (2^n cycles; default 2^28, ~0.1 s here) and take a core from whatever runs next, so every
// variant is timed in its own steady state, as in a loop of such calls (see docs/kernels_host.md).
// The runs of the three variants alternate, so that machine noise hits them alike.
//   gemm_bench [--quick] [--threads N] [--repeat R] [--json FILE]
#include <cblas.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "support/blas_peer.hpp"
#include "support/report.hpp"
#include "trellis/kernels/gemm_host.hpp"

using namespace trellis::kernels;
namespace tb = trellis::bench;

namespace {

struct Shape {
  std::int64_t m, n, k;
  const char* epilogue;  // none, bias, bias_gelu
  int reps;
};

std::vector<float> filled(std::size_t n, float scale) {
  std::vector<float> v(n);
  std::uint32_t s = 12345;
  for (auto& x : v) {
    s = s * 1664525u + 1013904223u;
    x = scale * (static_cast<float>(s >> 8) / 16777216.0f - 0.5f);
  }
  return v;
}

double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

}  // namespace


int main(int argc, char** argv) {
  const bool quick = tb::has_flag(argc, argv, "--quick");
  const int repeat = std::max(1, static_cast<int>(tb::int_flag(argc, argv, "--repeat", 1)));
  if (const long long threads = tb::int_flag(argc, argv, "--threads", 0); threads > 0)
    host::set_num_threads(static_cast<int>(threads));
  std::vector<Shape> shapes = {
      {256, 768, 768, "none", 20},       {1024, 3072, 768, "bias_gelu", 10}, {1024, 768, 3072, "bias", 10},
      {4096, 3072, 768, "bias_gelu", 5}, {4096, 768, 768, "bias", 8},        {4096, 3072, 768, "none", 5},
      {512, 50257, 768, "none", 3},      {512, 50257, 768, "bias", 3},
  };
  if (quick) shapes.resize(3);
  tb::JsonReport report("gemm_bench");
  // OpenBLAS' workers spin for OPENBLAS_THREAD_TIMEOUT (2^n cycles, default 2^28) after each call,
  // which slows the bare peer's successors (and, in the old design, the epilogue); it is printed.
  const char* timeout_env = std::getenv("OPENBLAS_THREAD_TIMEOUT");
  const std::string openblas_timeout = timeout_env ? timeout_env : "default";
  std::printf("host GEMM + fused epilogue vs cblas_sgemm (OpenBLAS, %d threads each, OPENBLAS_THREAD_TIMEOUT=%s), "
              "row-major, fp32\n",
              host::kernel_thread_count(), openblas_timeout.c_str());
  std::printf("%6s %6s %6s %-10s %10s %10s %10s %10s %10s %8s %8s %8s %9s\n", "m", "n", "k", "epilogue", "bare_min",
              "bare_med", "fused_min", "fused_med", "unfus_min", "r_min", "r_med", "cpu_r", "GFLOP/s");
  for (const Shape& s : shapes) {
    auto a = filled(s.m * s.k, 1.0f), b = filled(s.k * s.n, 1.0f), bias = filled(s.n, 0.2f);
    std::vector<float> c(s.m * s.n), pre(s.m * s.n);
    const std::string ep = s.epilogue;
    auto bare = [&] {
      tb::use_openblas_threads();  // the trellis calls leave OpenBLAS single-threaded
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(s.m), int(s.n), int(s.k), 1.0f, a.data(), int(s.k),
                  b.data(), int(s.n), 0.0f, c.data(), int(s.n));
    };
    auto fused = [&] {
      const GemmArgs args = gemm_args(s.m, s.n, s.k);
      if (ep == "none") host::gemm(args, a.data(), b.data(), c.data());
      else if (ep == "bias") host::gemm(args, a.data(), b.data(), c.data(), epilogue::Bias<>{bias.data()});
      else host::gemm(args, a.data(), b.data(), c.data(), epilogue::BiasGelu<>{bias.data(), pre.data()});
    };
    auto unfused = [&] {
      bare();
      if (ep == "none") return;
      // The same epilogue code as a second pass over the whole output, on the same thread pool.
      host::parallel_for((s.m + 63) / 64, [&](std::int64_t chunk) {
        for (std::int64_t i = chunk * 64; i < std::min(s.m, (chunk + 1) * 64); ++i) {
          float* row = c.data() + i * s.n;
          float* prow = pre.data() + i * s.n;
          if (ep == "bias") {
            for (std::int64_t j = 0; j < s.n; ++j) row[j] += bias[j];
          } else {
            host::gelu_row(s.n, row, bias.data(), prow);
          }
        }
      });
    };
    // Runs of `per_run` timed calls per variant, each after 0.2 s of untimed calls of it.
    std::vector<double> tb_, tf, tu, cb, cf;
    auto timed_run = [&](auto&& call, std::vector<double>& wall, std::vector<double>* cpu, int calls) {
      const double warm_until = tb::now_seconds() + 0.2;
      do call();
      while (tb::now_seconds() < warm_until);
      for (int i = 0; i < calls; ++i) {
        const double c0 = cpu_seconds(), t0 = tb::now_seconds();
        call();
        const double t1 = tb::now_seconds();
        wall.push_back(t1 - t0);
        if (cpu) cpu->push_back(cpu_seconds() - c0);
      }
    };
    const int runs = 3 * repeat, per_run = std::max(1, s.reps / 3 + 1);
    for (int r = 0; r < runs; ++r) {
      timed_run(bare, tb_, &cb, per_run);
      timed_run(fused, tf, &cf, per_run);
      timed_run(unfused, tu, nullptr, per_run);
    }
    const double cpu_ratio = *std::min_element(cf.begin(), cf.end()) / *std::min_element(cb.begin(), cb.end());
    auto mm = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return std::pair<double, double>{v.front(), v[v.size() / 2]};
    };
    auto [bmin, bmed] = mm(tb_);
    auto [fmin, fmed] = mm(tf);
    auto [umin, umed] = mm(tu);
    const double gflops = 2.0 * s.m * s.n * s.k / fmin * 1e-9;
    std::printf("%6lld %6lld %6lld %-10s %10.5f %10.5f %10.5f %10.5f %10.5f %8.3f %8.3f %8.3f %9.1f\n",
                (long long)s.m, (long long)s.n, (long long)s.k, s.epilogue, bmin, bmed, fmin, fmed, umin, fmin / bmin,
                fmed / bmed, cpu_ratio, gflops);
    tb::Row row;
    row.add("m", (long long)s.m).add("n", (long long)s.n).add("k", (long long)s.k).add_text("epilogue", s.epilogue);
    row.add("bare_min_s", bmin, "%.6f").add("bare_median_s", bmed, "%.6f");
    row.add("fused_min_s", fmin, "%.6f").add("fused_median_s", fmed, "%.6f");
    row.add("unfused_min_s", umin, "%.6f").add("unfused_median_s", umed, "%.6f");
    row.add("ratio_min", fmin / bmin, "%.4f").add("ratio_median", fmed / bmed, "%.4f").add("gflops", gflops, "%.1f");
    row.add("cpu_ratio_min", cpu_ratio, "%.4f").add("threads", (long long)host::kernel_thread_count());
    row.add_text("openblas_thread_timeout", openblas_timeout);
    report.add(row);
  }
  report.write(tb::json_path(argc, argv));
  return 0;
}
