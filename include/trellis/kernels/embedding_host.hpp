// Host token + position embedding, forward and backward.
//   host::embedding_forward(args, tokens, wte, wpe, out);    out[b, t] = wte[token] + wpe[t]
//   host::embedding_backward(args, tokens, dout, dwte, dwpe); dwte[token] += dout, dwpe[t] += sum_b dout
// tokens: int32 [batch, seq]; wte: [vocab_rows, dim]; wpe: [>= seq, dim] or null (no positions);
// out/dout: [batch, seq, dim]. Gradients are ADDED to (accumulation).
// Vocab-parallel: a rank holding rows [vocab_start, vocab_start + vocab_rows) of the table sets
// `sharded`; tokens it does not own contribute zeros (forward: the caller all-reduces the sum
// over ranks, so pass wpe on one rank only) and are skipped in backward. Unsharded, a token
// outside the table is an error.
// The backward scatter-add is deterministic: each task owns a slice of the channels and walks the
// tokens in order, so repeated tokens are summed in token order whatever the thread count.
#pragma once

#include <algorithm>
#include <cstdint>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/embedding.hpp"
#include "trellis/kernels/host_math.hpp"
#include "trellis/kernels/thread_pool.hpp"

namespace trellis::kernels::host {

namespace detail {
inline void check_embedding(const EmbeddingArgs& a, const std::int32_t* tokens, const void* wpe) {
  TRELLIS_CHECK(a.batch >= 0 && a.seq >= 0 && a.dim > 0 && a.vocab_rows > 0, "embedding: bad shape batch=", a.batch,
                " seq=", a.seq, " dim=", a.dim, " vocab_rows=", a.vocab_rows);
  TRELLIS_CHECK(!wpe || a.positions >= a.seq, "embedding: ", a.positions, " positions for a sequence of ", a.seq);
  if (!a.sharded) {
    for (std::int64_t i = 0; i < a.batch * a.seq; ++i)
      TRELLIS_CHECK(tokens[i] >= a.vocab_start && tokens[i] < a.vocab_start + a.vocab_rows, "embedding: token ",
                    tokens[i], " at position ", i, " is outside the vocabulary [", a.vocab_start, ", ",
                    a.vocab_start + a.vocab_rows, ")");
  }
}
}  // namespace detail

template <class T, class W>
void embedding_forward(const EmbeddingArgs& args, const std::int32_t* tokens, const W* wte, const W* wpe, T* out) {
  detail::check_embedding(args, tokens, wpe);
  const std::int64_t dim = args.dim, n = args.batch * args.seq;
  parallel_for((n + 15) / 16, [&](std::int64_t task) {
    const std::int64_t i1 = std::min(n, (task + 1) * 16);
    for (std::int64_t i = task * 16; i < i1; ++i) {
      const std::int64_t row = tokens[i] - args.vocab_start;
      const bool owned = row >= 0 && row < args.vocab_rows;
      const W* pos = wpe ? wpe + (i % args.seq) * dim : nullptr;
      const W* tok = owned ? wte + row * dim : nullptr;
      T* o = out + i * dim;
      for (std::int64_t j = 0; j < dim; ++j) {
        const float v = (tok ? to_float(tok[j]) : 0.0f) + (pos ? to_float(pos[j]) : 0.0f);
        o[j] = from_float<T>(v);
      }
    }
  });
}

template <class T, class W>
void embedding_backward(const EmbeddingArgs& args, const std::int32_t* tokens, const T* dout, W* dwte, W* dwpe) {
  detail::check_embedding(args, tokens, dwpe);
  constexpr std::int64_t channels_per_task = 64;
  const std::int64_t dim = args.dim, n = args.batch * args.seq;
  const std::int64_t slices = (dim + channels_per_task - 1) / channels_per_task;
  if (dwte) {
    parallel_for(slices, [&](std::int64_t s) {
      const std::int64_t c0 = s * channels_per_task, c1 = std::min(dim, c0 + channels_per_task);
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t row = tokens[i] - args.vocab_start;
        if (row < 0 || row >= args.vocab_rows) continue;
        W* g = dwte + row * dim;
        const T* d = dout + i * dim;
        for (std::int64_t j = c0; j < c1; ++j) g[j] = from_float<W>(to_float(g[j]) + to_float(d[j]));
      }
    });
  }
  if (dwpe) {
    parallel_for(args.seq, [&](std::int64_t t) {
      W* g = dwpe + t * dim;
      for (std::int64_t b = 0; b < args.batch; ++b) {
        const T* d = dout + (b * args.seq + t) * dim;
        for (std::int64_t j = 0; j < dim; ++j) g[j] = from_float<W>(to_float(g[j]) + to_float(d[j]));
      }
    });
  }
}

}  // namespace trellis::kernels::host
