// The embedding contract shared by the host and CUDA kernels (kernels/embedding_host.hpp,
// kernels/embedding_cuda.cuh) and by every backend: token ids [batch, seq] looked up in this
// rank's rows of wte, plus learned positions; vocab-parallel when `sharded`.
#pragma once

#include <cstdint>

namespace trellis::kernels {

struct EmbeddingArgs {
  std::int64_t batch = 1;
  std::int64_t seq = 0;
  std::int64_t dim = 0;
  std::int64_t vocab_rows = 0;   // rows of wte held here
  std::int64_t vocab_start = 0;  // global id of row 0 of wte
  std::int64_t positions = 0;    // rows of wpe (>= seq when wpe is given)
  bool sharded = false;
};

}  // namespace trellis::kernels
