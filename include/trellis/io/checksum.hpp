// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum stored with every tensor in a
// checkpoint. Uses the SSE4.2 crc32 instruction when the compiler targets it, else a
// slicing-by-8 table; both give the same value (tests check the RFC 3720 vectors).
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace trellis::io {

namespace detail {
using Crc32cTables = std::array<std::array<std::uint32_t, 256>, 8>;

constexpr Crc32cTables make_crc32c_tables() {
  Crc32cTables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t s = 1; s < 8; ++s)
    for (std::size_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
  return t;
}
inline constexpr Crc32cTables crc32c_tables = make_crc32c_tables();

// Table version on the raw (pre/post-inverted) state; portable reference.
inline std::uint32_t crc32c_update_table(std::uint32_t crc, const unsigned char* p, std::size_t n) {
  const auto& t = crc32c_tables;
  while (n >= 8) {
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    if constexpr (std::endian::native == std::endian::big) {
      lo = __builtin_bswap32(lo);
      hi = __builtin_bswap32(hi);
    }
    lo ^= crc;
    crc = t[7][lo & 0xff] ^ t[6][(lo >> 8) & 0xff] ^ t[5][(lo >> 16) & 0xff] ^ t[4][lo >> 24] ^
          t[3][hi & 0xff] ^ t[2][(hi >> 8) & 0xff] ^ t[1][(hi >> 16) & 0xff] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xffu];
  return crc;
}

inline std::uint32_t crc32c_update_fast(std::uint32_t crc, const unsigned char* p, std::size_t n) {
#if defined(__SSE4_2__) && defined(__x86_64__)
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  crc = static_cast<std::uint32_t>(c);
  while (n--) crc = _mm_crc32_u8(crc, *p++);
  return crc;
#else
  return crc32c_update_table(crc, p, n);
#endif
}
}  // namespace detail

// Incremental CRC32C: feed bytes in any number of pieces, read value() at the end.
class Crc32c {
 public:
  void update(const void* data, std::size_t bytes) {
    state_ = detail::crc32c_update_fast(state_, static_cast<const unsigned char*>(data), bytes);
  }
  std::uint32_t value() const { return ~state_; }

 private:
  std::uint32_t state_ = 0xffffffffu;
};

inline std::uint32_t crc32c(const void* data, std::size_t bytes) {
  Crc32c c;
  c.update(data, bytes);
  return c.value();
}
inline std::uint32_t crc32c(std::span<const std::byte> bytes) { return crc32c(bytes.data(), bytes.size()); }

// The portable table path alone (tests compare it with the hardware path).
inline std::uint32_t crc32c_portable(const void* data, std::size_t bytes) {
  return ~detail::crc32c_update_table(0xffffffffu, static_cast<const unsigned char*>(data), bytes);
}

}  // namespace trellis::io
