// Explicit instantiations of the CUDA attention launchers (and so of their 32 attention kernels: type x head_dim x causal x segmented, forward and backward), compiled
// once into trellis_gpu_kernel_instances; test and bench programs that link it define
// TRELLIS_ATTENTION_CUDA_EXTERN and skip these expensive instantiations.
#include "trellis/kernels/attention_cuda.cuh"

namespace trellis::kernels::cuda {
template void attention_forward<bfloat16>(const AttentionArgs&, const bfloat16*, const bfloat16*, const bfloat16*,
                                          bfloat16*, float*, cudaStream_t);
template void attention_forward<half>(const AttentionArgs&, const half*, const half*, const half*, half*, float*,
                                      cudaStream_t);
template void attention_backward<bfloat16>(const AttentionArgs&, const bfloat16*, const bfloat16*, const bfloat16*,
                                           const bfloat16*, const bfloat16*, const float*, bfloat16*, bfloat16*,
                                           bfloat16*, void*, std::size_t, cudaStream_t, bool);
template void attention_backward<half>(const AttentionArgs&, const half*, const half*, const half*, const half*,
                                       const half*, const float*, half*, half*, half*, void*, std::size_t,
                                       cudaStream_t, bool);
}  // namespace trellis::kernels::cuda
