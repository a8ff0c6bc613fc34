// Dropout of the norm/residual region (GPT-2's embd_pdrop and resid_pdrop). Whether element col of
// token (sample, t) is kept is a pure function of (step seed, site, GLOBAL sample index, position,
// col) — a hash, not a stateful generator — so every tensor-parallel / sequence-parallel layout,
// every pipeline split, the recompute pass, every dp split, every microbatching of the same
// global batch and every backend drop exactly the same elements (TokenShape carries the seed and
// the microbatch's first global sample; the hash is kernels/dropout.hpp, one function for host
// and device). Kept elements are scaled by 1 / (1 - p); the backward pass applies the same mask
// to the gradient. TokenShape::train = false (evaluation) makes it the identity.
// (Dropout of the attention probabilities is not offered: the flash-attention kernel has none.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <string_view>

#include "trellis/backend/backend.hpp"
#include "trellis/core/error.hpp"
#include "trellis/core/hash.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/kernels/dropout.hpp"
#include "trellis/nn/tensor_parallel.hpp"

namespace trellis::nn {

class Dropout {
 public:
  Dropout() = default;
  // site: the name of the place it is applied (e.g. "h.3.attn"), so sites draw different masks.
  Dropout(float p, std::string_view site) : p_(p), site_(name_hash(site)) {
    TRELLIS_CHECK(p >= 0.0f && p < 1.0f, "dropout probability ", p, " outside [0, 1)");
  }

  bool active() const { return p_ > 0.0f; }
  float probability() const { return p_; }

  bool keep(std::uint64_t seed, index_t sample, index_t t, index_t col) const {
    return kernels::dropout_keep(kernels::dropout_row_key(seed, site_, sample, t), col, p_);
  }

  // x: rows x width of a microbatch of `shape` in be's memory, whose first row is microbatch row
  // `row0` (row = t * batch + b, as every activation); x *= mask / (1 - p) in place. Training only.
  template <backend::Backend B>
  void apply(const B& be, const TokenShape& shape, index_t row0, index_t rows, index_t width,
             typename B::act_t* x) const {
    if (!active() || !shape.train) return;
    kernels::DropoutArgs a;
    a.seed = shape.seed;
    a.site = site_;
    a.p = p_;
    a.batch = shape.batch;
    a.first_sample = shape.first_sample;
    a.width = width;
    if (shape.cp_size == 1) {
      a.row0 = row0;
      a.rows = rows;
      be.dropout(a, x);
      return;
    }
    // Under context parallelism the rows are two chunks of the sequence, each with its own offset.
    const index_t chunk_rows = shape.cp_chunk() * shape.batch;
    for (int c = 0; c < 2; ++c) {
      const index_t begin = std::max(row0, c * chunk_rows), end = std::min(row0 + rows, (c + 1) * chunk_rows);
      if (begin >= end) continue;
      a.row0 = begin - c * chunk_rows;
      a.rows = end - begin;
      a.t_offset = shape.global_chunk(shape.cp_rank, c) * shape.cp_chunk();
      be.dropout(a, x + (begin - row0) * width);
    }
  }

 private:
  float p_ = 0.0f;
  std::uint64_t site_ = 0;
};

}  // namespace trellis::nn
