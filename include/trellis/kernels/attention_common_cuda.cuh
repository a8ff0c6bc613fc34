// What the CUDA flash attention's forward and backward share (nvcc, sm_80 and newer): the FLOP
// counters, the tile geometry, the mma.sync/ldmatrix fragment loads, the cp.async tile loads and
// the launch-time argument checks (part of kernels/attention_cuda.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/attention.hpp"

namespace trellis::kernels::cuda {

// Multiply-adds x 2 of the forward pass: two GEMMs of Tq x Tkv x d per head, the visible part
// only when causal (the causal_offset's bound; Tq == Tkv: about half). Segment ids live in device
// memory, so with segments this counts the causal bound only (an upper bound): the overload below
// takes host copies of the ids to count exactly.
inline double attention_forward_flops(const AttentionArgs& a) {
  double full = 4.0 * static_cast<double>(a.batch) * static_cast<double>(a.q_heads) * static_cast<double>(a.q_len) *
                static_cast<double>(a.kv_len) * static_cast<double>(a.head_dim);
  if (!a.causal || a.q_len == 0 || a.kv_len == 0) return full;
  double visible = 0;  // sum over rows of the visible keys
  for (std::int64_t i = 0; i < a.q_len; ++i) visible += static_cast<double>(a.last_visible_key(i) + 1 > 0 ? a.last_visible_key(i) + 1 : 0);
  return full * visible / (static_cast<double>(a.q_len) * static_cast<double>(a.kv_len));
}
// The same, counting the segment mask too from host copies of the ids ([batch, q_len] and
// [batch, kv_len], non-decreasing per sequence, as in AttentionArgs).
inline double attention_forward_flops(const AttentionArgs& a, const std::int32_t* host_q_segments,
                                      const std::int32_t* host_kv_segments) {
  if (!host_q_segments || !host_kv_segments || a.q_len == 0 || a.kv_len == 0) return attention_forward_flops(a);
  double visible = 0;  // sum over batches and rows of the visible keys
  for (std::int64_t b = 0; b < a.batch; ++b) {
    const std::int32_t* ks = host_kv_segments + b * a.kv_len;
    for (std::int64_t i = 0; i < a.q_len; ++i) {
      const std::int32_t id = host_q_segments[b * a.q_len + i];
      const std::int64_t first = std::lower_bound(ks, ks + a.kv_len, id) - ks;
      const std::int64_t last = std::min(a.last_visible_key(i), (std::upper_bound(ks, ks + a.kv_len, id) - ks) - 1);
      visible += static_cast<double>(last >= first ? last - first + 1 : 0);
    }
  }
  return 4.0 * static_cast<double>(a.q_heads) * static_cast<double>(a.head_dim) * visible;
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

// Searches the non-decreasing ids[0, n) for the first position whose id is >= target (Upper:
// > target), n if none: std::lower_bound / upper_bound, done by the whole block at once. Each
// round every thread tests one of kThreads evenly spaced positions and __syncthreads_count
// narrows the range kThreads-fold, so 16k ids take two rounds of one load each, where a single
// thread would wait on ~14 dependent loads. Every thread of the block must call it alike.
template <bool Upper>
__device__ __forceinline__ std::int64_t block_search(const std::int32_t* __restrict__ ids, std::int64_t n,
                                                     std::int32_t target) {
  std::int64_t lo = 0, hi = n;  // ids before lo are "before" target, ids from hi on are not
  while (hi > lo) {
    const std::int64_t step = (hi - lo + kThreads - 1) / kThreads;  // 1 in the last round
    const std::int64_t position = lo + (threadIdx.x + 1) * step - 1;
    bool before = false;
    if (position < hi) {
      const std::int32_t id = ids[position];
      before = Upper ? id <= target : id < target;
    }
    const std::int64_t count = __syncthreads_count(before);  // the tested positions "before", a prefix
    hi = min(hi, lo + (count + 1) * step - 1);  // the first position tested "not before" (or hi)
    lo += count * step;
  }
  return lo;
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
  TRELLIS_CHECK((a.q_segments == nullptr) == (a.kv_segments == nullptr), "attention (CUDA): q_segments (",
                a.q_segments ? "set" : "null", ") and kv_segments (", a.kv_segments ? "set" : "null",
                ") must be given together");
  // The ids must also be non-decreasing along every sequence (the tile ranges come from binary
  // searches); checking that here would read them back from the device, so the caller (the layer,
  // which builds them on the host) validates them.
}

// The causal offset as the kernels take it: relative to the default kv_len - q_len (see the
// forward kernel), after clamping to [-q_len, kv_len], which sees the same keys (nothing / every
// key) and keeps the kernels' 64-bit index arithmetic far from overflow for any offset.
inline std::int64_t kernel_causal_offset(const AttentionArgs& a) {
  return std::clamp(a.offset(), -a.q_len, a.kv_len) - (a.kv_len - a.q_len);
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

}  // namespace attention_detail

}  // namespace trellis::kernels::cuda
