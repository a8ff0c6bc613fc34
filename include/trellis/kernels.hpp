// trellis kernels, host half: GEMM with fused epilogues, flash attention, norms, cross-entropy,
// embedding, elementwise ops and AdamW. Compiles with g++ alone; link trellis::blas to run the
// GEMM on OpenBLAS. The CUDA kernels are in <trellis/cuda.cuh>.
#pragma once

#include "trellis/kernels/adamw_host.hpp"        // defines: adamw_step, grad_norm_squared, clip_scale
#include "trellis/kernels/attention.hpp"         // defines: AttentionArgs, merge_partials_row
#include "trellis/kernels/attention_host.hpp"    // defines: attention_forward/backward, merge_attention_partials
#include "trellis/kernels/blas_core.hpp"         // defines: cpu_features, blas_core_warning
#include "trellis/kernels/dropout.hpp"           // defines: DropoutArgs, dropout_keep, dropout_row_key
#include "trellis/kernels/dropout_host.hpp"      // defines: dropout_apply
#include "trellis/kernels/elementwise_host.hpp"  // defines: gelu_forward/backward, add, column_sums
#include "trellis/kernels/embedding_host.hpp"    // defines: EmbeddingArgs, embedding_forward/backward
#include "trellis/kernels/epilogue.hpp"          // defines: GemmArgs, Layout, Op, epilogue::*
#include "trellis/kernels/gemm_host.hpp"         // defines: host::gemm
#include "trellis/kernels/host_math.hpp"         // defines: fast_exp, fast_tanh, fast_gelu
#include "trellis/kernels/moe_host.hpp"          // defines: MoeRouteArgs, moe_route_*, moe_dispatch_plan, moe_combine*, gather_rows
#include "trellis/kernels/norms_host.hpp"        // defines: layernorm_*, rmsnorm_*
#include "trellis/kernels/thread_pool.hpp"       // defines: ThreadPool, parallel_for, set_num_threads
#include "trellis/kernels/xent_host.hpp"         // defines: softmax_xent_*, xent_partial_*, xent_finish
