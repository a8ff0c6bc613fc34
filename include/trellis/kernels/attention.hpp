// Backend-neutral description of scaled dot-product attention, shared by
// kernels/attention_host.hpp and the CUDA flash attention.
//
// Layout (all contiguous, row-major):
//   q, o, do, dq : [batch, q_heads,  q_len,  head_dim]
//   k, v, dk, dv : [batch, kv_heads, kv_len, head_dim]
//   lse, (delta) : [batch, q_heads,  q_len]            fp32
// Grouped-query attention: q head h reads kv head h / (q_heads / kv_heads); kv_heads == 1 is
// multi-query attention, kv_heads == q_heads plain multi-head attention.
//
// Math, for one (batch, q head), row i of q and row j of k/v:
//   s(i, j)  = scale * q_i . k_j            (scale defaults to 1 / sqrt(head_dim))
//   visible  = (!causal || j <= i + causal_offset) && (no segments || q_seg(i) == kv_seg(j))
//              causal_offset defaults to kv_len - q_len: the mask aligned bottom-right, so with
//              q_len == kv_len it is the usual j <= i, and a query chunk at the end of a longer kv
//              sequence sees everything before it. Ring attention over chunks of one sequence sets
//              it to (position of query row 0) - (position of key 0).
//   segments = packed documents (FlashAttention's varlen, as segment ids): the id of each query
//              row and key, [batch, q_len] and [batch, kv_len] int32 in the backend's memory,
//              non-decreasing along every sequence; a token sees only its own document.
//   lse(i)   = log sum_{visible j} exp(s(i, j))        (natural log; -inf when nothing is visible)
//   o_i      = sum_{visible j} exp(s(i, j) - lse(i)) v_j   (0 when nothing is visible)
// Because o and lse are returned, attention over kv split into parts can be merged exactly
// (merge_partials below): the ring-attention building block.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "trellis/core/config.hpp"

namespace trellis::kernels {

struct AttentionArgs {
  std::int64_t batch = 1;
  std::int64_t q_heads = 1;
  std::int64_t kv_heads = 1;
  std::int64_t q_len = 0;
  std::int64_t kv_len = 0;
  std::int64_t head_dim = 0;  // a multiple of 8
  bool causal = false;
  float scale = 0.0f;  // 0: 1 / sqrt(head_dim)
  static constexpr std::int64_t bottom_right = -(std::int64_t{1} << 62);
  std::int64_t causal_offset = bottom_right;  // query i sees keys j <= i + causal_offset
  const std::int32_t* q_segments = nullptr;   // [batch, q_len]; both null: no segment mask
  const std::int32_t* kv_segments = nullptr;  // [batch, kv_len]

  TRELLIS_HD float softmax_scale() const {
    return scale != 0.0f ? scale : 1.0f / ::sqrtf(static_cast<float>(head_dim));
  }
  TRELLIS_HD std::int64_t group_size() const { return q_heads / kv_heads; }
  TRELLIS_HD std::int64_t kv_head_of(std::int64_t q_head) const { return q_head / group_size(); }
  TRELLIS_HD std::int64_t offset() const { return causal_offset == bottom_right ? kv_len - q_len : causal_offset; }
  TRELLIS_HD bool segmented() const { return q_segments != nullptr; }
  // Last key of query row i the causal mask lets through (may be < 0: nothing visible), or
  // kv_len - 1 without it. Segments are not considered.
  TRELLIS_HD std::int64_t last_visible_key(std::int64_t i) const {
    if (!causal) return kv_len - 1;
    std::int64_t last = i + offset();
    return last < kv_len - 1 ? last : kv_len - 1;
  }
  // Query row i of batch b sees key j (segments read from the args' pointers: host or device).
  TRELLIS_HD bool visible(std::int64_t b, std::int64_t i, std::int64_t j) const {
    return j <= last_visible_key(i) && (!segmented() || q_segments[b * q_len + i] == kv_segments[b * kv_len + j]);
  }

  std::int64_t q_elements() const { return batch * q_heads * q_len * head_dim; }
  std::int64_t kv_elements() const { return batch * kv_heads * kv_len * head_dim; }
  std::int64_t lse_elements() const { return batch * q_heads * q_len; }
};

// Merges a partial result (o_part, lse_part) into (o_acc, lse_acc) for one row of head_dim
// values: the result is attention over the union of both key sets. Either side may be empty
// (lse = -inf). Plain scalar code usable on host and device.
TRELLIS_HD inline void merge_partials_row(std::int64_t head_dim, float* o_acc, float* lse_acc, const float* o_part,
                                          float lse_part) {
  const float a = *lse_acc;
  const float b = lse_part;
  if (b == -std::numeric_limits<float>::infinity()) return;
  if (a == -std::numeric_limits<float>::infinity()) {
    for (std::int64_t p = 0; p < head_dim; ++p) o_acc[p] = o_part[p];
    *lse_acc = b;
    return;
  }
  const float hi = a > b ? a : b;
  const float wa = ::expf(a - hi), wb = ::expf(b - hi);
  const float total = wa + wb;
  for (std::int64_t p = 0; p < head_dim; ++p) o_acc[p] = (o_acc[p] * wa + o_part[p] * wb) / total;
  *lse_acc = hi + ::logf(total);
}

}  // namespace trellis::kernels
