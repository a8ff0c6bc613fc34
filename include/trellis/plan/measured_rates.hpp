// plan::MeasuredRates: plan::Rates calibrated on the machine the planner runs on, by timing the
// host backend's own kernels (backend::Host<float>: the GEMM in its three forms, flash attention
// forward and backward, LayerNorm, GELU, the cross-entropy, AdamW, a memory-bound add) at the
// shapes the cost model asks for. Each shape is
// timed once (the fastest of a few runs, after a warm-up) and remembered, so a search over many
// layouts of one model times each distinct GEMM a single time. The kernels run on the calling
// thread's kernel pool (kernels::host::set_num_threads decides how many threads: one per rank
// when ranks are threads of one process, as a layout would run).
#pragma once

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "trellis/backend/host.hpp"
#include "trellis/kernels/adamw.hpp"
#include "trellis/kernels/attention.hpp"
#include "trellis/kernels/epilogue.hpp"
#include "trellis/plan/cost_model.hpp"

namespace trellis::plan {

class MeasuredRates {
 public:
  // repeats: timed runs per shape (the fastest counts). concurrent: how many copies of each
  // kernel run at once, one per thread -- the ranks of a layout that share this machine (thread
  // ranks on its cores), so the rate includes what they take from each other (memory bandwidth,
  // caches, clock).
  // With concurrent > 1 every shape is also timed alone (one copy: the other ranks' cores idle, as
  // a pipeline leaves them), for Rates::alone.
  explicit MeasuredRates(int repeats = 3, int concurrent = 1)
      : repeats_(std::max(1, repeats)), concurrent_(std::max(1, concurrent)) {
    if (concurrent_ > 1) alone_ = std::make_unique<MeasuredRates>(repeats_, 1);
  }

  // The Rates view; it refers to this object, which must outlive it.
  Rates rates() {
    Rates r = own_rates();
    if (alone_) {
      r.shared_by = concurrent_;
      r.alone = std::make_shared<const Rates>(alone_->rates());
    }
    return r;
  }
  // The rates of one copy alone (null with concurrent = 1).
  MeasuredRates* alone() { return alone_.get(); }

 private:
  Rates own_rates() {
    Rates r;
    r.gemm = [this](double m, double n, double k, GemmForm form) { return gemm(m, n, k, form); };
    r.attention_forward = [this](double b, double h, double t, double d) { return attention(b, h, t, d, false); };
    r.attention_backward = [this](double b, double h, double t, double d) { return attention(b, h, t, d, true); };
    r.layernorm = [this](double rows, double dim, bool bwd) { return layernorm(rows, dim, bwd); };
    r.gelu = [this](double n, bool bwd) { return gelu(n, bwd); };
    r.cross_entropy = [this](double rows, double cols, bool bwd) { return cross_entropy(rows, cols, bwd); };
    r.memory = [this](double bytes) { return bytes * seconds_per_byte(); };
    r.adamw = [this](double n) { return n * adamw_seconds_per_element(); };
    // the offloaded optimizer: the host is the device here, so its AdamW is the same kernel, and
    // a copy between "device" and host memory is a memory pass reading and writing the bytes
    r.host_adamw = r.adamw;
    r.host_copy = [this](double bytes) { return 2 * bytes * seconds_per_byte(); };
    r.collective_copy_bytes = 2;  // thread ranks' collectives are copies on these cores: read + write
    return r;
  }

 public:

  // Seconds of one m x n x k GEMM in the layers' form (plan::GemmForm; nn with a bias epilogue,
  // tn accumulating into C).
  double gemm(double m, double n, double k, GemmForm form) {
    const auto key = std::make_tuple(rounded(m), rounded(n), rounded(k), static_cast<std::int64_t>(form));
    if (auto it = gemm_.find(key); it != gemm_.end()) return it->second;
    const auto [M, N, K, u] = key;
    return gemm_[key] = timed([&, M = M, N = N, K = K] {
      struct Work {
        std::vector<float> a, b, c, bias;
        kernels::GemmArgs args;
      };
      auto w = std::make_shared<Work>();
      w->a.assign(static_cast<std::size_t>(M * K), 0.5f);
      w->b.assign(static_cast<std::size_t>(K * N), 0.25f);
      w->c.assign(static_cast<std::size_t>(M * N), 0.0f);
      w->bias.assign(static_cast<std::size_t>(N), 0.125f);
      using kernels::Op;
      w->args = form == GemmForm::nn          ? kernels::gemm_args(M, N, K)
                : form == GemmForm::nt ? kernels::gemm_args(M, N, K, Op::none, Op::transpose)
                                                 : kernels::gemm_args(M, N, K, Op::transpose, Op::none, 1.0f, 1.0f);
      return std::function<void()>([this, w, form] {
        if (form == GemmForm::nn)
          be_.gemm(w->args, w->a.data(), w->b.data(), w->c.data(), kernels::epilogue::Bias<float>{w->bias.data()});
        else
          be_.gemm(w->args, w->a.data(), w->b.data(), w->c.data());
      });
    });
  }

  // Causal attention over b sequences of h heads, t positions, head size d (d rounded up to 8).
  double attention(double b, double h, double t, double d, bool backward) {
    const auto key = std::make_tuple(rounded(b * h), rounded(t), (rounded(d) + 7) / 8 * 8, static_cast<std::int64_t>(backward));
    if (auto it = attention_.find(key); it != attention_.end()) return it->second;
    const auto [BH, T, D, bwd] = key;
    return attention_[key] = timed([&, BH = BH, T = T, D = D, bwd = bwd] {
      struct Work {
        kernels::AttentionArgs args;
        std::vector<float> q, k, v, o, d_o, dq, dk, dv, lse;
      };
      auto w = std::make_shared<Work>();
      w->args.batch = 1;
      w->args.q_heads = w->args.kv_heads = BH;
      w->args.q_len = w->args.kv_len = T;
      w->args.head_dim = D;
      w->args.causal = true;
      const auto n = static_cast<std::size_t>(BH * T * D);
      for (auto* x : {&w->q, &w->k, &w->v, &w->o, &w->dq, &w->dk, &w->dv}) x->resize(n);
      w->d_o.assign(n, 0.01f);
      w->lse.resize(static_cast<std::size_t>(BH * T));
      for (std::size_t i = 0; i < n; ++i) w->q[i] = w->k[i] = w->v[i] = static_cast<float>(i % 17) * 0.05f - 0.4f;
      be_.attention_forward(w->args, w->q.data(), w->k.data(), w->v.data(), w->o.data(), w->lse.data());
      return std::function<void()>([this, w, bwd] {
        if (bwd)
          be_.attention_backward(w->args, w->q.data(), w->k.data(), w->v.data(), w->o.data(), w->d_o.data(),
                                 w->lse.data(), w->dq.data(), w->dk.data(), w->dv.data());
        else
          be_.attention_forward(w->args, w->q.data(), w->k.data(), w->v.data(), w->o.data(), w->lse.data());
      });
    });
  }

  double layernorm(double rows, double dim, bool backward) {
    const auto key = std::make_tuple(rounded(rows), rounded(dim), static_cast<std::int64_t>(backward));
    if (auto it = layernorm_.find(key); it != layernorm_.end()) return it->second;
    const auto [R, D, bwd] = key;
    return layernorm_[key] = timed([&, R = R, D = D, bwd = bwd] {
      const auto n = static_cast<std::size_t>(R * D);
      auto x = std::make_shared<std::vector<float>>(3 * n + 4 * static_cast<std::size_t>(D) + 2 * static_cast<std::size_t>(R));
      for (std::size_t i = 0; i < n; ++i) (*x)[i] = static_cast<float>(i % 13) * 0.1f;
      return std::function<void()>([this, x, n, R, D, bwd] {
        float* in = x->data();
        float *out = in + n, *grad = out + n, *w = grad + n, *b = w + D, *dw = b + D, *db = dw + D, *mean = db + D,
              *rstd = mean + R;
        if (bwd)
          be_.layernorm_backward(R, D, out, in, w, mean, rstd, grad, dw, db, true);
        else
          be_.layernorm_forward(R, D, in, w, b, out, mean, rstd, 1e-5f);
      });
    });
  }

  double gelu(double n, bool backward) {
    const auto key = std::make_tuple(rounded(n), static_cast<std::int64_t>(backward));
    if (auto it = gelu_.find(key); it != gelu_.end()) return it->second;
    const auto [N, bwd] = key;
    return gelu_[key] = timed([&, N = N, bwd = bwd] {
      const auto n = static_cast<std::size_t>(N);
      auto x = std::make_shared<std::vector<float>>(3 * n);
      for (std::size_t i = 0; i < n; ++i) (*x)[i] = static_cast<float>(i % 29) * 0.2f - 3.0f;
      return std::function<void()>([this, x, n, N, bwd] {
        float* p = x->data();
        if (bwd)
          be_.gelu_backward(N, p, p + n, p + 2 * n);
        else
          be_.gelu_forward(N, p, p + n);
      });
    });
  }

  double cross_entropy(double rows, double cols, bool backward) {
    const auto key = std::make_tuple(rounded(rows), rounded(cols), static_cast<std::int64_t>(backward));
    if (auto it = xent_.find(key); it != xent_.end()) return it->second;
    const auto [R, C, bwd] = key;
    return xent_[key] = timed([&, R = R, C = C, bwd = bwd] {
      const auto n = static_cast<std::size_t>(R * C), rs = static_cast<std::size_t>(R);
      auto logits = std::make_shared<std::vector<float>>(2 * n);
      for (std::size_t i = 0; i < n; ++i) (*logits)[i] = static_cast<float>(i % 31) * 0.1f;
      auto stats = std::make_shared<std::vector<float>>(6 * rs, 0.0f);
      auto targets = std::make_shared<std::vector<std::int32_t>>(rs);
      for (std::size_t i = 0; i < rs; ++i) (*targets)[i] = static_cast<std::int32_t>(i % static_cast<std::size_t>(C));
      return std::function<void()>([this, logits, stats, targets, n, rs, R, C, bwd] {
        const float* l = logits->data();
        float *mx = stats->data(), *sum = mx + rs, *tgt = sum + rs, *loss = tgt + rs, *lse = loss + rs;
        if (bwd) {
          be_.xent_backward_sharded(R, C, C, l, targets->data(), 0, lse, 1.0f, logits->data() + n, C);
        } else {
          be_.xent_partial_max(R, C, C, l, mx);
          be_.xent_partial_sumexp(R, C, C, l, mx, sum);
          be_.xent_partial_target(R, C, C, l, targets->data(), 0, tgt);
          be_.xent_finish(R, mx, sum, tgt, targets->data(), loss, lse);
        }
      });
    });
  }

  // A memory-bound pass: out = a + b over 8M floats (96 MB touched, beyond the caches).
  double seconds_per_byte() {
    if (per_byte_ > 0) return per_byte_;
    const std::size_t n = std::size_t{1} << 23;
    per_byte_ = timed([&] {
      auto v = std::make_shared<std::vector<float>>(3 * n, 1.0f);
      return [this, v, n] { be_.add(static_cast<index_t>(n), v->data(), v->data() + n, v->data() + 2 * n); };
    }) / (12.0 * static_cast<double>(n));
    return per_byte_;
  }

  double adamw_seconds_per_element() {
    if (per_param_ > 0) return per_param_;
    const std::size_t n = std::size_t{1} << 22;
    per_param_ = timed([&] {
      auto v = std::make_shared<std::vector<float>>(4 * n, 0.01f);
      auto step = std::make_shared<std::int64_t>(0);
      return [this, v, n, step] {
        float* p = v->data();
        const kernels::AdamWTensor<float> t{{p, n}, {p + n, n}, {p + 2 * n, n}, {p + 3 * n, n}};
        be_.adamw(std::span<const kernels::AdamWTensor<float>>(&t, 1), {}, ++*step, 1.0f);
      };
    }) / static_cast<double>(n);
    return per_param_;
  }

 private:
  static std::int64_t rounded(double x) { return std::max<std::int64_t>(1, std::llround(x)); }
  // make() returns a piece of work with buffers of its own. It runs on `concurrent` threads at
  // once, each timing the fastest of `repeats` runs after a warm-up; the mean over threads counts.
  template <class Make>
  double timed(Make&& make) {
    std::vector<std::function<void()>> work;
    for (int i = 0; i < concurrent_; ++i) work.emplace_back(make());
    std::vector<double> best(work.size(), 1e300);
    std::barrier sync(concurrent_);
    auto run = [&](std::size_t i) {
      work[i]();  // warm-up: pages touched, pool threads awake
      std::vector<float> flush(std::size_t{1} << 23);  // 32 MB: the caches hold none of the operands, as in a step
      for (int r = 0; r < repeats_; ++r) {
        for (std::size_t j = 0; j < flush.size(); j += 16) flush[j] += 1.0f;
        sync.arrive_and_wait();
        const auto t0 = std::chrono::steady_clock::now();
        work[i]();
        best[i] = std::min(best[i], std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    };
    std::vector<std::thread> others;
    for (std::size_t i = 1; i < work.size(); ++i) others.emplace_back(run, i);
    run(0);
    for (auto& t : others) t.join();
    double sum = 0;
    for (double b : best) sum += b;
    return sum / static_cast<double>(best.size());
  }

  backend::Host<float> be_;
  int repeats_, concurrent_;
  std::unique_ptr<MeasuredRates> alone_;  // concurrent > 1: the same shapes timed one copy at a time
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>, double> gemm_;
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>, double> attention_;
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t>, double> layernorm_, xent_;
  std::map<std::tuple<std::int64_t, std::int64_t>, double> gelu_;
  double per_byte_ = 0, per_param_ = 0;
};

}  // namespace trellis::plan
