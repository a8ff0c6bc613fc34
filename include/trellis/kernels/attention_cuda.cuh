// FlashAttention-2 style attention on CUDA (nvcc, sm_80 and newer): forward and backward, bf16 or
// fp16 inputs, fp32 accumulation on tensor cores through mma.sync.m16n8k16, causal or not, head
// dimension 64 or 128, grouped-query / multi-query attention (kv_heads divides heads).
//
// Layout: q, o, dq: [B, H, T, d]; k, v, dk, dv: [B, Hkv, T, d]; lse: [B, H, T] (fp32, natural log
// of the softmax denominator of each row, scores already scaled). All contiguous, 16-byte aligned.
//   S = scale * Q K^T (masked above the diagonal when causal), P = softmax(S), O = P V.
//
// Forward: one block of 4 warps per (64 query rows, batch*head); each warp owns 16 rows and keeps
// its output tile, running row max and row sum in registers; K/V tiles of 64 keys stream through
// shared memory (online softmax, no T x T matrix anywhere).
// Backward: one block per (64 keys, batch*kv_head); each warp owns 16 keys and keeps dK, dV for
// them in registers while query tiles of every head of its group stream through shared memory;
// P is recomputed from lse; dQ is accumulated in an fp32 workspace with atomics and converted at
// the end. The workspace (attention_backward_workspace_bytes) also holds D = rowsum(dO * O).
//
// Kernels are templates; translation units that link a library of explicit instantiations
// define TRELLIS_ATTENTION_CUDA_EXTERN to skip compiling them again (see tests/gpu/support).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"

namespace trellis::kernels::cuda {

// Sizes of one attention call ([B, H, T, d] layout).
struct AttentionShape {
  std::int64_t batch = 1;
  std::int64_t heads = 1;
  std::int64_t kv_heads = 0;  // 0: same as heads (plain multi-head attention)
  std::int64_t seq = 0;       // T, for queries and keys alike
  std::int64_t head_dim = 0;  // 64 or 128
  bool causal = false;
  float scale = 0.0f;  // 0: 1/sqrt(head_dim)

  TRELLIS_HD std::int64_t kv_heads_or_heads() const { return kv_heads ? kv_heads : heads; }
  TRELLIS_HD float scale_or_default() const {
    return scale != 0.0f ? scale : 1.0f / ::sqrtf(static_cast<float>(head_dim));
  }
  // Multiply-adds of the forward pass (2 GEMMs of T x T x d per head; half of them when causal).
  double forward_flops() const {
    double f = 4.0 * static_cast<double>(batch) * heads * static_cast<double>(seq) * seq * head_dim;
    return causal ? f / 2 : f;
  }
  // Backward: 5 GEMMs (S recomputed, dV, dP, dK, dQ) = 2.5x the forward.
  double backward_flops() const { return 2.5 * forward_flops(); }
};

namespace attention_detail {

inline constexpr int kBlockRows = 64;   // query rows per block (forward) / keys per block (backward)
inline constexpr int kBlockCols = 64;   // keys per tile (forward) / queries per tile (backward)
inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kPad = 8;          // elements of padding per shared-memory row (bank spread)
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// Element traits: packing two floats into the mma operand register, reading one element.
template <class T> struct MmaElement;
template <> struct MmaElement<bfloat16> {
  static __device__ __forceinline__ std::uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low 16 bits) = lo
    return *reinterpret_cast<std::uint32_t*>(&v);
  }
  static __device__ __forceinline__ float to_float(std::uint16_t bits) {
    return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
  }
  static __device__ __forceinline__ std::uint16_t from_float(float f) {
    __nv_bfloat16 v = __float2bfloat16_rn(f);
    return *reinterpret_cast<std::uint16_t*>(&v);
  }
  // c (16x8, fp32) += a (16x16, row) * b (16x8, col)
  static __device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                             std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct MmaElement<half> {
  static __device__ __forceinline__ std::uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<std::uint32_t*>(&v);
  }
  static __device__ __forceinline__ float to_float(std::uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
  }
  static __device__ __forceinline__ std::uint16_t from_float(float f) {
    return __half_as_ushort(__float2half_rn(f));
  }
  static __device__ __forceinline__ void mma(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                             std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Fragment ownership of mma.m16n8k16 (lane = 4 * group + quad):
//   A (16x16): a0 = (group, 2quad..+1), a1 = (group+8, 2quad..), a2 = (group, 8+2quad..), a3 = (group+8, 8+2quad..)
//   B (16x8):  b0 = (k = 2quad..+1, n = group), b1 = (k = 8+2quad..+1, n = group)
//   C (16x8):  c0,c1 = (group, 2quad..+1), c2,c3 = (group+8, 2quad..+1)
// So two adjacent C tiles (n = 0..7, 8..15) are exactly one A fragment (k = 0..15): P never
// leaves registers between the two GEMMs.

__device__ __forceinline__ std::uint32_t load_pair(const std::uint16_t* p) {
  return *reinterpret_cast<const std::uint32_t*>(p);
}
__device__ __forceinline__ std::uint32_t pack_bits(std::uint16_t lo, std::uint16_t hi) {
  return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}

// A fragment of rows [row0, row0+16) x cols [col0, col0+16) of a row-major smem tile.
__device__ __forceinline__ void load_a_rows(std::uint32_t (&a)[4], const std::uint16_t* tile, int ld, int row0,
                                            int col0, int group, int quad) {
  const std::uint16_t* p = tile + (row0 + group) * ld + col0 + 2 * quad;
  a[0] = load_pair(p);
  a[1] = load_pair(p + 8 * ld);
  a[2] = load_pair(p + 8);
  a[3] = load_pair(p + 8 * ld + 8);
}
// B fragment (k x n = 16 x 8) where B(k, n) = tile[n][k] (k contiguous): e.g. K^T from K rows.
__device__ __forceinline__ void load_b_transposed(std::uint32_t& b0, std::uint32_t& b1, const std::uint16_t* tile,
                                                  int ld, int k0, int n0, int group, int quad) {
  const std::uint16_t* p = tile + (n0 + group) * ld + k0 + 2 * quad;
  b0 = load_pair(p);
  b1 = load_pair(p + 8);
}
// B fragment where B(k, n) = tile[k][n] (n contiguous): e.g. V with k = key.
__device__ __forceinline__ void load_b_rows(std::uint32_t& b0, std::uint32_t& b1, const std::uint16_t* tile, int ld,
                                            int k0, int n0, int group, int quad) {
  const std::uint16_t* p = tile + (k0 + 2 * quad) * ld + n0 + group;
  b0 = pack_bits(p[0], p[ld]);
  b1 = pack_bits(p[8 * ld], p[9 * ld]);
}

// Copies rows [row0, row0 + 64) of a [T, D] matrix into a padded smem tile; rows >= T become 0.
template <int D>
__device__ __forceinline__ void load_tile(std::uint16_t* tile, const std::uint16_t* src, std::int64_t row0,
                                          std::int64_t rows) {
  constexpr int kChunksPerRow = D / 8;  // 16-byte chunks
  constexpr int kLd = D + kPad;
  for (int c = threadIdx.x; c < kBlockRows * kChunksPerRow; c += kThreads) {
    int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (row0 + r < rows) value = *reinterpret_cast<const uint4*>(src + (row0 + r) * D + col);
    *reinterpret_cast<uint4*>(tile + r * kLd + col) = value;
  }
}

template <int D>
constexpr std::size_t forward_smem_bytes() {
  return 3 * std::size_t{kBlockRows} * (D + kPad) * sizeof(std::uint16_t);
}
template <int D>
constexpr std::size_t backward_smem_bytes() {
  return 4 * std::size_t{kBlockRows} * (D + kPad) * sizeof(std::uint16_t) +
         std::size_t{kBlockRows} * (kBlockCols + kPad) * sizeof(std::uint16_t) + 2 * kBlockCols * sizeof(float);
}

// ---- kernels -----------------------------------------------------------------------------------

// grid (ceil(T/64), B*H), 128 threads.
template <class T, int D, bool Causal>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(
    const std::uint16_t* __restrict__ q, const std::uint16_t* __restrict__ k, const std::uint16_t* __restrict__ v,
    std::uint16_t* __restrict__ o, float* __restrict__ lse, int heads, int group_size, std::int64_t seq,
    float scale_log2) {
  static_assert(D % 16 == 0 && D <= 256, "head dimension must be a multiple of 16");
  using E = MmaElement<T>;
  constexpr int kLd = D + kPad;
  extern __shared__ __align__(16) std::uint16_t smem[];
  std::uint16_t* q_tile = smem;                     // (64, D)
  std::uint16_t* k_tile = q_tile + kBlockRows * kLd;  // (64, D)
  std::uint16_t* v_tile = k_tile + kBlockRows * kLd;  // (64, D)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  const int query_blocks = static_cast<int>((seq + kBlockRows - 1) / kBlockRows);
  // Causal: the longest rows first, so the short blocks fill the tail of the grid.
  const int qb = Causal ? query_blocks - 1 - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
  const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
  const std::int64_t kv_bh = static_cast<std::int64_t>(b) * (heads / group_size) + h / group_size;
  const std::uint16_t* q_head = q + static_cast<std::int64_t>(bh) * seq * D;
  const std::uint16_t* k_head = k + kv_bh * seq * D;
  const std::uint16_t* v_head = v + kv_bh * seq * D;
  const std::int64_t q_row0 = static_cast<std::int64_t>(qb) * kBlockRows;

  load_tile<D>(q_tile, q_head, q_row0, seq);
  __syncthreads();
  std::uint32_t q_frag[D / 16][4];  // this warp's 16 rows of Q as A fragments
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) load_a_rows(q_frag[kk], q_tile, kLd, warp * 16, kk * 16, group, quad);

  float acc[D / 8][4];  // (16, D) output tile
#pragma unroll
  for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
  float row_max[2] = {-INFINITY, -INFINITY};  // rows group, group + 8 (log2 domain)
  float row_sum[2] = {0.0f, 0.0f};            // this thread's share of the row sums
  const std::int64_t my_row[2] = {q_row0 + warp * 16 + group, q_row0 + warp * 16 + group + 8};

  const int key_blocks = static_cast<int>((seq + kBlockCols - 1) / kBlockCols);
  const int last_block = Causal ? min(key_blocks, qb + 1) : key_blocks;
  for (int kb = 0; kb < last_block; ++kb) {
    __syncthreads();  // previous tiles consumed
    load_tile<D>(k_tile, k_head, static_cast<std::int64_t>(kb) * kBlockCols, seq);
    load_tile<D>(v_tile, v_head, static_cast<std::int64_t>(kb) * kBlockCols, seq);
    __syncthreads();

    float s[kBlockCols / 8][4];  // (16, 64) scores
#pragma unroll
    for (int j = 0; j < kBlockCols / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int j = 0; j < kBlockCols / 8; ++j) {
        std::uint32_t b0, b1;
        load_b_transposed(b0, b1, k_tile, kLd, kk * 16, j * 8, group, quad);
        E::mma(s[j], q_frag[kk], b0, b1);
      }
    }
    // Scale into the log2 domain and mask (keys past T; keys after the query when causal).
    const std::int64_t key0 = static_cast<std::int64_t>(kb) * kBlockCols;
    const bool needs_mask = key0 + kBlockCols > seq || (Causal && kb == qb);
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kBlockCols / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e] * scale_log2;
        if (needs_mask) {
          std::int64_t key = key0 + j * 8 + 2 * quad + (e & 1);
          if (key >= seq || (Causal && key > my_row[e / 2])) x = -INFINITY;
        }
        s[j][e] = x;
        tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
      }
    }
    float correction[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
      tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
      float new_max = fmaxf(row_max[r], tile_max[r]);
      // A row with every key masked so far keeps max -inf; use 0 so exp2 gives 0, never NaN.
      float base = new_max == -INFINITY ? 0.0f : new_max;
      correction[r] = exp2f(row_max[r] - base);
      row_max[r] = new_max;
      row_sum[r] *= correction[r];
      tile_max[r] = base;
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      acc[n][0] *= correction[0], acc[n][1] *= correction[0];
      acc[n][2] *= correction[1], acc[n][3] *= correction[1];
    }
    // P = exp2(s - max), straight into A fragments (16 x 64 = 4 k-steps of 16 keys), then O += P V.
#pragma unroll
    for (int kk = 0; kk < kBlockCols / 16; ++kk) {
      float p[2][4];
#pragma unroll
      for (int half_tile = 0; half_tile < 2; ++half_tile) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          p[half_tile][e] = exp2f(s[2 * kk + half_tile][e] - tile_max[e / 2]);
          row_sum[e / 2] += p[half_tile][e];
        }
      }
      std::uint32_t a[4] = {E::pack(p[0][0], p[0][1]), E::pack(p[0][2], p[0][3]), E::pack(p[1][0], p[1][1]),
                            E::pack(p[1][2], p[1][3])};
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        std::uint32_t b0, b1;
        load_b_rows(b0, b1, v_tile, kLd, kk * 16, n * 8, group, quad);
        E::mma(acc[n], a, b0, b1);
      }
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 1);
    row_sum[r] += __shfl_xor_sync(0xffffffffu, row_sum[r], 2);
  }
  std::uint16_t* o_head = o + static_cast<std::int64_t>(bh) * seq * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (my_row[r] >= seq) continue;
    float inv = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    std::uint16_t* out_row = o_head + my_row[r] * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      *reinterpret_cast<std::uint32_t*>(out_row + n * 8 + 2 * quad) =
          E::pack(acc[n][2 * r] * inv, acc[n][2 * r + 1] * inv);
    }
    if (quad == 0) lse[static_cast<std::int64_t>(bh) * seq + my_row[r]] = (row_max[r] + log2f(row_sum[r])) * kLn2;
  }
}

// D[row] = sum_d dO[row, d] * O[row, d] (fp32). One warp per row.
template <class T>
__global__ void attention_backward_prepare_kernel(const std::uint16_t* __restrict__ o,
                                                  const std::uint16_t* __restrict__ dout, float* __restrict__ delta,
                                                  std::int64_t rows, int head_dim) {
  using E = MmaElement<T>;
  std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float sum = 0.0f;
  for (int d = lane; d < head_dim; d += 32)
    sum += E::to_float(o[row * head_dim + d]) * E::to_float(dout[row * head_dim + d]);
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (lane == 0) delta[row] = sum;
}

template <class T>
__global__ void attention_convert_kernel(const float* __restrict__ src, std::uint16_t* __restrict__ dst,
                                         std::int64_t count) {
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (; i < count; i += step) dst[i] = MmaElement<T>::from_float(src[i]);
}

// grid (ceil(T/64), B*Hkv), 128 threads.
template <class T, int D, bool Causal>
__global__ void __launch_bounds__(kThreads) attention_backward_kernel(
    const std::uint16_t* __restrict__ q, const std::uint16_t* __restrict__ k, const std::uint16_t* __restrict__ v,
    const std::uint16_t* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dq_accum, std::uint16_t* __restrict__ dk, std::uint16_t* __restrict__ dv, int heads,
    int group_size, std::int64_t seq, float scale) {
  using E = MmaElement<T>;
  constexpr int kLd = D + kPad;
  constexpr int kLdS = kBlockCols + kPad;
  extern __shared__ __align__(16) std::uint16_t smem[];
  std::uint16_t* k_tile = smem;                          // (64 keys, D)
  std::uint16_t* v_tile = k_tile + kBlockRows * kLd;      // (64 keys, D)
  std::uint16_t* q_tile = v_tile + kBlockRows * kLd;      // (64 queries, D)
  std::uint16_t* do_tile = q_tile + kBlockRows * kLd;     // (64 queries, D)
  std::uint16_t* ds_tile = do_tile + kBlockRows * kLd;    // (64 keys, 64 queries): dS^T
  float* lse_tile = reinterpret_cast<float*>(ds_tile + kBlockRows * kLdS);  // (64)
  float* delta_tile = lse_tile + kBlockCols;                                // (64)

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  const int kv_heads = heads / group_size;
  const int kb = blockIdx.x;
  const int kv_bh = blockIdx.y, b = kv_bh / kv_heads, kvh = kv_bh % kv_heads;
  const std::int64_t key0 = static_cast<std::int64_t>(kb) * kBlockRows;
  const float scale_log2 = scale * kLog2e;

  load_tile<D>(k_tile, k + static_cast<std::int64_t>(kv_bh) * seq * D, key0, seq);
  load_tile<D>(v_tile, v + static_cast<std::int64_t>(kv_bh) * seq * D, key0, seq);

  float dk_acc[D / 8][4], dv_acc[D / 8][4];  // (16 keys, D) each
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;
  }
  const std::int64_t my_key[2] = {key0 + warp * 16 + group, key0 + warp * 16 + group + 8};
  const int query_blocks = static_cast<int>((seq + kBlockCols - 1) / kBlockCols);

  for (int hh = 0; hh < group_size; ++hh) {
    const std::int64_t bh = static_cast<std::int64_t>(b) * heads + kvh * group_size + hh;
    const std::uint16_t* q_head = q + bh * seq * D;
    const std::uint16_t* do_head = dout + bh * seq * D;
    for (int qb = Causal ? kb : 0; qb < query_blocks; ++qb) {
      const std::int64_t q0 = static_cast<std::int64_t>(qb) * kBlockCols;
      __syncthreads();  // previous tiles consumed
      load_tile<D>(q_tile, q_head, q0, seq);
      load_tile<D>(do_tile, do_head, q0, seq);
      for (int i = threadIdx.x; i < kBlockCols; i += kThreads) {
        bool valid = q0 + i < seq;
        lse_tile[i] = valid ? lse[bh * seq + q0 + i] : 0.0f;
        delta_tile[i] = valid ? delta[bh * seq + q0 + i] : 0.0f;
      }
      __syncthreads();

      // S^T and dP^T for this warp's 16 keys x 64 queries.
      float st[kBlockCols / 8][4], dpt[kBlockCols / 8][4];
#pragma unroll
      for (int j = 0; j < kBlockCols / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        std::uint32_t k_frag[4], v_frag[4];
        load_a_rows(k_frag, k_tile, kLd, warp * 16, kk * 16, group, quad);
        load_a_rows(v_frag, v_tile, kLd, warp * 16, kk * 16, group, quad);
#pragma unroll
        for (int j = 0; j < kBlockCols / 8; ++j) {
          std::uint32_t b0, b1;
          load_b_transposed(b0, b1, q_tile, kLd, kk * 16, j * 8, group, quad);
          E::mma(st[j], k_frag, b0, b1);
          load_b_transposed(b0, b1, do_tile, kLd, kk * 16, j * 8, group, quad);
          E::mma(dpt[j], v_frag, b0, b1);
        }
      }
      // P^T = exp(S^T - lse), dS^T = P^T (dP^T - D); masked entries are 0.
#pragma unroll
      for (int j = 0; j < kBlockCols / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int qi = j * 8 + 2 * quad + (e & 1);
          std::int64_t query = q0 + qi;
          std::int64_t key = my_key[e / 2];
          bool valid = query < seq && key < seq && (!Causal || key <= query);
          float p = valid ? exp2f(st[j][e] * scale_log2 - lse_tile[qi] * kLog2e) : 0.0f;
          st[j][e] = p;
          dpt[j][e] = p * (dpt[j][e] - delta_tile[qi]);
        }
      }
      // dV += P^T dO, dK += dS^T Q (k = queries, from registers).
#pragma unroll
      for (int kk = 0; kk < kBlockCols / 16; ++kk) {
        std::uint32_t p_frag[4] = {E::pack(st[2 * kk][0], st[2 * kk][1]), E::pack(st[2 * kk][2], st[2 * kk][3]),
                                   E::pack(st[2 * kk + 1][0], st[2 * kk + 1][1]),
                                   E::pack(st[2 * kk + 1][2], st[2 * kk + 1][3])};
        std::uint32_t ds_frag[4] = {E::pack(dpt[2 * kk][0], dpt[2 * kk][1]), E::pack(dpt[2 * kk][2], dpt[2 * kk][3]),
                                    E::pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]),
                                    E::pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          std::uint32_t b0, b1;
          load_b_rows(b0, b1, do_tile, kLd, kk * 16, n * 8, group, quad);
          E::mma(dv_acc[n], p_frag, b0, b1);
          load_b_rows(b0, b1, q_tile, kLd, kk * 16, n * 8, group, quad);
          E::mma(dk_acc[n], ds_frag, b0, b1);
        }
        // dS^T to shared memory for dQ: rows = keys, cols = queries.
        std::uint16_t* ds_row0 = ds_tile + (warp * 16 + group) * kLdS + kk * 16 + 2 * quad;
        *reinterpret_cast<std::uint32_t*>(ds_row0) = ds_frag[0];
        *reinterpret_cast<std::uint32_t*>(ds_row0 + 8 * kLdS) = ds_frag[1];
        *reinterpret_cast<std::uint32_t*>(ds_row0 + 8) = ds_frag[2];
        *reinterpret_cast<std::uint32_t*>(ds_row0 + 8 * kLdS + 8) = ds_frag[3];
      }
      __syncthreads();

      // dQ (64 queries, D) += scale * dS (64 q x 64 keys) K (64 keys x D); warp w: queries 16w..16w+15.
      // A(m = query, k = key) = ds_tile[key][query]: gathered 16 bits at a time.
      std::uint32_t a_frag[kBlockRows / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockRows / 16; ++kk) {
        const std::uint16_t* p = ds_tile + (kk * 16 + 2 * quad) * kLdS + warp * 16 + group;
        a_frag[kk][0] = pack_bits(p[0], p[kLdS]);
        a_frag[kk][1] = pack_bits(p[8], p[kLdS + 8]);
        a_frag[kk][2] = pack_bits(p[8 * kLdS], p[9 * kLdS]);
        a_frag[kk][3] = pack_bits(p[8 * kLdS + 8], p[9 * kLdS + 8]);
      }
      float* dq_head = dq_accum + bh * seq * D;
      const std::int64_t my_query[2] = {q0 + warp * 16 + group, q0 + warp * 16 + group + 8};
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int kk = 0; kk < kBlockRows / 16; ++kk) {
          std::uint32_t b0, b1;
          load_b_rows(b0, b1, k_tile, kLd, kk * 16, n * 8, group, quad);
          E::mma(c, a_frag[kk], b0, b1);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (my_query[r] < seq) {
            float* dst = dq_head + my_query[r] * D + n * 8 + 2 * quad;
            atomicAdd(dst, c[2 * r] * scale);
            atomicAdd(dst + 1, c[2 * r + 1] * scale);
          }
        }
      }
    }
  }

  // This block owns dK, dV of its keys for every head of the group: plain stores.
  std::uint16_t* dk_head = dk + static_cast<std::int64_t>(kv_bh) * seq * D;
  std::uint16_t* dv_head = dv + static_cast<std::int64_t>(kv_bh) * seq * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (my_key[r] >= seq) continue;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      std::int64_t offset = my_key[r] * D + n * 8 + 2 * quad;
      *reinterpret_cast<std::uint32_t*>(dk_head + offset) =
          E::pack(dk_acc[n][2 * r] * scale, dk_acc[n][2 * r + 1] * scale);
      *reinterpret_cast<std::uint32_t*>(dv_head + offset) = E::pack(dv_acc[n][2 * r], dv_acc[n][2 * r + 1]);
    }
  }
}

inline void check_shape(const AttentionShape& s) {
  TRELLIS_CHECK(s.batch > 0 && s.heads > 0 && s.seq > 0, "attention: batch, heads and seq must be positive (got ",
                s.batch, ", ", s.heads, ", ", s.seq, ")");
  TRELLIS_CHECK(s.head_dim == 64 || s.head_dim == 128, "attention (CUDA): head_dim must be 64 or 128, got ",
                s.head_dim);
  std::int64_t kvh = s.kv_heads_or_heads();
  TRELLIS_CHECK(kvh > 0 && s.heads % kvh == 0, "attention: kv_heads ", kvh, " must divide heads ", s.heads);
  TRELLIS_CHECK(s.batch * s.heads <= 65535, "attention (CUDA): batch*heads ", s.batch * s.heads,
                " exceeds the grid's y limit 65535");
}

inline void check_aligned(const void* p, const char* what) {
  TRELLIS_CHECK(reinterpret_cast<std::uintptr_t>(p) % 16 == 0, "attention (CUDA): ", what,
                " must be 16-byte aligned");
}

template <class Kernel>
void set_smem(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024)
    TRELLIS_CHECK_CUDA(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

template <class T, int D, bool Causal>
void launch_forward(const AttentionShape& s, const T* q, const T* k, const T* v, T* o, float* lse,
                    cudaStream_t stream) {
  auto kernel = attention_forward_kernel<T, D, Causal>;
  constexpr std::size_t smem = forward_smem_bytes<D>();
  set_smem(kernel, smem);
  dim3 grid(static_cast<unsigned>((s.seq + kBlockRows - 1) / kBlockRows), static_cast<unsigned>(s.batch * s.heads));
  int group = static_cast<int>(s.heads / s.kv_heads_or_heads());
  kernel<<<grid, kThreads, smem, stream>>>(
      reinterpret_cast<const std::uint16_t*>(q), reinterpret_cast<const std::uint16_t*>(k),
      reinterpret_cast<const std::uint16_t*>(v), reinterpret_cast<std::uint16_t*>(o), lse,
      static_cast<int>(s.heads), group, s.seq, s.scale_or_default() * kLog2e);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T, int D, bool Causal>
void launch_backward(const AttentionShape& s, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                     const float* delta, float* dq_accum, T* dk, T* dv, cudaStream_t stream) {
  auto kernel = attention_backward_kernel<T, D, Causal>;
  constexpr std::size_t smem = backward_smem_bytes<D>();
  set_smem(kernel, smem);
  std::int64_t kvh = s.kv_heads_or_heads();
  dim3 grid(static_cast<unsigned>((s.seq + kBlockRows - 1) / kBlockRows), static_cast<unsigned>(s.batch * kvh));
  kernel<<<grid, kThreads, smem, stream>>>(
      reinterpret_cast<const std::uint16_t*>(q), reinterpret_cast<const std::uint16_t*>(k),
      reinterpret_cast<const std::uint16_t*>(v), reinterpret_cast<const std::uint16_t*>(dout), lse, delta, dq_accum,
      reinterpret_cast<std::uint16_t*>(dk), reinterpret_cast<std::uint16_t*>(dv), static_cast<int>(s.heads),
      static_cast<int>(s.heads / kvh), s.seq, s.scale_or_default());
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace attention_detail

// ---- launchers -----------------------------------------------------------------------------------

// O = softmax(scale Q K^T [causal mask]) V and lse per row. T is bfloat16 or half.
template <class T>
void attention_forward(const AttentionShape& shape, const T* q, const T* k, const T* v, T* o, float* lse,
                       cudaStream_t stream);

// Bytes of device workspace attention_backward needs (fp32 dQ accumulator + row dot products).
inline std::size_t attention_backward_workspace_bytes(const AttentionShape& s) {
  std::size_t rows = static_cast<std::size_t>(s.batch * s.heads * s.seq);
  std::size_t dq = rows * static_cast<std::size_t>(s.head_dim) * sizeof(float);
  return (dq + 255) / 256 * 256 + rows * sizeof(float);
}

// dQ, dK, dV from the forward's inputs, output O, its lse and dO. `workspace` holds
// attention_backward_workspace_bytes(shape) bytes of device memory; everything runs on `stream`.
template <class T>
void attention_backward(const AttentionShape& shape, const T* q, const T* k, const T* v, const T* o, const T* dout,
                        const float* lse, T* dq, T* dk, T* dv, void* workspace, std::size_t workspace_bytes,
                        cudaStream_t stream);

#if !defined(TRELLIS_ATTENTION_CUDA_EXTERN)
template <class T>
void attention_forward(const AttentionShape& shape, const T* q, const T* k, const T* v, T* o, float* lse,
                       cudaStream_t stream) {
  static_assert(std::is_same_v<T, bfloat16> || std::is_same_v<T, half>, "attention takes bfloat16 or half");
  namespace ad = attention_detail;
  ad::check_shape(shape);
  ad::check_aligned(q, "q"), ad::check_aligned(k, "k"), ad::check_aligned(v, "v"), ad::check_aligned(o, "o");
  TRELLIS_CHECK(lse != nullptr, "attention: lse must not be null");
  if (shape.head_dim == 64) {
    shape.causal ? ad::launch_forward<T, 64, true>(shape, q, k, v, o, lse, stream)
                 : ad::launch_forward<T, 64, false>(shape, q, k, v, o, lse, stream);
  } else {
    shape.causal ? ad::launch_forward<T, 128, true>(shape, q, k, v, o, lse, stream)
                 : ad::launch_forward<T, 128, false>(shape, q, k, v, o, lse, stream);
  }
}

template <class T>
void attention_backward(const AttentionShape& shape, const T* q, const T* k, const T* v, const T* o, const T* dout,
                        const float* lse, T* dq, T* dk, T* dv, void* workspace, std::size_t workspace_bytes,
                        cudaStream_t stream) {
  static_assert(std::is_same_v<T, bfloat16> || std::is_same_v<T, half>, "attention takes bfloat16 or half");
  namespace ad = attention_detail;
  ad::check_shape(shape);
  for (auto [p, name] : {std::pair<const void*, const char*>{q, "q"}, {k, "k"}, {v, "v"}, {o, "o"}, {dout, "dout"},
                         {dq, "dq"}, {dk, "dk"}, {dv, "dv"}})
    ad::check_aligned(p, name);
  TRELLIS_CHECK(workspace && workspace_bytes >= attention_backward_workspace_bytes(shape),
                "attention_backward: workspace of ", workspace_bytes, " bytes, needs ",
                attention_backward_workspace_bytes(shape));
  const std::int64_t rows = shape.batch * shape.heads * shape.seq;
  const std::int64_t dq_count = rows * shape.head_dim;
  float* dq_accum = static_cast<float*>(workspace);
  float* delta = reinterpret_cast<float*>(static_cast<char*>(workspace) +
                                          (static_cast<std::size_t>(dq_count) * sizeof(float) + 255) / 256 * 256);
  TRELLIS_CHECK_CUDA(cudaMemsetAsync(dq_accum, 0, static_cast<std::size_t>(dq_count) * sizeof(float), stream));
  constexpr int kRowsPerBlock = 8;  // one warp per row
  ad::attention_backward_prepare_kernel<T>
      <<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kRowsPerBlock * 32, 0, stream>>>(
          reinterpret_cast<const std::uint16_t*>(o), reinterpret_cast<const std::uint16_t*>(dout), delta, rows,
          static_cast<int>(shape.head_dim));
  TRELLIS_CHECK_CUDA(cudaGetLastError());
  if (shape.head_dim == 64) {
    shape.causal ? ad::launch_backward<T, 64, true>(shape, q, k, v, dout, lse, delta, dq_accum, dk, dv, stream)
                 : ad::launch_backward<T, 64, false>(shape, q, k, v, dout, lse, delta, dq_accum, dk, dv, stream);
  } else {
    shape.causal ? ad::launch_backward<T, 128, true>(shape, q, k, v, dout, lse, delta, dq_accum, dk, dv, stream)
                 : ad::launch_backward<T, 128, false>(shape, q, k, v, dout, lse, delta, dq_accum, dk, dv, stream);
  }
  ad::attention_convert_kernel<T><<<1024, 256, 0, stream>>>(dq_accum, reinterpret_cast<std::uint16_t*>(dq), dq_count);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}
#else
extern template void attention_forward<bfloat16>(const AttentionShape&, const bfloat16*, const bfloat16*,
                                                 const bfloat16*, bfloat16*, float*, cudaStream_t);
extern template void attention_forward<half>(const AttentionShape&, const half*, const half*, const half*, half*,
                                             float*, cudaStream_t);
extern template void attention_backward<bfloat16>(const AttentionShape&, const bfloat16*, const bfloat16*,
                                                  const bfloat16*, const bfloat16*, const bfloat16*, const float*,
                                                  bfloat16*, bfloat16*, bfloat16*, void*, std::size_t, cudaStream_t);
extern template void attention_backward<half>(const AttentionShape&, const half*, const half*, const half*,
                                              const half*, const half*, const float*, half*, half*, half*, void*,
                                              std::size_t, cudaStream_t);
#endif

}  // namespace trellis::kernels::cuda
