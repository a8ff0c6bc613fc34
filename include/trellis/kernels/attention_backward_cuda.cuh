// The CUDA flash attention backward (nvcc): its kernels (row terms D, dK/dV with dQ accumulated
// in an fp32 workspace, dQ conversion), launcher, workspace size and cuda::attention_backward
// (part of kernels/attention_cuda.cuh, whose leading comment describes the algorithm).
#pragma once

#include <cuda_runtime_api.h>

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

// Backward: K, V, two stages of (Q, dO), dS^T, and two stages of (lse, delta) rows.
template <int D>
constexpr std::size_t backward_smem_bytes() {
  return 6 * std::size_t{kBlockRows} * (D + kPad) * sizeof(std::uint16_t) +
         std::size_t{kBlockRows} * (kBlockCols + kPad) * sizeof(std::uint16_t) + 4 * kBlockCols * sizeof(float);
}

// ---- kernels -----------------------------------------------------------------------------------

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
// Segmented (q_segments / kv_segments set): the block visits only the query tiles between the
// documents of its first and last key (two block-wide binary searches), and compares ids element
// by element only in tiles that straddle a document boundary; a separate instantiation.
template <class T, int D, bool Causal, bool Segmented>
__global__ void __launch_bounds__(kThreads) attention_backward_kernel(
    const std::uint16_t* __restrict__ q, const std::uint16_t* __restrict__ k, const std::uint16_t* __restrict__ v,
    const std::uint16_t* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ delta,
    float* __restrict__ dq_accum, std::uint16_t* __restrict__ dk, std::uint16_t* __restrict__ dv,
    const std::int32_t* __restrict__ q_segments, const std::int32_t* __restrict__ kv_segments, int heads,
    int group_size, std::int64_t q_len, std::int64_t kv_len, std::int64_t offset_from_bottom_right, float scale,
    bool accumulate) {
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
  // Query i sees keys j <= i + causal_offset; passed relative to kv_len - q_len, as in the forward.
  const std::int64_t causal_offset = kv_len - q_len + offset_from_bottom_right;

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
  int first_query_block = 0, last_query_block = query_blocks;  // [first, last) meet this key block
  if (Causal) {  // the first query that sees key0 is key0 - offset
    std::int64_t first_query = key0 - causal_offset;
    first_query_block = first_query <= 0 ? 0 : static_cast<int>(min(static_cast<std::int64_t>(query_blocks), first_query / kBlockCols));
  }
  // The keys' and rows' segment ids (Segmented only), and the id shared by all of this block's
  // keys; block_one_segment is false when they span documents.
  const std::int32_t* key_ids = Segmented ? kv_segments + static_cast<std::int64_t>(batch) * kv_len : nullptr;
  const std::int32_t* row_ids = Segmented ? q_segments + static_cast<std::int64_t>(batch) * q_len : nullptr;
  std::int32_t block_id = 0, my_key_id[2] = {0, 0};
  bool block_one_segment = false;
  if constexpr (Segmented) {  // rows whose ids lie between the first and last key's
    const std::int64_t key_last = min(key0 + kBlockRows, kv_len) - 1;
    const std::int32_t first_id = key_ids[key0], last_id = key_ids[key_last];
    block_id = first_id;
    block_one_segment = first_id == last_id;
    my_key_id[0] = key_ids[min(my_key[0], key_last)];
    my_key_id[1] = key_ids[min(my_key[1], key_last)];
    const std::int64_t begin = block_search<false>(row_ids, q_len, first_id);
    const std::int64_t end = block_search<true>(row_ids, q_len, last_id);
    first_query_block = max(first_query_block, static_cast<int>(begin / kBlockCols));
    last_query_block = static_cast<int>((end + kBlockCols - 1) / kBlockCols);
  }

  // Work items: every query block this key block meets, for every q head of the group.
  const int blocks_per_head = last_query_block - first_query_block;
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
      // P^T = exp(S^T - lse), dS^T = P^T (dP^T - D); masked entries are 0 (with segments, ids are
      // compared only when this tile of queries and keys straddles a document boundary).
      bool straddles = false;
      if constexpr (Segmented)
        straddles = !block_one_segment || row_ids[q0] != block_id || row_ids[min(q0 + kBlockCols, q_len) - 1] != block_id;
#pragma unroll
      for (int j = 0; j < kBlockCols / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          int qi = j * 8 + 2 * quad + (e & 1);
          std::int64_t query = q0 + qi;
          std::int64_t key = my_key[e / 2];
          bool valid = query < q_len && key < kv_len && (!Causal || key <= query + causal_offset);
          if (Segmented && straddles && valid) valid = row_ids[query] == my_key_id[e / 2];
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

template <class T, int D, bool Causal, bool Segmented>
void launch_backward(const AttentionArgs& a, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                     const float* delta, float* dq_accum, T* dk, T* dv, bool accumulate, cudaStream_t stream) {
  auto kernel = attention_backward_kernel<T, D, Causal, Segmented>;
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
      reinterpret_cast<std::uint16_t*>(dk), reinterpret_cast<std::uint16_t*>(dv), a.q_segments, a.kv_segments,
      static_cast<int>(a.q_heads), static_cast<int>(a.group_size()), a.q_len, a.kv_len,
      kernel_causal_offset(a), a.softmax_scale(), accumulate);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace attention_detail

// ---- launchers -----------------------------------------------------------------------------------

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
  auto launch = [&]<int D, bool Causal>() {
    args.segmented()
        ? ad::launch_backward<T, D, Causal, true>(args, q, k, v, d_o, lse, delta, dq_accum, dk, dv, accumulate, stream)
        : ad::launch_backward<T, D, Causal, false>(args, q, k, v, d_o, lse, delta, dq_accum, dk, dv, accumulate, stream);
  };
  if (args.head_dim == 64) {
    args.causal ? launch.template operator()<64, true>() : launch.template operator()<64, false>();
  } else {
    args.causal ? launch.template operator()<128, true>() : launch.template operator()<128, false>();
  }
  ad::attention_convert_kernel<T>
      <<<1024, 256, 0, stream>>>(dq_accum, reinterpret_cast<std::uint16_t*>(dq), dq_count, accumulate);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}
#else
extern template void attention_backward<bfloat16>(const AttentionArgs&, const bfloat16*, const bfloat16*,
                                                  const bfloat16*, const bfloat16*, const bfloat16*, const float*,
                                                  bfloat16*, bfloat16*, bfloat16*, void*, std::size_t, cudaStream_t,
                                                  bool);
extern template void attention_backward<half>(const AttentionArgs&, const half*, const half*, const half*,
                                              const half*, const half*, const float*, half*, half*, half*, void*,
                                              std::size_t, cudaStream_t, bool);
#endif

}  // namespace trellis::kernels::cuda
