// Grouped GEMM for Mixture-of-Experts layers: host::grouped_gemm (every expert's tiles in one
// parallel_for) vs a loop of per-expert host::gemm calls vs one dense host::gemm of the same FLOPs,
// timed alternately in one run. The products are those of the c_fc linear of an MoE expert MLP,
// E experts, width d, hidden h, T routed rows in all (expert e gets m_e rows, back to back):
//   forward  H_e  = gelu(X_e W_e + b_e), pre-activation saved     (m_e x d) x (d x h), BiasGelu
//            dense: X (T x d) x W (d x h), BiasGelu
//   dx       dX_e = dH_e W_e^T                                     (m_e x h) x (h x d), W_e stored d x h
//            dense: dH (T x h) x W^T
//   dw       dW_e = X_e^T dH_e: m = d, n = h, k = m_e              (rows of each expert summed over)
//            dense: X^T dH, m = d, n = h, k = T
// Loads: balanced (T / E rows each) and skewed (halving: 2048, 1024, ..., 64, 64, 0 at T = 4096).
// Every variant does 2 T d h FLOPs, so GFLOP/s compare directly; g/d = dense time / grouped time
// (grouped's speed relative to the dense GEMM: the goal is >= 0.9 on balanced loads), g/l = loop
// time / grouped time. Each variant is timed in runs of back-to-back calls, each run after 0.2 s
// of untimed calls of it (0.05 s with --quick), and the runs of the three variants alternate, so
// that machine noise hits them alike (as gemm_bench does). Columns: min and median seconds. Before
// timing, grouped and loop outputs are compared bit for bit (column `same`).
// All three variants run single-threaded BLAS calls on the kernel pool; --threads N sets its size.
// --quick: d = 256, h = 1024, T = 1024 (a few seconds).
//   grouped_gemm_bench [--quick] [--threads N] [--repeat R] [--json FILE]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "support/report.hpp"
#include "trellis/kernels/gemm_host.hpp"

using namespace trellis::kernels;
namespace tb = trellis::bench;

namespace {

std::vector<float> filled(std::size_t n, float scale, std::uint32_t seed) {
  std::vector<float> v(n);
  for (auto& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = scale * (static_cast<float>(seed >> 8) / 16777216.0f - 0.5f);
  }
  return v;
}

struct Timing {
  double min = 0.0, median = 0.0;
};

Timing summary(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v.front(), v[v.size() / 2]};
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = tb::has_flag(argc, argv, "--quick");
  const int repeat = std::max(1, static_cast<int>(tb::int_flag(argc, argv, "--repeat", 1)));
  if (const long long threads = tb::int_flag(argc, argv, "--threads", 0); threads > 0)
    host::set_num_threads(static_cast<int>(threads));
  const std::int64_t experts = 8, d = quick ? 256 : 768, h = quick ? 1024 : 3072, total = quick ? 1024 : 4096;
  const double warm_seconds = quick ? 0.05 : 0.2;
  const int runs = 3 * repeat, per_run = 2;

  struct Load {
    const char* name;
    std::vector<std::int64_t> rows;
  };
  std::vector<Load> loads = {{"balanced", std::vector<std::int64_t>(experts, total / experts)},
                             {"skewed", {2048, 1024, 512, 256, 128, 64, 64, 0}}};
  for (auto& r : loads[1].rows) r = r * total / 4096;

  // Operands: the routed rows back to back (X, H, dH, dX), per-expert weights, biases, gradients.
  const auto x = filled(static_cast<std::size_t>(total * d), 1.0f, 1);
  const auto dh = filled(static_cast<std::size_t>(total * h), 1.0f, 2);
  const auto w = filled(static_cast<std::size_t>(experts * d * h), 0.1f, 3);
  const auto bias = filled(static_cast<std::size_t>(experts * h), 0.2f, 4);
  std::vector<float> hidden(total * h), pre(total * h), dx(total * d), dw(experts * d * h);

  tb::JsonReport report("grouped_gemm_bench");
  std::printf("MoE expert products: grouped_gemm vs a loop of per-expert gemm calls vs one dense gemm of the same "
              "FLOPs\n%lld experts, d = %lld, h = %lld, T = %lld rows, kernel pool of %d threads (single-threaded "
              "BLAS per tile), fp32, row-major\n",
              (long long)experts, (long long)d, (long long)h, (long long)total, host::kernel_thread_count());
  for (const Load& load : loads) {
    std::printf("%-8s rows per expert:", load.name);
    for (std::int64_t r : load.rows) std::printf(" %lld", (long long)r);
    std::printf("\n");
  }
  std::printf("%-8s %-8s %9s %9s %9s %9s %9s %9s %7s %7s %7s %7s %7s %7s %7s %4s\n", "product", "load", "grp_min",
              "grp_med", "loop_min", "loop_med", "dense_min", "dense_med", "grp_GF", "loop_GF", "dense_GF", "g/d_min",
              "g/d_med", "g/l_min", "g/l_med", "same");

  const double flops = 2.0 * static_cast<double>(total) * static_cast<double>(d) * static_cast<double>(h);
  for (const char* product : {"forward", "dx", "dw"}) {
    const std::string p = product;
    for (const Load& load : loads) {
      // The groups of this product and load, and its dense equivalent.
      std::vector<GemmGroup<float, float, float, epilogue::BiasGelu<>>> fwd;
      std::vector<GemmGroup<float, float, float, epilogue::None>> plain;
      std::int64_t row0 = 0;
      for (std::int64_t e = 0; e < experts; ++e) {
        const std::int64_t m = load.rows[e];
        const float* we = w.data() + e * d * h;
        if (p == "forward") {
          fwd.push_back({gemm_args(m, h, d), x.data() + row0 * d, we, hidden.data() + row0 * h,
                         {bias.data() + e * h, pre.data() + row0 * h}});
        } else if (p == "dx") {
          plain.push_back({gemm_args(m, d, h, Op::none, Op::transpose), dh.data() + row0 * h, we, dx.data() + row0 * d, {}});
        } else {
          plain.push_back({gemm_args(d, h, m, Op::transpose, Op::none), x.data() + row0 * d, dh.data() + row0 * h,
                           dw.data() + e * d * h, {}});
        }
        row0 += m;
      }
      auto grouped = [&] {
        if (p == "forward") host::grouped_gemm(fwd);
        else host::grouped_gemm(plain);
      };
      auto loop = [&] {
        if (p == "forward")
          for (const auto& g : fwd) host::gemm(g.args, g.a, g.b, g.c, g.ep);
        else
          for (const auto& g : plain) host::gemm(g.args, g.a, g.b, g.c, g.ep);
      };
      auto dense = [&] {
        if (p == "forward")
          host::gemm(gemm_args(total, h, d), x.data(), w.data(), hidden.data(),
                     epilogue::BiasGelu<>{bias.data(), pre.data()});
        else if (p == "dx")
          host::gemm(gemm_args(total, d, h, Op::none, Op::transpose), dh.data(), w.data(), dx.data());
        else
          host::gemm(gemm_args(d, h, total, Op::transpose, Op::none), x.data(), dh.data(), dw.data());
      };
      // The outputs this product writes, to compare grouped and loop once.
      std::vector<std::vector<float>*> outputs;
      if (p == "forward") outputs = {&hidden, &pre};
      else if (p == "dx") outputs = {&dx};
      else outputs = {&dw};
      grouped();
      std::vector<std::vector<float>> first;
      for (auto* o : outputs) first.push_back(*o);
      loop();
      bool same = true;
      for (std::size_t i = 0; i < outputs.size(); ++i)
        same = same && std::memcmp(first[i].data(), outputs[i]->data(), first[i].size() * sizeof(float)) == 0;

      std::vector<double> tg, tl, td;
      auto timed_run = [&](auto&& call, std::vector<double>& wall) {
        const double warm_until = tb::now_seconds() + warm_seconds;
        do call();
        while (tb::now_seconds() < warm_until);
        for (int i = 0; i < per_run; ++i) {
          const double t0 = tb::now_seconds();
          call();
          wall.push_back(tb::now_seconds() - t0);
        }
      };
      for (int r = 0; r < runs; ++r) {
        timed_run(grouped, tg);
        timed_run(loop, tl);
        timed_run(dense, td);
      }
      const Timing g = summary(tg), l = summary(tl), dn = summary(td);
      const double g_gf = flops / g.min * 1e-9, l_gf = flops / l.min * 1e-9, d_gf = flops / dn.min * 1e-9;
      std::printf("%-8s %-8s %9.5f %9.5f %9.5f %9.5f %9.5f %9.5f %7.1f %7.1f %7.1f %7.3f %7.3f %7.3f %7.3f %4s\n",
                  product, load.name, g.min, g.median, l.min, l.median, dn.min, dn.median, g_gf, l_gf, d_gf,
                  dn.min / g.min, dn.median / g.median, l.min / g.min, l.median / g.median, same ? "yes" : "NO");
      tb::Row row;
      row.add_text("product", product).add_text("load", load.name);
      row.add("experts", (long long)experts).add("d", (long long)d).add("h", (long long)h).add("rows", (long long)total);
      row.add("grouped_min_s", g.min, "%.6f").add("grouped_median_s", g.median, "%.6f");
      row.add("loop_min_s", l.min, "%.6f").add("loop_median_s", l.median, "%.6f");
      row.add("dense_min_s", dn.min, "%.6f").add("dense_median_s", dn.median, "%.6f");
      row.add("grouped_gflops", g_gf, "%.1f").add("loop_gflops", l_gf, "%.1f").add("dense_gflops", d_gf, "%.1f");
      row.add("grouped_vs_dense_min", dn.min / g.min, "%.4f").add("grouped_vs_dense_median", dn.median / g.median, "%.4f");
      row.add("grouped_vs_loop_min", l.min / g.min, "%.4f").add("grouped_vs_loop_median", l.median / g.median, "%.4f");
      row.add("threads", (long long)host::kernel_thread_count()).add_text("same_bits", same ? "yes" : "no");
      report.add(row);
    }
  }
  report.write(tb::json_path(argc, argv));
  return 0;
}
