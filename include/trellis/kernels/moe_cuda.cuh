// CUDA kernels of the Mixture-of-Experts routing contract (kernels/moe.hpp), the same results as
// the host kernels in kernels/moe_host.hpp (same top-k tie rule, same stable order by expert, same
// capacity rule, same slot numbering). Device pointers, ordered on `stream`:
//   cuda::moe_route_forward(args, logits, probs, lse, expert, gate, routed, prob_sums, stream);
//   cuda::moe_dispatch_plan(rows, topk, experts, capacity, expert, slot, source_row, kept,
//                           workspace, workspace_bytes, stream);
//       workspace: moe_dispatch_plan_workspace_bytes(rows, topk, experts) (CUB's size queries
//       plus the sort's buffers; ask at set-up, as every CUB-style query)
//   cuda::gather_rows(rows, cols, src, index, dst, stream);
//   cuda::moe_combine(rows, topk, cols, y, slot, gate, out, accumulate, stream);
//   cuda::moe_combine_backward(rows, topk, cols, dout, y, slot, gate, dgate, dy, stream);
//   cuda::moe_route_backward(args, probs, lse, expert, gate, dgate, aux_grad, z_grad, dlogits, stream);
//   cuda::gemm_without_product(args, c, ep, stream);    C = epilogue(beta C): a GEMM with k = 0
//
// moe_route_forward: one warp per row (fp32 softmax, lse, top-k by k rounds of a warp arg-max
// whose ties go to the lower expert index, as the host's insertion; the normalisation sums the
// chosen gates in choice order like the host). routed[e] counts with integer atomics (exact);
// prob_sums[e] adds each block's shared-memory partial sums with float atomics, so its summation
// order is not fixed on CUDA (not bitwise reproducible): it feeds only the reported
// load-balancing loss value, never a gradient (the gradient uses `routed`, which is exact).
// moe_dispatch_plan: the sort by expert, the counts and the offsets are CUB primitives:
//   keys = expert ids (an id outside [0, experts) becomes `experts`: sorted last, dropped, since a
//   device kernel cannot raise the host's error), values = assignment index a;
//   cub::DeviceRadixSort::SortPairs (stable: within an expert the order is by a, i.e. token order)
//   -> cub::DeviceHistogram::HistogramEven (count per expert) -> cub::DeviceScan::ExclusiveSum
//   (offsets) -> one small kernel for the capacity (kept[e] = min(count, capacity)) ->
//   ExclusiveSum of kept (kept offsets) -> one kernel writing slot[a] and source_row[s].
// gather_rows, moe_combine (fp32 accumulation, one rounding), moe_combine_backward (dgate an fp32
// dot per (row, choice), a block reduction: summation order differs from the host's sequential
// one) and moe_route_backward (one warp per row) are direct kernels.
// gemm_without_product: what a grouped GEMM needs for a group with k = 0 (an expert that received
// no rows), which cuBLASLt refuses: C = epilogue(beta C), bias gradients included (one thread per
// column, rows in order).
#pragma once

#include <cub/device/device_histogram.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <cuda_runtime_api.h>

#include <bit>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/cuda_common.cuh"
#include "trellis/kernels/epilogue.hpp"
#include "trellis/kernels/moe.hpp"
#include "trellis/kernels/moe_host.hpp"

namespace trellis::kernels::cuda {

// Largest top-k the routing kernels take (k <= 2 in practice) and largest expert count (the
// forward's per-block shared-memory sums: experts * 8 bytes).
inline constexpr int kMoeMaxTopk = 8;
inline constexpr std::int64_t kMoeMaxExperts = 6144;
inline constexpr int kMoeThreads = 256;  // 8 warps: 8 rows at a time in the per-row-warp kernels

namespace device {

// (value, index) arg-max step: the larger value wins, equal values go to the lower index; an
// index < 0 is "none yet".
__device__ __forceinline__ void moe_better(float& best, int& best_i, float v, int i) {
  if (i < 0) return;
  if (best_i < 0 || v > best || (v == best && i < best_i)) {
    best = v;
    best_i = i;
  }
}

// Kernels are templates (here on the block size or the index type) so that a header included by
// several translation units of one program defines each of them once.

// One warp per row (grid-stride over rows); shared memory: experts floats (probability sums) and
// experts ints (routed counts), flushed to global memory with one atomic per expert per block.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    moe_route_forward_kernel(MoeRouteArgs a, const float* __restrict__ logits, float* __restrict__ probs,
                             float* __restrict__ lse, std::int32_t* __restrict__ expert, float* __restrict__ gate,
                             std::int32_t* __restrict__ routed, float* __restrict__ prob_sums) {
  extern __shared__ float moe_shared[];
  const std::int64_t E = a.experts;
  const int k = a.topk;
  float* psum = moe_shared;
  int* rcount = reinterpret_cast<int*>(moe_shared + E);
  for (std::int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    psum[e] = 0.0f;
    rcount[e] = 0;
  }
  __syncthreads();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * warps + warp; r < a.rows;
       r += static_cast<std::int64_t>(gridDim.x) * warps) {
    const float* z = logits + r * E;
    float* p = probs + r * E;
    float mx = -INFINITY;
    for (std::int64_t e = lane; e < E; e += 32) mx = fmaxf(mx, z[e]);
    mx = warp_max(mx);
    float s = 0.0f;
    for (std::int64_t e = lane; e < E; e += 32) {
      const float v = expf(z[e] - mx);
      p[e] = v;
      s += v;
    }
    s = warp_sum(s);
    const float inv = 1.0f / s;
    for (std::int64_t e = lane; e < E; e += 32) {
      const float v = p[e] * inv;  // each lane re-reads only what it wrote
      p[e] = v;
      atomicAdd(&psum[e], v);
    }
    if (lane == 0) lse[r] = mx + logf(s);
    // top-k: k rounds of a warp arg-max over the experts not chosen yet.
    int chosen[kMoeMaxTopk];
    float g[kMoeMaxTopk];
#pragma unroll
    for (int j = 0; j < kMoeMaxTopk; ++j) {
      chosen[j] = -1;
      g[j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kMoeMaxTopk; ++j) {
      if (j >= k) break;
      float best = -INFINITY;
      int best_i = -1;
      for (std::int64_t e = lane; e < E; e += 32) {
        bool taken = false;
#pragma unroll
        for (int q = 0; q < kMoeMaxTopk; ++q) taken |= (q < j && chosen[q] == static_cast<int>(e));
        if (!taken) moe_better(best, best_i, p[e], static_cast<int>(e));
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, offset);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, offset);
        moe_better(best, best_i, ob, oi);
      }
      chosen[j] = best_i;
      g[j] = best;
    }
    if (a.normalize) {  // the chosen gates summed in choice order, as on the host
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kMoeMaxTopk; ++j)
        if (j < k) sum += g[j];
#pragma unroll
      for (int j = 0; j < kMoeMaxTopk; ++j)
        if (j < k) g[j] /= sum;
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < kMoeMaxTopk; ++j) {
        if (j >= k) break;
        expert[r * k + j] = chosen[j];
        gate[r * k + j] = g[j];
        atomicAdd(&rcount[chosen[j]], 1);
      }
    }
  }
  __syncthreads();
  for (std::int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    if (psum[e] != 0.0f) atomicAdd(&prob_sums[e], psum[e]);
    if (rcount[e] != 0) atomicAdd(&routed[e], rcount[e]);
  }
}

// keys[a] = expert id (outside [0, experts): experts, sorted last), values[a] = a.
template <class I>
__global__ void moe_plan_keys_kernel(std::int64_t n, I experts, const I* __restrict__ expert, I* __restrict__ keys,
                                     I* __restrict__ values) {
  for (std::int64_t a = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; a < n;
       a += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const I e = expert[a];
    keys[a] = (e >= 0 && e < experts) ? e : experts;
    values[a] = static_cast<I>(a);
  }
}

// kept[e] = min(count[e], capacity) (capacity < 0: all).
template <class I>
__global__ void moe_plan_capacity_kernel(I experts, std::int64_t capacity, const I* __restrict__ count,
                                         I* __restrict__ kept) {
  const std::int64_t e = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  const std::int64_t c = count[e];
  kept[e] = static_cast<I>((capacity < 0 || c < capacity) ? c : capacity);
}

// Sorted position i holds assignment a of expert e: it is the (i - offset[e])-th of e, kept when
// that is below kept[e], at slot kept_offset[e] + (i - offset[e]).
template <class I>
__global__ void moe_plan_slots_kernel(std::int64_t n, int topk, I experts, const I* __restrict__ sorted_expert,
                                      const I* __restrict__ sorted_a, const I* __restrict__ offset,
                                      const I* __restrict__ kept, const I* __restrict__ kept_offset,
                                      I* __restrict__ slot, I* __restrict__ source_row) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const I e = sorted_expert[i], a = sorted_a[i];
    if (e >= experts) {
      slot[a] = -1;
      continue;
    }
    const std::int64_t pos = i - offset[e];
    if (pos < kept[e]) {
      const std::int64_t s = kept_offset[e] + pos;
      slot[a] = static_cast<I>(s);
      source_row[s] = a / topk;
    } else {
      slot[a] = -1;
    }
  }
}

// One block per row.
template <class T>
__global__ void gather_rows_kernel(std::int64_t cols, const T* __restrict__ src, const std::int32_t* __restrict__ index,
                                   T* __restrict__ dst) {
  const std::int64_t i = blockIdx.x;
  const T* s = src + static_cast<std::int64_t>(index[i]) * cols;
  T* d = dst + i * cols;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) d[c] = s[c];
}

// One block per row: out[r] (+)= sum_j gate * y[slot], fp32, one rounding.
template <class T>
__global__ void moe_combine_kernel(int topk, std::int64_t cols, const T* __restrict__ y,
                                   const std::int32_t* __restrict__ slot, const float* __restrict__ gate,
                                   T* __restrict__ out, bool accumulate) {
  const std::int64_t r = blockIdx.x;
  const std::int32_t* sl = slot + r * topk;
  T* o = out + r * cols;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    float acc = accumulate ? to_float(o[c]) : 0.0f;
    for (int j = 0; j < topk; ++j) {
      const std::int32_t s = sl[j];
      if (s < 0) continue;
      const float g = gate ? gate[r * topk + j] : 1.0f;
      acc += g * to_float(y[static_cast<std::int64_t>(s) * cols + c]);
    }
    o[c] = from_float<T>(acc);
  }
}

// One block per row: for each kept choice, dy[slot] = gate * dout[r] and dgate = <dout[r], y[slot]>.
template <class T>
__global__ void moe_combine_backward_kernel(int topk, std::int64_t cols, const T* __restrict__ dout,
                                            const T* __restrict__ y, const std::int32_t* __restrict__ slot,
                                            const float* __restrict__ gate, float* __restrict__ dgate,
                                            T* __restrict__ dy) {
  __shared__ float scratch[32];
  const std::int64_t r = blockIdx.x;
  const T* d = dout + r * cols;
  for (int j = 0; j < topk; ++j) {
    const std::int64_t a = r * topk + j;
    const std::int32_t s = slot[a];  // the same for the whole block
    if (s < 0) {
      if (threadIdx.x == 0) dgate[a] = 0.0f;
      continue;
    }
    const T* yr = y + static_cast<std::int64_t>(s) * cols;
    T* dyr = dy + static_cast<std::int64_t>(s) * cols;
    const float g = gate[a];
    float dot = 0.0f;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
      const float dv = to_float(d[c]);
      dot += dv * to_float(yr[c]);
      dyr[c] = from_float<T>(g * dv);
    }
    dot = block_sum(dot, scratch);
    if (threadIdx.x == 0) dgate[a] = dot;
  }
}

// One warp per row (grid-stride): dlogits = p (dp - <dp, p>) + z_grad lse p, dp as on the host.
template <int Threads>
__global__ void __launch_bounds__(Threads)
    moe_route_backward_kernel(MoeRouteArgs a, const float* __restrict__ probs, const float* __restrict__ lse,
                              const std::int32_t* __restrict__ expert, const float* __restrict__ gate,
                              const float* __restrict__ dgate, const float* __restrict__ aux_grad, float z_grad,
                              float* __restrict__ dlogits) {
  const std::int64_t E = a.experts;
  const int k = a.topk;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * warps + warp; r < a.rows;
       r += static_cast<std::int64_t>(gridDim.x) * warps) {
    const float* p = probs + r * E;
    float* dz = dlogits + r * E;
    const std::int32_t* ex = expert + r * k;
    const float* g = gate + r * k;
    const float* dg = dgate + r * k;
    // The row's scalars, on every lane in the host's order.
    float gdot = 0.0f, chosen_sum = 0.0f;
    if (a.normalize) {
      for (int j = 0; j < k; ++j) {
        gdot += dg[j] * g[j];
        chosen_sum += p[ex[j]];
      }
    }
    float part = 0.0f;
    for (std::int64_t e = lane; e < E; e += 32) {
      float v = aux_grad ? aux_grad[e] : 0.0f;
      for (int j = 0; j < k; ++j)
        if (ex[j] == e) v += a.normalize ? (dg[j] - gdot) / chosen_sum : dg[j];
      dz[e] = v;
      part += v * p[e];
    }
    const float dot = warp_sum(part);
    const float zl = z_grad * lse[r];
    for (std::int64_t e = lane; e < E; e += 32) {
      const float pe = p[e];
      dz[e] = pe * (dz[e] - dot) + zl * pe;
    }
  }
}

// C = epilogue(beta C) for a GEMM with k = 0, one thread per column of C, rows in order (the bias
// gradient sums the written values in fp32 in row order).
template <EpilogueKind K, class TC>
__global__ void gemm_without_product_kernel(GemmArgs args, TC* __restrict__ c, const TC* __restrict__ bias,
                                            TC* __restrict__ pre, std::int64_t ld_pre, TC* __restrict__ bias_grad,
                                            bool accumulate) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= args.n) return;
  const std::int64_t ldc = args.ldc_or_packed();
  const float b = bias ? to_float(bias[j]) : 0.0f;
  float sum = 0.0f;
  for (std::int64_t i = 0; i < args.m; ++i) {
    TC* ci = c + args.offset(i, j, ldc);
    const float acc = args.beta == 0.0f ? 0.0f : args.beta * to_float(*ci);  // beta == 0: C is not read
    float pre_value = 0.0f;
    if constexpr (K == EpilogueKind::dgelu || K == EpilogueKind::dgelu_bias_grad) {
      pre_value = to_float(pre[args.offset(i, j, ld_pre)]);
    } else if constexpr (K == EpilogueKind::bias_gelu) {
      if (pre) pre[args.offset(i, j, ld_pre)] = from_float<TC>(acc + b);
    }
    const float v = epilogue_apply<K>(acc, b, pre_value);
    *ci = from_float<TC>(v);
    sum += v;
  }
  if (bias_grad) bias_grad[j] = from_float<TC>(accumulate ? to_float(bias_grad[j]) + sum : sum);
}

}  // namespace device

namespace detail {

inline std::size_t moe_align(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// Radix sort bits for keys in [0, experts] (experts itself: an invalid id).
inline int moe_key_bits(std::int64_t experts) {
  return static_cast<int>(std::bit_width(static_cast<std::uint64_t>(experts)));
}

inline void check_moe_plan_args(std::int64_t rows, int topk, std::int64_t experts) {
  TRELLIS_CHECK(rows >= 0 && topk >= 1 && experts >= 1, "moe dispatch: rows ", rows, ", top-", topk, ", experts ",
                experts);
  TRELLIS_CHECK(rows * topk <= INT32_MAX && experts < INT32_MAX, "moe dispatch (CUDA): ", rows * topk,
                " assignments or ", experts, " experts exceed int32 indices");
}

// The largest temporary storage CUB asks for among the plan's sort, histogram and scans.
inline std::size_t moe_plan_cub_bytes(std::int64_t n, std::int64_t experts) {
  const int items = static_cast<int>(n), E = static_cast<int>(experts);
  std::size_t sort = 0, hist = 0, scan = 0;
  TRELLIS_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, sort, static_cast<const std::int32_t*>(nullptr),
                                                     static_cast<std::int32_t*>(nullptr),
                                                     static_cast<const std::int32_t*>(nullptr),
                                                     static_cast<std::int32_t*>(nullptr), items, 0,
                                                     moe_key_bits(experts)));
  TRELLIS_CHECK_CUDA(cub::DeviceHistogram::HistogramEven(nullptr, hist, static_cast<const std::int32_t*>(nullptr),
                                                         static_cast<int*>(nullptr), E + 1, 0, E, items));
  TRELLIS_CHECK_CUDA(cub::DeviceScan::ExclusiveSum(nullptr, scan, static_cast<const std::int32_t*>(nullptr),
                                                   static_cast<std::int32_t*>(nullptr), E));
  std::size_t bytes = sort > hist ? sort : hist;
  return bytes > scan ? bytes : scan;
}

// Where the plan's buffers lie in its workspace (each 256-byte aligned): sort keys and values in
// and out (n each), counts, offsets and kept offsets (experts each), then CUB's temporary storage.
struct MoePlanWorkspace {
  std::size_t keys_in = 0, keys_out = 0, values_in = 0, values_out = 0, count = 0, offset = 0, kept_offset = 0,
              temp = 0, temp_bytes = 0, total = 0;
  MoePlanWorkspace(std::int64_t n, std::int64_t experts, std::size_t cub_bytes) {
    const std::size_t per_n = moe_align(static_cast<std::size_t>(n) * sizeof(std::int32_t));
    const std::size_t per_e = moe_align(static_cast<std::size_t>(experts) * sizeof(std::int32_t));
    keys_out = keys_in + per_n;
    values_in = keys_out + per_n;
    values_out = values_in + per_n;
    count = values_out + per_n;
    offset = count + per_e;
    kept_offset = offset + per_e;
    temp = kept_offset + per_e;
    temp_bytes = moe_align(cub_bytes);
    total = temp + temp_bytes;
  }
};

inline unsigned moe_row_warps_grid(std::int64_t rows) {
  return grid_for(rows, kMoeThreads / 32, 4096);
}

inline void check_moe_rows(std::int64_t rows, int topk, std::int64_t cols, const char* what) {
  TRELLIS_CHECK(rows >= 0 && topk >= 1 && cols >= 0, what, ": rows ", rows, ", top-", topk, ", cols ", cols);
  TRELLIS_CHECK(rows <= INT32_MAX, what, " (CUDA): ", rows, " rows exceed one launch");
}

}  // namespace detail

// Bytes of workspace moe_dispatch_plan needs (CUB's size queries: asks the current device).
inline std::size_t moe_dispatch_plan_workspace_bytes(std::int64_t rows, int topk, std::int64_t experts) {
  detail::check_moe_plan_args(rows, topk, experts);
  const std::int64_t n = rows * topk;
  if (n == 0) return 0;
  return detail::MoePlanWorkspace(n, experts, detail::moe_plan_cub_bytes(n, experts)).total;
}

inline void moe_route_forward(const MoeRouteArgs& a, const float* logits, float* probs, float* lse,
                              std::int32_t* expert, float* gate, std::int32_t* routed, float* prob_sums,
                              cudaStream_t stream) {
  host::check_route_args(a);
  TRELLIS_CHECK(a.topk <= kMoeMaxTopk && a.experts <= kMoeMaxExperts, "moe_route_forward (CUDA): top-", a.topk,
                " of ", a.experts, " experts (at most top-", kMoeMaxTopk, " of ", kMoeMaxExperts, ")");
  TRELLIS_CHECK_CUDA(cudaMemsetAsync(routed, 0, static_cast<std::size_t>(a.experts) * sizeof(std::int32_t), stream));
  TRELLIS_CHECK_CUDA(cudaMemsetAsync(prob_sums, 0, static_cast<std::size_t>(a.experts) * sizeof(float), stream));
  if (a.rows == 0) return;
  const std::size_t shared = static_cast<std::size_t>(a.experts) * (sizeof(float) + sizeof(int));
  device::moe_route_forward_kernel<kMoeThreads><<<detail::moe_row_warps_grid(a.rows), kMoeThreads, shared, stream>>>(
      a, logits, probs, lse, expert, gate, routed, prob_sums);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

inline void moe_dispatch_plan(std::int64_t rows, int topk, std::int64_t experts, std::int64_t capacity,
                              const std::int32_t* expert, std::int32_t* slot, std::int32_t* source_row,
                              std::int32_t* kept, void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  detail::check_moe_plan_args(rows, topk, experts);
  const std::int64_t n = rows * topk;
  const int E = static_cast<int>(experts);
  if (n == 0) {
    TRELLIS_CHECK_CUDA(cudaMemsetAsync(kept, 0, static_cast<std::size_t>(experts) * sizeof(std::int32_t), stream));
    return;
  }
  const detail::MoePlanWorkspace w(n, experts, detail::moe_plan_cub_bytes(n, experts));
  TRELLIS_CHECK(workspace != nullptr && workspace_bytes >= w.total, "moe_dispatch_plan: workspace of ",
                workspace_bytes, " bytes, needs ", w.total, " (moe_dispatch_plan_workspace_bytes)");
  auto* base = static_cast<std::byte*>(workspace);
  auto at = [base](std::size_t offset) { return reinterpret_cast<std::int32_t*>(base + offset); };
  std::int32_t *keys_in = at(w.keys_in), *keys_out = at(w.keys_out), *values_in = at(w.values_in),
               *values_out = at(w.values_out), *count = at(w.count), *offset = at(w.offset),
               *kept_offset = at(w.kept_offset);
  void* temp = base + w.temp;
  const int items = static_cast<int>(n);

  device::moe_plan_keys_kernel<std::int32_t><<<detail::grid_for(n, 256, 4096), 256, 0, stream>>>(n, E, expert, keys_in, values_in);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
  std::size_t bytes = w.temp_bytes;
  TRELLIS_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(temp, bytes, keys_in, keys_out, values_in, values_out, items, 0,
                                                     detail::moe_key_bits(experts), stream));
  bytes = w.temp_bytes;
  TRELLIS_CHECK_CUDA(cub::DeviceHistogram::HistogramEven(temp, bytes, static_cast<const std::int32_t*>(keys_in), count,
                                                         E + 1, 0, E, items, stream));
  bytes = w.temp_bytes;
  TRELLIS_CHECK_CUDA(cub::DeviceScan::ExclusiveSum(temp, bytes, count, offset, E, stream));
  device::moe_plan_capacity_kernel<std::int32_t><<<detail::grid_for(experts, 256), 256, 0, stream>>>(E, capacity, count, kept);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
  bytes = w.temp_bytes;
  TRELLIS_CHECK_CUDA(cub::DeviceScan::ExclusiveSum(temp, bytes, kept, kept_offset, E, stream));
  device::moe_plan_slots_kernel<std::int32_t><<<detail::grid_for(n, 256, 4096), 256, 0, stream>>>(
      n, topk, E, keys_out, values_out, offset, kept, kept_offset, slot, source_row);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T>
void gather_rows(std::int64_t rows, std::int64_t cols, const T* src, const std::int32_t* index, T* dst,
                 cudaStream_t stream) {
  detail::check_moe_rows(rows, 1, cols, "gather_rows");
  if (rows == 0 || cols == 0) return;
  device::gather_rows_kernel<<<static_cast<unsigned>(rows), kMoeThreads, 0, stream>>>(cols, src, index, dst);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T>
void moe_combine(std::int64_t rows, int topk, std::int64_t cols, const T* y, const std::int32_t* slot,
                 const float* gate, T* out, bool accumulate, cudaStream_t stream) {
  detail::check_moe_rows(rows, topk, cols, "moe_combine");
  if (rows == 0 || cols == 0) return;
  device::moe_combine_kernel<<<static_cast<unsigned>(rows), kMoeThreads, 0, stream>>>(topk, cols, y, slot, gate, out,
                                                                                      accumulate);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T>
void moe_combine_backward(std::int64_t rows, int topk, std::int64_t cols, const T* dout, const T* y,
                          const std::int32_t* slot, const float* gate, float* dgate, T* dy, cudaStream_t stream) {
  detail::check_moe_rows(rows, topk, cols, "moe_combine_backward");
  if (rows == 0) return;
  device::moe_combine_backward_kernel<<<static_cast<unsigned>(rows), kMoeThreads, 0, stream>>>(topk, cols, dout, y,
                                                                                               slot, gate, dgate, dy);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

inline void moe_route_backward(const MoeRouteArgs& a, const float* probs, const float* lse, const std::int32_t* expert,
                               const float* gate, const float* dgate, const float* aux_grad, float z_grad,
                               float* dlogits, cudaStream_t stream) {
  host::check_route_args(a);
  if (a.rows == 0) return;
  device::moe_route_backward_kernel<kMoeThreads><<<detail::moe_row_warps_grid(a.rows), kMoeThreads, 0, stream>>>(
      a, probs, lse, expert, gate, dgate, aux_grad, z_grad, dlogits);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

// C = epilogue(beta C): the host GEMM's contract at k = 0 (alpha op(A) op(B) is an empty sum),
// which cuBLASLt refuses; grouped GEMMs pass it for such groups (kernels::cuda::grouped_gemm's
// zero_k). One GEMM (batch 1); vectors and the pre-activation have C's type, as on the cuBLASLt
// path. An empty C only zeroes an overwritten bias gradient.
template <class TC, class E>
  requires GemmEpilogue<E>
void gemm_without_product(const GemmArgs& args, TC* c, const E& ep, cudaStream_t stream) {
  using traits = epilogue_traits<E>;
  TRELLIS_CHECK(args.batch == 1 && args.m >= 0 && args.n >= 0, "gemm_without_product: batch ", args.batch, ", m ",
                args.m, ", n ", args.n);
  const TC* bias = nullptr;
  TC* pre = nullptr;
  TC* bias_grad = nullptr;
  bool accumulate = false;
  if constexpr (traits::has_bias) {
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(*ep.bias)>, TC>, "bias must have C's type");
    bias = ep.bias;
    TRELLIS_CHECK(bias != nullptr, "gemm_without_product: bias epilogue without a bias vector");
  }
  std::int64_t ld_pre = 0;
  if constexpr (traits::reads_pre || traits::writes_pre) {
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(*ep.pre_activation)>, TC>,
                  "pre-activation must have C's type");
    pre = const_cast<TC*>(ep.pre_activation);  // read only by DGelu epilogues
    if constexpr (traits::reads_pre) TRELLIS_CHECK(pre != nullptr, "gemm_without_product: DGelu without pre_activation");
    ld_pre = ep.ld_pre ? ep.ld_pre : args.ldc_or_packed();
  }
  if constexpr (traits::bias_grad) {
    static_assert(std::is_same_v<std::remove_cvref_t<decltype(*ep.bias_grad)>, TC>, "bias_grad must have C's type");
    bias_grad = ep.bias_grad;
    accumulate = ep.accumulate;
    TRELLIS_CHECK(bias_grad != nullptr, "gemm_without_product: bias-grad epilogue without a bias_grad vector");
  }
  if (args.m == 0 || args.n == 0) {
    if (bias_grad && !accumulate && args.n > 0)
      TRELLIS_CHECK_CUDA(cudaMemsetAsync(bias_grad, 0, static_cast<std::size_t>(args.n) * sizeof(TC), stream));
    return;
  }
  TRELLIS_CHECK(c != nullptr, "gemm_without_product: C is null");
  TRELLIS_CHECK(args.ldc_or_packed() >= args.packed_ld(args.m, args.n), "gemm_without_product: ldc ", args.ldc,
                " too small");
  device::gemm_without_product_kernel<traits::kind, TC><<<detail::grid_for(args.n, 128), 128, 0, stream>>>(
      args, c, bias, pre, ld_pre, bias_grad, accumulate);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

}  // namespace trellis::kernels::cuda
