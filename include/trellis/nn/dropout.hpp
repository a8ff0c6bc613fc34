// Dropout of the norm/residual region (GPT-2's embd_pdrop and resid_pdrop). Whether element
// (row, col) is kept is a pure function of (microbatch seed, site, global row, col) — a hash, not
// a stateful generator — so every tensor-parallel / sequence-parallel layout, every pipeline
// split and the recompute pass drop exactly the same elements. Kept elements are scaled by
// 1 / (1 - p); the backward pass applies the same mask to the gradient.
// (Dropout of the attention probabilities is not offered: the flash-attention kernel has none.)
#pragma once

#include <cstdint>
#include <string_view>

#include "trellis/core/error.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/nn/parameter.hpp"

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

  bool keep(std::uint64_t seed, index_t row, index_t col) const {
    const std::uint64_t base = detail::splitmix64(seed ^ site_);
    const std::uint64_t h = detail::splitmix64(base + static_cast<std::uint64_t>(row) * 0x9E3779B97F4A7C15ull +
                                               static_cast<std::uint64_t>(col));
    const float u = static_cast<float>(h >> 40) * 0x1.0p-24f;  // [0, 1)
    return u >= p_;
  }

  // x: rows x width whose first row is global row `row0`; x *= mask / (1 - p) in place.
  void apply(std::uint64_t seed, index_t row0, index_t rows, index_t width, float* x) const {
    if (!active()) return;
    const float scale = 1.0f / (1.0f - p_);
    for (index_t r = 0; r < rows; ++r)
      for (index_t c = 0; c < width; ++c) x[r * width + c] = keep(seed, row0 + r, c) ? x[r * width + c] * scale : 0.0f;
  }

 private:
  float p_ = 0.0f;
  std::uint64_t site_ = 0;
};

}  // namespace trellis::nn
