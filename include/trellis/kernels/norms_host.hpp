// Host LayerNorm and RMSNorm, forward and backward, over the last dimension of [rows, dim].
//   host::layernorm_forward(rows, dim, x, weight, bias, out, mean, rstd, eps [, residual, sum_out]);
//   host::layernorm_backward(rows, dim, dout, input, weight, mean, rstd, dinput, dweight, dbias);
//   host::rmsnorm_forward / host::rmsnorm_backward: the same without mean and bias.
// Activations (x, out, dout, dinput) are float, half or bfloat16; weights W float or 16-bit;
// statistics (mean, rstd: [rows]) and all arithmetic fp32.
// Fused residual add: with `residual` non-null the normalised input is x + residual, which is also
// written to `sum_out` (the new residual stream, and the `input` the backward pass needs).
// Backward: dinput is overwritten (or added to with accumulate_dinput, for a residual branch);
// dweight and dbias are always ADDED to (gradient accumulation). Weight gradients are summed per
// fixed block of rows and the blocks added in order, so they do not depend on the thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/host_math.hpp"
#include "trellis/kernels/thread_pool.hpp"

namespace trellis::kernels::host {

namespace detail {
inline constexpr std::int64_t norm_rows_per_task = 32;

inline void check_norm_shape(const char* what, std::int64_t rows, std::int64_t dim) {
  TRELLIS_CHECK(rows >= 0 && dim > 0, what, ": bad shape rows=", rows, " dim=", dim);
}

// Sum of n floats with 8 lanes (vectorisable, fixed order).
inline float lanes8_sum(const float* x, std::int64_t n) {
  float lanes[8] = {};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += x[i + l];
  float s = 0.0f;
  for (; i < n; ++i) s += x[i];
  for (int l = 0; l < 8; ++l) s += lanes[l];
  return s;
}

// Row r of the norm's input in fp32: x, or with a residual x + residual, which is also stored in
// sum_out (the row is then re-read from what was stored, as the CUDA kernel normalises it).
template <class T>
void load_norm_row(std::int64_t r, std::int64_t dim, const T* x, const T* residual, T* sum_out, float* row) {
  const T* xr = x + r * dim;
  for (std::int64_t j = 0; j < dim; ++j) row[j] = to_float(xr[j]);
  if (!residual) return;
  const T* rr = residual + r * dim;
  T* sr = sum_out + r * dim;
  for (std::int64_t j = 0; j < dim; ++j) {
    row[j] += to_float(rr[j]);
    sr[j] = from_float<T>(row[j]);
    if constexpr (!std::is_same_v<T, float>) row[j] = to_float(sr[j]);
  }
}

// Weight-gradient partials: one (dim) row per task, summed in task order into dst (+=).
template <class W>
void add_partials(std::int64_t tasks, std::int64_t dim, const std::vector<float>& partials, W* dst) {
  if (!dst) return;
  for (std::int64_t j = 0; j < dim; ++j) {
    float s = to_float(dst[j]);
    for (std::int64_t t = 0; t < tasks; ++t) s += partials[t * dim + j];
    dst[j] = from_float<W>(s);
  }
}
}  // namespace detail

template <class T, class W>
void layernorm_forward(std::int64_t rows, std::int64_t dim, const T* x, const W* weight, const W* bias, T* out,
                       float* mean, float* rstd, float eps = 1e-5f, const T* residual = nullptr,
                       T* sum_out = nullptr) {
  detail::check_norm_shape("layernorm_forward", rows, dim);
  TRELLIS_CHECK(x && out && weight, "layernorm_forward: null x, out or weight");
  TRELLIS_CHECK(!residual || sum_out, "layernorm_forward: a residual needs sum_out for the summed input");
  const std::int64_t tasks = (rows + detail::norm_rows_per_task - 1) / detail::norm_rows_per_task;
  parallel_for(tasks, [&](std::int64_t t) {
    std::vector<float> row(static_cast<std::size_t>(dim)), w(static_cast<std::size_t>(dim)),
        b(static_cast<std::size_t>(dim), 0.0f);
    for (std::int64_t j = 0; j < dim; ++j) w[j] = to_float(weight[j]);
    if (bias)
      for (std::int64_t j = 0; j < dim; ++j) b[j] = to_float(bias[j]);
    const std::int64_t r1 = std::min(rows, (t + 1) * detail::norm_rows_per_task);
    for (std::int64_t r = t * detail::norm_rows_per_task; r < r1; ++r) {
      detail::load_norm_row(r, dim, x, residual, sum_out, row.data());
      const float mu = detail::lanes8_sum(row.data(), dim) / static_cast<float>(dim);
      float var_lanes[8] = {};
      std::int64_t j = 0;
      for (; j + 8 <= dim; j += 8)
        for (int l = 0; l < 8; ++l) var_lanes[l] += (row[j + l] - mu) * (row[j + l] - mu);
      float var = 0.0f;
      for (; j < dim; ++j) var += (row[j] - mu) * (row[j] - mu);
      for (int l = 0; l < 8; ++l) var += var_lanes[l];
      var /= static_cast<float>(dim);
      const float rs = 1.0f / std::sqrt(var + eps);
      T* o = out + r * dim;
      for (std::int64_t jj = 0; jj < dim; ++jj) o[jj] = from_float<T>((row[jj] - mu) * rs * w[jj] + b[jj]);
      if (mean) mean[r] = mu;
      if (rstd) rstd[r] = rs;
    }
  });
}

template <class T, class W>
void layernorm_backward(std::int64_t rows, std::int64_t dim, const T* dout, const T* input, const W* weight,
                        const float* mean, const float* rstd, T* dinput, W* dweight, W* dbias,
                        bool accumulate_dinput = false) {
  detail::check_norm_shape("layernorm_backward", rows, dim);
  TRELLIS_CHECK(dout && input && weight && mean && rstd && dinput, "layernorm_backward: null pointer");
  const std::int64_t tasks = (rows + detail::norm_rows_per_task - 1) / detail::norm_rows_per_task;
  std::vector<float> dw(static_cast<std::size_t>(tasks * dim), 0.0f), db(static_cast<std::size_t>(tasks * dim), 0.0f);
  parallel_for(tasks, [&](std::int64_t t) {
    std::vector<float> xhat(static_cast<std::size_t>(dim)), g(static_cast<std::size_t>(dim)),
        w(static_cast<std::size_t>(dim));
    for (std::int64_t j = 0; j < dim; ++j) w[j] = to_float(weight[j]);
    float* dwt = dw.data() + t * dim;
    float* dbt = db.data() + t * dim;
    const std::int64_t r1 = std::min(rows, (t + 1) * detail::norm_rows_per_task);
    for (std::int64_t r = t * detail::norm_rows_per_task; r < r1; ++r) {
      const float mu = mean[r], rs = rstd[r];
      const T* xr = input + r * dim;
      const T* dr = dout + r * dim;
      for (std::int64_t j = 0; j < dim; ++j) {
        const float dy = to_float(dr[j]);
        xhat[j] = (to_float(xr[j]) - mu) * rs;
        g[j] = dy * w[j];  // d loss / d xhat
        dwt[j] += dy * xhat[j];
        dbt[j] += dy;
      }
      const float g_mean = detail::lanes8_sum(g.data(), dim) / static_cast<float>(dim);
      for (std::int64_t j = 0; j < dim; ++j) xhat[j] *= g[j];  // reuse: g * xhat
      const float gx_mean = detail::lanes8_sum(xhat.data(), dim) / static_cast<float>(dim);
      T* dx = dinput + r * dim;
      for (std::int64_t j = 0; j < dim; ++j) {
        const float xh = (to_float(xr[j]) - mu) * rs;
        const float v = rs * (g[j] - g_mean - xh * gx_mean);
        dx[j] = from_float<T>(accumulate_dinput ? to_float(dx[j]) + v : v);
      }
    }
  });
  detail::add_partials(tasks, dim, dw, dweight);
  detail::add_partials(tasks, dim, db, dbias);
}

template <class T, class W>
void rmsnorm_forward(std::int64_t rows, std::int64_t dim, const T* x, const W* weight, T* out, float* rstd,
                     float eps = 1e-5f, const T* residual = nullptr, T* sum_out = nullptr) {
  detail::check_norm_shape("rmsnorm_forward", rows, dim);
  TRELLIS_CHECK(x && out && weight, "rmsnorm_forward: null x, out or weight");
  TRELLIS_CHECK(!residual || sum_out, "rmsnorm_forward: a residual needs sum_out for the summed input");
  const std::int64_t tasks = (rows + detail::norm_rows_per_task - 1) / detail::norm_rows_per_task;
  parallel_for(tasks, [&](std::int64_t t) {
    std::vector<float> row(static_cast<std::size_t>(dim)), sq(static_cast<std::size_t>(dim)),
        w(static_cast<std::size_t>(dim));
    for (std::int64_t j = 0; j < dim; ++j) w[j] = to_float(weight[j]);
    const std::int64_t r1 = std::min(rows, (t + 1) * detail::norm_rows_per_task);
    for (std::int64_t r = t * detail::norm_rows_per_task; r < r1; ++r) {
      detail::load_norm_row(r, dim, x, residual, sum_out, row.data());
      for (std::int64_t j = 0; j < dim; ++j) sq[j] = row[j] * row[j];
      const float ms = detail::lanes8_sum(sq.data(), dim) / static_cast<float>(dim);
      const float rs = 1.0f / std::sqrt(ms + eps);
      T* o = out + r * dim;
      for (std::int64_t j = 0; j < dim; ++j) o[j] = from_float<T>(row[j] * rs * w[j]);
      if (rstd) rstd[r] = rs;
    }
  });
}

template <class T, class W>
void rmsnorm_backward(std::int64_t rows, std::int64_t dim, const T* dout, const T* input, const W* weight,
                      const float* rstd, T* dinput, W* dweight, bool accumulate_dinput = false) {
  detail::check_norm_shape("rmsnorm_backward", rows, dim);
  TRELLIS_CHECK(dout && input && weight && rstd && dinput, "rmsnorm_backward: null pointer");
  const std::int64_t tasks = (rows + detail::norm_rows_per_task - 1) / detail::norm_rows_per_task;
  std::vector<float> dw(static_cast<std::size_t>(tasks * dim), 0.0f);
  parallel_for(tasks, [&](std::int64_t t) {
    std::vector<float> xhat(static_cast<std::size_t>(dim)), g(static_cast<std::size_t>(dim)),
        gx(static_cast<std::size_t>(dim)), w(static_cast<std::size_t>(dim));
    for (std::int64_t j = 0; j < dim; ++j) w[j] = to_float(weight[j]);
    float* dwt = dw.data() + t * dim;
    const std::int64_t r1 = std::min(rows, (t + 1) * detail::norm_rows_per_task);
    for (std::int64_t r = t * detail::norm_rows_per_task; r < r1; ++r) {
      const float rs = rstd[r];
      const T* xr = input + r * dim;
      const T* dr = dout + r * dim;
      for (std::int64_t j = 0; j < dim; ++j) {
        const float dy = to_float(dr[j]);
        xhat[j] = to_float(xr[j]) * rs;
        g[j] = dy * w[j];
        gx[j] = g[j] * xhat[j];
        dwt[j] += dy * xhat[j];
      }
      const float gx_mean = detail::lanes8_sum(gx.data(), dim) / static_cast<float>(dim);
      T* dx = dinput + r * dim;
      for (std::int64_t j = 0; j < dim; ++j) {
        const float v = rs * (g[j] - xhat[j] * gx_mean);
        dx[j] = from_float<T>(accumulate_dinput ? to_float(dx[j]) + v : v);
      }
    }
  });
  detail::add_partials(tasks, dim, dw, dweight);
}

}  // namespace trellis::kernels::host
