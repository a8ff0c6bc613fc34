// plan::BasicMeasuredRates<B>: plan::Rates calibrated on the machine the planner runs on, by timing
// backend B's own kernels (the GEMM in its three forms, flash attention forward and backward,
// LayerNorm, GELU, the cross-entropy, AdamW, a memory-bound add) at the shapes the cost model asks
// for, on buffers of B in B's activation type. plan::MeasuredRates is the host's
// (backend::Host<float>); BasicMeasuredRates<backend::Cuda> times a GPU. Each shape is timed once
// (the fastest of a few runs, after a warm-up, caches flushed before each) and remembered, so a
// search over many layouts of one model times each distinct GEMM a single time. On the host the
// kernels run on the calling thread's kernel pool (kernels::host::set_num_threads decides how many
// threads: one per rank when ranks are threads of one process, as a layout would run).
//
// A device's rates leave Rates::host_adamw and host_copy empty: the offloaded optimizer's CPU
// AdamW and host link are not B's kernels (take them from cluster_rates where they matter).
#pragma once

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "trellis/backend/backend.hpp"
#include "trellis/backend/host.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/adamw.hpp"
#include "trellis/kernels/attention.hpp"
#include "trellis/kernels/epilogue.hpp"
#include "trellis/plan/cost_model.hpp"

namespace trellis::plan {

template <backend::Backend B>
class BasicMeasuredRates {
  using act_t = typename B::act_t;
  template <class T>
  using buffer = typename B::template buffer<T>;

 public:
  // repeats: timed runs per shape (the fastest counts). concurrent: how many copies of each
  // kernel run at once, one per thread -- the ranks of a layout that share this machine (thread
  // ranks on its cores), so the rate includes what they take from each other (memory bandwidth,
  // caches, clock); host backends only (a device's ranks have a device each).
  // With concurrent > 1 every shape is also timed alone (one copy: the other ranks' cores idle, as
  // a pipeline leaves them), for Rates::alone.
  explicit BasicMeasuredRates(int repeats = 3, int concurrent = 1, B backend = B{})
      : be_(std::move(backend)), repeats_(std::max(1, repeats)), concurrent_(std::max(1, concurrent)) {
    TRELLIS_CHECK(B::host_readable || concurrent_ == 1, "plan::BasicMeasuredRates: concurrent = ", concurrent_,
                  " times thread ranks sharing one CPU; a device backend's ranks each have a device of their "
                  "own: time it with concurrent = 1");
    if (concurrent_ > 1) alone_ = std::make_unique<BasicMeasuredRates>(repeats_, 1, be_);
  }
  BasicMeasuredRates(const BasicMeasuredRates&) = delete;  // the Rates views and retime() refer to this object
  BasicMeasuredRates& operator=(const BasicMeasuredRates&) = delete;

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
  BasicMeasuredRates* alone() { return alone_.get(); }

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
    if constexpr (B::host_readable) {
      // the offloaded optimizer: the host is the device here, so its AdamW is the same kernel, and
      // a copy between "device" and host memory is a memory pass reading and writing the bytes
      r.host_adamw = r.adamw;
      r.host_copy = [this](double bytes) { return 2 * bytes * seconds_per_byte(); };
      r.collective_copy_bytes = 2;  // thread ranks' collectives are copies on these cores: read + write
    }
    return r;
  }

 public:
  // Seconds of one m x n x k GEMM in the layers' form (plan::GemmForm; nn with a bias epilogue,
  // tn accumulating into an fp32 C, as weight gradients are).
  double gemm(double m, double n, double k, GemmForm form) {
    const auto key = std::make_tuple(rounded(m), rounded(n), rounded(k), static_cast<std::int64_t>(form));
    if (auto it = gemm_.find(key); it != gemm_.end()) return it->second;
    const auto [M, N, K, u] = key;
    return remember(gemm_[key], [this, form, M = M, N = N, K = K] {
      struct Work {
        buffer<act_t> a, b, c, bias;
        buffer<float> c_f32;  // tn
        kernels::GemmArgs args;
      };
      auto w = std::make_shared<Work>();
      w->a = filled<act_t>(static_cast<std::size_t>(M * K), [](std::size_t) { return 0.5f; });
      w->b = filled<act_t>(static_cast<std::size_t>(K * N), [](std::size_t) { return 0.25f; });
      if (form == GemmForm::tn) {
        w->c_f32 = be_.template allocate<float>(static_cast<std::size_t>(M * N));
      } else {
        w->c = be_.template allocate<act_t>(static_cast<std::size_t>(M * N));
        w->bias = filled<act_t>(static_cast<std::size_t>(N), [](std::size_t) { return 0.125f; });
      }
      using kernels::Op;
      w->args = form == GemmForm::nn   ? kernels::gemm_args(M, N, K)
                : form == GemmForm::nt ? kernels::gemm_args(M, N, K, Op::none, Op::transpose)
                                       : kernels::gemm_args(M, N, K, Op::transpose, Op::none, 1.0f, 1.0f);
      return std::function<void()>([this, w, form] {
        if (form == GemmForm::nn)
          be_.gemm(w->args, w->a.data(), w->b.data(), w->c.data(), kernels::epilogue::Bias<act_t>{w->bias.data()});
        else if (form == GemmForm::nt)
          be_.gemm(w->args, w->a.data(), w->b.data(), w->c.data());
        else
          be_.gemm(w->args, w->a.data(), w->b.data(), w->c_f32.data());
      });
    });
  }

  // Causal attention over b sequences of h heads, t positions, head size d (d rounded up to 8).
  double attention(double b, double h, double t, double d, bool backward) {
    const auto key = std::make_tuple(rounded(b * h), rounded(t), (rounded(d) + 7) / 8 * 8, static_cast<std::int64_t>(backward));
    if (auto it = attention_.find(key); it != attention_.end()) return it->second;
    const auto [BH, T, D, bwd] = key;
    return remember(attention_[key], [this, BH = BH, T = T, D = D, bwd = bwd] {
      struct Work {
        kernels::AttentionArgs args;
        buffer<act_t> q, k, v, o, d_o, dq, dk, dv;
        buffer<float> lse;
      };
      auto w = std::make_shared<Work>();
      w->args.batch = 1;
      w->args.q_heads = w->args.kv_heads = BH;
      w->args.q_len = w->args.kv_len = T;
      w->args.head_dim = D;
      w->args.causal = true;
      const auto n = static_cast<std::size_t>(BH * T * D);
      auto qkv = [](std::size_t i) { return static_cast<float>(i % 17) * 0.05f - 0.4f; };
      w->q = filled<act_t>(n, qkv);
      w->k = filled<act_t>(n, qkv);
      w->v = filled<act_t>(n, qkv);
      w->d_o = filled<act_t>(n, [](std::size_t) { return 0.01f; });
      for (auto* x : {&w->o, &w->dq, &w->dk, &w->dv}) *x = be_.template allocate<act_t>(n);
      w->lse = be_.template allocate<float>(static_cast<std::size_t>(BH * T));
      if (bwd) be_.reserve_workspace(be_.attention_backward_workspace(w->args));
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
    return remember(layernorm_[key], [this, R = R, D = D, bwd = bwd] {
      const auto n = static_cast<std::size_t>(R * D);
      // activations: input, output, input gradient; fp32: weight, bias, their gradients, mean, rstd
      auto x = std::make_shared<buffer<act_t>>(
          filled<act_t>(3 * n, [n](std::size_t i) { return i < n ? static_cast<float>(i % 13) * 0.1f : 0.0f; }));
      auto f = std::make_shared<buffer<float>>(be_.template allocate<float>(4 * static_cast<std::size_t>(D) +
                                                                            2 * static_cast<std::size_t>(R)));
      if (bwd) be_.reserve_workspace(be_.layernorm_backward_workspace(R, D));
      return std::function<void()>([this, x, f, n, R, D, bwd] {
        act_t *in = x->data(), *out = in + n, *grad = out + n;
        float *w = f->data(), *b = w + D, *dw = b + D, *db = dw + D, *mean = db + D, *rstd = mean + R;
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
    return remember(gelu_[key], [this, N = N, bwd = bwd] {
      const auto n = static_cast<std::size_t>(N);
      auto x = std::make_shared<buffer<act_t>>(
          filled<act_t>(3 * n, [n](std::size_t i) { return i < n ? static_cast<float>(i % 29) * 0.2f - 3.0f : 0.0f; }));
      return std::function<void()>([this, x, n, N, bwd] {
        act_t* p = x->data();
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
    return remember(xent_[key], [this, R = R, C = C, bwd = bwd] {
      const auto n = static_cast<std::size_t>(R * C), rs = static_cast<std::size_t>(R);
      // logits, then their gradient
      auto logits = std::make_shared<buffer<act_t>>(
          filled<act_t>(2 * n, [n](std::size_t i) { return i < n ? static_cast<float>(i % 31) * 0.1f : 0.0f; }));
      auto stats = std::make_shared<buffer<float>>(be_.template allocate<float>(6 * rs));
      auto targets = std::make_shared<buffer<std::int32_t>>(filled<std::int32_t>(
          rs, [C](std::size_t i) { return static_cast<std::int32_t>(i % static_cast<std::size_t>(C)); }));
      return std::function<void()>([this, logits, stats, targets, n, rs, R, C, bwd] {
        const act_t* l = logits->data();
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
    const std::size_t n = std::size_t{1} << 23;
    if (add_seconds_ <= 0)
      remember(add_seconds_, [this, n] {
        auto v = std::make_shared<buffer<float>>(filled<float>(3 * n, [](std::size_t) { return 1.0f; }));
        return [this, v, n] { be_.add(static_cast<index_t>(n), v->data(), v->data() + n, v->data() + 2 * n); };
      });
    return add_seconds_ / (12.0 * static_cast<double>(n));
  }

  double adamw_seconds_per_element() {
    const std::size_t n = std::size_t{1} << 22;
    if (adamw_seconds_ <= 0)
      remember(adamw_seconds_, [this, n] {
        auto v = std::make_shared<buffer<float>>(filled<float>(4 * n, [](std::size_t) { return 0.01f; }));
        auto step = std::make_shared<std::int64_t>(0);
        return [this, v, n, step] {
          float* p = v->data();
          const kernels::AdamWTensor<float> t{{p, n}, {p + n, n}, {p + 2 * n, n}, {p + 3 * n, n}};
          be_.adamw(std::span<const kernels::AdamWTensor<float>>(&t, 1), {}, ++*step, 1.0f);
        };
      });
    return adamw_seconds_ / static_cast<double>(n);
  }

  // Times every shape timed so far again (and the alone rates'), keeping each one's faster time.
  // A calibration spread over a while this way meets a shared machine's quick spells as a
  // measurement that keeps its fastest steps does (bench_plan re-times after each of its rounds).
  void retime() {
    for (auto& again : retimers_) again();
    if (alone_) alone_->retime();
  }
  // How many shapes have been timed, counting each retime (this table's, not the alone one's).
  int timings() const { return timings_; }

 private:
  static std::int64_t rounded(double x) { return std::max<std::int64_t>(1, std::llround(x)); }
  // The cache flush before each timed run, so that the caches hold none of the operands, as in a
  // step: a buffer of B beyond its last-level cache, written. 32 MB on the host; 256 MB on a
  // device, more than a GPU's L2 (40 MB on an A100, 50 MB on an H100).
  static constexpr std::size_t flush_floats = B::host_readable ? std::size_t{1} << 23 : std::size_t{1} << 26;

  // A buffer of B holding value(i) at i, computed on the host and uploaded.
  template <class T, class Value>
  buffer<T> filled(std::size_t n, Value value) const {
    std::vector<T> host(n);
    for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<T>(value(i));
    buffer<T> b = be_.template allocate<T>(n);
    be_.upload(b.data(), host.data(), n);
    return b;
  }
  // Times `make`'s work into `slot` and keeps it for retime(). make must own what it captures.
  template <class Make>
  double remember(double& slot, Make make) {
    slot = timed(make);
    retimers_.push_back([this, &slot, make] { slot = std::min(slot, timed(make)); });
    return slot;
  }
  // make() returns a piece of work with buffers of its own, timed as the fastest of `repeats` runs
  // after a warm-up, each on flushed caches.
  template <class Make>
  double timed(Make&& make) {
    ++timings_;
    if constexpr (B::host_readable) {
      std::vector<std::function<void()>> work;
      for (int i = 0; i < concurrent_; ++i) work.emplace_back(make());
      return host_seconds(work);
    } else {
      return device_seconds(make());
    }
  }
  // The copies of a work run on `concurrent` threads at once; the mean of their times counts.
  double host_seconds(std::vector<std::function<void()>>& work) {
    std::vector<double> best(work.size(), 1e300);
    std::barrier sync(concurrent_);
    auto run = [&](std::size_t i) {
      work[i]();  // warm-up: pages touched, pool threads awake
      buffer<float> flush = be_.template allocate<float>(flush_floats);
      for (int r = 0; r < repeats_; ++r) {
        // a read and a write of every line (a memset may store around the cache)
        for (std::size_t j = 0; j < flush_floats; j += 16) flush.data()[j] += 1.0f;
        sync.arrive_and_wait();
        be_.synchronize();
        const auto t0 = std::chrono::steady_clock::now();
        work[i]();
        be_.synchronize();
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
  // A device run as the host sees it, between two synchronize() calls, would add the launch and
  // the synchronisation (microseconds: more than a small GEMM takes). So `pairs` flushes, each
  // followed by the run, are enqueued back to back -- the device busy with a flush while the host
  // launches the next run -- and the same flushes alone are timed beside them; the difference over
  // `pairs` is one run on a flushed cache. The fastest of `repeats` each.
  double device_seconds(const std::function<void()>& work) {
    constexpr int pairs = 8;
    buffer<float> flush = be_.template allocate<float>(flush_floats);
    work();  // warm-up: plans made, workspaces mapped
    auto span = [&](bool with_work) {
      be_.synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      for (int j = 0; j < pairs; ++j) {
        be_.fill_zero(flush.data(), flush_floats);
        if (with_work) work();
      }
      be_.synchronize();
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    double flushes = 1e300, both = 1e300;
    for (int r = 0; r < repeats_; ++r) {
      flushes = std::min(flushes, span(false));
      both = std::min(both, span(true));
    }
    // floored: a run shorter than the flushes' noise is not free, and 0 would read as "not timed"
    return std::max(both - flushes, 1e-3 * flushes) / pairs;
  }

  B be_;
  int repeats_, concurrent_;
  std::unique_ptr<BasicMeasuredRates> alone_;  // concurrent > 1: the same shapes timed one copy at a time
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>, double> gemm_;
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t>, double> attention_;
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t>, double> layernorm_, xent_;
  std::map<std::tuple<std::int64_t, std::int64_t>, double> gelu_;
  double add_seconds_ = 0, adamw_seconds_ = 0;  // the memory pass's and AdamW's, whole
  int timings_ = 0;
  std::vector<std::function<void()>> retimers_;  // retime(): each shape's timing again (map nodes stay put)
};

// The host's rates: backend::Host<float>'s kernels.
using MeasuredRates = BasicMeasuredRates<backend::Host<float>>;

}  // namespace trellis::plan
