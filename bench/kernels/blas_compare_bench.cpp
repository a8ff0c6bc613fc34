// Which CBLAS for the host GEMMs (issue #19)? GPT-2 124M's fp32 products (the shapes of
// gemm_bf16_bench: each linear's forward, input-gradient and weight-gradient product at 256 token
// rows, and the tied LM head) as plain cblas_sgemm, side by side:
//   openblas   OpenBLAS with the core it detects (OPENBLAS_CORETYPE unset)
//   forced     OpenBLAS with OPENBLAS_CORETYPE = the core for this CPU's widest units
//              (recommended_openblas_core; OpenBLAS reads it when it loads, hence a process each)
//   blis       BLIS (Debian's libblis-dev), its own architecture detection
//   blis forced BLIS with BLIS_ARCH_TYPE=0 ("skx", AVX-512) on an AVX-512 CPU
// Each library is dlopen()ed by a child process of this binary (the binary links no BLAS, so two
// libraries defining cblas_sgemm never meet); the children run round robin, --rounds times, and
// each shape's best time over the rounds is reported. Inside a child, as in trellis' host GEMM:
// the library single-threaded, C's rows split over the kernel pool's threads (one sgemm each).
//   blas_compare_bench [--threads N] [--rounds R] [--json FILE]
//   blas_compare_bench --child openblas|blis [--threads N]      (one library, one line per shape)
// Library paths: $TRELLIS_OPENBLAS_LIB (default libopenblas.so.0), $TRELLIS_BLIS_LIB (default:
// Debian's blis-pthread, blis-openmp, blis-serial, then libblis.so.4).
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "support/report.hpp"
#include "trellis/kernels/blas_core.hpp"
#include "trellis/kernels/cpu_peak.hpp"
#include "trellis/kernels/thread_pool.hpp"

namespace tb = trellis::bench;
namespace host = trellis::kernels::host;

namespace {

struct Shape {
  const char* name;
  int m, n, k;
  bool ta, tb;
};

// Row-major, C = op(A) op(B); weights stored in x out (y = x w), wte V x C.
std::vector<Shape> gpt2_shapes() {
  constexpr int R = 256, C = 768, V = 50257;
  std::vector<Shape> s;
  auto linear = [&](const char* fwd, const char* dx, const char* dw, int in, int out) {
    s.push_back({fwd, R, out, in, false, false});
    s.push_back({dx, R, in, out, false, true});
    s.push_back({dw, in, out, R, true, false});
  };
  linear("attn.c_attn fwd", "attn.c_attn dx", "attn.c_attn dw", C, 3 * C);
  linear("attn.c_proj fwd", "attn.c_proj dx", "attn.c_proj dw", C, C);
  linear("mlp.c_fc fwd", "mlp.c_fc dx", "mlp.c_fc dw", C, 4 * C);
  linear("mlp.c_proj fwd", "mlp.c_proj dx", "mlp.c_proj dw", 4 * C, C);
  s.push_back({"lm_head fwd", R, V, C, false, true});
  s.push_back({"lm_head dx", R, C, V, false, false});
  s.push_back({"lm_head dw", V, C, R, true, false});
  return s;
}

using SgemmFn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;  // CBLAS enum values (cblas.h)

std::string blis_default_path() {
  for (const char* p : {"/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4",
                        "/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4",
                        "/usr/lib/x86_64-linux-gnu/blis-serial/libblis.so.4"})
    if (access(p, R_OK) == 0) return p;
  return "libblis.so.4";
}

// One library: prints "lib <name> <core>" then "shape <i> <min_s> <median_s>" per shape.
int child(const std::string& which, int threads) {
  const char* env = std::getenv(which == "blis" ? "TRELLIS_BLIS_LIB" : "TRELLIS_OPENBLAS_LIB");
  const std::string path = env ? env : which == "blis" ? blis_default_path() : "libopenblas.so.0";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    std::printf("error cannot load %s: %s\n", path.c_str(), dlerror());
    return 1;
  }
  auto sgemm = reinterpret_cast<SgemmFn>(dlsym(lib, "cblas_sgemm"));
  if (!sgemm) {
    std::printf("error %s has no cblas_sgemm\n", path.c_str());
    return 1;
  }
  std::string core = "?";
  if (which == "blis") {  // single-threaded; the architecture BLIS picked
    if (auto set = reinterpret_cast<void (*)(std::int64_t)>(dlsym(lib, "bli_thread_set_num_threads"))) set(1);
    auto id = reinterpret_cast<int (*)()>(dlsym(lib, "bli_arch_query_id"));
    auto name = reinterpret_cast<const char* (*)(int)>(dlsym(lib, "bli_arch_string"));
    if (id && name) core = name(id());
  } else {
    if (auto set = reinterpret_cast<void (*)(int)>(dlsym(lib, "openblas_set_num_threads"))) set(1);
    if (auto name = reinterpret_cast<char* (*)()>(dlsym(lib, "openblas_get_corename"))) core = name();
  }
  std::printf("lib %s %s\n", which.c_str(), core.c_str());
  host::set_num_threads(threads);
  const auto shapes = gpt2_shapes();
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    std::vector<float> a(static_cast<std::size_t>(s.m) * s.k), b(static_cast<std::size_t>(s.k) * s.n),
        c(static_cast<std::size_t>(s.m) * s.n, 0.0f);
    for (std::size_t j = 0; j < a.size(); ++j) a[j] = static_cast<float>(j % 17) * 0.01f - 0.08f;
    for (std::size_t j = 0; j < b.size(); ++j) b[j] = static_cast<float>(j % 13) * 0.01f - 0.06f;
    const int lda = s.ta ? s.m : s.k, ldb = s.tb ? s.k : s.n, ldc = s.n;
    const int parts = std::min(threads, std::max(1, s.m / 16));
    auto call = [&] {  // C's rows split over the pool, one single-threaded sgemm each
      host::parallel_for(parts, [&](std::int64_t p) {
        const int r0 = static_cast<int>(s.m * p / parts), r1 = static_cast<int>(s.m * (p + 1) / parts);
        const float* ap = s.ta ? a.data() + r0 : a.data() + static_cast<std::size_t>(r0) * lda;
        sgemm(kRowMajor, s.ta ? kTrans : kNoTrans, s.tb ? kTrans : kNoTrans, r1 - r0, s.n, s.k, 1.0f, ap, lda,
              b.data(), ldb, 0.0f, c.data() + static_cast<std::size_t>(r0) * ldc, ldc);
      });
    };
    const double warm_until = tb::now_seconds() + 0.1;
    do call();
    while (tb::now_seconds() < warm_until);
    std::vector<double> t;
    const double start = tb::now_seconds();
    while (t.size() < 3 || (tb::now_seconds() - start < 0.3 && t.size() < 50)) {
      const double t0 = tb::now_seconds();
      call();
      t.push_back(tb::now_seconds() - t0);
    }
    std::sort(t.begin(), t.end());
    std::printf("shape %zu %.9f %.9f\n", i, t.front(), t[t.size() / 2]);
    std::fflush(stdout);
  }
  return 0;
}

struct Column {
  std::string label, env, which, core;
  std::vector<double> min_s, median_s;  // per shape, best over the rounds
  std::string error;
};

void run_child(const std::string& self, Column& col, int threads) {
  const std::string cmd = "env " + col.env + " '" + self + "' --child " + col.which + " --threads " +
                          std::to_string(threads) + " 2>&1";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(popen(cmd.c_str(), "r"), pclose);
  char buf[512];
  while (pipe && std::fgets(buf, sizeof buf, pipe.get())) {
    std::string line(buf);
    char w[64], core[128];
    std::size_t i = 0;
    double mn = 0, md = 0;
    if (std::sscanf(buf, "lib %63s %127s", w, core) == 2) {
      col.core = core;
    } else if (std::sscanf(buf, "shape %zu %lf %lf", &i, &mn, &md) == 3 && i < col.min_s.size()) {
      col.min_s[i] = col.min_s[i] > 0 ? std::min(col.min_s[i], mn) : mn;
      col.median_s[i] = col.median_s[i] > 0 ? std::min(col.median_s[i], md) : md;
    } else if (line.rfind("error", 0) == 0) {
      col.error = line.substr(6, line.size() - 7);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = static_cast<int>(
      tb::int_flag(argc, argv, "--threads", std::max(1u, std::thread::hardware_concurrency())));
  const std::string which = tb::flag_value(argc, argv, "--child");
  if (!which.empty()) return child(which, threads);

  const int rounds = std::max(1, static_cast<int>(tb::int_flag(argc, argv, "--rounds", 2)));
  char self[4096];
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  if (len <= 0) return 1;
  self[len] = '\0';
  const std::string forced = host::recommended_openblas_core(host::cpu_features());
  const auto shapes = gpt2_shapes();
  std::vector<Column> cols;
  cols.push_back({"OpenBLAS detected", "-u OPENBLAS_CORETYPE", "openblas", "?", {}, {}, {}});
  if (!forced.empty())
    cols.push_back({"OpenBLAS forced", "OPENBLAS_CORETYPE=" + forced, "openblas", "?", {}, {}, {}});
  cols.push_back({"BLIS detected", "-u BLIS_NUM_THREADS -u BLIS_ARCH_TYPE", "blis", "?", {}, {}, {}});
  // BLIS 0.9 does not know Sapphire / Emerald Rapids either (it picks its AVX2 "haswell" kernels);
  // BLIS_ARCH_TYPE=0 is its id of "skx" (AVX-512) in 0.9's arch_t order (the child prints the name).
  if (host::cpu_features().avx512f)
    cols.push_back({"BLIS forced", "-u BLIS_NUM_THREADS BLIS_ARCH_TYPE=0", "blis", "?", {}, {}, {}});
  for (auto& c : cols) c.min_s.assign(shapes.size(), 0.0), c.median_s.assign(shapes.size(), 0.0);
  const host::CpuPeak peak = host::measure_cpu_peak(threads);
  for (int r = 0; r < rounds; ++r)
    for (auto& c : cols) run_child(self, c, threads);

  std::printf("cblas_sgemm GFLOP/s (best min / best median over %d rounds), GPT-2 124M products at 256 token rows, "
              "%d threads (rows split, library single-threaded)\n",
              rounds, threads);
  std::printf("fp32 machine peak %.1f GFLOP/s: %s\n", peak.theoretical.fp32 / 1e9, peak.describe().c_str());
  std::printf("%-16s %6s %6s %6s", "product", "m", "n", "k");
  for (const auto& c : cols) std::printf(" | %-24s", (c.label + " (" + c.core + ")").c_str());
  std::printf("\n");
  tb::JsonReport report("blas_compare_bench");
  std::vector<double> sums(cols.size(), 0.0);
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    const double gflop = 2.0 * s.m * s.n * s.k * 1e-9;
    std::printf("%-16s %6d %6d %6d", s.name, s.m, s.n, s.k);
    tb::Row row;
    row.add_text("product", s.name).add("m", (long long)s.m).add("n", (long long)s.n).add("k", (long long)s.k);
    for (std::size_t j = 0; j < cols.size(); ++j) {
      const auto& c = cols[j];
      if (c.min_s[i] <= 0) {
        std::printf(" | %-24s", "n/a");
        continue;
      }
      sums[j] += c.min_s[i];
      std::printf(" | %11.1f / %10.1f", gflop / c.min_s[i], gflop / c.median_s[i]);
      row.add(c.which + (c.label.ends_with("forced") ? "_forced" : "") + "_min_s", c.min_s[i], "%.6f");
    }
    std::printf("\n");
    report.add(row);
  }
  double total_gflop = 0;
  for (const Shape& s : shapes) total_gflop += 2.0 * s.m * s.n * s.k * 1e-9;
  std::printf("sum of min times:");
  for (std::size_t j = 0; j < cols.size(); ++j) {
    if (!cols[j].error.empty()) std::printf("  %s: %s;", cols[j].label.c_str(), cols[j].error.c_str());
    else std::printf("  %s %.4f s (%.1f GFLOP/s, %.0f%% of the fp32 machine peak);", cols[j].label.c_str(), sums[j],
                     total_gflop / sums[j], 100.0 * total_gflop * 1e9 / sums[j] / peak.theoretical.fp32);
  }
  std::printf("\n");
  report.write(tb::json_path(argc, argv));
  return 0;
}
