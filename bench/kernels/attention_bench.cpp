// Host flash attention (forward + backward) vs the materialised reference softmax(scale QK^T)V with
// its standard backward, both in one run. The reference is what an eager framework does: every
// matrix product on cblas_sgemm, the [batch, heads, T, T] probabilities kept from forward for the
// backward pass, dP/dS as full T x T temporaries. Peak memory = the most bytes allocated at once
// during the call (global operator new is counted; inputs/outputs allocated beforehand are not).
// --threads N sets both OpenBLAS' and the kernel pool's thread count.
//   attention_bench [--quick] [--threads N] [--json FILE]
#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "support/blas_peer.hpp"
#include "support/report.hpp"
#include "trellis/kernels/attention_host.hpp"

// ---- allocation counting -----------------------------------------------------------------------
namespace {
std::atomic<long long> g_live{0}, g_peak{0};
void note_alloc(long long bytes) {
  long long now = g_live.fetch_add(bytes) + bytes;
  long long peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}
void* counted_alloc(std::size_t n, std::size_t align) {
  // Header of 64 bytes holds the size, keeping any alignment up to 64.
  const std::size_t header = 64;
  void* raw = align > 16 ? std::aligned_alloc(64, ((n + header + 63) / 64) * 64) : std::malloc(n + header);
  if (!raw) throw std::bad_alloc();
  *static_cast<std::size_t*>(raw) = n;
  note_alloc(static_cast<long long>(n));
  return static_cast<char*>(raw) + header;
}
void counted_free(void* p) {
  if (!p) return;
  void* raw = static_cast<char*>(p) - 64;
  g_live.fetch_sub(static_cast<long long>(*static_cast<std::size_t*>(raw)));
  std::free(raw);
}
}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n, 16); }
void* operator new[](std::size_t n) { return counted_alloc(n, 16); }
void* operator new(std::size_t n, std::align_val_t a) { return counted_alloc(n, static_cast<std::size_t>(a)); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_alloc(n, static_cast<std::size_t>(a)); }
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_free(p); }
void operator delete(void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }

using namespace trellis::kernels;
namespace tb = trellis::bench;

namespace {

// Reference forward: P = softmax(scale Q K^T) kept for backward (as autograd would), O = P V.
void naive_forward(const AttentionArgs& a, const float* q, const float* k, const float* v, float* o,
                   std::vector<float>& p) {
  const std::int64_t T = a.q_len, d = a.head_dim, heads = a.batch * a.q_heads;
  p.assign(static_cast<std::size_t>(heads * T * T), 0.0f);
  const float scale = a.softmax_scale();
  for (std::int64_t h = 0; h < heads; ++h) {
    float* ph = p.data() + h * T * T;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(T), int(T), int(d), scale, q + h * T * d, int(d),
                k + h * T * d, int(d), 0.0f, ph, int(T));
    for (std::int64_t i = 0; i < T; ++i) {
      float* row = ph + i * T;
      const std::int64_t n = a.causal ? i + 1 : T;
      float mx = -INFINITY;
      for (std::int64_t j = 0; j < n; ++j) mx = std::max(mx, row[j]);
      float s = 0;
      for (std::int64_t j = 0; j < n; ++j) s += (row[j] = host::fast_exp(row[j] - mx));
      const float inv = 1.0f / s;
      for (std::int64_t j = 0; j < n; ++j) row[j] *= inv;
      for (std::int64_t j = n; j < T; ++j) row[j] = 0.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(T), int(d), int(T), 1.0f, ph, int(T), v + h * T * d,
                int(d), 0.0f, o + h * T * d, int(d));
  }
}

// Reference backward from the kept P: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP)),
// dQ = scale dS K, dK = scale dS^T Q. dP and dS are full [heads, T, T] temporaries.
void naive_backward(const AttentionArgs& a, const float* q, const float* k, const float* v, const float* d_o,
                    const std::vector<float>& p, float* dq, float* dk, float* dv) {
  const std::int64_t T = a.q_len, d = a.head_dim, heads = a.batch * a.q_heads;
  const float scale = a.softmax_scale();
  std::vector<float> dp(static_cast<std::size_t>(heads * T * T));
  for (std::int64_t h = 0; h < heads; ++h) {
    const float* ph = p.data() + h * T * T;
    float* dph = dp.data() + h * T * T;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(T), int(d), int(T), 1.0f, ph, int(T), d_o + h * T * d,
                int(d), 0.0f, dv + h * T * d, int(d));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(T), int(T), int(d), 1.0f, d_o + h * T * d, int(d),
                v + h * T * d, int(d), 0.0f, dph, int(T));
    for (std::int64_t i = 0; i < T; ++i) {
      const float* prow = ph + i * T;
      float* row = dph + i * T;
      float dot = 0;
      for (std::int64_t j = 0; j < T; ++j) dot += prow[j] * row[j];
      for (std::int64_t j = 0; j < T; ++j) row[j] = prow[j] * (row[j] - dot);  // dS in place
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(T), int(d), int(T), scale, dph, int(T),
                k + h * T * d, int(d), 0.0f, dq + h * T * d, int(d));
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(T), int(d), int(T), scale, dph, int(T), q + h * T * d,
                int(d), 0.0f, dk + h * T * d, int(d));
  }
}

std::vector<float> filled(std::size_t n, std::uint32_t seed) {
  std::vector<float> v(n);
  for (auto& x : v) {
    seed = seed * 1664525u + 1013904223u;
    x = static_cast<float>(seed >> 8) / 16777216.0f - 0.5f;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = tb::has_flag(argc, argv, "--quick");
  // --threads N: the kernel pool's threads; the reference's OpenBLAS gets as many (blas_peer.hpp).
  if (const long long threads = tb::int_flag(argc, argv, "--threads", 0); threads > 0)
    host::set_num_threads(static_cast<int>(threads));
  const std::int64_t heads = 4, d = 64;
  std::vector<std::int64_t> lengths = {512, 1024, 2048, 4096};
  if (quick) lengths = {512, 1024};
  tb::JsonReport report("attention_bench");
  std::printf("host flash attention fwd+bwd vs materialised softmax(QK^T)V on cblas_sgemm; batch 1, %lld heads, d %lld, "
              "%d kernel threads\n",
              (long long)heads, (long long)d, host::kernel_thread_count());
  std::printf("%6s %-7s %10s %10s %10s %10s %8s %8s %12s %12s %8s %8s\n", "T", "mask", "naive_min", "naive_med",
              "flash_min", "flash_med", "t_ratio", "t_r_med", "naive_peak", "flash_peak", "mem_rat", "max_err");
  for (std::int64_t T : lengths)
    for (bool causal : {false, true}) {
      AttentionArgs a;
      a.batch = 1, a.q_heads = heads, a.kv_heads = heads, a.q_len = T, a.kv_len = T, a.head_dim = d, a.causal = causal;
      auto q = filled(a.q_elements(), 1), k = filled(a.kv_elements(), 2), v = filled(a.kv_elements(), 3),
           d_o = filled(a.q_elements(), 4);
      std::vector<float> o(q.size()), lse(a.lse_elements()), dq(q.size()), dk(k.size()), dv(v.size());
      std::vector<float> no(q.size()), ndq(q.size()), ndk(k.size()), ndv(v.size());
      auto flash = [&] {
        host::attention_forward(a, q.data(), k.data(), v.data(), o.data(), lse.data());
        host::attention_backward(a, q.data(), k.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(),
                                 dk.data(), dv.data());
      };
      auto naive = [&] {
        tb::use_openblas_threads();
        std::vector<float> p;
        naive_forward(a, q.data(), k.data(), v.data(), no.data(), p);
        naive_backward(a, q.data(), k.data(), v.data(), d_o.data(), p, ndq.data(), ndk.data(), ndv.data());
      };
      auto peak_of = [&](auto&& fn) {
        const long long base = g_live.load();
        g_peak.store(base);
        fn();
        return g_peak.load() - base;
      };
      const long long naive_peak = peak_of(naive);
      const long long flash_peak = peak_of(flash);
      double err = 0;
      for (std::size_t i = 0; i < o.size(); ++i) err = std::max(err, double(std::fabs(o[i] - no[i])));
      for (std::size_t i = 0; i < dq.size(); ++i) err = std::max(err, double(std::fabs(dq[i] - ndq[i])));
      for (std::size_t i = 0; i < dk.size(); ++i) err = std::max(err, double(std::fabs(dk[i] - ndk[i])));
      const int reps = T >= 4096 ? 2 : T >= 2048 ? 3 : 5;
      std::vector<double> tn, tf;
      for (int r = 0; r < reps; ++r) {
        double t0 = tb::now_seconds();
        naive();
        double t1 = tb::now_seconds();
        flash();
        double t2 = tb::now_seconds();
        tn.push_back(t1 - t0), tf.push_back(t2 - t1);
      }
      std::sort(tn.begin(), tn.end());
      std::sort(tf.begin(), tf.end());
      const double nmin = tn.front(), nmed = tn[tn.size() / 2], fmin = tf.front(), fmed = tf[tf.size() / 2];
      std::printf("%6lld %-7s %10.4f %10.4f %10.4f %10.4f %8.3f %8.3f %12lld %12lld %8.4f %8.1e\n", (long long)T,
                  causal ? "causal" : "full", nmin, nmed, fmin, fmed, fmin / nmin, fmed / nmed, naive_peak, flash_peak,
                  double(flash_peak) / double(naive_peak), err);
      tb::Row row;
      row.add("T", (long long)T).add_text("mask", causal ? "causal" : "full").add("heads", (long long)heads);
      row.add("head_dim", (long long)d).add("naive_min_s", nmin, "%.5f").add("naive_median_s", nmed, "%.5f");
      row.add("flash_min_s", fmin, "%.5f").add("flash_median_s", fmed, "%.5f");
      row.add("time_ratio_min", fmin / nmin, "%.4f").add("time_ratio_median", fmed / nmed, "%.4f");
      row.add("naive_peak_bytes", naive_peak).add("flash_peak_bytes", flash_peak);
      row.add("memory_ratio", double(flash_peak) / double(naive_peak), "%.5f").add("max_abs_diff", err, "%.2e");
      report.add(row);
    }
  report.write(tb::json_path(argc, argv));
  return 0;
}
