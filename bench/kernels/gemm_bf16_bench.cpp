// bf16 host GEMMs (issue #19): GPT-2 124M's products at T = 64, B = 4 (m = 256 token rows), each
// linear's forward, input-gradient and weight-gradient product, timed three ways in one process:
//   fp32    host::gemm on fp32 operands (single-threaded OpenBLAS sgemm per tile on the kernel pool:
//           what backend::Host<float> runs)
//   convert host::gemm on bf16 operands via fp32 copies (Bf16Product::convert_fp32: what
//           backend::Host<bfloat16> ran before oneDNN)
//   dnnl    host::gemm on bf16 operands, Bf16Product::automatic (oneDNN's AMX / AVX512-BF16 matmul
//           per tile when linked; otherwise the same as convert, and the header line says so)
// Same epilogues and output types as the layers: forward with bias (bias + GELU with pre-activation
// for c_fc; none for the tied LM head), bf16 outputs for activations and input gradients, fp32
// weight gradients accumulated (beta = 1). Variants alternate in runs of back-to-back calls after
// 0.1 s of untimed calls, so noise hits them alike; GFLOP/s from the min and the median time.
//   gemm_bf16_bench [--threads N] [--repeat R] [--json FILE]
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "support/report.hpp"
#include "trellis/kernels/cpu_peak.hpp"
#include "trellis/kernels/gemm_host.hpp"

using namespace trellis;
using namespace trellis::kernels;
namespace tb = trellis::bench;

namespace {

template <class T>
std::vector<T> filled(std::size_t n, float scale, std::uint32_t seed) {
  std::vector<T> v(n);
  for (auto& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = T(scale * (static_cast<float>(seed >> 8) / 16777216.0f - 0.5f));
  }
  return v;
}

enum class Pass { forward, dx, dw };

struct Product {
  const char* layer;
  Pass pass;
  GemmArgs args;
  const char* epilogue;  // none, bias, bias_gelu
  int reps;
};

// One product at element type T (float or bfloat16): operands, outputs and the call.
template <class T>
struct Operands {
  std::vector<T> a, b, c16;
  std::vector<float> c32, bias;
  std::vector<T> pre, bias_t;
  Operands(const Product& p) {
    const GemmArgs& g = p.args;
    a = filled<T>(g.a_rows() * g.a_cols(), 1.0f, 1);
    b = filled<T>(g.b_rows() * g.b_cols(), 0.1f, 2);
    c16.assign(g.m * g.n, T(0.0f));
    c32.assign(g.m * g.n, 0.0f);
    pre.assign(g.m * g.n, T(0.0f));
    bias = filled<float>(g.n, 0.2f, 3);
    bias_t = filled<T>(g.n, 0.2f, 3);
  }
  void run(const Product& p, host::GemmOptions opt) {
    const std::string ep = p.epilogue;
    if (p.pass == Pass::dw) {  // fp32 weight gradient, accumulated
      host::gemm(p.args, a.data(), b.data(), c32.data(), epilogue::None{}, opt);
    } else if (ep == "bias") {
      host::gemm(p.args, a.data(), b.data(), c16.data(), epilogue::Bias<>{bias.data()}, opt);
    } else if (ep == "bias_gelu") {
      host::gemm(p.args, a.data(), b.data(), c16.data(), epilogue::BiasGelu<T>{bias_t.data(), pre.data()}, opt);
    } else {
      host::gemm(p.args, a.data(), b.data(), c16.data(), epilogue::None{}, opt);
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  const int repeat = std::max(1, static_cast<int>(tb::int_flag(argc, argv, "--repeat", 1)));
  if (const long long threads = tb::int_flag(argc, argv, "--threads", 0); threads > 0)
    host::set_num_threads(static_cast<int>(threads));
  constexpr std::int64_t R = 256, C = 768, V = 50257;
  std::vector<Product> products;
  auto linear = [&](const char* name, std::int64_t in, std::int64_t out, const char* ep, int reps) {
    // weight stored in x out (nn/tensor_parallel.hpp): y = x w, dx = dy w^T, dw += x^T dy
    products.push_back({name, Pass::forward, gemm_args(R, out, in), ep, reps});
    products.push_back({name, Pass::dx, gemm_args(R, in, out, Op::none, Op::transpose), "none", reps});
    products.push_back({name, Pass::dw, gemm_args(in, out, R, Op::transpose, Op::none, 1.0f, 1.0f), "none", reps});
  };
  linear("attn.c_attn", C, 3 * C, "bias", 12);
  linear("attn.c_proj", C, C, "bias", 30);
  linear("mlp.c_fc", C, 4 * C, "bias_gelu", 10);
  linear("mlp.c_proj", 4 * C, C, "bias", 10);
  // tied LM head, wte stored V x C: logits = x wte^T, dx = dlogits wte, dwte += dlogits^T x
  products.push_back({"lm_head", Pass::forward, gemm_args(R, V, C, Op::none, Op::transpose), "none", 2});
  products.push_back({"lm_head", Pass::dx, gemm_args(R, C, V), "none", 2});
  products.push_back({"lm_head", Pass::dw, gemm_args(V, C, R, Op::transpose, Op::none, 1.0f, 1.0f), "none", 2});

  // The machine's peaks (kernels/cpu_peak.hpp): the sums below as fractions of them.
  const host::CpuPeak machine = host::measure_cpu_peak(host::kernel_thread_count());
  std::printf("machine peak: %s\n", machine.describe().c_str());
  const std::string impl = host::dnnl_bf16_native() ? host::dnnl_bf16_implementation() : "not used (fp32 path)";
  std::printf("host GEMM GFLOP/s, GPT-2 124M products at %lld token rows, %d threads; bf16 via oneDNN: %s\n",
              (long long)R, host::kernel_thread_count(), impl.c_str());
  std::printf("%-12s %-4s %6s %6s %6s %-9s | %9s %9s | %9s %9s | %9s %9s | %7s %7s\n", "layer", "pass", "m", "n", "k",
              "epilogue", "fp32_max", "fp32_med", "conv_max", "conv_med", "dnnl_max", "dnnl_med", "dnnl/32", "dnnl/cv");
  tb::JsonReport report("gemm_bf16_bench");
  double total_gflop = 0;
  double total_fp32 = 0, total_conv = 0, total_dnnl = 0;  // sums of min times over the products
  const char* pass_names[] = {"fwd", "dx", "dw"};
  for (const Product& p : products) {
    Operands<float> f32(p);
    Operands<bfloat16> b16(p);
    host::GemmOptions conv_opt, dnnl_opt;
    conv_opt.bf16_product = host::Bf16Product::convert_fp32;
    auto fp32 = [&] { f32.run(p, {}); };
    auto conv = [&] { b16.run(p, conv_opt); };
    auto dnnl = [&] { b16.run(p, dnnl_opt); };
    std::vector<double> t32, tcv, tdn;
    auto timed_run = [&](auto&& call, std::vector<double>& wall, int calls) {
      const double warm_until = tb::now_seconds() + 0.1;
      do call();
      while (tb::now_seconds() < warm_until);
      for (int i = 0; i < calls; ++i) {
        const double t0 = tb::now_seconds();
        call();
        wall.push_back(tb::now_seconds() - t0);
      }
    };
    const int runs = 3 * repeat, per_run = std::max(1, p.reps / 3 + 1);
    for (int r = 0; r < runs; ++r) {
      timed_run(fp32, t32, per_run);
      timed_run(conv, tcv, per_run);
      timed_run(dnnl, tdn, per_run);
    }
    auto mm = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return std::pair<double, double>{v.front(), v[v.size() / 2]};
    };
    auto [f_min, f_med] = mm(t32);
    auto [c_min, c_med] = mm(tcv);
    auto [d_min, d_med] = mm(tdn);
    total_fp32 += f_min, total_conv += c_min, total_dnnl += d_min;
    const double flop = 2.0 * p.args.m * p.args.n * p.args.k * 1e-9;
    total_gflop += flop;
    std::printf("%-12s %-4s %6lld %6lld %6lld %-9s | %9.1f %9.1f | %9.1f %9.1f | %9.1f %9.1f | %7.2f %7.2f\n", p.layer,
                pass_names[int(p.pass)], (long long)p.args.m, (long long)p.args.n, (long long)p.args.k, p.epilogue,
                flop / f_min, flop / f_med, flop / c_min, flop / c_med, flop / d_min, flop / d_med, f_min / d_min,
                c_min / d_min);
    tb::Row row;
    row.add_text("layer", p.layer).add_text("pass", pass_names[int(p.pass)]);
    row.add("m", (long long)p.args.m).add("n", (long long)p.args.n).add("k", (long long)p.args.k);
    row.add_text("epilogue", p.epilogue);
    row.add("fp32_min_s", f_min, "%.6f").add("fp32_median_s", f_med, "%.6f");
    row.add("convert_min_s", c_min, "%.6f").add("convert_median_s", c_med, "%.6f");
    row.add("dnnl_min_s", d_min, "%.6f").add("dnnl_median_s", d_med, "%.6f");
    report.add(row);
  }
  std::printf("sum of min times over the products (one layer's three products each + LM head): fp32 %.4f s, "
              "convert %.4f s, dnnl %.4f s; fp32/dnnl %.2f, convert/dnnl %.2f\n",
              total_fp32, total_conv, total_dnnl, total_fp32 / total_dnnl, total_conv / total_dnnl);
  std::printf("against the machine peaks: fp32 %.1f GFLOP/s = %.1f%% of the fp32 peak; dnnl %.1f GFLOP/s = %.1f%% of "
              "the bf16 peak (%s), %.1f%% of the fp32 peak\n",
              total_gflop / total_fp32, 100.0 * total_gflop * 1e9 / total_fp32 / machine.theoretical.fp32,
              total_gflop / total_dnnl, 100.0 * total_gflop * 1e9 / total_dnnl / machine.theoretical.bf16,
              host::bf16_peak_unit(machine.features), 100.0 * total_gflop * 1e9 / total_dnnl / machine.theoretical.fp32);
  report.write(tb::json_path(argc, argv));
  return 0;
}
