// FlashAttention-2 style attention on CUDA (nvcc, sm_80 and newer): forward and backward, bf16 or
// fp16 inputs, fp32 accumulation on tensor cores through mma.sync.m16n8k16, causal or not, head
// dimension 64 or 128, grouped-query / multi-query attention (kv_heads divides heads).
//
// Arguments, layout and math are kernels::AttentionArgs (kernels/attention.hpp), the same as the
// host attention: q, o, dq [B, Hq, Tq, d]; k, v, dk, dv [B, Hkv, Tkv, d]; lse [B, Hq, Tq] fp32
// (natural log; -inf for a row that sees no key, whose output is 0); causal mask aligned
// bottom-right (j <= i + Tkv - Tq). Pointers are device pointers, 16-byte aligned.
//   cuda::attention_forward(args, q, k, v, o, lse, stream);
//   cuda::attention_backward(args, q, k, v, o, d_o, lse, dq, dk, dv, workspace, bytes, stream, accumulate);
//
// Forward: one block of 4 warps per (128 query rows, batch*head); each warp owns 32 rows and keeps
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
#include "trellis/kernels/attention.hpp"

namespace trellis::kernels::cuda {

// Multiply-adds x 2 of the forward pass: two GEMMs of Tq x Tkv x d per head, the visible part
// only when causal (Tq == Tkv: about half).
inline double attention_forward_flops(const AttentionArgs& a) {
  double full = 4.0 * static_cast<double>(a.batch) * static_cast<double>(a.q_heads) * static_cast<double>(a.q_len) *
                static_cast<double>(a.kv_len) * static_cast<double>(a.head_dim);
  if (!a.causal || a.q_len == 0 || a.kv_len == 0) return full;
  double visible = 0;  // sum over rows of the visible keys
  for (std::int64_t i = 0; i < a.q_len; ++i) visible += static_cast<double>(a.last_visible_key(i) + 1 > 0 ? a.last_visible_key(i) + 1 : 0);
  return full * visible / (static_cast<double>(a.q_len) * static_cast<double>(a.kv_len));
}
// Backward: five GEMMs (S recomputed, dV, dP, dK, dQ) = 2.5x the forward.
inline double attention_backward_flops(const AttentionArgs& a) { return 2.5 * attention_forward_flops(a); }

namespace attention_detail {

inline constexpr int kBlockRows = 64;   // keys per block (backward); K/V tile rows (forward)
inline constexpr int kForwardRows = 128;  // query rows per forward block: 4 warps x 2 m-tiles of 16
inline constexpr int kForwardMTiles = kForwardRows / (16 * 4);
inline constexpr int kForwardCols = 64;  // keys per forward K/V tile
inline constexpr int kBlockCols = 64;   // queries per tile (backward)
inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * 32;
inline constexpr int kPad = 8;          // elements of padding per shared-memory row (bank spread)
inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

// 2^x through the special-function unit directly (flush to zero; -inf -> 0): exp2f adds
// range handling around the same instruction, which costs in the softmax of every tile.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

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

// Four 8x8 b16 matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
// Without .trans lane l receives (row l / 4, cols 2 (l % 4), +1) of each matrix, with .trans
// (rows 2 (l % 4), +1; col l / 4).
template <bool Transposed>
__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], const std::uint16_t* row_address) {
  const auto address = static_cast<std::uint32_t>(__cvta_generic_to_shared(row_address));
  if constexpr (Transposed) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  }
}

// A fragment of rows [row0, row0+16) x cols [col0, col0+16) of a row-major tile, one ldmatrix:
// matrices (row0.., col0..), (row0+8.., col0..), (row0.., col0+8..), (row0+8.., col0+8..).
__device__ __forceinline__ void load_a_rows_x4(std::uint32_t (&a)[4], const std::uint16_t* tile, int ld, int row0,
                                               int col0, int lane) {
#if defined(TRELLIS_ATTENTION_SCALAR_LOADS)
  load_a_rows(a, tile, ld, row0, col0, lane / 4, lane % 4);
#else
  const int matrix = lane / 8, row = lane % 8;
  ldmatrix_x4<false>(a, tile + (row0 + row + 8 * (matrix & 1)) * ld + col0 + 8 * (matrix >> 1));
#endif
}

// B fragments (b0, b1) of n-tiles n0 and n0 + 8 where B(k, n) = tile[n][k] (k contiguous, e.g.
// K^T from K rows), one ldmatrix: matrices (n0.., k0..), (n0.., k0+8..), (n0+8.., k0..),
// (n0+8.., k0+8..). b[0], b[1] serve n-tile n0; b[2], b[3] serve n0 + 8.
__device__ __forceinline__ void load_b_transposed_x2(std::uint32_t (&b)[4], const std::uint16_t* tile, int ld,
                                                     int k0, int n0, int lane) {
#if defined(TRELLIS_ATTENTION_SCALAR_LOADS)
  const int group = lane / 4, quad = lane % 4;
  load_b_transposed(b[0], b[1], tile, ld, k0, n0, group, quad);
  load_b_transposed(b[2], b[3], tile, ld, k0, n0 + 8, group, quad);
#else
  const int matrix = lane / 8, row = lane % 8;
  ldmatrix_x4<false>(b, tile + (n0 + row + 8 * (matrix >> 1)) * ld + k0 + 8 * (matrix & 1));
#endif
}

// B fragments (b0, b1) of two adjacent n-tiles, n0 and n0 + 8, where B(k, n) = tile[k][n] (n
// contiguous, e.g. V with k = key): one ldmatrix.x4.trans. Lane l addresses row l % 8 of 8x8
// matrix l / 8; matrices: (k0.., n0..), (k0+8.., n0..), (k0.., n0+8..), (k0+8.., n0+8..).
// b[0], b[1] serve n-tile n0; b[2], b[3] serve n0 + 8. Rows must be 16-byte aligned.
// TRELLIS_ATTENTION_SCALAR_LOADS selects the plain 16-bit loads instead (a debugging aid).
__device__ __forceinline__ void load_b_rows_x2(std::uint32_t (&b)[4], const std::uint16_t* tile, int ld, int k0,
                                               int n0, int lane) {
#if defined(TRELLIS_ATTENTION_SCALAR_LOADS)
  const int group = lane / 4, quad = lane % 4;
  load_b_rows(b[0], b[1], tile, ld, k0, n0, group, quad);
  load_b_rows(b[2], b[3], tile, ld, k0, n0 + 8, group, quad);
#else
  const int matrix = lane / 8, row = lane % 8;
  ldmatrix_x4<true>(b, tile + (k0 + row + 8 * (matrix & 1)) * ld + n0 + 8 * (matrix >> 1));
#endif
}

// A fragment (m x k = 16 x 16) where A(m, k) = tile[k0 + k][m0 + m] (m contiguous, e.g. dS from a
// stored dS^T), one ldmatrix.x4.trans: matrices (k0.., m0..), (k0.., m0+8..), (k0+8.., m0..),
// (k0+8.., m0+8..) give a0..a3. Rows must be 16-byte aligned.
__device__ __forceinline__ void load_a_transposed_x4(std::uint32_t (&a)[4], const std::uint16_t* tile, int ld, int k0,
                                                     int m0, int lane) {
#if defined(TRELLIS_ATTENTION_SCALAR_LOADS)
  const int group = lane / 4, quad = lane % 4;
  const std::uint16_t* p = tile + (k0 + 2 * quad) * ld + m0 + group;
  a[0] = pack_bits(p[0], p[ld]);
  a[1] = pack_bits(p[8], p[ld + 8]);
  a[2] = pack_bits(p[8 * ld], p[9 * ld]);
  a[3] = pack_bits(p[8 * ld + 8], p[9 * ld + 8]);
#else
  const int matrix = lane / 8, row = lane % 8;
  ldmatrix_x4<true>(a, tile + (k0 + row + 8 * (matrix >> 1)) * ld + m0 + 8 * (matrix & 1));
#endif
}

// Copies rows [row0, row0 + 64) of a [T, D] matrix into a padded smem tile; rows >= T become 0.
template <int D, int TileRows = kBlockRows>
__device__ __forceinline__ void load_tile(std::uint16_t* tile, const std::uint16_t* src, std::int64_t row0,
                                          std::int64_t rows) {
  constexpr int kChunksPerRow = D / 8;  // 16-byte chunks
  constexpr int kLd = D + kPad;
  for (int c = threadIdx.x; c < TileRows * kChunksPerRow; c += kThreads) {
    int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    uint4 value = make_uint4(0, 0, 0, 0);
    if (row0 + r < rows) value = *reinterpret_cast<const uint4*>(src + (row0 + r) * D + col);
    *reinterpret_cast<uint4*>(tile + r * kLd + col) = value;
  }
}

// load_tile through cp.async (16-byte copies, rows >= `rows` zero-filled), so the next K/V tile
// arrives while the current one is used. Callers commit a group and wait for it; the scalar
// debugging build copies synchronously instead.
template <int D, int TileRows = kBlockRows>
__device__ __forceinline__ void load_tile_async(std::uint16_t* tile, const std::uint16_t* src, std::int64_t row0,
                                                std::int64_t rows) {
#if defined(TRELLIS_ATTENTION_SCALAR_LOADS)
  load_tile<D, TileRows>(tile, src, row0, rows);
#else
  constexpr int kChunksPerRow = D / 8;
  constexpr int kLd = D + kPad;
#pragma unroll 2
  for (int c = threadIdx.x; c < TileRows * kChunksPerRow; c += kThreads) {
    const int r = c / kChunksPerRow, col = (c % kChunksPerRow) * 8;
    const bool valid = row0 + r < rows;
    const std::uint16_t* from = src + (valid ? (row0 + r) * D + col : 0);  // never read when !valid
    const auto to = static_cast<std::uint32_t>(__cvta_generic_to_shared(tile + r * kLd + col));
    const int bytes = valid ? 16 : 0;  // 0: fill the 16 bytes with zeros
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(from), "r"(bytes));
  }
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if !defined(TRELLIS_ATTENTION_SCALAR_LOADS)
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most `Pending` of this thread's committed groups are still in flight.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
#if !defined(TRELLIS_ATTENTION_SCALAR_LOADS)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
#endif
}

// Forward: Q (128 rows) plus two stages of K and V (64 rows each).
template <int D>
constexpr std::size_t forward_smem_bytes() {
  return (std::size_t{kForwardRows} + 4 * std::size_t{kForwardCols}) * (D + kPad) * sizeof(std::uint16_t);
}
// Backward: K, V, two stages of (Q, dO), dS^T, and two stages of (lse, delta) rows.
template <int D>
constexpr std::size_t backward_smem_bytes() {
  return 6 * std::size_t{kBlockRows} * (D + kPad) * sizeof(std::uint16_t) +
         std::size_t{kBlockRows} * (kBlockCols + kPad) * sizeof(std::uint16_t) + 4 * kBlockCols * sizeof(float);
}

// ---- kernels -----------------------------------------------------------------------------------

// grid (ceil(Tq/128), B*H), or (ceil(Tq/128) * B*H) when causal; 128 threads. Each warp owns 32
// query rows (two m-tiles of 16), so every K or V fragment read from shared memory feeds four mma
// instead of two: the ldmatrix traffic per mma halves, which is what bounds mma.sync here. Q
// fragments are re-read from shared memory per k-step (keeping them in registers beside the
// 32 x D accumulators would spill).
template <class T, int D, bool Causal>
__global__ void __launch_bounds__(kThreads, 2) attention_forward_kernel(
    const std::uint16_t* __restrict__ q, const std::uint16_t* __restrict__ k, const std::uint16_t* __restrict__ v,
    std::uint16_t* __restrict__ o, float* __restrict__ lse, int heads, int group_size, std::int64_t q_len,
    std::int64_t kv_len, float scale_log2) {
  static_assert(D % 16 == 0 && D <= 256, "head dimension must be a multiple of 16");
  using E = MmaElement<T>;
  constexpr int kLd = D + kPad;
  constexpr int kM = kForwardMTiles;  // m-tiles of 16 rows per warp
  extern __shared__ __align__(16) std::uint16_t smem[];
  std::uint16_t* q_tile = smem;  // (128, D)
  // Two stages of (K, V) tiles, (64, D) each, after Q.
  auto k_stage = [&](int stage) { return smem + (kForwardRows + (2 * stage) * kForwardCols) * kLd; };
  auto v_stage = [&](int stage) { return smem + (kForwardRows + (2 * stage + 1) * kForwardCols) * kLd; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  const int query_blocks = static_cast<int>((q_len + kForwardRows - 1) / kForwardRows);
  const std::int64_t causal_offset = kv_len - q_len;  // row i sees keys j <= i + offset
  // Causal grids are 1-D, heaviest work first over the whole grid: every head's last query
  // block, then every head's second to last, ..., so the short blocks fill the tail.
  // Causal grid: (query_blocks * B*H); otherwise (query_blocks, B*H).
  const int head_count = Causal ? static_cast<int>(gridDim.x) / query_blocks : 0;
  const int bh = Causal ? static_cast<int>(blockIdx.x) % head_count : static_cast<int>(blockIdx.y);
  const int qb = Causal ? query_blocks - 1 - static_cast<int>(blockIdx.x) / head_count : static_cast<int>(blockIdx.x);
  const int batch = bh / heads, h = bh % heads;
  const std::int64_t kv_bh = static_cast<std::int64_t>(batch) * (heads / group_size) + h / group_size;
  const std::uint16_t* q_head = q + static_cast<std::int64_t>(bh) * q_len * D;
  const std::uint16_t* k_head = k + kv_bh * kv_len * D;
  const std::uint16_t* v_head = v + kv_bh * kv_len * D;
  const std::int64_t q_row0 = static_cast<std::int64_t>(qb) * kForwardRows;
  const int warp_row0 = warp * 16 * kM;  // first row of this warp in the block

  int last_block = 0;  // key blocks [0, last_block) hold keys some row of this block sees
  {
    const int key_blocks = static_cast<int>((kv_len + kForwardCols - 1) / kForwardCols);
    last_block = key_blocks;
    if (Causal) {
      std::int64_t last_key = q_row0 + kForwardRows - 1 + causal_offset;
      last_block = last_key < 0 ? 0 : static_cast<int>(min(static_cast<std::int64_t>(key_blocks), last_key / kForwardCols + 1));
    }
  }
  if (last_block > 0) {  // Q and the first K/V tiles in one cp.async group
    load_tile_async<D, kForwardRows>(q_tile, q_head, q_row0, q_len);
    load_tile_async<D, kForwardCols>(k_stage(0), k_head, 0, kv_len);
    load_tile_async<D, kForwardCols>(v_stage(0), v_head, 0, kv_len);
    cp_async_commit();
  }

  float acc[kM][D / 8][4];  // (32, D) output tile
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0.0f;
  float row_max[kM][2], row_sum[kM][2];  // rows group, group + 8 of each m-tile (log2 domain)
#pragma unroll
  for (int m = 0; m < kM; ++m) {
    row_max[m][0] = row_max[m][1] = -INFINITY;
    row_sum[m][0] = row_sum[m][1] = 0.0f;  // this thread's share of the row sums
  }
  const int thread_row = warp_row0 + group;  // + 16 m + 8 r: the thread's rows in the block

  for (int kb = 0; kb < last_block; ++kb) {
    // Prefetch tile kb + 1 into the other stage (last read in iteration kb - 1, which ended with
    // a barrier), then wait for tile kb.
    if (kb + 1 < last_block) {
      load_tile_async<D, kForwardCols>(k_stage((kb + 1) & 1), k_head, static_cast<std::int64_t>(kb + 1) * kForwardCols, kv_len);
      load_tile_async<D, kForwardCols>(v_stage((kb + 1) & 1), v_head, static_cast<std::int64_t>(kb + 1) * kForwardCols, kv_len);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // every thread's copies of tile kb (and of Q) are visible
    const std::uint16_t* k_tile = k_stage(kb & 1);
    const std::uint16_t* v_tile = v_stage(kb & 1);

    float s[kM][kForwardCols / 8][4];  // (32, 64) scores
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
      for (int j = 0; j < kForwardCols / 8; ++j) s[m][j][0] = s[m][j][1] = s[m][j][2] = s[m][j][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      std::uint32_t qa[kM][4];
#pragma unroll
      for (int m = 0; m < kM; ++m) load_a_rows_x4(qa[m], q_tile, kLd, warp_row0 + m * 16, kk * 16, lane);
#pragma unroll
      for (int j = 0; j < kForwardCols / 8; j += 2) {
        std::uint32_t b[4];
        load_b_transposed_x2(b, k_tile, kLd, kk * 16, j * 8, lane);
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          E::mma(s[m][j], qa[m], b[0], b[1]);
          E::mma(s[m][j + 1], qa[m], b[2], b[3]);
        }
      }
    }
    // Scale into the log2 domain and mask (keys past T; keys after the query when causal).
    const std::int64_t key0 = static_cast<std::int64_t>(kb) * kForwardCols;
    const bool needs_mask = key0 + kForwardCols > kv_len || (Causal && key0 + kForwardCols - 1 > q_row0 + causal_offset);
    // Tile-relative bounds (small ints): key column c is valid below keys_left; causal, it is
    // visible to block row i when c <= i + diagonal.
    const int keys_left = static_cast<int>(min(kv_len - key0, static_cast<std::int64_t>(kForwardCols)));
    const std::int64_t diagonal_wide = q_row0 + causal_offset - key0;
    const int diagonal = static_cast<int>(max(min(diagonal_wide, std::int64_t{1} << 20), -(std::int64_t{1} << 20)));
    float tile_max[kM][2];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      tile_max[m][0] = tile_max[m][1] = -INFINITY;
#pragma unroll
      for (int j = 0; j < kForwardCols / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[m][j][e] * scale_log2;
          if (needs_mask) {
            const int column = j * 8 + 2 * quad + (e & 1);
            if (column >= keys_left || (Causal && column > thread_row + 16 * m + 8 * (e / 2) + diagonal)) x = -INFINITY;
          }
          s[m][j][e] = x;
          tile_max[m][e / 2] = fmaxf(tile_max[m][e / 2], x);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      float correction[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float t = tile_max[m][r];
        t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 1));
        t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 2));
        float new_max = fmaxf(row_max[m][r], t);
        // A row with every key masked so far keeps max -inf; use 0 so exp2 gives 0, never NaN.
        float base = new_max == -INFINITY ? 0.0f : new_max;
        correction[r] = fast_exp2(row_max[m][r] - base);
        row_max[m][r] = new_max;
        row_sum[m][r] *= correction[r];
        tile_max[m][r] = base;
      }
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        acc[m][n][0] *= correction[0], acc[m][n][1] *= correction[0];
        acc[m][n][2] *= correction[1], acc[m][n][3] *= correction[1];
      }
    }
    // P = exp2(s - max), straight into A fragments (16 x 64 = 4 k-steps of 16 keys per m-tile),
    // then O += P V with each V fragment serving both m-tiles.
#pragma unroll
    for (int kk = 0; kk < kForwardCols / 16; ++kk) {
      std::uint32_t a[kM][4];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
        float p[2][4];
#pragma unroll
        for (int half_tile = 0; half_tile < 2; ++half_tile) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            p[half_tile][e] = fast_exp2(s[m][2 * kk + half_tile][e] - tile_max[m][e / 2]);
            row_sum[m][e / 2] += p[half_tile][e];
          }
        }
        a[m][0] = E::pack(p[0][0], p[0][1]), a[m][1] = E::pack(p[0][2], p[0][3]);
        a[m][2] = E::pack(p[1][0], p[1][1]), a[m][3] = E::pack(p[1][2], p[1][3]);
      }
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        std::uint32_t b[4];
        load_b_rows_x2(b, v_tile, kLd, kk * 16, n * 8, lane);
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          E::mma(acc[m][n], a[m], b[0], b[1]);
          E::mma(acc[m][n + 1], a[m], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // stage kb & 1 is refilled in iteration kb + 1
  }

  std::uint16_t* o_head = o + static_cast<std::int64_t>(bh) * q_len * D;
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float sum = row_sum[m][r];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const std::int64_t row = q_row0 + thread_row + 16 * m + 8 * r;
      if (row >= q_len) continue;
      float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      std::uint16_t* out_row = o_head + row * D;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        *reinterpret_cast<std::uint32_t*>(out_row + n * 8 + 2 * quad) =
            E::pack(acc[m][n][2 * r] * inv, acc[m][n][2 * r + 1] * inv);
      }
      // Nothing visible: max -inf, sum 0 -> lse -inf and o 0, as on the host.
      if (quad == 0) lse[static_cast<std::int64_t>(bh) * q_len + row] = (row_max[m][r] + log2f(sum)) * kLn2;
    }
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

// dst = src (or dst + src when accumulating), rounded to T.
template <class T>
__global__ void attention_convert_kernel(const float* __restrict__ src, std::uint16_t* __restrict__ dst,
                                         std::int64_t count, bool accumulate) {
  std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  std::int64_t step = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (; i < count; i += step) {
    float value = src[i];
    if (accumulate) value += MmaElement<T>::to_float(dst[i]);
    dst[i] = MmaElement<T>::from_float(value);
  }
}

// grid (ceil(Tkv/64), B*Hkv), or (ceil(Tkv/64) * B*Hkv) when causal; 128 threads.
template <class T, int D, bool Causal>
__global__ void __launch_bounds__(kThreads) attention_backward_kernel(
    const std::uint16_t* __restrict__ q, const std::uint16_t* __restrict__ k, const std::uint16_t* __restrict__ v,
    const std::uint16_t* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dq_accum, std::uint16_t* __restrict__ dk, std::uint16_t* __restrict__ dv, int heads,
    int group_size, std::int64_t q_len, std::int64_t kv_len, float scale, bool accumulate) {
  using E = MmaElement<T>;
  constexpr int kLd = D + kPad;
  constexpr int kLdS = kBlockCols + kPad;
  extern __shared__ __align__(16) std::uint16_t smem[];
  constexpr int kTile = kBlockRows * kLd;
  std::uint16_t* k_tile = smem;           // (64 keys, D)
  std::uint16_t* v_tile = smem + kTile;   // (64 keys, D)
  // Two stages of (Q, dO) tiles, (64 queries, D) each, so the next pair loads during this one.
  auto q_stage = [&](int stage) { return smem + (2 + 2 * stage) * kTile; };
  auto do_stage = [&](int stage) { return smem + (3 + 2 * stage) * kTile; };
  std::uint16_t* ds_tile = smem + 6 * kTile;  // (64 keys, 64 queries): dS^T
  // Two stages of (lse, delta), 64 floats each.
  auto lse_stage = [&](int stage) { return reinterpret_cast<float*>(ds_tile + kBlockRows * kLdS) + 2 * kBlockCols * stage; };

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  const int kv_heads = heads / group_size;
  // Causal grids are 1-D, heaviest first over the whole grid (key block 0 meets every query):
  // every kv head's first key block, then every head's second, ...
  const int key_blocks = static_cast<int>((kv_len + kBlockRows - 1) / kBlockRows);
  const int head_count = Causal ? static_cast<int>(gridDim.x) / key_blocks : 0;
  const int kb = Causal ? static_cast<int>(blockIdx.x) / head_count : static_cast<int>(blockIdx.x);
  const int kv_bh = Causal ? static_cast<int>(blockIdx.x) % head_count : static_cast<int>(blockIdx.y);
  const int batch = kv_bh / kv_heads, kvh = kv_bh % kv_heads;
  const std::int64_t key0 = static_cast<std::int64_t>(kb) * kBlockRows;
  const float scale_log2 = scale * kLog2e;
  const std::int64_t causal_offset = kv_len - q_len;  // query i sees keys j <= i + offset

  load_tile<D>(k_tile, k + static_cast<std::int64_t>(kv_bh) * kv_len * D, key0, kv_len);
  load_tile<D>(v_tile, v + static_cast<std::int64_t>(kv_bh) * kv_len * D, key0, kv_len);

  float dk_acc[D / 8][4], dv_acc[D / 8][4];  // (16 keys, D) each
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;
  }
  const std::int64_t my_key[2] = {key0 + warp * 16 + group, key0 + warp * 16 + group + 8};
  const int query_blocks = static_cast<int>((q_len + kBlockCols - 1) / kBlockCols);
  int first_query_block = 0;
  if (Causal) {  // the first query that sees key0 is key0 - offset
    std::int64_t first_query = key0 - causal_offset;
    first_query_block = first_query <= 0 ? 0 : static_cast<int>(min(static_cast<std::int64_t>(query_blocks), first_query / kBlockCols));
  }

  // Work items: every query block this key block meets, for every q head of the group.
  const int blocks_per_head = query_blocks - first_query_block;
  const int items = blocks_per_head > 0 ? group_size * blocks_per_head : 0;
  auto item_head = [&](int item) {  // (b, q head) row index of the [B*Hq, T, D] tensors
    return static_cast<std::int64_t>(batch) * heads + kvh * group_size + item / blocks_per_head;
  };
  auto item_q0 = [&](int item) {
    return static_cast<std::int64_t>(first_query_block + item % blocks_per_head) * kBlockCols;
  };
  // Starts the loads of work item `item` into `stage`: Q, dO, lse and delta through cp.async (one
  // group). The stage was last read before the mid-iteration barrier of the previous item, which
  // every thread has passed.
  auto issue = [&](int item, int stage) {
    const std::int64_t bh = item_head(item), q0 = item_q0(item);
    load_tile_async<D>(q_stage(stage), q + bh * q_len * D, q0, q_len);
    load_tile_async<D>(do_stage(stage), dout + bh * q_len * D, q0, q_len);
    float* lse_rows = lse_stage(stage);
    for (int i = threadIdx.x; i < kBlockCols; i += kThreads) {
      const bool valid = q0 + i < q_len;
#if defined(TRELLIS_ATTENTION_SCALAR_LOADS)
      lse_rows[i] = valid ? lse[bh * q_len + q0 + i] : 0.0f;
      lse_rows[kBlockCols + i] = valid ? delta[bh * q_len + q0 + i] : 0.0f;
#else
      // In the same cp.async group as Q and dO: a plain load here would stall these threads on
      // global memory latency once per item. Rows past q_len are zero-filled.
      const std::int64_t offset = valid ? bh * q_len + q0 + i : 0;
      const int bytes = valid ? 4 : 0;
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                       static_cast<std::uint32_t>(__cvta_generic_to_shared(lse_rows + i))),
                   "l"(lse + offset), "r"(bytes));
      asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(
                       static_cast<std::uint32_t>(__cvta_generic_to_shared(lse_rows + kBlockCols + i))),
                   "l"(delta + offset), "r"(bytes));
#endif
    }
    cp_async_commit();
  };
  if (items > 0) issue(0, 0);

  for (int item = 0; item < items; ++item) {
    const int stage = item & 1;
    if (item + 1 < items) {
      issue(item + 1, stage ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this item's tiles (and K, V, and the previous dQ reads of dS) settled
    {
      const std::int64_t bh = item_head(item), q0 = item_q0(item);
      const std::uint16_t* q_tile = q_stage(stage);
      const std::uint16_t* do_tile = do_stage(stage);
      const float* lse_tile = lse_stage(stage);
      const float* delta_tile = lse_tile + kBlockCols;

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
        load_a_rows_x4(k_frag, k_tile, kLd, warp * 16, kk * 16, lane);
        load_a_rows_x4(v_frag, v_tile, kLd, warp * 16, kk * 16, lane);
#pragma unroll
        for (int j = 0; j < kBlockCols / 8; j += 2) {
          std::uint32_t b[4];
          load_b_transposed_x2(b, q_tile, kLd, kk * 16, j * 8, lane);
          E::mma(st[j], k_frag, b[0], b[1]);
          E::mma(st[j + 1], k_frag, b[2], b[3]);
          load_b_transposed_x2(b, do_tile, kLd, kk * 16, j * 8, lane);
          E::mma(dpt[j], v_frag, b[0], b[1]);
          E::mma(dpt[j + 1], v_frag, b[2], b[3]);
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
          bool valid = query < q_len && key < kv_len && (!Causal || key <= query + causal_offset);
          float p = valid ? fast_exp2(st[j][e] * scale_log2 - lse_tile[qi] * kLog2e) : 0.0f;
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
        for (int n = 0; n < D / 8; n += 2) {
          std::uint32_t b[4];
          load_b_rows_x2(b, do_tile, kLd, kk * 16, n * 8, lane);
          E::mma(dv_acc[n], p_frag, b[0], b[1]);
          E::mma(dv_acc[n + 1], p_frag, b[2], b[3]);
          load_b_rows_x2(b, q_tile, kLd, kk * 16, n * 8, lane);
          E::mma(dk_acc[n], ds_frag, b[0], b[1]);
          E::mma(dk_acc[n + 1], ds_frag, b[2], b[3]);
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
      // A(m = query, k = key) = ds_tile[key][query].
      std::uint32_t a_frag[kBlockRows / 16][4];
#pragma unroll
      for (int kk = 0; kk < kBlockRows / 16; ++kk) load_a_transposed_x4(a_frag[kk], ds_tile, kLdS, kk * 16, warp * 16, lane);
      float* dq_head = dq_accum + bh * q_len * D;
      const std::int64_t my_query[2] = {q0 + warp * 16 + group, q0 + warp * 16 + group + 8};
#pragma unroll
      for (int n = 0; n < D / 8; n += 2) {
        float c[2][4] = {};  // n-tiles n, n + 1
#pragma unroll
        for (int kk = 0; kk < kBlockRows / 16; ++kk) {
          std::uint32_t b[4];
          load_b_rows_x2(b, k_tile, kLd, kk * 16, n * 8, lane);
          E::mma(c[0], a_frag[kk], b[0], b[1]);
          E::mma(c[1], a_frag[kk], b[2], b[3]);
        }
#pragma unroll
        for (int half_tile = 0; half_tile < 2; ++half_tile) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (my_query[r] < q_len) {
              float* dst = dq_head + my_query[r] * D + (n + half_tile) * 8 + 2 * quad;  // 8-byte aligned
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
              atomicAdd(reinterpret_cast<float2*>(dst), make_float2(c[half_tile][2 * r] * scale, c[half_tile][2 * r + 1] * scale));
#else
              atomicAdd(dst, c[half_tile][2 * r] * scale);
              atomicAdd(dst + 1, c[half_tile][2 * r + 1] * scale);
#endif
            }
          }
        }
      }
    }
  }

  // This block owns dK, dV of its keys for every head of the group: plain stores.
  std::uint16_t* dk_head = dk + static_cast<std::int64_t>(kv_bh) * kv_len * D;
  std::uint16_t* dv_head = dv + static_cast<std::int64_t>(kv_bh) * kv_len * D;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (my_key[r] >= kv_len) continue;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      std::int64_t offset = my_key[r] * D + n * 8 + 2 * quad;
      float k0 = dk_acc[n][2 * r] * scale, k1 = dk_acc[n][2 * r + 1] * scale;
      float v0 = dv_acc[n][2 * r], v1 = dv_acc[n][2 * r + 1];
      if (accumulate) {
        k0 += E::to_float(dk_head[offset]), k1 += E::to_float(dk_head[offset + 1]);
        v0 += E::to_float(dv_head[offset]), v1 += E::to_float(dv_head[offset + 1]);
      }
      *reinterpret_cast<std::uint32_t*>(dk_head + offset) = E::pack(k0, k1);
      *reinterpret_cast<std::uint32_t*>(dv_head + offset) = E::pack(v0, v1);
    }
  }
}

inline void check_args(const AttentionArgs& a) {
  TRELLIS_CHECK(a.batch >= 1 && a.q_len >= 1 && a.kv_len >= 1, "attention (CUDA): batch, q_len and kv_len must be "
                "positive (got ", a.batch, ", ", a.q_len, ", ", a.kv_len, ")");
  TRELLIS_CHECK(a.q_heads >= 1 && a.kv_heads >= 1 && a.q_heads % a.kv_heads == 0, "attention: kv_heads (",
                a.kv_heads, ") must divide q_heads (", a.q_heads, ")");
  TRELLIS_CHECK(a.head_dim == 64 || a.head_dim == 128, "attention (CUDA): head_dim must be 64 or 128, got ",
                a.head_dim);
  TRELLIS_CHECK(std::isfinite(a.scale), "attention: scale is not finite");
  TRELLIS_CHECK(a.batch * a.q_heads <= 65535, "attention (CUDA): batch*q_heads ", a.batch * a.q_heads,
                " exceeds the grid's y limit 65535");
}

inline void check_aligned(const void* p, const char* what) {
  TRELLIS_CHECK(p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 == 0, "attention (CUDA): ", what,
                " must be a non-null, 16-byte aligned device pointer");
}

template <class Kernel>
void set_smem(Kernel kernel, std::size_t bytes) {
  if (bytes > 48 * 1024)
    TRELLIS_CHECK_CUDA(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  // Ask for the largest shared-memory carveout: two ~100 KiB blocks per SM on sm_90 (the driver
  // otherwise may pick a smaller one and run a single block per SM).
  TRELLIS_CHECK_CUDA(
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
}

template <class T, int D, bool Causal>
void launch_forward(const AttentionArgs& a, const T* q, const T* k, const T* v, T* o, float* lse,
                    cudaStream_t stream) {
  auto kernel = attention_forward_kernel<T, D, Causal>;
  constexpr std::size_t smem = forward_smem_bytes<D>();
  set_smem(kernel, smem);
  const auto query_blocks = static_cast<unsigned>((a.q_len + kForwardRows - 1) / kForwardRows);
  const auto heads = static_cast<unsigned>(a.batch * a.q_heads);
  // Causal: one dimension ordered heaviest first (see the kernel).
  TRELLIS_CHECK(!Causal || static_cast<double>(query_blocks) * heads < 2147483648.0, "attention (CUDA): ",
                query_blocks, " query blocks x ", heads, " heads exceed the causal grid's limit 2^31");
  dim3 grid = Causal ? dim3(query_blocks * heads, 1) : dim3(query_blocks, heads);
  kernel<<<grid, kThreads, smem, stream>>>(
      reinterpret_cast<const std::uint16_t*>(q), reinterpret_cast<const std::uint16_t*>(k),
      reinterpret_cast<const std::uint16_t*>(v), reinterpret_cast<std::uint16_t*>(o), lse,
      static_cast<int>(a.q_heads), static_cast<int>(a.group_size()), a.q_len, a.kv_len, a.softmax_scale() * kLog2e);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T, int D, bool Causal>
void launch_backward(const AttentionArgs& a, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                     const float* delta, float* dq_accum, T* dk, T* dv, bool accumulate, cudaStream_t stream) {
  auto kernel = attention_backward_kernel<T, D, Causal>;
  constexpr std::size_t smem = backward_smem_bytes<D>();
  set_smem(kernel, smem);
  const auto key_blocks = static_cast<unsigned>((a.kv_len + kBlockRows - 1) / kBlockRows);
  const auto heads = static_cast<unsigned>(a.batch * a.kv_heads);
  TRELLIS_CHECK(!Causal || static_cast<double>(key_blocks) * heads < 2147483648.0, "attention_backward (CUDA): ",
                key_blocks, " key blocks x ", heads, " kv heads exceed the causal grid's limit 2^31");
  dim3 grid = Causal ? dim3(key_blocks * heads, 1) : dim3(key_blocks, heads);
  kernel<<<grid, kThreads, smem, stream>>>(
      reinterpret_cast<const std::uint16_t*>(q), reinterpret_cast<const std::uint16_t*>(k),
      reinterpret_cast<const std::uint16_t*>(v), reinterpret_cast<const std::uint16_t*>(dout), lse, delta, dq_accum,
      reinterpret_cast<std::uint16_t*>(dk), reinterpret_cast<std::uint16_t*>(dv), static_cast<int>(a.q_heads),
      static_cast<int>(a.group_size()), a.q_len, a.kv_len, a.softmax_scale(), accumulate);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace attention_detail

// ---- launchers -----------------------------------------------------------------------------------

// o = softmax(scale q k^T [causal]) v and lse per row (kernels/attention.hpp). T: bfloat16 or half.
template <class T>
void attention_forward(const AttentionArgs& args, const T* q, const T* k, const T* v, T* o, float* lse,
                       cudaStream_t stream);

// Bytes of device workspace attention_backward needs (fp32 dq accumulator + row terms delta).
inline std::size_t attention_backward_workspace_bytes(const AttentionArgs& a) {
  std::size_t rows = static_cast<std::size_t>(a.batch * a.q_heads * a.q_len);
  std::size_t dq = rows * static_cast<std::size_t>(a.head_dim) * sizeof(float);
  return (dq + 255) / 256 * 256 + rows * sizeof(float);
}

// dq, dk, dv from the forward's inputs, its output o and lse, and d_o; overwritten, or added to
// when `accumulate`. `workspace` holds attention_backward_workspace_bytes(args) bytes of device
// memory; everything runs on `stream`.
template <class T>
void attention_backward(const AttentionArgs& args, const T* q, const T* k, const T* v, const T* o, const T* d_o,
                        const float* lse, T* dq, T* dk, T* dv, void* workspace, std::size_t workspace_bytes,
                        cudaStream_t stream, bool accumulate = false);

#if !defined(TRELLIS_ATTENTION_CUDA_EXTERN)
template <class T>
void attention_forward(const AttentionArgs& args, const T* q, const T* k, const T* v, T* o, float* lse,
                       cudaStream_t stream) {
  static_assert(std::is_same_v<T, bfloat16> || std::is_same_v<T, half>, "attention takes bfloat16 or half");
  namespace ad = attention_detail;
  ad::check_args(args);
  ad::check_aligned(q, "q"), ad::check_aligned(k, "k"), ad::check_aligned(v, "v"), ad::check_aligned(o, "o");
  TRELLIS_CHECK(lse != nullptr, "attention: lse must not be null");
  if (args.head_dim == 64) {
    args.causal ? ad::launch_forward<T, 64, true>(args, q, k, v, o, lse, stream)
                : ad::launch_forward<T, 64, false>(args, q, k, v, o, lse, stream);
  } else {
    args.causal ? ad::launch_forward<T, 128, true>(args, q, k, v, o, lse, stream)
                : ad::launch_forward<T, 128, false>(args, q, k, v, o, lse, stream);
  }
}

template <class T>
void attention_backward(const AttentionArgs& args, const T* q, const T* k, const T* v, const T* o, const T* d_o,
                        const float* lse, T* dq, T* dk, T* dv, void* workspace, std::size_t workspace_bytes,
                        cudaStream_t stream, bool accumulate) {
  static_assert(std::is_same_v<T, bfloat16> || std::is_same_v<T, half>, "attention takes bfloat16 or half");
  namespace ad = attention_detail;
  ad::check_args(args);
  ad::check_aligned(q, "q"), ad::check_aligned(k, "k"), ad::check_aligned(v, "v"), ad::check_aligned(o, "o");
  ad::check_aligned(d_o, "d_o"), ad::check_aligned(dq, "dq"), ad::check_aligned(dk, "dk"), ad::check_aligned(dv, "dv");
  TRELLIS_CHECK(lse != nullptr, "attention_backward: lse must not be null");
  TRELLIS_CHECK(workspace && workspace_bytes >= attention_backward_workspace_bytes(args),
                "attention_backward: workspace of ", workspace_bytes, " bytes, needs ",
                attention_backward_workspace_bytes(args));
  const std::int64_t rows = args.batch * args.q_heads * args.q_len;
  const std::int64_t dq_count = rows * args.head_dim;
  float* dq_accum = static_cast<float*>(workspace);
  float* delta = reinterpret_cast<float*>(static_cast<char*>(workspace) +
                                          (static_cast<std::size_t>(dq_count) * sizeof(float) + 255) / 256 * 256);
  TRELLIS_CHECK_CUDA(cudaMemsetAsync(dq_accum, 0, static_cast<std::size_t>(dq_count) * sizeof(float), stream));
  constexpr int kRowsPerBlock = 8;  // one warp per row
  ad::attention_backward_prepare_kernel<T>
      <<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kRowsPerBlock * 32, 0, stream>>>(
          reinterpret_cast<const std::uint16_t*>(o), reinterpret_cast<const std::uint16_t*>(d_o), delta, rows,
          static_cast<int>(args.head_dim));
  TRELLIS_CHECK_CUDA(cudaGetLastError());
  if (args.head_dim == 64) {
    args.causal ? ad::launch_backward<T, 64, true>(args, q, k, v, d_o, lse, delta, dq_accum, dk, dv, accumulate, stream)
                : ad::launch_backward<T, 64, false>(args, q, k, v, d_o, lse, delta, dq_accum, dk, dv, accumulate, stream);
  } else {
    args.causal ? ad::launch_backward<T, 128, true>(args, q, k, v, d_o, lse, delta, dq_accum, dk, dv, accumulate, stream)
                : ad::launch_backward<T, 128, false>(args, q, k, v, d_o, lse, delta, dq_accum, dk, dv, accumulate, stream);
  }
  ad::attention_convert_kernel<T>
      <<<1024, 256, 0, stream>>>(dq_accum, reinterpret_cast<std::uint16_t*>(dq), dq_count, accumulate);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}
#else
extern template void attention_forward<bfloat16>(const AttentionArgs&, const bfloat16*, const bfloat16*,
                                                 const bfloat16*, bfloat16*, float*, cudaStream_t);
extern template void attention_forward<half>(const AttentionArgs&, const half*, const half*, const half*, half*,
                                             float*, cudaStream_t);
extern template void attention_backward<bfloat16>(const AttentionArgs&, const bfloat16*, const bfloat16*,
                                                  const bfloat16*, const bfloat16*, const bfloat16*, const float*,
                                                  bfloat16*, bfloat16*, bfloat16*, void*, std::size_t, cudaStream_t,
                                                  bool);
extern template void attention_backward<half>(const AttentionArgs&, const half*, const half*, const half*,
                                              const half*, const half*, const float*, half*, half*, half*, void*,
                                              std::size_t, cudaStream_t, bool);
#endif

}  // namespace trellis::kernels::cuda
