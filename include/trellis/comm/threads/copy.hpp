// Byte copies for the thread backend's data paths: streaming (non-temporal) stores for messages
// too large for the cache (part of comm/threads.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace trellis::comm {

namespace detail {

// ------------------------------------------------------------------------------------------------
// Copies for large messages: non-temporal stores skip the read-for-ownership of the destination
// (a third less memory traffic) when the data would not fit in cache anyway.

// Messages whose buffers (all ranks, inputs + outputs) exceed this many bytes use streaming stores.
#ifndef TRELLIS_COMM_STREAM_BYTES
#define TRELLIS_COMM_STREAM_BYTES (std::size_t{16} << 20)
#endif

inline void stream_copy(std::byte* dst, const std::byte* src, std::size_t bytes) {
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
#if defined(__AVX512F__)
  constexpr std::size_t vec = 64;
#elif defined(__AVX__)
  constexpr std::size_t vec = 32;
#else
  constexpr std::size_t vec = 16;
#endif
  std::size_t head = (vec - (reinterpret_cast<std::uintptr_t>(dst) & (vec - 1))) & (vec - 1);
  if (head > bytes) head = bytes;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  bytes -= head;
  std::size_t i = 0;
  for (; i + vec <= bytes; i += vec) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
#elif defined(__AVX__)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
#else
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
#endif
  }
  std::memcpy(dst + i, src + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

// Orders streaming stores before the release that publishes a finished task.
inline void stream_fence() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

inline void copy_bytes(std::byte* dst, const std::byte* src, std::size_t bytes, bool streaming) {
  if (streaming) stream_copy(dst, src, bytes);
  else std::memcpy(dst, src, bytes);
}

}  // namespace detail

}  // namespace trellis::comm
