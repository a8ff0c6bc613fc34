// Host AdamW over many tensors in one fused call, and global gradient-norm clipping.
//   host::adamw_step(tensors, config, step, grad_scale);
//   double n2 = host::grad_norm_squared(grads);  // fp64 sum of squares over all tensors
//   float s = host::clip_scale(std::sqrt(n2), max_norm);  -> pass as grad_scale
// AdamW (decoupled weight decay, Loshchilov & Hutter; PyTorch's torch.optim.AdamW), step t >= 1:
//   g = grad_scale * grad
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   p = p - lr * weight_decay * decay_mult * p - lr * (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
// Parameters and moments are fp32 (master weights); gradients fp32, half or bfloat16.
// Tensors are cut into fixed chunks that the thread pool runs in parallel; results are exact
// elementwise, so they do not depend on the thread count. The norm sums per fixed chunk in fp64
// and adds the chunks in order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/adamw.hpp"
#include "trellis/kernels/host_math.hpp"
#include "trellis/kernels/thread_pool.hpp"

namespace trellis::kernels::host {

namespace detail {
inline constexpr std::int64_t optim_chunk = 1 << 15;

// (tensor index, first element) of every fixed-size chunk of every tensor.
template <class Span>
std::vector<std::pair<std::int64_t, std::int64_t>> tensor_chunks(std::span<const Span> tensors,
                                                                 std::int64_t (*size_of)(const Span&)) {
  std::vector<std::pair<std::int64_t, std::int64_t>> chunks;
  for (std::size_t t = 0; t < tensors.size(); ++t)
    for (std::int64_t e = 0; e < size_of(tensors[t]); e += optim_chunk) chunks.emplace_back(t, e);
  return chunks;
}

}  // namespace detail

namespace detail {
// The scalars of one AdamW update of one tensor.
struct AdamWLanes {
  float b1, b2, eps, step_size, inv_sqrt_bc2, decay, grad_scale;
};

#if TRELLIS_HOST_SIMD
// One vector of elements. The scalar loop compiled to scalar code (the loads of the captured
// config and sqrt's errno check kept g++ from vectorising it): 321 ms of a GPT-2 124M step, now
// memory-bound (docs/kernels_host.md, "AdamW").
TRELLIS_FORCEINLINE void adamw_vector(const AdamWLanes& s, float* p, const float* g, float* m, float* v) {
  const simd::vfloat gs = s.grad_scale * simd::load(g);
  const simd::vfloat mn = s.b1 * simd::load(m) + (1.0f - s.b1) * gs;
  const simd::vfloat vn = s.b2 * simd::load(v) + (1.0f - s.b2) * gs * gs;
  simd::store(m, mn);
  simd::store(v, vn);
  simd::store(p, simd::load(p) * s.decay - s.step_size * mn / (simd::sqrt(vn) * s.inv_sqrt_bc2 + s.eps));
}
#endif

// Elements [0, n) of one tensor. With SIMD, a tail shorter than a vector runs through the same
// vector code on zero-padded copies, so an element's bits do not depend on where its chunk starts
// (ZeRO-1's shards and the replicated update agree exactly).
template <class G>
void adamw_range(const AdamWLanes& s, std::int64_t n, float* TRELLIS_RESTRICT p, const G* TRELLIS_RESTRICT g,
                 float* TRELLIS_RESTRICT m, float* TRELLIS_RESTRICT v) {
#if TRELLIS_HOST_SIMD
  constexpr int W = simd::width;
  float gf[W];
  std::int64_t e = 0;
  for (; e + W <= n; e += W) {
    const float* ge = nullptr;
    if constexpr (std::is_same_v<G, float>) {
      ge = g + e;
    } else {
      for (int l = 0; l < W; ++l) gf[l] = to_float(g[e + l]);
      ge = gf;
    }
    adamw_vector(s, p + e, ge, m + e, v + e);
  }
  if (e < n) {
    const auto r = static_cast<int>(n - e);
    float tp[W] = {}, tm[W] = {}, tv[W] = {}, tg[W] = {};
    for (int l = 0; l < r; ++l) tp[l] = p[e + l], tm[l] = m[e + l], tv[l] = v[e + l], tg[l] = to_float(g[e + l]);
    adamw_vector(s, tp, tg, tm, tv);
    for (int l = 0; l < r; ++l) p[e + l] = tp[l], m[e + l] = tm[l], v[e + l] = tv[l];
  }
#else
  for (std::int64_t e = 0; e < n; ++e) {
    const float gs = s.grad_scale * to_float(g[e]);
    const float mn = s.b1 * m[e] + (1.0f - s.b1) * gs;
    const float vn = s.b2 * v[e] + (1.0f - s.b2) * gs * gs;
    m[e] = mn;
    v[e] = vn;
    p[e] = p[e] * s.decay - s.step_size * mn / (std::sqrt(vn) * s.inv_sqrt_bc2 + s.eps);
  }
#endif
}
}  // namespace detail

template <class G>
void adamw_step(std::span<const AdamWTensor<G>> tensors, const AdamWConfig& config, std::int64_t step,
                float grad_scale = 1.0f) {
  const kernels::detail::AdamWScalars scalars = kernels::detail::adamw_prepare(tensors, config, step);
  auto chunks = detail::tensor_chunks<AdamWTensor<G>>(
      tensors, +[](const AdamWTensor<G>& x) { return static_cast<std::int64_t>(x.param.size()); });
  parallel_for(static_cast<std::int64_t>(chunks.size()), [&](std::int64_t c) {
    const auto& x = tensors[chunks[c].first];
    const std::int64_t e0 = chunks[c].second;
    const std::int64_t e1 = std::min<std::int64_t>(static_cast<std::int64_t>(x.param.size()), e0 + detail::optim_chunk);
    const detail::AdamWLanes s{config.beta1,         config.beta2,
                               config.eps,           scalars.step_size,
                               scalars.inv_sqrt_bc2, 1.0f - config.lr * config.weight_decay * x.decay_mult,
                               grad_scale};
    detail::adamw_range(s, e1 - e0, x.param.data() + e0, x.grad.data() + e0, x.m.data() + e0, x.v.data() + e0);
  });
}

template <class G>
void adamw_step(const std::vector<AdamWTensor<G>>& tensors, const AdamWConfig& config, std::int64_t step,
                float grad_scale = 1.0f) {
  adamw_step(std::span<const AdamWTensor<G>>(tensors), config, step, grad_scale);
}

// Sum of squares of every element of every tensor, accumulated in fp64.
template <class G>
double grad_norm_squared(std::span<const std::span<const G>> grads) {
  auto chunks = detail::tensor_chunks<std::span<const G>>(
      grads, +[](const std::span<const G>& x) { return static_cast<std::int64_t>(x.size()); });
  std::vector<double> partial(chunks.size(), 0.0);
  parallel_for(static_cast<std::int64_t>(chunks.size()), [&](std::int64_t c) {
    const auto& x = grads[chunks[c].first];
    const std::int64_t e0 = chunks[c].second;
    const std::int64_t e1 = std::min<std::int64_t>(static_cast<std::int64_t>(x.size()), e0 + detail::optim_chunk);
    double lanes[8] = {};
    std::int64_t e = e0;
    for (; e + 8 <= e1; e += 8)
      for (int l = 0; l < 8; ++l) {
        const double g = to_float(x[e + l]);
        lanes[l] += g * g;
      }
    double s = 0.0;
    for (; e < e1; ++e) s += static_cast<double>(to_float(x[e])) * to_float(x[e]);
    for (int l = 0; l < 8; ++l) s += lanes[l];
    partial[c] = s;
  });
  double total = 0.0;
  for (double p : partial) total += p;
  return total;
}

template <class G>
double grad_norm_squared(const std::vector<std::span<const G>>& grads) {
  return grad_norm_squared(std::span<const std::span<const G>>(grads));
}

// Factor that brings a global norm down to max_norm (1 when it is already below): multiply the
// gradients by it, e.g. as adamw_step's grad_scale. A non-finite norm is an error: silently
// skipping or zeroing a step would hide a divergence.
inline float clip_scale(double norm, double max_norm, double eps = 1e-6) {
  TRELLIS_CHECK(std::isfinite(norm), "clip_scale: the gradient norm is not finite (", norm, ")");
  TRELLIS_CHECK(max_norm > 0.0, "clip_scale: max_norm must be > 0, got ", max_norm);
  return norm > max_norm ? static_cast<float>(max_norm / (norm + eps)) : 1.0f;
}

}  // namespace trellis::kernels::host
