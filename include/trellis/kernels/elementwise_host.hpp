// Host elementwise kernels: GELU (tanh form, as GPT-2) forward and backward, residual add, and the
// column sums of a matrix (the bias gradient of a linear layer whose output gradient is given).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/host_math.hpp"
#include "trellis/kernels/thread_pool.hpp"

namespace trellis::kernels::host {

namespace detail {
inline constexpr std::int64_t elementwise_chunk = 16384;

template <class Fn>
void for_chunks(std::int64_t n, Fn&& fn) {
  parallel_for((n + elementwise_chunk - 1) / elementwise_chunk, [&](std::int64_t c) {
    fn(c * elementwise_chunk, std::min(n, (c + 1) * elementwise_chunk));
  });
}
}  // namespace detail

// out = gelu_tanh(x); out may alias x.
template <class T>
void gelu_forward(std::int64_t n, const T* x, T* out) {
  TRELLIS_CHECK(n >= 0, "gelu_forward: negative size ", n);
  detail::for_chunks(n, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) out[i] = from_float<T>(fast_gelu(to_float(x[i])));
  });
}

// dx = dout * gelu_tanh'(x) (or dx += ... with accumulate); dx may alias dout.
template <class T>
void gelu_backward(std::int64_t n, const T* x, const T* dout, T* dx, bool accumulate = false) {
  TRELLIS_CHECK(n >= 0, "gelu_backward: negative size ", n);
  detail::for_chunks(n, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const float g = to_float(dout[i]) * fast_gelu_grad(to_float(x[i]));
      dx[i] = from_float<T>(accumulate ? to_float(dx[i]) + g : g);
    }
  });
}

// out = a + b, summed in fp32 (out may alias either; the types may differ: a bf16 part added into
// an fp32 accumulator).
template <class TA, class TB, class TO>
void add(std::int64_t n, const TA* a, const TB* b, TO* out) {
  TRELLIS_CHECK(n >= 0, "add: negative size ", n);
  detail::for_chunks(n, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) out[i] = from_float<TO>(to_float(a[i]) + to_float(b[i]));
  });
}

// sums[j] (+)= sum_i x[i, j] for a row-major rows x cols matrix with row stride ld. Summed per
// fixed block of rows, blocks added in order: deterministic whatever the thread count.
template <class T, class S>
void column_sums(std::int64_t rows, std::int64_t cols, std::int64_t ld, const T* x, S* sums, bool accumulate = true) {
  TRELLIS_CHECK(rows >= 0 && cols >= 0 && ld >= cols, "column_sums: bad shape rows=", rows, " cols=", cols, " ld=", ld);
  constexpr std::int64_t rows_per_task = 64;
  const std::int64_t tasks = (rows + rows_per_task - 1) / rows_per_task;
  std::vector<float> partial(static_cast<std::size_t>(tasks * cols), 0.0f);
  parallel_for(tasks, [&](std::int64_t t) {
    float* p = partial.data() + t * cols;
    const std::int64_t r1 = std::min(rows, (t + 1) * rows_per_task);
    for (std::int64_t r = t * rows_per_task; r < r1; ++r)
      for (std::int64_t j = 0; j < cols; ++j) p[j] += to_float(x[r * ld + j]);
  });
  for (std::int64_t j = 0; j < cols; ++j) {
    float s = accumulate ? to_float(sums[j]) : 0.0f;
    for (std::int64_t t = 0; t < tasks; ++t) s += partial[t * cols + j];
    sums[j] = from_float<S>(s);
  }
}

}  // namespace trellis::kernels::host
