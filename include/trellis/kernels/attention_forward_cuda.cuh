// The CUDA flash attention forward (nvcc): its kernel, launcher and cuda::attention_forward
// (part of kernels/attention_cuda.cuh, whose leading comment describes the algorithm).
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/attention.hpp"
#include "trellis/kernels/attention_common_cuda.cuh"

namespace trellis::kernels::cuda {

namespace attention_detail {

// Forward: Q (128 rows) plus two stages of K and V (64 rows each).
template <int D>
constexpr std::size_t forward_smem_bytes() {
  return (std::size_t{kForwardRows} + 4 * std::size_t{kForwardCols}) * (D + kPad) * sizeof(std::uint16_t);
}

// ---- kernels -----------------------------------------------------------------------------------

// grid (ceil(Tq/128), B*H), or (ceil(Tq/128) * B*H) when causal; 128 threads. Each warp owns 32
// query rows (two m-tiles of 16), so every K or V fragment read from shared memory feeds four mma
// instead of two: the ldmatrix traffic per mma halves, which is what bounds mma.sync here. Q
// fragments are re-read from shared memory per k-step (keeping them in registers beside the
// 32 x D accumulators would spill).
// Segmented (q_segments / kv_segments set): the block visits only the key tiles between the
// documents of its first and last row (two block-wide binary searches), and compares ids element
// by element only in tiles that straddle a document boundary. A separate instantiation, so the
// unsegmented kernel carries none of it.
template <class T, int D, bool Causal, bool Segmented>
__global__ void __launch_bounds__(kThreads, 2) attention_forward_kernel(
    const std::uint16_t* __restrict__ q, const std::uint16_t* __restrict__ k, const std::uint16_t* __restrict__ v,
    std::uint16_t* __restrict__ o, float* __restrict__ lse, const std::int32_t* __restrict__ q_segments,
    const std::int32_t* __restrict__ kv_segments, int heads, int group_size, std::int64_t q_len, std::int64_t kv_len,
    std::int64_t offset_from_bottom_right, float scale_log2) {
  static_assert(D % 16 == 0 && D <= 256, "head dimension must be a multiple of 16");
  using E = MmaElement<T>;
  constexpr int kLd = D + kPad;
  constexpr int kM = kForwardMTiles;  // m-tiles of 16 rows per warp
  extern __shared__ __align__(16) std::uint16_t smem[];
  std::uint16_t* q_tile = smem;  // (128, D)
  // Two stages of (K, V) tiles, (64, D) each, after Q.
  auto k_stage = [&](int stage) { return smem + (kForwardRows + (2 * stage) * kForwardCols) * kLd; };
  auto v_stage = [&](int stage) { return smem + (kForwardRows + (2 * stage + 1) * kForwardCols) * kLd; };

  // Row i sees keys j <= i + causal_offset, passed relative to the default kv_len - q_len: so
  // passed, ptxas allocates the unsegmented kernels exactly as before the offset existed (with
  // the plain offset the d = 128 causal one spilled twice as much on sm_90a; ptxas -v).
  const std::int64_t causal_offset = kv_len - q_len + offset_from_bottom_right;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, group = lane / 4, quad = lane % 4;
  const int query_blocks = static_cast<int>((q_len + kForwardRows - 1) / kForwardRows);
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

  // The rows' and keys' segment ids of this sequence (Segmented only); block_id is the first
  // row's, shared by every row of the block when block_one_segment.
  const std::int32_t* row_ids = Segmented ? q_segments + static_cast<std::int64_t>(batch) * q_len : nullptr;
  const std::int32_t* key_ids = Segmented ? kv_segments + static_cast<std::int64_t>(batch) * kv_len : nullptr;
  const std::int64_t q_row_last = min(q_row0 + kForwardRows, q_len) - 1;
  std::int32_t block_id = 0;
  bool block_one_segment = false;

  int first_block = 0, last_block = 0;  // key blocks [first_block, last_block) hold keys some row of this block sees
  {
    const int key_blocks = static_cast<int>((kv_len + kForwardCols - 1) / kForwardCols);
    last_block = key_blocks;
    if (Causal) {
      std::int64_t last_key = q_row0 + kForwardRows - 1 + causal_offset;
      last_block = last_key < 0 ? 0 : static_cast<int>(min(static_cast<std::int64_t>(key_blocks), last_key / kForwardCols + 1));
    }
    if constexpr (Segmented) {  // keys whose ids lie between the first and last row's
      const std::int32_t first_id = row_ids[q_row0], last_id = row_ids[q_row_last];
      block_id = first_id;
      block_one_segment = first_id == last_id;
      const std::int64_t begin = block_search<false>(key_ids, kv_len, first_id);
      const std::int64_t end = block_search<true>(key_ids, kv_len, last_id);
      first_block = static_cast<int>(begin / kForwardCols);
      last_block = min(last_block, static_cast<int>((end + kForwardCols - 1) / kForwardCols));
    }
  }
  if (last_block > first_block) {  // Q and the first K/V tiles in one cp.async group
    const std::int64_t key0 = static_cast<std::int64_t>(first_block) * kForwardCols;
    load_tile_async<D, kForwardRows>(q_tile, q_head, q_row0, q_len);
    load_tile_async<D, kForwardCols>(k_stage(first_block & 1), k_head, key0, kv_len);
    load_tile_async<D, kForwardCols>(v_stage(first_block & 1), v_head, key0, kv_len);
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

  for (int kb = first_block; kb < last_block; ++kb) {
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
    // Scale into the log2 domain and mask (keys past T; keys after the query when causal; keys of
    // other documents when the tile straddles a boundary: ids non-decreasing, so a tile lies in
    // one document when its first and last key have the rows' common id).
    const std::int64_t key0 = static_cast<std::int64_t>(kb) * kForwardCols;
    bool straddles = false;
    if constexpr (Segmented)
      straddles = !block_one_segment || key_ids[key0] != block_id ||
                  key_ids[min(key0 + kForwardCols, kv_len) - 1] != block_id;
    const bool needs_mask = key0 + kForwardCols > kv_len || (Causal && key0 + kForwardCols - 1 > q_row0 + causal_offset) || straddles;
    // Tile-relative bounds (small ints): key column c is valid below keys_left; causal, it is
    // visible to block row i when c <= i + diagonal.
    const int keys_left = static_cast<int>(min(kv_len - key0, static_cast<std::int64_t>(kForwardCols)));
    const std::int64_t diagonal_wide = q_row0 + causal_offset - key0;
    const int diagonal = static_cast<int>(max(min(diagonal_wide, std::int64_t{1} << 20), -(std::int64_t{1} << 20)));
    float tile_max[kM][2];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      tile_max[m][0] = tile_max[m][1] = -INFINITY;
      std::int32_t my_row_id[2] = {0, 0};  // ids of this thread's two rows of m-tile m (rows past q_len: the last)
      if (Segmented && straddles) {
#pragma unroll
        for (int r = 0; r < 2; ++r) my_row_id[r] = row_ids[min(q_row0 + thread_row + 16 * m + 8 * r, q_row_last)];
      }
#pragma unroll
      for (int j = 0; j < kForwardCols / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[m][j][e] * scale_log2;
          if (needs_mask) {
            const int column = j * 8 + 2 * quad + (e & 1);
            bool hidden = column >= keys_left || (Causal && column > thread_row + 16 * m + 8 * (e / 2) + diagonal);
            if (Segmented && straddles && !hidden) hidden = key_ids[key0 + column] != my_row_id[e / 2];
            if (hidden) x = -INFINITY;
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

template <class T, int D, bool Causal, bool Segmented>
void launch_forward(const AttentionArgs& a, const T* q, const T* k, const T* v, T* o, float* lse,
                    cudaStream_t stream) {
  auto kernel = attention_forward_kernel<T, D, Causal, Segmented>;
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
      reinterpret_cast<const std::uint16_t*>(v), reinterpret_cast<std::uint16_t*>(o), lse, a.q_segments,
      a.kv_segments, static_cast<int>(a.q_heads), static_cast<int>(a.group_size()), a.q_len, a.kv_len,
      kernel_causal_offset(a), a.softmax_scale() * kLog2e);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace attention_detail

// ---- launchers -----------------------------------------------------------------------------------

// o = softmax(scale q k^T [causal]) v and lse per row (kernels/attention.hpp). T: bfloat16 or half.
template <class T>
void attention_forward(const AttentionArgs& args, const T* q, const T* k, const T* v, T* o, float* lse,
                       cudaStream_t stream);

#if !defined(TRELLIS_ATTENTION_CUDA_EXTERN)
template <class T>
void attention_forward(const AttentionArgs& args, const T* q, const T* k, const T* v, T* o, float* lse,
                       cudaStream_t stream) {
  static_assert(std::is_same_v<T, bfloat16> || std::is_same_v<T, half>, "attention takes bfloat16 or half");
  namespace ad = attention_detail;
  ad::check_args(args);
  ad::check_aligned(q, "q"), ad::check_aligned(k, "k"), ad::check_aligned(v, "v"), ad::check_aligned(o, "o");
  TRELLIS_CHECK(lse != nullptr, "attention: lse must not be null");
  auto launch = [&]<int D, bool Causal>() {
    args.segmented() ? ad::launch_forward<T, D, Causal, true>(args, q, k, v, o, lse, stream)
                     : ad::launch_forward<T, D, Causal, false>(args, q, k, v, o, lse, stream);
  };
  if (args.head_dim == 64) {
    args.causal ? launch.template operator()<64, true>() : launch.template operator()<64, false>();
  } else {
    args.causal ? launch.template operator()<128, true>() : launch.template operator()<128, false>();
  }
}
#else
extern template void attention_forward<bfloat16>(const AttentionArgs&, const bfloat16*, const bfloat16*,
                                                 const bfloat16*, bfloat16*, float*, cudaStream_t);
extern template void attention_forward<half>(const AttentionArgs&, const half*, const half*, const half*, half*,
                                             float*, cudaStream_t);
#endif

}  // namespace trellis::kernels::cuda
