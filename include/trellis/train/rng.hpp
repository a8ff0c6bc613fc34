// A small, fast, saveable random generator: xoshiro256** (Blackman & Vigna) seeded through
// splitmix64. Integer output and uniforms are bit-identical on every platform (only integer
// arithmetic and exact scaling by powers of two); normals go through std::log/std::cos, which
// agree to the last bit wherever the C library's are correctly rounded (glibc) and within an ulp
// elsewhere. The whole state is four 64-bit words: state(), set_state(), to_string().
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <numbers>
#include <string>
#include <string_view>

#include "trellis/core/error.hpp"

namespace trellis::train {

// One step of splitmix64: advances `x` and returns a well-mixed 64-bit value.
inline std::uint64_t splitmix64(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

class Rng {
 public:
  using State = std::array<std::uint64_t, 4>;

  // `stream` gives independent sequences for the same seed (per rank, per epoch, per purpose).
  explicit Rng(std::uint64_t seed = 0, std::uint64_t stream = 0) {
    std::uint64_t x = seed;
    std::uint64_t mixed_seed = splitmix64(x);
    std::uint64_t y = stream ^ 0x5851f42d4c957f2dull;
    std::uint64_t mixed_stream = splitmix64(y);
    std::uint64_t z = mixed_seed ^ (mixed_stream * 0xd1342543de82ef95ull);
    for (auto& w : s_) w = splitmix64(z);
  }
  static Rng from_state(const State& s) {
    Rng r;
    r.set_state(s);
    return r;
  }

  std::uint64_t next_u64() {
    const std::uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const std::uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  std::uint32_t next_u32() { return static_cast<std::uint32_t>(next_u64() >> 32); }

  // Uniform in [0, 1): the top 53 (double) or 24 (float) bits, exactly scaled.
  double uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }
  float uniform_float() { return static_cast<float>(next_u64() >> 40) * 0x1.0p-24f; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

  // Uniform integer in [0, n), unbiased (rejection of the short last interval).
  std::uint64_t uniform_int(std::uint64_t n) {
    TRELLIS_CHECK(n > 0, "uniform_int: empty range");
    const std::uint64_t threshold = (0 - n) % n;  // 2^64 mod n
    while (true) {
      std::uint64_t r = next_u64();
      if (r >= threshold) return r % n;
    }
  }

  // Standard normal by Box-Muller (one value per two uniforms; no cached spare, so the state is
  // just the four words).
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1]: log is finite
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }
  double normal(double mean, double stddev) { return mean + stddev * normal(); }

  const State& state() const { return s_; }
  void set_state(const State& s) {
    TRELLIS_CHECK(s[0] | s[1] | s[2] | s[3], "Rng: the all-zero state is not allowed");
    s_ = s;
  }

  // 64 hex digits, for checkpoint metadata.
  std::string to_string() const {
    std::string out;
    char buf[17];
    for (auto w : s_) {
      std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(w));
      out += buf;
    }
    return out;
  }
  static Rng from_string(std::string_view text) {
    TRELLIS_CHECK(text.size() == 64, "Rng state \"", text, "\" is not 64 hex digits");
    State s{};
    for (int i = 0; i < 64; ++i) {
      char c = text[static_cast<std::size_t>(i)];
      std::uint64_t v;
      if (c >= '0' && c <= '9') v = static_cast<std::uint64_t>(c - '0');
      else if (c >= 'a' && c <= 'f') v = static_cast<std::uint64_t>(c - 'a' + 10);
      else TRELLIS_THROW("Rng state \"", text, "\" has a non-hex digit");
      s[static_cast<std::size_t>(i / 16)] = (s[static_cast<std::size_t>(i / 16)] << 4) | v;
    }
    return from_state(s);
  }

  bool operator==(const Rng&) const = default;

 private:
  static std::uint64_t rotl(std::uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  State s_{};
};

}  // namespace trellis::train
