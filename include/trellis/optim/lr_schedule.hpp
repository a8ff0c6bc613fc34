// Learning-rate schedules: value types with operator()(step) -> lr, steps counted from 0.
//   WarmupCosine{.max_lr = 6e-4, .min_lr = 6e-5, .warmup_steps = 100, .total_steps = 5000}
// warm-up:  step < W          lr = max_lr * (step + 1) / W          (never 0 at step 0)
// cosine:   W <= step < S      lr = min_lr + (max_lr - min_lr) * (1 + cos(pi * (step - W) / (S - W))) / 2
// after:    step >= S          lr = min_lr
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>

#include "trellis/core/error.hpp"

namespace trellis::optim {

struct ConstantLR {
  double lr = 1e-3;
  double operator()(std::int64_t /*step*/) const { return lr; }
};

struct WarmupCosine {
  double max_lr = 3e-4;
  double min_lr = 0.0;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;

  double operator()(std::int64_t step) const {
    TRELLIS_CHECK(step >= 0, "WarmupCosine: negative step ", step);
    TRELLIS_CHECK(warmup_steps >= 0 && total_steps > warmup_steps, "WarmupCosine: warmup_steps ", warmup_steps,
                  " must be in [0, total_steps = ", total_steps, ")");
    if (step < warmup_steps) return max_lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
    if (step >= total_steps) return min_lr;
    const double progress =
        static_cast<double>(step - warmup_steps) / static_cast<double>(total_steps - warmup_steps);
    return min_lr + (max_lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
  }
};

}  // namespace trellis::optim
