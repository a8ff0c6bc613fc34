// Host kernels of the Mixture-of-Experts routing contract (kernels/moe.hpp). Rows run in blocks on
// the kernel thread pool; the dispatch plan is one counting sort (stable), which is what the CUDA
// path's radix sort by expert computes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/moe.hpp"
#include "trellis/kernels/thread_pool.hpp"

namespace trellis::kernels::host {

namespace detail {
// f(row) for every row, in blocks of rows on the pool.
template <class F>
void for_rows(std::int64_t rows, std::int64_t row_cost, F&& f) {
  const std::int64_t per_task = std::max<std::int64_t>(1, (std::int64_t{1} << 16) / std::max<std::int64_t>(row_cost, 1));
  const std::int64_t tasks = (rows + per_task - 1) / per_task;
  parallel_for(tasks, [&](std::int64_t t) {
    const std::int64_t end = std::min(rows, (t + 1) * per_task);
    for (std::int64_t r = t * per_task; r < end; ++r) f(r);
  });
}
}  // namespace detail

inline void check_route_args(const MoeRouteArgs& a) {
  TRELLIS_CHECK(a.rows >= 0 && a.experts >= 1, "moe routing: rows ", a.rows, ", experts ", a.experts);
  TRELLIS_CHECK(a.topk >= 1 && a.topk <= a.experts, "moe routing: top-", a.topk, " of ", a.experts, " experts");
  TRELLIS_CHECK(!(a.normalize && a.topk == 1),
                "moe routing: normalised gates with top-1 would all be 1 (no gradient reaches the router)");
}

inline void moe_route_forward(const MoeRouteArgs& a, const float* logits, float* probs, float* lse,
                              std::int32_t* expert, float* gate, std::int32_t* routed, float* prob_sums) {
  check_route_args(a);
  const std::int64_t E = a.experts;
  const int k = a.topk;
  detail::for_rows(a.rows, E, [&](std::int64_t r) {
    const float* z = logits + r * E;
    float* p = probs + r * E;
    float mx = -std::numeric_limits<float>::infinity();
    for (std::int64_t e = 0; e < E; ++e) mx = std::max(mx, z[e]);
    float s = 0.0f;
    for (std::int64_t e = 0; e < E; ++e) s += (p[e] = std::exp(z[e] - mx));
    const float inv = 1.0f / s;
    for (std::int64_t e = 0; e < E; ++e) p[e] *= inv;
    lse[r] = mx + std::log(s);
    // top-k by insertion (k is 1 or 2 in practice): strictly greater moves up, so ties keep the
    // lower index first.
    std::int32_t* ex = expert + r * k;
    float* g = gate + r * k;
    int have = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      int pos = have;
      while (pos > 0 && p[e] > g[pos - 1]) --pos;
      if (pos >= k) continue;
      for (int j = std::min(have, k - 1); j > pos; --j) {
        ex[j] = ex[j - 1];
        g[j] = g[j - 1];
      }
      ex[pos] = static_cast<std::int32_t>(e);
      g[pos] = p[e];
      have = std::min(have + 1, k);
    }
    if (a.normalize) {
      float sum = 0.0f;
      for (int j = 0; j < k; ++j) sum += g[j];
      for (int j = 0; j < k; ++j) g[j] /= sum;
    }
  });
  std::fill_n(routed, E, 0);
  for (std::int64_t i = 0; i < a.rows * k; ++i) ++routed[expert[i]];
  std::fill_n(prob_sums, E, 0.0f);
  for (std::int64_t r = 0; r < a.rows; ++r)
    for (std::int64_t e = 0; e < E; ++e) prob_sums[e] += probs[r * E + e];
}

// Returns the number of kept assignments (rows of the dispatched buffer).
inline std::int64_t moe_dispatch_plan(std::int64_t rows, int topk, std::int64_t experts, std::int64_t capacity,
                                      const std::int32_t* expert, std::int32_t* slot, std::int32_t* source_row,
                                      std::int32_t* kept) {
  const std::int64_t n = rows * topk;
  std::vector<std::int64_t> count(static_cast<std::size_t>(experts), 0);
  for (std::int64_t a = 0; a < n; ++a) {
    TRELLIS_CHECK(expert[a] >= 0 && expert[a] < experts, "moe dispatch: assignment ", a, " names expert ", expert[a],
                  " of ", experts);
    ++count[expert[a]];
  }
  std::vector<std::int64_t> offset(static_cast<std::size_t>(experts), 0), seen(static_cast<std::size_t>(experts), 0);
  std::int64_t total = 0;
  for (std::int64_t e = 0; e < experts; ++e) {
    const std::int64_t k = capacity < 0 ? count[e] : std::min(count[e], capacity);
    kept[e] = static_cast<std::int32_t>(k);
    offset[e] = total;
    total += k;
  }
  for (std::int64_t a = 0; a < n; ++a) {
    const std::int32_t e = expert[a];
    const std::int64_t pos = seen[e]++;
    if (pos < kept[e]) {
      slot[a] = static_cast<std::int32_t>(offset[e] + pos);
      source_row[offset[e] + pos] = static_cast<std::int32_t>(a / topk);
    } else {
      slot[a] = -1;
    }
  }
  return total;
}

template <class T>
void gather_rows(std::int64_t rows, std::int64_t cols, const T* src, const std::int32_t* index, T* dst) {
  detail::for_rows(rows, cols, [&](std::int64_t i) {
    std::copy_n(src + static_cast<std::int64_t>(index[i]) * cols, cols, dst + i * cols);
  });
}

template <class T>
void moe_combine(std::int64_t rows, int topk, std::int64_t cols, const T* y, const std::int32_t* slot,
                 const float* gate, T* out, bool accumulate) {
  detail::for_rows(rows, cols * topk, [&](std::int64_t r) {
    thread_local std::vector<float> acc;
    acc.assign(static_cast<std::size_t>(cols), 0.0f);
    if (accumulate)
      for (std::int64_t c = 0; c < cols; ++c) acc[c] = to_float(out[r * cols + c]);
    for (int j = 0; j < topk; ++j) {
      const std::int32_t s = slot[r * topk + j];
      if (s < 0) continue;
      const float g = gate ? gate[r * topk + j] : 1.0f;
      const T* yr = y + static_cast<std::int64_t>(s) * cols;
      for (std::int64_t c = 0; c < cols; ++c) acc[c] += g * to_float(yr[c]);
    }
    for (std::int64_t c = 0; c < cols; ++c) out[r * cols + c] = from_float<T>(acc[c]);
  });
}

template <class T>
void moe_combine_backward(std::int64_t rows, int topk, std::int64_t cols, const T* dout, const T* y,
                          const std::int32_t* slot, const float* gate, float* dgate, T* dy) {
  detail::for_rows(rows, cols * topk, [&](std::int64_t r) {
    const T* d = dout + r * cols;
    for (int j = 0; j < topk; ++j) {
      const std::int64_t a = r * topk + j;
      const std::int32_t s = slot[a];
      if (s < 0) {
        dgate[a] = 0.0f;
        continue;
      }
      const T* yr = y + static_cast<std::int64_t>(s) * cols;
      T* dyr = dy + static_cast<std::int64_t>(s) * cols;
      const float g = gate[a];
      float dot = 0.0f;
      for (std::int64_t c = 0; c < cols; ++c) {
        const float dv = to_float(d[c]);
        dot += dv * to_float(yr[c]);
        dyr[c] = from_float<T>(g * dv);
      }
      dgate[a] = dot;
    }
  });
}

inline void moe_route_backward(const MoeRouteArgs& a, const float* probs, const float* lse, const std::int32_t* expert,
                               const float* gate, const float* dgate, const float* aux_grad, float z_grad,
                               float* dlogits) {
  check_route_args(a);
  const std::int64_t E = a.experts;
  const int k = a.topk;
  detail::for_rows(a.rows, E, [&](std::int64_t r) {
    const float* p = probs + r * E;
    float* dz = dlogits + r * E;
    // dz holds d(loss)/d(probs) first, then becomes d(loss)/d(logits) in place.
    for (std::int64_t e = 0; e < E; ++e) dz[e] = aux_grad ? aux_grad[e] : 0.0f;
    const float* g = gate + r * k;
    const float* dg = dgate + r * k;
    if (a.normalize) {
      // g_j = p_j / S with S the sum of the chosen p: dp_i = (dg_i - sum_j dg_j g_j) / S.
      float dot = 0.0f, chosen_sum = 0.0f;
      for (int j = 0; j < k; ++j) {
        dot += dg[j] * g[j];
        chosen_sum += p[expert[r * k + j]];
      }
      for (int j = 0; j < k; ++j) dz[expert[r * k + j]] += (dg[j] - dot) / chosen_sum;
    } else {
      for (int j = 0; j < k; ++j) dz[expert[r * k + j]] += dg[j];
    }
    float dot = 0.0f;
    for (std::int64_t e = 0; e < E; ++e) dot += dz[e] * p[e];
    const float zl = z_grad * lse[r];
    for (std::int64_t e = 0; e < E; ++e) dz[e] = p[e] * (dz[e] - dot) + zl * p[e];
  });
}

}  // namespace trellis::kernels::host
