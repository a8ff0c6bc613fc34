// The thread backend's typed reduction kernels: op over every rank's input in a fixed rank order,
// one 64-byte line at a time, each finished line stored into every output (part of
// comm/threads.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "trellis/comm/communicator.hpp"
#include "trellis/core/config.hpp"
#include "trellis/core/dtype.hpp"

namespace trellis::comm {

namespace detail {

// ------------------------------------------------------------------------------------------------
// Reduction kernels: out = op(in_0, in_1, ..., in_{n-1}) element-wise, in that order.

template <class T>
struct ReduceArith {
  using A = accumulate_t<T>;
  static A load(T v) { return static_cast<A>(v); }
  static T store(A v) { return static_cast<T>(v); }
  static A add(A a, A b) {
    if constexpr (std::is_integral_v<A>) {  // integers wrap (no signed-overflow UB)
      using U = std::make_unsigned_t<A>;
      return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
    } else {
      return a + b;
    }
  }
  static A mul(A a, A b) {
    if constexpr (std::is_integral_v<A>) {
      using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
      return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
    } else {
      return a * b;
    }
  }
};

// Stores one 64-byte line at a 64-byte aligned `dst`, bypassing the cache when `streaming`.
inline void store_line(std::byte* dst, const void* line, bool streaming) {
#if defined(__AVX512F__)
  if (streaming) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), _mm512_loadu_si512(line));
    return;
  }
#elif defined(__AVX__)
  if (streaming) {
    const auto* src = static_cast<const __m256i*>(line);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), _mm256_loadu_si256(src));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), _mm256_loadu_si256(src + 1));
    return;
  }
#elif defined(__SSE2__)
  if (streaming) {
    const auto* src = static_cast<const __m128i*>(line);
    for (int i = 0; i < 4; ++i)
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + 16 * i), _mm_loadu_si128(src + i));
    return;
  }
#endif
  std::memcpy(dst, line, 64);
}

// acc op v, with acc holding the lower ranks: the order is fixed (rank 0, 1, ..., n-1).
template <class T, ReduceOp Op>
inline accumulate_t<T> reduce_combine(accumulate_t<T> acc, accumulate_t<T> v) {
  using R = ReduceArith<T>;
  if constexpr (Op == ReduceOp::sum || Op == ReduceOp::avg) return R::add(acc, v);
  else if constexpr (Op == ReduceOp::prod) return R::mul(acc, v);
  else if constexpr (Op == ReduceOp::min) return v < acc ? v : acc;
  else return acc < v ? v : acc;
}

// res[0, Len) = op over the inputs of elements [base, base + Len). Len is a compile-time
// constant for whole lines so the accumulators live in vector registers.
template <class T, ReduceOp Op, std::size_t Len>
inline void reduce_span(const std::byte* const* ins, int n_in, std::size_t base, std::size_t len, int divisor,
                        T* TRELLIS_RESTRICT res) {
  using R = ReduceArith<T>;
  using A = typename R::A;
  const std::size_t m = Len > 0 ? Len : len;
  alignas(64) A acc[Len > 0 ? Len : 64 / sizeof(T)];
  const T* TRELLIS_RESTRICT in0 = reinterpret_cast<const T*>(ins[0]) + base;
  for (std::size_t i = 0; i < m; ++i) acc[i] = R::load(in0[i]);
  for (int k = 1; k < n_in; ++k) {
    const T* TRELLIS_RESTRICT src = reinterpret_cast<const T*>(ins[k]) + base;
    for (std::size_t i = 0; i < m; ++i) acc[i] = reduce_combine<T, Op>(acc[i], R::load(src[i]));
  }
  if constexpr (Op == ReduceOp::avg) {
    const A d = static_cast<A>(divisor);
    for (std::size_t i = 0; i < m; ++i) acc[i] = static_cast<A>(acc[i] / d);
  }
  for (std::size_t i = 0; i < m; ++i) res[i] = R::store(acc[i]);
}

// outs[o][i] = op(ins[0][i], ..., ins[n_in-1][i]) for i < count and every output o, one cache
// line at a time: the line's accumulators stay in registers and each finished line goes straight
// to every output (streaming stores for large messages), so every input byte is read once and
// every output byte written once, with no staging buffer. n_in == 1 is a copy to n_out outputs.
template <class T, ReduceOp Op>
inline void reduce_into(const std::byte* const* ins, int n_in, std::byte* const* outs, int n_out,
                        std::size_t count, int divisor, bool streaming) {
  constexpr std::size_t line = 64 / sizeof(T);  // elements per 64-byte output line
  const bool copy = n_in == 1 && Op != ReduceOp::avg;
  // Elements [base, base + len), len < line or not aligned: through a small buffer.
  const auto partial = [&](std::size_t base, std::size_t len) {
    alignas(64) T res[line];
    reduce_span<T, Op, 0>(ins, n_in, base, len, divisor, res);
    for (int o = 0; o < n_out; ++o) std::memcpy(outs[o] + base * sizeof(T), res, len * sizeof(T));
  };
  // Whole lines need every output at the same offset within a line (true for the usual
  // allocations); otherwise everything goes through the partial path.
  const auto misalignment = [](const std::byte* p) { return reinterpret_cast<std::uintptr_t>(p) & 63; };
  bool aligned_together = misalignment(outs[0]) % sizeof(T) == 0;
  for (int o = 1; o < n_out; ++o) aligned_together = aligned_together && misalignment(outs[o]) == misalignment(outs[0]);
  std::size_t head = count;
  if (aligned_together) head = std::min(count, ((64 - misalignment(outs[0])) & 63) / sizeof(T));
  for (std::size_t base = 0; base < head; base += line) partial(base, std::min(line, head - base));
  std::size_t base = head;
  if (copy) {
    for (; base + line <= count; base += line)
      for (int o = 0; o < n_out; ++o) store_line(outs[o] + base * sizeof(T), ins[0] + base * sizeof(T), streaming);
  } else {
    for (; base + line <= count; base += line) {
      alignas(64) T res[line];
      reduce_span<T, Op, line>(ins, n_in, base, line, divisor, res);
      for (int o = 0; o < n_out; ++o) store_line(outs[o] + base * sizeof(T), res, streaming);
    }
  }
  for (; base < count; base += line) partial(base, std::min(line, count - base));
}

template <class T>
inline void reduce_typed(const std::byte* const* ins, int n_in, std::byte* const* outs, int n_out,
                         std::size_t count, ReduceOp op, int divisor, bool streaming) {
  switch (op) {
    case ReduceOp::sum: return reduce_into<T, ReduceOp::sum>(ins, n_in, outs, n_out, count, divisor, streaming);
    case ReduceOp::avg: return reduce_into<T, ReduceOp::avg>(ins, n_in, outs, n_out, count, divisor, streaming);
    case ReduceOp::min: return reduce_into<T, ReduceOp::min>(ins, n_in, outs, n_out, count, divisor, streaming);
    case ReduceOp::max: return reduce_into<T, ReduceOp::max>(ins, n_in, outs, n_out, count, divisor, streaming);
    case ReduceOp::prod: return reduce_into<T, ReduceOp::prod>(ins, n_in, outs, n_out, count, divisor, streaming);
  }
}

// outs[o][i] = op(ins[0][i], ..., ins[n_in-1][i]) for every o, in rank order.
inline void reduce_dispatch(DType dtype, const std::byte* const* ins, int n_in,
                            std::byte* const* outs, int n_out, std::size_t count, ReduceOp op,
                            int divisor, bool streaming = false) {
  if (count == 0 || n_out == 0) return;
  if (n_in == 1 && op != ReduceOp::avg) {  // a copy: move the bits, whatever they mean
    switch (dtype_size(dtype)) {
      case 1: return reduce_into<std::uint8_t, ReduceOp::sum>(ins, 1, outs, n_out, count, 1, streaming);
      case 2: return reduce_into<std::uint16_t, ReduceOp::sum>(ins, 1, outs, n_out, count, 1, streaming);
      case 4: return reduce_into<std::uint32_t, ReduceOp::sum>(ins, 1, outs, n_out, count, 1, streaming);
      case 8: return reduce_into<std::uint64_t, ReduceOp::sum>(ins, 1, outs, n_out, count, 1, streaming);
      default: break;
    }
  }
  switch (dtype) {
    case DType::f32: return reduce_typed<float>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::f64: return reduce_typed<double>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::f16: return reduce_typed<half>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::bf16: return reduce_typed<bfloat16>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::i8: return reduce_typed<std::int8_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::u8: return reduce_typed<std::uint8_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::i32: return reduce_typed<std::int32_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::u32: return reduce_typed<std::uint32_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::i64: return reduce_typed<std::int64_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
    case DType::u64: return reduce_typed<std::uint64_t>(ins, n_in, outs, n_out, count, op, divisor, streaming);
  }
}

}  // namespace detail

}  // namespace trellis::comm
