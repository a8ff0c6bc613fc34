// Host softmax cross-entropy over logits [rows, vocab] (row stride ld >= vocab), fused forward and
// backward, never materialising the probabilities: each row is read once for its statistics
// (online max and sum of exponentials) and once more to write d logits.
//   host::softmax_xent_forward(rows, vocab, ld, logits, targets, loss, lse);
//   host::softmax_xent_backward(rows, vocab, ld, logits, targets, lse, grad_scale, dlogits, ld_grad);
//   host::softmax_xent_forward_backward(...): both in one call; dlogits may alias logits (in place).
// loss_r = lse_r - logit[r, target_r]; d logits[r, j] = grad_scale * (softmax_j - [j == target_r]).
// A negative target (ignore index) gives loss 0 and zero gradient. Targets are int32.
//
// Vocab-parallel (each tensor-parallel rank holds columns [vocab_start, vocab_start + vocab_local)
// of the logits). The kernels never communicate; the caller runs the collectives in between:
//   xent_partial_max(...)         -> all_reduce(max) -> global max per row
//   xent_partial_sumexp(..., max) -> all_reduce(sum) -> global sum of exp(logit - max)
//   xent_partial_target(...)      -> all_reduce(sum) -> the target logit (only its owner adds it)
//   xent_finish(max, sumexp, target_logit, targets) -> loss and lse per row
//   xent_backward_sharded(..., lse) -> this rank's slice of d logits
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/host_math.hpp"
#include "trellis/kernels/thread_pool.hpp"

namespace trellis::kernels::host {

namespace detail {
inline constexpr std::int64_t xent_rows_per_task = 4;
inline constexpr std::int64_t xent_chunk = 1024;  // columns converted to fp32 at a time

inline void check_xent_shape(const char* what, std::int64_t rows, std::int64_t vocab, std::int64_t ld) {
  TRELLIS_CHECK(rows >= 0 && vocab > 0 && ld >= vocab, what, ": bad shape rows=", rows, " vocab=", vocab, " ld=", ld);
}

// Online (max, sum exp(x - max)) of one row, chunked so the exponentials vectorise.
template <class T>
void row_max_sumexp(const T* x, std::int64_t n, float& max_out, float& sum_out) {
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  float m = ninf, s = 0.0f;
  float buf[xent_chunk];
  for (std::int64_t c0 = 0; c0 < n; c0 += xent_chunk) {
    const std::int64_t len = std::min(xent_chunk, n - c0);
    float cm = ninf;
    for (std::int64_t j = 0; j < len; ++j) {
      buf[j] = to_float(x[c0 + j]);
      cm = cm > buf[j] ? cm : buf[j];
    }
    const float m_new = m > cm ? m : cm;
    if (m_new == ninf) continue;
    float lanes[16] = {};
    std::int64_t j = 0;
    for (; j + 16 <= len; j += 16)
      for (int l = 0; l < 16; ++l) lanes[l] += fast_exp(buf[j + l] - m_new);
    float cs = 0.0f;
    for (; j < len; ++j) cs += fast_exp(buf[j] - m_new);
    for (int l = 0; l < 16; ++l) cs += lanes[l];
    s = s * fast_exp(m - m_new) + cs;
    m = m_new;
  }
  max_out = m;
  sum_out = s;
}

template <class Fn>
void for_row_blocks(std::int64_t rows, Fn&& fn) {
  const std::int64_t tasks = (rows + xent_rows_per_task - 1) / xent_rows_per_task;
  parallel_for(tasks, [&](std::int64_t t) {
    const std::int64_t r1 = std::min(rows, (t + 1) * xent_rows_per_task);
    for (std::int64_t r = t * xent_rows_per_task; r < r1; ++r) fn(r);
  });
}

// d logits for one row slice: grad_scale * (exp(x - lse) - [global column == target]).
template <class T, class G>
void write_row_grad(const T* x, std::int64_t n, float lse, std::int64_t target_local, float grad_scale, G* g) {
  float buf[xent_chunk];
  for (std::int64_t c0 = 0; c0 < n; c0 += xent_chunk) {
    const std::int64_t len = std::min(xent_chunk, n - c0);
    for (std::int64_t j = 0; j < len; ++j) buf[j] = grad_scale * fast_exp(to_float(x[c0 + j]) - lse);
    if (target_local >= c0 && target_local < c0 + len) buf[target_local - c0] -= grad_scale;
    for (std::int64_t j = 0; j < len; ++j) g[c0 + j] = from_float<G>(buf[j]);
  }
}
}  // namespace detail

// loss[r] and (optionally) lse[r] = log sum_j exp(logits[r, j]).
template <class T>
void softmax_xent_forward(std::int64_t rows, std::int64_t vocab, std::int64_t ld, const T* logits,
                          const std::int32_t* targets, float* loss, float* lse = nullptr) {
  detail::check_xent_shape("softmax_xent_forward", rows, vocab, ld);
  TRELLIS_CHECK(logits && targets && loss, "softmax_xent_forward: null pointer");
  detail::for_row_blocks(rows, [&](std::int64_t r) {
    const T* x = logits + r * ld;
    const std::int32_t t = targets[r];
    TRELLIS_CHECK(t < vocab, "softmax_xent_forward: target ", t, " of row ", r, " is outside the vocabulary of ", vocab);
    float m, s;
    detail::row_max_sumexp(x, vocab, m, s);
    const float l = m + std::log(s);
    if (lse) lse[r] = l;
    loss[r] = t < 0 ? 0.0f : l - to_float(x[t]);
  });
}

// dlogits (row stride ld_grad) from the forward's lse; dlogits may alias logits when ld_grad == ld.
template <class T, class G>
void softmax_xent_backward(std::int64_t rows, std::int64_t vocab, std::int64_t ld, const T* logits,
                           const std::int32_t* targets, const float* lse, float grad_scale, G* dlogits,
                           std::int64_t ld_grad) {
  detail::check_xent_shape("softmax_xent_backward", rows, vocab, ld);
  TRELLIS_CHECK(ld_grad >= vocab, "softmax_xent_backward: ld_grad ", ld_grad, " < vocab ", vocab);
  TRELLIS_CHECK(logits && targets && lse && dlogits, "softmax_xent_backward: null pointer");
  detail::for_row_blocks(rows, [&](std::int64_t r) {
    const std::int32_t t = targets[r];
    G* g = dlogits + r * ld_grad;
    if (t < 0) {
      for (std::int64_t j = 0; j < vocab; ++j) g[j] = from_float<G>(0.0f);
      return;
    }
    TRELLIS_CHECK(t < vocab, "softmax_xent_backward: target ", t, " of row ", r, " is outside the vocabulary of ", vocab);
    detail::write_row_grad(logits + r * ld, vocab, lse[r], t, grad_scale, g);
  });
}

// Forward and backward in one pass per row (statistics, then d logits); in place when dlogits == logits.
template <class T, class G>
void softmax_xent_forward_backward(std::int64_t rows, std::int64_t vocab, std::int64_t ld, const T* logits,
                                   const std::int32_t* targets, float* loss, float grad_scale, G* dlogits,
                                   std::int64_t ld_grad, float* lse = nullptr) {
  detail::check_xent_shape("softmax_xent_forward_backward", rows, vocab, ld);
  TRELLIS_CHECK(ld_grad >= vocab, "softmax_xent_forward_backward: ld_grad ", ld_grad, " < vocab ", vocab);
  TRELLIS_CHECK(logits && targets && loss && dlogits, "softmax_xent_forward_backward: null pointer");
  detail::for_row_blocks(rows, [&](std::int64_t r) {
    const T* x = logits + r * ld;
    const std::int32_t t = targets[r];
    TRELLIS_CHECK(t < vocab, "softmax_xent_forward_backward: target ", t, " of row ", r,
                  " is outside the vocabulary of ", vocab);
    float m, s;
    detail::row_max_sumexp(x, vocab, m, s);
    const float l = m + std::log(s);
    if (lse) lse[r] = l;
    G* g = dlogits + r * ld_grad;
    if (t < 0) {
      loss[r] = 0.0f;
      for (std::int64_t j = 0; j < vocab; ++j) g[j] = from_float<G>(0.0f);
      return;
    }
    loss[r] = l - to_float(x[t]);  // read before the in-place write below
    detail::write_row_grad(x, vocab, l, t, grad_scale, g);
  });
}

// ---- vocab-parallel pieces ------------------------------------------------------------------

// row_max[r] = max of this rank's logits of row r.
template <class T>
void xent_partial_max(std::int64_t rows, std::int64_t vocab_local, std::int64_t ld, const T* logits, float* row_max) {
  detail::check_xent_shape("xent_partial_max", rows, vocab_local, ld);
  detail::for_row_blocks(rows, [&](std::int64_t r) {
    const T* x = logits + r * ld;
    float lanes[16];
    for (int l = 0; l < 16; ++l) lanes[l] = -std::numeric_limits<float>::infinity();
    std::int64_t j = 0;
    for (; j + 16 <= vocab_local; j += 16)
      for (int l = 0; l < 16; ++l) lanes[l] = std::max(lanes[l], to_float(x[j + l]));
    float m = -std::numeric_limits<float>::infinity();
    for (; j < vocab_local; ++j) m = std::max(m, to_float(x[j]));
    for (int l = 0; l < 16; ++l) m = std::max(m, lanes[l]);
    row_max[r] = m;
  });
}

// sumexp[r] = sum over this rank's columns of exp(logit - global_max[r]).
template <class T>
void xent_partial_sumexp(std::int64_t rows, std::int64_t vocab_local, std::int64_t ld, const T* logits,
                         const float* global_max, float* sumexp) {
  detail::check_xent_shape("xent_partial_sumexp", rows, vocab_local, ld);
  detail::for_row_blocks(rows, [&](std::int64_t r) {
    const T* x = logits + r * ld;
    const float m = global_max[r];
    float buf[detail::xent_chunk];
    float lanes[16] = {};
    float tail = 0.0f;
    for (std::int64_t c0 = 0; c0 < vocab_local; c0 += detail::xent_chunk) {
      const std::int64_t len = std::min(detail::xent_chunk, vocab_local - c0);
      for (std::int64_t j = 0; j < len; ++j) buf[j] = fast_exp(to_float(x[c0 + j]) - m);
      std::int64_t j = 0;
      for (; j + 16 <= len; j += 16)
        for (int l = 0; l < 16; ++l) lanes[l] += buf[j + l];
      for (; j < len; ++j) tail += buf[j];
    }
    for (int l = 0; l < 16; ++l) tail += lanes[l];
    sumexp[r] = tail;
  });
}

// target_logit[r] = logit of the target if this rank owns it, else 0 (sum over ranks = the logit).
template <class T>
void xent_partial_target(std::int64_t rows, std::int64_t vocab_local, std::int64_t ld, const T* logits,
                         const std::int32_t* targets, std::int64_t vocab_start, float* target_logit) {
  detail::check_xent_shape("xent_partial_target", rows, vocab_local, ld);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t t = targets[r] - vocab_start;
    target_logit[r] = targets[r] >= 0 && t >= 0 && t < vocab_local ? to_float(logits[r * ld + t]) : 0.0f;
  }
}

// loss[r] = lse[r] - target_logit[r], lse = global_max + log(global_sumexp); ignored rows get 0.
inline void xent_finish(std::int64_t rows, const float* global_max, const float* global_sumexp,
                        const float* target_logit, const std::int32_t* targets, float* loss, float* lse = nullptr) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float l = global_max[r] + std::log(global_sumexp[r]);
    if (lse) lse[r] = l;
    loss[r] = targets[r] < 0 ? 0.0f : l - target_logit[r];
  }
}

// This rank's columns of d logits (may alias logits when ld_grad == ld).
template <class T, class G>
void xent_backward_sharded(std::int64_t rows, std::int64_t vocab_local, std::int64_t ld, const T* logits,
                           const std::int32_t* targets, std::int64_t vocab_start, const float* lse, float grad_scale,
                           G* dlogits, std::int64_t ld_grad) {
  detail::check_xent_shape("xent_backward_sharded", rows, vocab_local, ld);
  TRELLIS_CHECK(ld_grad >= vocab_local, "xent_backward_sharded: ld_grad ", ld_grad, " < vocab_local ", vocab_local);
  detail::for_row_blocks(rows, [&](std::int64_t r) {
    G* g = dlogits + r * ld_grad;
    if (targets[r] < 0) {
      for (std::int64_t j = 0; j < vocab_local; ++j) g[j] = from_float<G>(0.0f);
      return;
    }
    const std::int64_t t = targets[r] - vocab_start;  // outside [0, vocab_local): not ours
    detail::write_row_grad(logits + r * ld, vocab_local, lse[r], t, grad_scale, g);
  });
}

}  // namespace trellis::kernels::host
