// The AdamW contract shared by the host and CUDA kernels (kernels/adamw_host.hpp,
// kernels/adamw_cuda.cuh) and by every backend: hyper-parameters, one tensor's spans, and the
// validation + bias-corrected scalars both kernels use, so both check alike and step alike.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>

#include "trellis/core/error.hpp"

namespace trellis::kernels {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

template <class G = float>
struct AdamWTensor {
  std::span<float> param;
  std::span<const G> grad;
  std::span<float> m;
  std::span<float> v;
  float decay_mult = 1.0f;  // 0 for tensors without weight decay (biases, norms)
};

namespace detail {
// Checks an AdamW call and returns its bias-corrected scalars; shared by the host and CUDA steps so
// both validate alike and use the very same step_size / inv_sqrt_bc2 (computed in fp64).
struct AdamWScalars {
  float step_size;     // lr / (1 - beta1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - beta2^t)
};
template <class G>
AdamWScalars adamw_prepare(std::span<const AdamWTensor<G>> tensors, const AdamWConfig& config, std::int64_t step) {
  TRELLIS_CHECK(step >= 1, "adamw_step: step counts from 1, got ", step);
  TRELLIS_CHECK(config.beta1 >= 0.0f && config.beta1 < 1.0f && config.beta2 >= 0.0f && config.beta2 < 1.0f,
                "adamw_step: betas must be in [0, 1), got ", config.beta1, ", ", config.beta2);
  for (std::size_t t = 0; t < tensors.size(); ++t) {
    const auto& x = tensors[t];
    TRELLIS_CHECK(x.grad.size() == x.param.size() && x.m.size() == x.param.size() && x.v.size() == x.param.size(),
                  "adamw_step: tensor ", t, " has param/grad/m/v of sizes ", x.param.size(), "/", x.grad.size(), "/",
                  x.m.size(), "/", x.v.size());
  }
  const double bc1 = 1.0 - std::pow(static_cast<double>(config.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(config.beta2), static_cast<double>(step));
  return {static_cast<float>(config.lr / bc1), static_cast<float>(1.0 / std::sqrt(bc2))};
}
}  // namespace detail

}  // namespace trellis::kernels
