// An independent naive GPT-2 in double precision (the math of HF's GPT2LMHeadModel, dropout 0):
// written from the model's definition, sharing no code with nn/, so that the model tests compare
// against GPT-2 itself and not against a restatement of the layers. Parameters by GPT-2 name.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "trellis/nn/gpt.hpp"

namespace nn_test {

using RefParams = std::map<std::string, std::vector<double>>;

inline void ref_layernorm(const std::vector<double>& x, trellis::index_t rows, trellis::index_t C,
                          const std::vector<double>& w, const std::vector<double>& b, std::vector<double>& y) {
  y.assign(x.size(), 0.0);
  for (trellis::index_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (trellis::index_t c = 0; c < C; ++c) mean += x[r * C + c];
    mean /= C;
    for (trellis::index_t c = 0; c < C; ++c) var += (x[r * C + c] - mean) * (x[r * C + c] - mean);
    var /= C;
    const double rs = 1.0 / std::sqrt(var + 1e-5);
    for (trellis::index_t c = 0; c < C; ++c) y[r * C + c] = (x[r * C + c] - mean) * rs * w[c] + b[c];
  }
}
// y (rows, out) = x (rows, in) W (in, out) + b
inline std::vector<double> ref_linear(const std::vector<double>& x, trellis::index_t rows, trellis::index_t in,
                                      const std::vector<double>& W, const std::vector<double>& b,
                                      trellis::index_t out) {
  std::vector<double> y(rows * out);
  for (trellis::index_t r = 0; r < rows; ++r)
    for (trellis::index_t o = 0; o < out; ++o) {
      double s = b[o];
      for (trellis::index_t i = 0; i < in; ++i) s += x[r * in + i] * W[i * out + o];
      y[r * out + o] = s;
    }
  return y;
}

// ln_f of the last block's output for tokens (B, T) row-major: (B * T, width), row b * T + t.
inline std::vector<double> ref_final_hidden(const trellis::nn::GptConfig& cfg, RefParams& P,
                                            const std::vector<std::int32_t>& tokens, trellis::index_t B,
                                            trellis::index_t T) {
  using trellis::index_t;
  const index_t C = cfg.width, H = cfg.heads, D = C / H, N = B * T;
  std::vector<double> x(N * C), h;
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < T; ++t)
      for (index_t c = 0; c < C; ++c)
        x[(b * T + t) * C + c] = P["wte.weight"][tokens[b * T + t] * C + c] + P["wpe.weight"][t * C + c];
  for (index_t l = 0; l < cfg.layers; ++l) {
    const std::string pre = "h." + std::to_string(l) + ".";
    ref_layernorm(x, N, C, P[pre + "ln_1.weight"], P[pre + "ln_1.bias"], h);
    auto qkv = ref_linear(h, N, C, P[pre + "attn.c_attn.weight"], P[pre + "attn.c_attn.bias"], 3 * C);
    std::vector<double> y(N * C, 0.0);
    for (index_t b = 0; b < B; ++b)
      for (index_t hd = 0; hd < H; ++hd)
        for (index_t t = 0; t < T; ++t) {
          std::vector<double> att(t + 1);
          double mx = -1e300;
          for (index_t s = 0; s <= t; ++s) {
            double dot = 0;
            for (index_t d = 0; d < D; ++d)
              dot += qkv[(b * T + t) * 3 * C + hd * D + d] * qkv[(b * T + s) * 3 * C + C + hd * D + d];
            att[s] = dot / std::sqrt(static_cast<double>(D));
            mx = std::max(mx, att[s]);
          }
          double z = 0;
          for (auto& a : att) z += (a = std::exp(a - mx));
          for (index_t d = 0; d < D; ++d) {
            double o = 0;
            for (index_t s = 0; s <= t; ++s) o += att[s] / z * qkv[(b * T + s) * 3 * C + 2 * C + hd * D + d];
            y[(b * T + t) * C + hd * D + d] = o;
          }
        }
    auto a = ref_linear(y, N, C, P[pre + "attn.c_proj.weight"], P[pre + "attn.c_proj.bias"], C);
    for (index_t i = 0; i < N * C; ++i) x[i] += a[i];
    ref_layernorm(x, N, C, P[pre + "ln_2.weight"], P[pre + "ln_2.bias"], h);
    auto f = ref_linear(h, N, C, P[pre + "mlp.c_fc.weight"], P[pre + "mlp.c_fc.bias"], 4 * C);
    for (auto& v : f) v = 0.5 * v * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (v + 0.044715 * v * v * v)));
    auto m = ref_linear(f, N, 4 * C, P[pre + "mlp.c_proj.weight"], P[pre + "mlp.c_proj.bias"], C);
    for (index_t i = 0; i < N * C; ++i) x[i] += m[i];
  }
  ref_layernorm(x, N, C, P["ln_f.weight"], P["ln_f.bias"], h);
  return h;
}

// Logits (vocab) of row r of ref_final_hidden through the tied head: h_r . wte^T.
inline std::vector<double> ref_row_logits(const trellis::nn::GptConfig& cfg, RefParams& P,
                                          const std::vector<double>& h, trellis::index_t r) {
  const trellis::index_t C = cfg.width;
  std::vector<double> logits(cfg.vocab);
  for (trellis::index_t v = 0; v < cfg.vocab; ++v) {
    double s = 0;
    for (trellis::index_t c = 0; c < C; ++c) s += h[r * C + c] * P["wte.weight"][v * C + c];
    logits[v] = s;
  }
  return logits;
}

}  // namespace nn_test
