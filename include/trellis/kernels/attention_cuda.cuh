// FlashAttention-2 style attention on CUDA (nvcc, sm_80 and newer): forward and backward, bf16 or
// fp16 inputs, fp32 accumulation on tensor cores through mma.sync.m16n8k16, causal or not, head
// dimension 64 or 128, grouped-query / multi-query attention (kv_heads divides heads).
//
// Arguments, layout and math are kernels::AttentionArgs (kernels/attention.hpp), the same as the
// host attention: q, o, dq [B, Hq, Tq, d]; k, v, dk, dv [B, Hkv, Tkv, d]; lse [B, Hq, Tq] fp32
// (natural log; -inf for a row that sees no key, whose output is 0); causal mask j <= i +
// args.offset() (bottom-right, Tkv - Tq, unless causal_offset is set: ring attention chunks);
// optional segment ids (packed documents, device int32 [B, Tq] and [B, Tkv], non-decreasing, which
// the caller validates): blocks skip the tiles outside their rows' documents and compare ids only
// in tiles that straddle a boundary. Tensor pointers are device pointers, 16-byte aligned.
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
//
// The pieces: kernels/attention_forward_cuda.cuh, kernels/attention_backward_cuda.cuh, and what
// they share, kernels/attention_common_cuda.cuh (tile geometry, fragment loads, argument checks).
#pragma once

#include "trellis/kernels/attention_backward_cuda.cuh"  // defines: attention_backward, attention_backward_workspace_bytes
#include "trellis/kernels/attention_common_cuda.cuh"    // defines: attention_forward_flops, attention_backward_flops
#include "trellis/kernels/attention_forward_cuda.cuh"   // defines: attention_forward
