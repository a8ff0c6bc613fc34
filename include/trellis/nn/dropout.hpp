// Dropout of the norm/residual region (GPT-2's embd_pdrop and resid_pdrop). Whether element col of
// token (sample, t) is kept is a pure function of (step seed, site, GLOBAL sample index, position,
// col) — a hash, not a stateful generator — so every tensor-parallel / sequence-parallel layout,
// every pipeline split, the recompute pass, every dp split and every microbatching of the same
// global batch drop exactly the same elements (TokenShape carries the seed and the microbatch's
// first global sample). Kept elements are scaled by 1 / (1 - p); the backward pass applies the
// same mask to the gradient. TokenShape::train = false (evaluation) makes it the identity.
// (Dropout of the attention probabilities is not offered: the flash-attention kernel has none.)
#pragma once

#include <cstdint>
#include <string_view>

#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/nn/parameter.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

class Dropout {
 public:
  Dropout() = default;
  // site: the name of the place it is applied (e.g. "h.3.attn"), so sites draw different masks.
  Dropout(float p, std::string_view site) : p_(p), site_(detail::name_hash(site)) {
    TRELLIS_CHECK(p >= 0.0f && p < 1.0f, "dropout probability ", p, " outside [0, 1)");
  }

  bool active() const { return p_ > 0.0f; }
  float probability() const { return p_; }

  bool keep(std::uint64_t seed, index_t sample, index_t t, index_t col) const {
    return keep_in_row(row_key(seed, sample, t), col);
  }

  // x: rows x width of a microbatch of `shape`, whose first row is microbatch row `row0`
  // (row = t * batch + b, as every activation); x *= mask / (1 - p) in place. Training only.
  void apply(const TokenShape& shape, index_t row0, index_t rows, index_t width, float* x) const {
    if (!active() || !shape.train) return;
    const float scale = 1.0f / (1.0f - p_);
    for (index_t r = 0; r < rows; ++r) {
      const index_t row = row0 + r, t = row / shape.batch, b = row % shape.batch;
      const std::uint64_t key = row_key(shape.seed, shape.first_sample + b, t);
      float* xr = x + r * width;
      for (index_t c = 0; c < width; ++c) xr[c] = keep_in_row(key, c) ? xr[c] * scale : 0.0f;
    }
  }

 private:
  std::uint64_t row_key(std::uint64_t seed, index_t sample, index_t t) const {
    const std::uint64_t base = detail::splitmix64(seed ^ site_);
    return detail::splitmix64(detail::splitmix64(base + static_cast<std::uint64_t>(sample)) +
                              static_cast<std::uint64_t>(t));
  }
  bool keep_in_row(std::uint64_t key, index_t col) const {
    const std::uint64_t h = detail::splitmix64(key + static_cast<std::uint64_t>(col) * 0x9E3779B97F4A7C15ull);
    const float u = static_cast<float>(h >> 40) * 0x1.0p-24f;  // [0, 1)
    return u >= p_;
  }

  float p_ = 0.0f;
  std::uint64_t site_ = 0;
};

}  // namespace trellis::nn
