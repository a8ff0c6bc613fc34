// Gradient clipping by global norm. The norm covers the gradients of every rank: each rank sums
// the squares of the gradients it holds (kernels::host::grad_norm_squared, fp64), a caller-given
// reduction adds those sums over the ranks (an all-reduce over the tp/pp/dp ranks that hold
// DIFFERENT parts; count a replicated tensor on one rank only), and the scale
//   scale = max_norm / (norm + 1e-6) if norm > max_norm, else 1
// multiplies every gradient, either in place or fused into the optimizer (grad_scale).
// optim does not depend on a backend: the reduction is any callable double -> double;
// sum_over(comm) makes one from a Communicator, LocalSum{} is the single-rank identity.
#pragma once

#include <cmath>
#include <concepts>
#include <span>
#include <vector>

#include "trellis/comm/communicator.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/adamw_host.hpp"

namespace trellis::optim {

// No reduction: this rank holds every gradient.
struct LocalSum {
  double operator()(double local) const { return local; }
};

// A reduction that all-reduces (sum) a double over `comm`.
template <class C>
auto sum_over(C& comm) {
  return [&comm](double local) {
    double total = 0.0;
    comm.all_reduce(&local, &total, 1, comm::ReduceOp::sum);
    return total;
  };
}

template <class R>
concept NormReduction = std::invocable<R&, double> && std::convertible_to<std::invoke_result_t<R&, double>, double>;

// sqrt of the reduced sum of squares of `grads`.
template <class G, NormReduction R>
double global_grad_norm(std::span<const std::span<const G>> grads, R&& reduce_sum) {
  const double total = static_cast<double>(reduce_sum(kernels::host::grad_norm_squared<G>(grads)));
  TRELLIS_CHECK(total >= 0.0 || std::isnan(total), "global_grad_norm: the reduced sum of squares is negative (", total, ")");
  return std::sqrt(total);
}

struct ClipResult {
  double norm = 0.0;   // global norm before clipping
  float scale = 1.0f;  // factor applied (or to apply)
};

// The norm and the clip factor, gradients untouched: pass `scale` to AdamWState::update.
template <class G, NormReduction R>
ClipResult clip_factor(std::span<const std::span<const G>> grads, double max_norm, R&& reduce_sum) {
  const double norm = global_grad_norm<G>(grads, reduce_sum);
  return {norm, kernels::host::clip_scale(norm, max_norm)};
}

// Clips fp32 gradients in place.
template <NormReduction R>
ClipResult clip_grad_norm(std::span<const std::span<float>> grads, double max_norm, R&& reduce_sum) {
  std::vector<std::span<const float>> view(grads.begin(), grads.end());
  ClipResult r = clip_factor<float>(std::span<const std::span<const float>>(view), max_norm, reduce_sum);
  if (r.scale != 1.0f)
    for (auto g : grads)
      for (float& x : g) x *= r.scale;
  return r;
}
template <NormReduction R>
ClipResult clip_grad_norm(const std::vector<std::span<float>>& grads, double max_norm, R&& reduce_sum) {
  return clip_grad_norm(std::span<const std::span<float>>(grads), max_norm, reduce_sum);
}

}  // namespace trellis::optim
