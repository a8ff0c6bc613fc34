// Host flash attention, forward and backward (layout and math in kernels/attention.hpp).
//   host::attention_forward(args, q, k, v, o, lse);
//   host::attention_backward(args, q, k, v, o, d_o, lse, dq, dk, dv);
//   host::merge_attention_partials(rows, head_dim, o_acc, lse_acc, o_part, lse_part);
// Elements are float, half or bfloat16; all arithmetic is fp32. Tiled with an online softmax:
// no T x T matrix is ever formed; extra memory is O(T * head_dim) (a few tiles per thread, plus
// for the backward pass the row terms delta = rowsum(do * o) and fp32 partial dq buffers).
// Tasks run on kernels/thread_pool.hpp: forward over (batch, q head, query tile), backward over
// (batch, kv head, group of kv tiles); partial dq sums are added in a fixed order, so the
// results do not depend on the number of threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/attention.hpp"
#include "trellis/kernels/host_math.hpp"
#include "trellis/kernels/thread_pool.hpp"

namespace trellis::kernels::host {

namespace detail {

inline constexpr std::int64_t attn_q_tile = 64;   // Br: query rows per tile
inline constexpr std::int64_t attn_kv_tile = 64;  // Bc: keys per tile

inline void check_attention_args(const AttentionArgs& a) {
  TRELLIS_CHECK(a.batch >= 0 && a.q_len >= 0 && a.kv_len >= 0, "attention: negative size (batch ", a.batch,
                ", q_len ", a.q_len, ", kv_len ", a.kv_len, ")");
  TRELLIS_CHECK(a.q_heads >= 1 && a.kv_heads >= 1, "attention: q_heads (", a.q_heads, ") and kv_heads (",
                a.kv_heads, ") must be >= 1");
  TRELLIS_CHECK(a.q_heads % a.kv_heads == 0, "attention: kv_heads (", a.kv_heads, ") must divide q_heads (",
                a.q_heads, ")");
  TRELLIS_CHECK(a.head_dim > 0 && a.head_dim % 8 == 0, "attention: head_dim must be a positive multiple of 8, got ",
                a.head_dim);
  TRELLIS_CHECK(std::isfinite(a.scale), "attention: scale is not finite");
  TRELLIS_CHECK((a.q_segments == nullptr) == (a.kv_segments == nullptr),
                "attention: q_segments and kv_segments must be given together");
  if (!a.segmented()) return;
  auto check_rows = [&](const std::int32_t* seg, std::int64_t len, const char* which) {
    for (std::int64_t b = 0; b < a.batch; ++b)
      for (std::int64_t t = 1; t < len; ++t)
        TRELLIS_CHECK(seg[b * len + t - 1] <= seg[b * len + t], "attention: ", which, " of sequence ", b,
                      " decrease at position ", t, " (", seg[b * len + t - 1], " then ", seg[b * len + t],
                      "): packed documents must be contiguous, ids non-decreasing");
  };
  check_rows(a.q_segments, a.q_len, "q_segments");
  check_rows(a.kv_segments, a.kv_len, "kv_segments");
}

// The keys [begin, end) that any of query rows [i0, i1) of batch b can see: the causal bound of
// the last row, and with segments the keys whose ids lie between the rows' ids (binary search:
// ids are non-decreasing). Empty when begin >= end.
struct IndexRange {
  std::int64_t begin = 0, end = 0;
};
inline IndexRange visible_keys(const AttentionArgs& a, std::int64_t b, std::int64_t i0, std::int64_t i1) {
  IndexRange r{0, a.last_visible_key(i1 - 1) + 1};
  if (a.segmented()) {
    const std::int32_t* ks = a.kv_segments + b * a.kv_len;
    r.begin = std::lower_bound(ks, ks + a.kv_len, a.q_segments[b * a.q_len + i0]) - ks;
    r.end = std::min(r.end, std::upper_bound(ks, ks + a.kv_len, a.q_segments[b * a.q_len + i1 - 1]) - ks);
  }
  return r;
}
// The query rows [begin, end) of batch b that can see any of keys [j0, j1).
inline IndexRange seeing_rows(const AttentionArgs& a, std::int64_t b, std::int64_t j0, std::int64_t j1) {
  IndexRange r{a.causal ? std::max<std::int64_t>(0, j0 - a.offset()) : 0, a.q_len};
  if (a.segmented()) {
    const std::int32_t* qs = a.q_segments + b * a.q_len;
    r.begin = std::max(r.begin, std::lower_bound(qs, qs + a.q_len, a.kv_segments[b * a.kv_len + j0]) - qs);
    r.end = std::upper_bound(qs, qs + a.q_len, a.kv_segments[b * a.kv_len + j1 - 1]) - qs;
  }
  return r;
}

// Max and sum of N values with 16 independent lanes: vectorisable without -ffast-math, fixed order.
template <std::int64_t N>
inline float lane_max(const float* x) {
  static_assert(N % 16 == 0);
  float lanes[16];
  for (int l = 0; l < 16; ++l) lanes[l] = x[l];
  for (std::int64_t i = 16; i < N; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] = lanes[l] > x[i + l] ? lanes[l] : x[i + l];
  float m = lanes[0];
  for (int l = 1; l < 16; ++l) m = m > lanes[l] ? m : lanes[l];
  return m;
}
template <std::int64_t N>
inline float lane_sum(const float* x) {
  static_assert(N % 16 == 0);
  float lanes[16] = {};
  for (std::int64_t i = 0; i < N; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += x[i + l];
  float s = 0.0f;
  for (int l = 0; l < 16; ++l) s += lanes[l];
  return s;
}

// rows x d tile of src (row stride d) into fp32 dst (row stride d), times `mul`.
template <class T>
void load_rows(const T* src, std::int64_t rows, std::int64_t d, float* dst, float mul = 1.0f) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t p = 0; p < d; ++p) dst[r * d + p] = to_float(src[r * d + p]) * mul;
}
// rows x d tile of src into its transpose dst (d x cols, row stride cols), fp32.
template <class T>
void load_transposed(const T* src, std::int64_t rows, std::int64_t d, float* dst, std::int64_t cols) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t p = 0; p < d; ++p) dst[p * cols + r] = to_float(src[r * d + p]);
  for (std::int64_t r = rows; r < cols; ++r)
    for (std::int64_t p = 0; p < d; ++p) dst[p * cols + r] = 0.0f;
}

// Register-blocked tile product: c (R x C) (+)= a (R x k, row stride lda) * b (k x C, row stride
// ldb). Constant R and C let the compiler keep the R x C accumulators in vector registers.
template <int R, int C, bool Accumulate>
TRELLIS_FORCEINLINE void micro_gemm(const float* TRELLIS_RESTRICT a, std::int64_t lda,
                                    const float* TRELLIS_RESTRICT b, std::int64_t ldb, float* TRELLIS_RESTRICT c,
                                    std::int64_t ldc, std::int64_t k) {
  float acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = Accumulate ? c[i * ldc + j] : 0.0f;
  for (std::int64_t p = 0; p < k; ++p) {
    const float* TRELLIS_RESTRICT brow = b + p * ldb;
    for (int i = 0; i < R; ++i) {
      const float av = a[i * lda + p];
      for (int j = 0; j < C; ++j) acc[i][j] += av * brow[j];
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) c[i * ldc + j] = acc[i][j];
}

// c (m x n) (+)= a (m x k) * b (k x n), all row-major with the given row strides; m a multiple of
// 4, n a multiple of 8 (tiles are padded to that).
template <bool Accumulate>
inline void tile_gemm(std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
                      const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  for (std::int64_t i0 = 0; i0 < m; i0 += 4) {
    std::int64_t j0 = 0;
    for (; j0 + 32 <= n; j0 += 32)
      micro_gemm<4, 32, Accumulate>(a + i0 * lda, lda, b + j0, ldb, c + i0 * ldc + j0, ldc, k);
    for (; j0 + 16 <= n; j0 += 16)
      micro_gemm<4, 16, Accumulate>(a + i0 * lda, lda, b + j0, ldb, c + i0 * ldc + j0, ldc, k);
    for (; j0 + 8 <= n; j0 += 8)
      micro_gemm<4, 8, Accumulate>(a + i0 * lda, lda, b + j0, ldb, c + i0 * ldc + j0, ldc, k);
  }
}

// dst (cols x rows) = src (rows x cols) transposed.
inline void transpose_tile(const float* TRELLIS_RESTRICT src, std::int64_t rows, std::int64_t cols,
                           float* TRELLIS_RESTRICT dst) {
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

}  // namespace detail

// o = softmax(scale * q k^T [masked]) v and lse per query row. See kernels/attention.hpp.
template <class T>
void attention_forward(const AttentionArgs& args, const T* q, const T* k, const T* v, T* o, float* lse) {
  detail::check_attention_args(args);
  const std::int64_t d = args.head_dim, tq = args.q_len, tk = args.kv_len;
  if (args.batch == 0 || tq == 0) return;
  TRELLIS_CHECK(q && o && lse && (tk == 0 || (k && v)), "attention_forward: null pointer");
  constexpr std::int64_t Br = detail::attn_q_tile, Bc = detail::attn_kv_tile;
  const std::int64_t q_tiles = (tq + Br - 1) / Br;
  const float scale = args.softmax_scale();
  constexpr float ninf = -std::numeric_limits<float>::infinity();

  parallel_for(args.batch * args.q_heads * q_tiles, [&](std::int64_t task) {
    const std::int64_t qt = task % q_tiles;
    const std::int64_t bh = task / q_tiles;  // batch * q_heads + head
    const std::int64_t b = bh / args.q_heads, h = bh % args.q_heads;
    const std::int64_t kvh = b * args.kv_heads + args.kv_head_of(h);
    const std::int64_t i0 = qt * Br, rows = std::min(Br, tq - i0);
    const T* qp = q + (bh * tq + i0) * d;
    const T* kp = k + kvh * tk * d;
    const T* vp = v + kvh * tk * d;

    std::vector<float> work(static_cast<std::size_t>(Br * d * 2 + d * Bc + Bc * d + Br * Bc + 2 * Br));
    float* qf = work.data();    // (Br, d) q * scale
    float* acc = qf + Br * d;   // (Br, d) unnormalised output
    float* kt = acc + Br * d;   // (d, Bc) k tile transposed
    float* vf = kt + d * Bc;    // (Bc, d)
    float* s = vf + Bc * d;     // (Br, Bc) scores, then probabilities
    float* mrow = s + Br * Bc;  // (Br) running max
    float* lrow = mrow + Br;    // (Br) running sum
    detail::load_rows(qp, rows, d, qf, scale);
    std::fill(qf + rows * d, qf + Br * d, 0.0f);  // padded rows stay finite
    std::fill(acc, acc + Br * d, 0.0f);
    std::fill(mrow, mrow + Br, ninf);
    std::fill(lrow, lrow + Br, 0.0f);

    const detail::IndexRange keys = detail::visible_keys(args, b, i0, i0 + rows);
    const std::int32_t* qseg = args.segmented() ? args.q_segments + b * tq + i0 : nullptr;
    const std::int32_t* kseg = args.segmented() ? args.kv_segments + b * tk : nullptr;
    for (std::int64_t j0 = keys.begin / Bc * Bc; j0 < keys.end; j0 += Bc) {
      const std::int64_t cols = std::min(Bc, tk - j0);
      detail::load_transposed(kp + j0 * d, cols, d, kt, Bc);
      detail::load_rows(vp + j0 * d, cols, d, vf);
      const std::int64_t rows4 = (rows + 3) / 4 * 4;
      detail::tile_gemm<false>(rows4, Bc, d, qf, d, kt, Bc, s, Bc);
      const bool one_segment = !qseg || (qseg[0] == qseg[rows - 1] && kseg[j0] == qseg[0] && kseg[j0 + cols - 1] == qseg[0]);
      const bool needs_mask = args.last_visible_key(i0) < j0 + Bc - 1 || cols < Bc || !one_segment;
      for (std::int64_t r = 0; r < rows; ++r) {
        float* srow = s + r * Bc;
        if (needs_mask) {
          const std::int64_t last = args.last_visible_key(i0 + r) - j0;  // last visible column
          for (std::int64_t c = std::max<std::int64_t>(last + 1, 0); c < Bc; ++c) srow[c] = ninf;
          if (!one_segment)
            for (std::int64_t c = 0; c < cols; ++c)
              if (kseg[j0 + c] != qseg[r]) srow[c] = ninf;
        }
        const float tile_max = detail::lane_max<Bc>(srow);
        const float m_new = std::max(mrow[r], tile_max);
        if (m_new == ninf) {  // nothing visible yet in this row
          std::fill(srow, srow + Bc, 0.0f);
          continue;
        }
        const float correction = fast_exp(mrow[r] - m_new);
        for (std::int64_t c = 0; c < Bc; ++c) srow[c] = fast_exp(srow[c] - m_new);
        lrow[r] = lrow[r] * correction + detail::lane_sum<Bc>(srow);
        mrow[r] = m_new;
        if (correction != 1.0f) {
          float* arow = acc + r * d;
          for (std::int64_t p = 0; p < d; ++p) arow[p] *= correction;
        }
      }
      if (cols < Bc) std::fill(vf + cols * d, vf + Bc * d, 0.0f);
      detail::tile_gemm<true>(rows4, d, Bc, s, Bc, vf, d, acc, d);
    }
    T* op = o + (bh * tq + i0) * d;
    float* lp = lse + bh * tq + i0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const bool empty = lrow[r] == 0.0f;
      const float inv = empty ? 0.0f : 1.0f / lrow[r];
      for (std::int64_t p = 0; p < d; ++p) op[r * d + p] = from_float<T>(acc[r * d + p] * inv);
      lp[r] = empty ? ninf : mrow[r] + std::log(lrow[r]);
    }
  });
}

// Gradients of attention_forward from (q, k, v, o, do, lse); dq, dk, dv are overwritten, or
// added to when `accumulate` (ring attention: several kv parts, o and lse being the merged ones).
template <class T>
void attention_backward(const AttentionArgs& args, const T* q, const T* k, const T* v, const T* o, const T* d_o,
                        const float* lse, T* dq, T* dk, T* dv, bool accumulate = false) {
  detail::check_attention_args(args);
  const std::int64_t d = args.head_dim, tq = args.q_len, tk = args.kv_len;
  if (args.batch == 0) return;
  TRELLIS_CHECK((tq == 0 || (q && o && d_o && lse && dq)) && (tk == 0 || (k && v && dk && dv)),
                "attention_backward: null pointer");
  constexpr std::int64_t Br = detail::attn_q_tile, Bc = detail::attn_kv_tile;
  const float scale = args.softmax_scale();
  const std::int64_t group = args.group_size();
  const std::int64_t kv_tiles = (tk + Bc - 1) / Bc;
  const std::int64_t q_rows = args.batch * args.q_heads * tq;

  // delta_i = do_i . o_i (= sum_j p_ij dp_ij), once per row.
  std::vector<float> delta(static_cast<std::size_t>(q_rows));
  parallel_for((q_rows + 255) / 256, [&](std::int64_t chunk) {
    const std::int64_t r1 = std::min(q_rows, (chunk + 1) * 256);
    for (std::int64_t r = chunk * 256; r < r1; ++r) {
      float lanes[8] = {};
      for (std::int64_t p = 0; p < d; p += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += to_float(d_o[r * d + p + l]) * to_float(o[r * d + p + l]);
      float s = 0.0f;
      for (int l = 0; l < 8; ++l) s += lanes[l];
      delta[r] = s;
    }
  });

  // Each (batch, kv head) is split into `parts` interleaved sets of kv tiles; each part keeps its
  // own fp32 dq, summed in part order afterwards. `parts` depends on the shape only.
  const std::int64_t heads = args.batch * args.kv_heads;
  const std::int64_t parts =
      kv_tiles == 0 ? 1 : std::clamp<std::int64_t>((8 + heads - 1) / heads, 1, std::min<std::int64_t>(kv_tiles, 8));
  const std::int64_t dq_part_size = q_rows * d;
  std::vector<float> dq_parts(static_cast<std::size_t>(parts * dq_part_size), 0.0f);

  parallel_for(heads * parts, [&](std::int64_t task) {
    const std::int64_t part = task % parts;
    const std::int64_t bkv = task / parts;  // batch * kv_heads + kv head
    const std::int64_t b = bkv / args.kv_heads, kvh = bkv % args.kv_heads;
    const T* kp = k + bkv * tk * d;
    const T* vp = v + bkv * tk * d;
    float* dq_part = dq_parts.data() + part * dq_part_size;

    std::vector<float> work(
        static_cast<std::size_t>(Bc * d * 3 + d * Bc * 2 + Br * d * 3 + Br * Bc * 2 + Bc * Br * 2 + Br * 2));
    float* kf = work.data();          // (Bc, d)
    float* dk_acc = kf + Bc * d;      // (Bc, d)
    float* dv_acc = dk_acc + Bc * d;  // (Bc, d)
    float* kt = dv_acc + Bc * d;      // (d, Bc)
    float* vt = kt + d * Bc;          // (d, Bc)
    float* qf = vt + d * Bc;          // (Br, d)
    float* dof = qf + Br * d;         // (Br, d)
    float* dq_tile = dof + Br * d;    // (Br, d)
    float* pt = dq_tile + Br * d;     // (Br, Bc) probabilities
    float* ds = pt + Br * Bc;         // (Br, Bc) dp, then ds
    float* pt_t = ds + Br * Bc;       // (Bc, Br) p transposed
    float* ds_t = pt_t + Bc * Br;     // (Bc, Br) ds transposed
    float* lse_t = ds_t + Bc * Br;    // (Br)
    float* delta_t = lse_t + Br;      // (Br)
    constexpr float ninf = -std::numeric_limits<float>::infinity();

    for (std::int64_t jt = part; jt < kv_tiles; jt += parts) {
      const std::int64_t j0 = jt * Bc, cols = std::min(Bc, tk - j0);
      detail::load_rows(kp + j0 * d, cols, d, kf);
      std::fill(kf + cols * d, kf + Bc * d, 0.0f);
      detail::load_transposed(kp + j0 * d, cols, d, kt, Bc);
      detail::load_transposed(vp + j0 * d, cols, d, vt, Bc);
      std::fill(dk_acc, dk_acc + Bc * d, 0.0f);
      std::fill(dv_acc, dv_acc + Bc * d, 0.0f);
      const detail::IndexRange seeing = detail::seeing_rows(args, b, j0, j0 + cols);
      const std::int32_t* kseg = args.segmented() ? args.kv_segments + b * tk + j0 : nullptr;
      for (std::int64_t hq = kvh * group; hq < (kvh + 1) * group; ++hq) {
        const std::int64_t bh = b * args.q_heads + hq;
        for (std::int64_t i0 = seeing.begin / Br * Br; i0 < seeing.end; i0 += Br) {
          const std::int64_t rows = std::min(Br, tq - i0);
          const std::int64_t row_base = bh * tq + i0;
          const std::int64_t rows4 = (rows + 3) / 4 * 4;  // the micro-kernel's row blocking
          detail::load_rows(q + row_base * d, rows, d, qf);
          detail::load_rows(d_o + row_base * d, rows, d, dof);
          std::fill(qf + rows * d, qf + rows4 * d, 0.0f);
          std::fill(dof + rows * d, dof + rows4 * d, 0.0f);
          for (std::int64_t r = 0; r < rows; ++r) {
            lse_t[r] = lse[row_base + r];
            delta_t[r] = delta[row_base + r];
          }
          // p = exp(scale * q k^T - lse), masked; padded rows 0.
          detail::tile_gemm<false>(rows4, Bc, d, qf, d, kt, Bc, pt, Bc);
          for (std::int64_t r = 0; r < rows4; ++r) {
            float* prow = pt + r * Bc;
            if (r >= rows || lse_t[r] == ninf) {
              std::fill(prow, prow + Bc, 0.0f);
              continue;
            }
            const std::int64_t last = args.last_visible_key(i0 + r) - j0;
            const float l = lse_t[r];
            for (std::int64_t c = 0; c < Bc; ++c) prow[c] = fast_exp(prow[c] * scale - l);
            for (std::int64_t c = std::max<std::int64_t>(std::min(last, cols - 1) + 1, 0); c < Bc; ++c)
              prow[c] = 0.0f;
            if (kseg) {
              const std::int32_t qs = args.q_segments[b * tq + i0 + r];
              for (std::int64_t c = 0; c < cols; ++c)
                if (kseg[c] != qs) prow[c] = 0.0f;
            }
          }
          // dv += p^T do
          detail::transpose_tile(pt, rows4, Bc, pt_t);
          detail::tile_gemm<true>(Bc, d, rows4, pt_t, rows4, dof, d, dv_acc, d);
          // dp = do v^T;  ds = p * (dp - delta) * scale
          detail::tile_gemm<false>(rows4, Bc, d, dof, d, vt, Bc, ds, Bc);
          for (std::int64_t r = 0; r < rows4; ++r) {
            float* dsrow = ds + r * Bc;
            const float* prow = pt + r * Bc;
            const float dl = r < rows ? delta_t[r] : 0.0f;
            for (std::int64_t c = 0; c < Bc; ++c) dsrow[c] = prow[c] * (dsrow[c] - dl) * scale;
          }
          // dk += ds^T q;  dq += ds k
          detail::transpose_tile(ds, rows4, Bc, ds_t);
          detail::tile_gemm<true>(Bc, d, rows4, ds_t, rows4, qf, d, dk_acc, d);
          detail::tile_gemm<false>(rows4, d, Bc, ds, Bc, kf, d, dq_tile, d);
          float* dqp = dq_part + row_base * d;
          for (std::int64_t e = 0; e < rows * d; ++e) dqp[e] += dq_tile[e];
        }
      }
      T* dkp = dk + (bkv * tk + j0) * d;
      T* dvp = dv + (bkv * tk + j0) * d;
      for (std::int64_t e = 0; e < cols * d; ++e) {
        dkp[e] = from_float<T>(dk_acc[e] + (accumulate ? to_float(dkp[e]) : 0.0f));
        dvp[e] = from_float<T>(dv_acc[e] + (accumulate ? to_float(dvp[e]) : 0.0f));
      }
    }
  });

  // dq = sum of the parts, in part order.
  const std::int64_t total = q_rows * d;
  parallel_for((total + 4095) / 4096, [&](std::int64_t chunk) {
    const std::int64_t e1 = std::min(total, (chunk + 1) * 4096);
    for (std::int64_t e = chunk * 4096; e < e1; ++e) {
      float s = accumulate ? to_float(dq[e]) : 0.0f;
      for (std::int64_t p = 0; p < parts; ++p) s += dq_parts[p * dq_part_size + e];
      dq[e] = from_float<T>(s);
    }
  });
}

// Merges a partial attention result into an accumulator, row by row (rows = batch * heads *
// q_len): afterwards (o_acc, lse_acc) is attention over the union of both key sets.
template <class T>
void merge_attention_partials(std::int64_t rows, std::int64_t head_dim, T* o_acc, float* lse_acc, const T* o_part,
                              const float* lse_part) {
  TRELLIS_CHECK(rows >= 0 && head_dim > 0, "merge_attention_partials: bad shape rows=", rows, " head_dim=", head_dim);
  parallel_for((rows + 63) / 64, [&](std::int64_t chunk) {
    std::vector<float> acc(static_cast<std::size_t>(head_dim)), part(static_cast<std::size_t>(head_dim));
    const std::int64_t r1 = std::min(rows, (chunk + 1) * 64);
    for (std::int64_t r = chunk * 64; r < r1; ++r) {
      for (std::int64_t p = 0; p < head_dim; ++p) {
        acc[p] = to_float(o_acc[r * head_dim + p]);
        part[p] = to_float(o_part[r * head_dim + p]);
      }
      merge_partials_row(head_dim, acc.data(), lse_acc + r, part.data(), lse_part[r]);
      for (std::int64_t p = 0; p < head_dim; ++p) o_acc[r * head_dim + p] = from_float<T>(acc[p]);
    }
  });
}

}  // namespace trellis::kernels::host
