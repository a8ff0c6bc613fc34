// The compute floor of a GPT-2 training step, shared by bench/nn and bench/train: the step's GEMMs
// (per block c_attn, attn c_proj, c_fc, mlp c_proj, plus the LM head; each forward product with
// its two backward products dX and dW) run as bare cblas_sgemm calls, timed in the same run as
// the thing compared with it.
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "support/blas_peer.hpp"
#include "support/report.hpp"
#include "trellis/nn/gpt.hpp"

namespace trellis::bench {

// The GEMMs of one step over `tokens` rows, with their buffers: run() makes every call once.
class GptSgemmFloor {
 public:
  GptSgemmFloor(const nn::GptConfig& cfg, int tokens) : n_(tokens) {
    const int C = static_cast<int>(cfg.width), V = static_cast<int>(cfg.vocab);
    for (index_t l = 0; l < cfg.layers; ++l) {
      shapes_.push_back({3 * C, C});
      shapes_.push_back({C, C});
      shapes_.push_back({4 * C, C});
      shapes_.push_back({C, 4 * C});
    }
    shapes_.push_back({V, C});  // LM head
    std::size_t big_w = 0, big_y = 0;
    for (auto s : shapes_) {
      big_w = std::max(big_w, static_cast<std::size_t>(s.n) * s.k);
      big_y = std::max(big_y, static_cast<std::size_t>(n_) * std::max(s.n, s.k));
    }
    x_.assign(big_y, 0.01f);
    y_.assign(big_y, 0.02f);
    dx_.assign(big_y, 0.0f);
    w_.assign(big_w, 0.03f);
    dw_.assign(big_w, 0.0f);
  }

  void run() {
    use_openblas_threads();
    const int N = n_;
    for (auto s : shapes_) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, s.n, s.k, 1.0f, x_.data(), s.k, w_.data(), s.n,
                  0.0f, y_.data(), s.n);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, s.k, s.n, 1.0f, y_.data(), s.n, w_.data(), s.n,
                  0.0f, dx_.data(), s.k);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, s.k, s.n, N, 1.0f, x_.data(), s.k, y_.data(), s.n,
                  1.0f, dw_.data(), s.n);
    }
  }

 private:
  struct Shape {
    int n, k;  // y (N x n) = x (N x k) W (k x n)
  };
  int n_;
  std::vector<Shape> shapes_;
  std::vector<float> x_, y_, dx_, w_, dw_;
};

// Seconds (minimum and median over `iters` timed repetitions) for the GEMMs of one step over
// `tokens` rows.
inline std::pair<double, double> gpt_sgemm_floor_min_median(const nn::GptConfig& cfg, int tokens, int warmup,
                                                            int iters) {
  GptSgemmFloor floor(cfg, tokens);
  return time_min_median([&] { floor.run(); }, warmup, iters);
}

// The minimum alone.
inline double gpt_sgemm_floor_seconds(const nn::GptConfig& cfg, int tokens, int warmup, int iters) {
  return gpt_sgemm_floor_min_median(cfg, tokens, warmup, iters).first;
}

// FLOPs of those GEMMs: 2 per multiply-add, forward + 2 backward products.
inline double gpt_gemm_flops(const nn::GptConfig& cfg, double tokens) {
  const double C = static_cast<double>(cfg.width), V = static_cast<double>(cfg.vocab);
  const double per_token = static_cast<double>(cfg.layers) * (3 * C * C + C * C + 4 * C * C + 4 * C * C) + V * C;
  return 6.0 * per_token * tokens;
}

}  // namespace trellis::bench
