// The dropout contract shared by the host and CUDA kernels (kernels/dropout_host.hpp,
// kernels/dropout_cuda.cuh) and every backend. Whether element `col` of token (sample, t) is kept
// is a pure hash of (step seed, site, GLOBAL sample, position, col), so every tp/sp/pp/dp layout,
// the recompute pass and every backend drop exactly the same elements (nn/dropout.hpp says why).
// The rows are a block of a microbatch in sequence-major order (row = t * batch + b).
#pragma once

#include <cstdint>

#include "trellis/core/config.hpp"
#include "trellis/core/hash.hpp"

namespace trellis::kernels {

struct DropoutArgs {
  std::uint64_t seed = 0;  // the step's seed
  std::uint64_t site = 0;  // name_hash of the place it is applied ("h.3.attn")
  float p = 0.0f;          // drop probability, [0, 1)
  std::int64_t batch = 1;         // samples per microbatch
  std::int64_t first_sample = 0;  // global index of the microbatch's sample 0
  std::int64_t row0 = 0;          // microbatch row of x's first row
  std::int64_t t_offset = 0;      // global position of the rows' position 0 (context-parallel chunks)
  std::int64_t rows = 0;
  std::int64_t width = 0;
};

// The per-token key; keep(key, col) then decides each element.
TRELLIS_HD inline std::uint64_t dropout_row_key(std::uint64_t seed, std::uint64_t site, std::int64_t sample,
                                                std::int64_t t) {
  const std::uint64_t base = splitmix64(seed ^ site);
  return splitmix64(splitmix64(base + static_cast<std::uint64_t>(sample)) + static_cast<std::uint64_t>(t));
}
TRELLIS_HD inline bool dropout_keep(std::uint64_t row_key, std::int64_t col, float p) {
  const std::uint64_t h = splitmix64(row_key + static_cast<std::uint64_t>(col) * 0x9E3779B97F4A7C15ull);
  const float u = static_cast<float>(h >> 40) * 0x1.0p-24f;  // [0, 1), exact in fp32
  return u >= p;
}
// Row r of x (0 <= r < rows): its key.
TRELLIS_HD inline std::uint64_t dropout_key_of_row(const DropoutArgs& a, std::int64_t r) {
  const std::int64_t row = a.row0 + r, t = row / a.batch + a.t_offset, b = row % a.batch;
  return dropout_row_key(a.seed, a.site, a.first_sample + b, t);
}

}  // namespace trellis::kernels
