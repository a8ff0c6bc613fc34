// GPU attention benchmark: trellis' flash attention (kernels/attention_cuda.cuh) forward and
// backward TFLOP/s at head_dim 128, T = 1k..16k, causal and not, bf16, 16 heads and B*T = 16k
// tokens; side by side with the materialised peer in the same run: S = Q K^T on cuBLASLt (fp32),
// a row softmax kernel (causal mask applied there) writing P in bf16, then O = P V on cuBLASLt.
// FLOPs counted as usual for attention: 4 B H Tq Tkv d forward (the visible half when causal),
// 2.5x that backward; the peer is credited with the same useful FLOPs.
//   gpu_attention_bench [--json FILE] [--quick]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "support/cuda_device.hpp"
#include "support/report.hpp"
#include "trellis/core/check_cuda.hpp"
#include "trellis/core/cuda_buffer.hpp"
#include "trellis/kernels/attention_cuda.cuh"
#include "trellis/kernels/cuda_common.cuh"
#include "trellis/kernels/gemm_cuda.hpp"

namespace k = trellis::kernels;
using trellis::bfloat16;

namespace {

// P[row, j] = softmax_j(S[row, j]) over visible j (causal: j <= i), in bf16. One block per row.
__global__ void softmax_rows_kernel(const float* s, bfloat16* p, std::int64_t t, bool causal, float scale) {
  __shared__ float scratch[32];
  const std::int64_t row = blockIdx.x;
  const std::int64_t i = row % t;
  const std::int64_t visible = causal ? i + 1 : t;
  const float* sr = s + row * t;
  bfloat16* pr = p + row * t;
  float local = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < visible; j += blockDim.x) local = fmaxf(local, sr[j] * scale);
  local = k::cuda::device::warp_max(local);
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = local;
  __syncthreads();
  float m = -INFINITY;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) m = fmaxf(m, scratch[w]);
  float sum = 0.0f;
  for (std::int64_t j = threadIdx.x; j < visible; j += blockDim.x) sum += __expf(sr[j] * scale - m);
  sum = k::cuda::device::block_sum(sum, scratch);
  const float inv = 1.0f / sum;
  for (std::int64_t j = threadIdx.x; j < t; j += blockDim.x)
    pr[j] = k::cuda::device::from_float<bfloat16>(j < visible ? __expf(sr[j] * scale - m) * inv : 0.0f);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string json = trellis::bench::json_path(argc, argv);
  const bool quick = trellis::bench::has_flag(argc, argv, "--quick");
  const auto device = trellis::bench::first_cuda_device("gpu_attention_bench");
  if (!device) return 0;
  const cudaDeviceProp& prop = *device;
  std::printf("# gpu_attention_bench on %s: bf16, head_dim 128, 16 heads, batch*T = 16k tokens\n", prop.name);
  cudaStream_t stream;
  TRELLIS_CHECK_CUDA(cudaStreamCreate(&stream));
  k::cuda::GemmHandle gemm;
  trellis::bench::JsonReport report("gpu_attention_bench");
  std::printf("%6s %6s %4s | %9s %9s | %9s %9s | %9s %9s %8s\n", "T", "causal", "B", "fwd_ms", "fwd_TF/s", "bwd_ms",
              "bwd_TF/s", "peer_ms", "peer_TF/s", "speedup");

  std::vector<std::int64_t> lengths = {1024, 2048, 4096, 8192, 16384};
  if (quick) lengths = {1024, 4096};
  const std::int64_t heads = 16, d = 128, tokens = 16384;
  for (std::int64_t t : lengths) {
    for (bool causal : {false, true}) {
      try {  // one configuration failing (e.g. out of memory) must not lose the others
        k::AttentionArgs a;
        a.batch = std::max<std::int64_t>(1, tokens / t), a.q_heads = heads, a.kv_heads = heads;
        a.q_len = a.kv_len = t, a.head_dim = d, a.causal = causal;
        const std::size_t n = static_cast<std::size_t>(a.q_elements());
        trellis::Buffer<bfloat16, trellis::Cuda> q(n, stream), kk(n, stream), v(n, stream), o(n, stream),
            d_o(n, stream), dq(n, stream), dk(n, stream), dv(n, stream);
        trellis::Buffer<float, trellis::Cuda> lse(static_cast<std::size_t>(a.lse_elements()), stream);
        const std::size_t ws_bytes = k::cuda::attention_backward_workspace_bytes(a);
        trellis::Buffer<char, trellis::Cuda> ws(ws_bytes, stream, false);
        // Constant byte patterns (small finite bf16 values): the kernels' work does not depend on values.
        TRELLIS_CHECK_CUDA(cudaMemsetAsync(q.data(), 0x3c, n * sizeof(bfloat16), stream));
        TRELLIS_CHECK_CUDA(cudaMemsetAsync(kk.data(), 0x3b, n * sizeof(bfloat16), stream));
        TRELLIS_CHECK_CUDA(cudaMemsetAsync(v.data(), 0x3d, n * sizeof(bfloat16), stream));
        TRELLIS_CHECK_CUDA(cudaMemsetAsync(d_o.data(), 0x3a, n * sizeof(bfloat16), stream));
        const int iters = quick ? 3 : (t >= 8192 ? 5 : 10);
        auto fwd = [&] { k::cuda::attention_forward(a, q.data(), kk.data(), v.data(), o.data(), lse.data(), stream); };
        auto bwd = [&] {
          k::cuda::attention_backward(a, q.data(), kk.data(), v.data(), o.data(), d_o.data(), lse.data(), dq.data(),
                                      dk.data(), dv.data(), ws.data(), ws_bytes, stream);
        };
        const double t_fwd = trellis::bench::cuda_time_ms(stream, fwd, 2, iters);
        const double t_bwd = trellis::bench::cuda_time_ms(stream, bwd, 2, iters);

        // Peer: materialised attention on cuBLASLt (batched over B*H).
        const std::int64_t bh = a.batch * heads;
        trellis::Buffer<float, trellis::Cuda> s(static_cast<std::size_t>(bh * t * t), stream, false);
        trellis::Buffer<bfloat16, trellis::Cuda> p(static_cast<std::size_t>(bh * t * t), stream, false);
        k::GemmArgs qk = k::gemm_args(t, t, d, k::Op::none, k::Op::transpose);
        qk.batch = bh;
        qk.packed();
        k::GemmArgs pv = k::gemm_args(t, d, t);
        pv.batch = bh;
        pv.packed();
        const float scale = 1.0f / std::sqrt(static_cast<float>(d));
        auto peer = [&] {
          k::cuda::gemm(gemm, qk, q.data(), kk.data(), s.data(), stream);
          softmax_rows_kernel<<<static_cast<unsigned>(bh * t), 256, 0, stream>>>(s.data(), p.data(), t, causal, scale);
          k::cuda::gemm(gemm, pv, p.data(), v.data(), o.data(), stream);
        };
        const double t_peer = trellis::bench::cuda_time_ms(stream, peer, 1, std::max(2, iters / 2));
        const double f_fwd = k::cuda::attention_forward_flops(a), f_bwd = k::cuda::attention_backward_flops(a);
        auto tf = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
        std::printf("%6lld %6s %4lld | %9.3f %9.1f | %9.3f %9.1f | %9.3f %9.1f %8.2f\n", (long long)t,
                    causal ? "yes" : "no", (long long)a.batch, t_fwd, tf(f_fwd, t_fwd), t_bwd, tf(f_bwd, t_bwd), t_peer,
                    tf(f_fwd, t_peer), t_peer / t_fwd);
        trellis::bench::Row row;
        row.add("T", (long long)t).add_text("causal", causal ? "yes" : "no").add("batch", (long long)a.batch);
        row.add("heads", (long long)heads).add("head_dim", (long long)d);
        row.add("fwd_ms", t_fwd, "%.4f").add("fwd_tflops", tf(f_fwd, t_fwd));
        row.add("bwd_ms", t_bwd, "%.4f").add("bwd_tflops", tf(f_bwd, t_bwd));
        row.add("materialised_fwd_ms", t_peer, "%.4f").add("materialised_fwd_tflops", tf(f_fwd, t_peer));
        row.add("fwd_speedup_vs_materialised", t_peer / t_fwd);
        report.add(row);
      } catch (const std::exception& e) {
        std::printf("%6lld %6s failed: %s\n", (long long)t, causal ? "yes" : "no", e.what());
        (void)cudaGetLastError();
      }
    }
  }
  TRELLIS_CHECK_CUDA(cudaStreamSynchronize(stream));
  report.write(json);
  (void)cudaStreamDestroy(stream);
  return 0;
}
