// Numeric types usable on host and device: trellis::half (IEEE binary16) and trellis::bfloat16,
// stored as 16 bits, converted with round-to-nearest-even; plus a runtime DType tag.
// The conversions are plain bit manipulation so the host and device produce identical bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <ostream>
#include <type_traits>

#include "trellis/core/config.hpp"

namespace trellis {

namespace detail {
TRELLIS_HD TRELLIS_FORCEINLINE std::uint32_t float_bits(float f) {
#if TRELLIS_DEVICE_CODE
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
TRELLIS_HD TRELLIS_FORCEINLINE float bits_float(std::uint32_t u) {
#if TRELLIS_DEVICE_CODE
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Every NaN becomes the canonical quiet NaN 0x7fff, as CUDA's conversions (host and device) do.
inline constexpr std::uint16_t canonical_nan16 = 0x7fffu;

// float -> bfloat16 bits, round to nearest even.
TRELLIS_HD inline std::uint16_t float_to_bf16_bits(float f) {
  std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return canonical_nan16;
  std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}
TRELLIS_HD inline float bf16_bits_to_float(std::uint16_t h) {
  return bits_float(static_cast<std::uint32_t>(h) << 16);
}

// float -> IEEE half bits, round to nearest even, with subnormals, overflow to Inf and NaN.
TRELLIS_HD inline std::uint16_t float_to_half_bits(float f) {
  std::uint32_t u = float_bits(f);
  std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return canonical_nan16;
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to Inf
  if (abs < 0x38800000u) {                                                   // half subnormal
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal: +-0
    std::uint32_t exponent = abs >> 23;
    std::uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    std::uint32_t shift = 126u - exponent;  // in 14..24
    std::uint32_t result = mantissa >> shift;
    std::uint32_t remainder = mantissa & ((1u << shift) - 1u);
    std::uint32_t halfway = 1u << (shift - 1u);
    if (remainder > halfway || (remainder == halfway && (result & 1u))) ++result;
    return static_cast<std::uint16_t>(sign | result);
  }
  // Normal: rebias exponent (127 -> 15) and round the 13 dropped mantissa bits to nearest even.
  std::uint32_t rebased = abs - 0x38000000u;
  std::uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | ((rebased + rounding) >> 13));
}
TRELLIS_HD inline float half_bits_to_float(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exponent = (h >> 10) & 0x1fu;
  std::uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) {  // Inf keeps its sign; NaN becomes the canonical float NaN, as in CUDA
    return bits_float(mantissa ? 0x7fffffffu : (sign | 0x7f800000u));
  }
  if (exponent == 0) {
    if (mantissa == 0) return bits_float(sign);
    // Subnormal: value = mantissa * 2^-24, exact in float.
    float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}
}  // namespace detail

// Tag to construct a 16-bit type from raw bits.
struct from_bits_t {};
inline constexpr from_bits_t from_bits{};

// IEEE 754 binary16. Arithmetic goes through float (as on GPUs without native half math).
struct half {
  std::uint16_t bits = 0;
  half() = default;
  TRELLIS_HD constexpr half(from_bits_t, std::uint16_t b) : bits(b) {}
  TRELLIS_HD half(float f) : bits(detail::float_to_half_bits(f)) {}
  TRELLIS_HD operator float() const { return detail::half_bits_to_float(bits); }
};

// bfloat16: the upper 16 bits of a float, rounded to nearest even.
struct bfloat16 {
  std::uint16_t bits = 0;
  bfloat16() = default;
  TRELLIS_HD constexpr bfloat16(from_bits_t, std::uint16_t b) : bits(b) {}
  TRELLIS_HD bfloat16(float f) : bits(detail::float_to_bf16_bits(f)) {}
  TRELLIS_HD operator float() const { return detail::bf16_bits_to_float(bits); }
};

static_assert(sizeof(half) == 2 && std::is_trivially_copyable_v<half>);
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

// Runtime element-type tag, used where a type must cross a type-erased boundary
// (communicator fingerprints, checkpoints, benchmarks).
enum class DType : std::uint8_t { f32, f64, f16, bf16, i8, u8, i32, u32, i64, u64 };

template <class T> struct dtype_of;
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<half> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<bfloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<std::int8_t> { static constexpr DType value = DType::i8; };
template <> struct dtype_of<std::uint8_t> { static constexpr DType value = DType::u8; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<std::uint32_t> { static constexpr DType value = DType::u32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<std::uint64_t> { static constexpr DType value = DType::u64; };
template <class T> inline constexpr DType dtype_v = dtype_of<std::remove_cv_t<T>>::value;

// Types the library knows how to move and reduce.
template <class T>
concept Element = requires { dtype_of<std::remove_cv_t<T>>::value; };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f64: case DType::i64: case DType::u64: return 8;
    case DType::f32: case DType::i32: case DType::u32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::i8: case DType::u8: return 1;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float";
    case DType::f64: return "double";
    case DType::f16: return "half";
    case DType::bf16: return "bfloat16";
    case DType::i8: return "int8";
    case DType::u8: return "uint8";
    case DType::i32: return "int32";
    case DType::u32: return "uint32";
    case DType::i64: return "int64";
    case DType::u64: return "uint64";
  }
  return "?";
}

inline std::ostream& operator<<(std::ostream& out, DType t) { return out << dtype_name(t); }

// The type arithmetic on T is done in: float for the 16-bit types, T itself otherwise.
template <class T> struct accumulate_type { using type = T; };
template <> struct accumulate_type<half> { using type = float; };
template <> struct accumulate_type<bfloat16> { using type = float; };
template <class T> using accumulate_t = typename accumulate_type<T>::type;

}  // namespace trellis
