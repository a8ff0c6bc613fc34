// A synthetic training batch for the trainer benchmarks.
#pragma once

#include <cstddef>
#include <cstdint>

#include "trellis/train/data.hpp"

namespace trellis::bench {

// Builds a batch of `rows` x `seq` tokens whose global sample index starts at `first_row`.
inline trellis::train::Batch make_batch(trellis::index_t rows, trellis::index_t seq, trellis::index_t vocab, trellis::index_t first_row = 0) {
  trellis::train::Batch b;
  b.rows = rows;
  b.seq_len = seq;
  const auto n = static_cast<std::size_t>(rows * seq);
  b.inputs.resize(n);
  b.targets.resize(n);
  const auto base = static_cast<std::size_t>(first_row * seq);
  for (std::size_t i = 0; i < n; ++i) {
    b.inputs[i] = static_cast<std::int32_t>(((base + i) * 7919) % static_cast<std::size_t>(vocab));
    b.targets[i] = static_cast<std::int32_t>(((base + i) * 104729 + 3) % static_cast<std::size_t>(vocab));
  }
  return b;
}

}  // namespace trellis::bench
