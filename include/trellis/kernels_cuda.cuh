// The CUDA kernels of trellis (nvcc): cuBLASLt GEMM with epilogues (and grouped), flash attention,
// norms, softmax cross-entropy, embedding, elementwise, Mixture-of-Experts routing, AdamW and
// gradient norm. Each mirrors its host twin in kernels/*_host.hpp (same argument PODs and
// contracts) and takes a cudaStream_t.
#pragma once

#include "trellis/kernels/adamw_cuda.cuh"         // defines: cuda::adamw_step, grad_norm_squared
#include "trellis/kernels/attention_cuda.cuh"     // defines: cuda::attention_forward, attention_backward
#include "trellis/kernels/dropout_cuda.cuh"       // defines: cuda::dropout_apply
#include "trellis/kernels/cuda_common.cuh"        // defines: column_sums_workspace_bytes, device helpers
#include "trellis/kernels/elementwise_cuda.cuh"   // defines: cuda::gelu_forward/backward, add, column_sums
#include "trellis/kernels/embedding_cuda.cuh"     // defines: cuda::embedding_forward/backward
#include "trellis/kernels/gemm_cuda.hpp"          // defines: cuda::GemmHandle, cuda::gemm, grouped_gemm
#include "trellis/kernels/moe_cuda.cuh"           // defines: cuda::moe_route_*, moe_dispatch_plan, moe_combine*
#include "trellis/kernels/norms_cuda.cuh"         // defines: cuda::layernorm_*, rmsnorm_*
#include "trellis/kernels/xent_cuda.cuh"          // defines: cuda::softmax_xent_*
