// Host elementwise kernels: GELU (tanh form, as GPT-2) forward and backward, residual add, the
// column sums of a matrix (the bias gradient of a linear layer whose output gradient is given), and
// the fp32 -> activation-type conversion of a parameter's GEMM operand.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

// dst[i] = bfloat16(src[i]) for i < n: round to nearest even, every NaN to the canonical 0x7fff
// (the bits of the scalar conversion, core/dtype.hpp), with GCC/clang vector extensions. A bf16
// backend converts every weight from its fp32 master values at each use (nn/operand.hpp): the
// scalar loop on the calling thread took ~5 % of a GPT-2 124M bf16 step.
inline void float_to_bf16_row(std::int64_t n, const float* TRELLIS_RESTRICT src, bfloat16* TRELLIS_RESTRICT dst) {
  std::int64_t i = 0;
#if TRELLIS_HOST_SIMD
  typedef std::uint16_t vbits16 __attribute__((vector_size(simd::width * sizeof(std::uint16_t))));
  for (; i + simd::width <= n; i += simd::width) {
    simd::vuint u;
    std::memcpy(&u, src + i, sizeof u);
    const simd::vuint rounded = (u + (0x7fffu + ((u >> 16) & 1u))) >> 16;
    const simd::vuint nan = simd::vuint{} + static_cast<std::uint32_t>(trellis::detail::canonical_nan16);
    const vbits16 bits = __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded, vbits16);
    std::memcpy(static_cast<void*>(dst + i), &bits, sizeof bits);
  }
#endif
  for (; i < n; ++i) dst[i] = bfloat16(src[i]);
}

// dst = src converted to T (float: a copy), in chunks on the pool.
template <class T>
void convert(std::int64_t n, const float* src, T* dst) {
  TRELLIS_CHECK(n >= 0, "convert: negative size ", n);
  detail::for_chunks(n, [&](std::int64_t i0, std::int64_t i1) {
    if constexpr (std::is_same_v<T, bfloat16>) float_to_bf16_row(i1 - i0, src + i0, dst + i0);
    else if constexpr (std::is_same_v<T, float>) std::copy(src + i0, src + i1, dst + i0);
    else for (std::int64_t i = i0; i < i1; ++i) dst[i] = from_float<T>(src[i]);
  });
}

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
