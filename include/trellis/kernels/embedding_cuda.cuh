// CUDA token + position embedding, same contracts as kernels/embedding_host.hpp (EmbeddingArgs):
//   cuda::embedding_forward(args, tokens, wte, wpe, out, stream);    out[b, t] = wte[token] + wpe[t]
//   cuda::embedding_backward(args, tokens, dout, dwte, dwpe, stream); gradients ADDED to
// tokens: int32 [batch, seq] on the device. Sharded (vocab-parallel): tokens outside this rank's
// rows contribute zeros / are skipped. Unsharded, tokens are not range-checked on the device (the
// host kernel checks them): an out-of-range token is skipped like a foreign one.
// The backward scatter-add is deterministic: each thread owns one channel and walks the tokens in
// order (repeated tokens summed in token order), as on the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/cuda_common.cuh"
#include "trellis/kernels/embedding_host.hpp"

namespace trellis::kernels::cuda {

namespace device {
// grid (batch * seq, ceil(dim / 256))
template <class T, class W>
__global__ void embedding_forward_kernel(EmbeddingArgs a, const std::int32_t* __restrict__ tokens,
                                         const W* __restrict__ wte, const W* __restrict__ wpe, T* __restrict__ out) {
  const std::int64_t i = blockIdx.x;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (j >= a.dim) return;
  const std::int64_t row = tokens[i] - a.vocab_start;
  float v = (row >= 0 && row < a.vocab_rows) ? to_float(wte[row * a.dim + j]) : 0.0f;
  if (wpe) v += to_float(wpe[(i % a.seq) * a.dim + j]);
  out[i * a.dim + j] = from_float<T>(v);
}

// One thread per channel, tokens in order.
template <class T, class W>
__global__ void embedding_backward_wte_kernel(EmbeddingArgs a, const std::int32_t* __restrict__ tokens,
                                              const T* __restrict__ dout, W* __restrict__ dwte) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= a.dim) return;
  const std::int64_t n = a.batch * a.seq;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t row = tokens[i] - a.vocab_start;
    if (row < 0 || row >= a.vocab_rows) continue;
    W* g = dwte + row * a.dim + j;
    *g = from_float<W>(to_float(*g) + to_float(dout[i * a.dim + j]));
  }
}

// grid (ceil(dim / 256), seq): dwpe[t, j] += sum_b dout[b, t, j], b in order.
template <class T, class W>
__global__ void embedding_backward_wpe_kernel(EmbeddingArgs a, const T* __restrict__ dout, W* __restrict__ dwpe) {
  const std::int64_t t = blockIdx.y;
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= a.dim) return;
  float v = to_float(dwpe[t * a.dim + j]);
  for (std::int64_t b = 0; b < a.batch; ++b) v += to_float(dout[(b * a.seq + t) * a.dim + j]);
  dwpe[t * a.dim + j] = from_float<W>(v);
}
}  // namespace device

namespace detail {
inline void check_embedding_cuda(const EmbeddingArgs& a, const void* tokens, const void* wpe) {
  TRELLIS_CHECK(a.batch >= 0 && a.seq >= 0 && a.dim > 0 && a.vocab_rows > 0, "embedding: bad shape batch=", a.batch,
                " seq=", a.seq, " dim=", a.dim, " vocab_rows=", a.vocab_rows);
  TRELLIS_CHECK(!wpe || a.positions >= a.seq, "embedding: ", a.positions, " positions for a sequence of ", a.seq);
  TRELLIS_CHECK(a.batch * a.seq == 0 || tokens, "embedding: null tokens");
  TRELLIS_CHECK(a.batch * a.seq <= 0x7fffffffLL && a.seq <= 65535 && a.dim <= 65535LL * 256,
                "embedding (CUDA): batch*seq ", a.batch * a.seq, ", seq ", a.seq, " or dim ", a.dim,
                " too large for one launch");
}
}  // namespace detail

template <class T, class W>
void embedding_forward(const EmbeddingArgs& args, const std::int32_t* tokens, const W* wte, const W* wpe, T* out,
                       cudaStream_t stream) {
  detail::check_embedding_cuda(args, tokens, wpe);
  const std::int64_t n = args.batch * args.seq;
  if (n == 0) return;
  device::embedding_forward_kernel<<<dim3(static_cast<unsigned>(n), static_cast<unsigned>((args.dim + 255) / 256)), 256,
                                     0, stream>>>(args, tokens, wte, wpe, out);
  TRELLIS_CHECK_CUDA(cudaGetLastError());
}

template <class T, class W>
void embedding_backward(const EmbeddingArgs& args, const std::int32_t* tokens, const T* dout, W* dwte, W* dwpe,
                        cudaStream_t stream) {
  detail::check_embedding_cuda(args, tokens, dwpe);
  if (args.batch * args.seq == 0) return;
  const unsigned blocks = static_cast<unsigned>((args.dim + 127) / 128);
  if (dwte) {
    device::embedding_backward_wte_kernel<<<blocks, 128, 0, stream>>>(args, tokens, dout, dwte);
    TRELLIS_CHECK_CUDA(cudaGetLastError());
  }
  if (dwpe) {
    device::embedding_backward_wpe_kernel<<<dim3(static_cast<unsigned>((args.dim + 255) / 256),
                                                 static_cast<unsigned>(args.seq)),
                                            256, 0, stream>>>(args, dout, dwpe);
    TRELLIS_CHECK_CUDA(cudaGetLastError());
  }
}

}  // namespace trellis::kernels::cuda
