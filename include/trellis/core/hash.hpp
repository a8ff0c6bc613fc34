// Counter-based hashing shared by host and device code: parameter initialisation and dropout masks
// are pure functions of (seed, name, global index), so every layout and backend draws the same
// numbers (no generator state to split across ranks or threads).
#pragma once

#include <cstdint>
#include <string_view>

#include "trellis/core/config.hpp"

namespace trellis {

// SplitMix64's output function (Steele, Lea, Flood 2014): a bijective 64-bit mixer.
TRELLIS_HD constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// FNV-1a of a name (host only: names are hashed once at set-up).
constexpr std::uint64_t name_hash(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

}  // namespace trellis
