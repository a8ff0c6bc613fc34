// The compute-backend concept: the one interface through which layers, models and trainers run
// kernels and hold memory. A backend names
//   - its memory space (trellis::Host or trellis::Cuda) and activation type act_t (the GEMM
//     operand and activation dtype: fp32, or bf16 with fp32 accumulation and statistics);
//   - buffers (owning: zeroed, or scratch left unset), copies in and out of its memory, a stream and events (empty
//     types on the host, where every call has finished when it returns), named ranges (NVTX);
//   - CUB-style workspace queries, asked at set-up for the largest shapes, then one
//     reserve_workspace(max): no scratch grows in the middle of a step;
//   - the kernels the layers call, with backend-neutral contracts (kernels::GemmArgs and
//     epilogues, AttentionArgs, HeadsLayout, EmbeddingArgs, DropoutArgs, AdamWTensor/AdamWConfig);
//   - Mixture-of-Experts pieces: grouped_gemm over kernels::GemmGroup spans (one GEMM per expert)
//     and the routing ops of kernels/moe.hpp (MoeRouteArgs; int32 expert ids, slots and counts),
//     moe_dispatch_plan with its workspace query.
// Backends: backend::Host<float>, backend::Host<bfloat16> (backend/host.hpp) and backend::Cuda
// (backend/cuda.cuh, bf16). docs/backend.md says why the layers take a backend and what it owns.
//
// A layer runs collectives on the activations it computes, so its communicator must live in the
// same memory space: CompatibleWith<B, C> is checked at compile time (ThreadComm and MpiComm are
// host communicators, NcclComm a CUDA one).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "trellis/core/space.hpp"
#include "trellis/core/tensor.hpp"
#include "trellis/kernels/adamw.hpp"
#include "trellis/kernels/attention.hpp"
#include "trellis/kernels/dropout.hpp"
#include "trellis/kernels/embedding.hpp"
#include "trellis/kernels/epilogue.hpp"
#include "trellis/kernels/heads.hpp"
#include "trellis/kernels/moe.hpp"

namespace trellis::backend {

template <class B>
concept Backend = requires(B& b, const B& cb, std::size_t n, index_t i, const float* cf, float* f,
                           typename B::act_t* x, const typename B::act_t* cx, const std::int32_t* ids,
                           const kernels::GemmArgs& gemm, const kernels::AttentionArgs& attn,
                           const kernels::HeadsLayout& heads, const kernels::EmbeddingArgs& emb,
                           const kernels::DropoutArgs& drop,
                           std::span<const std::span<const float>> grads,
                           std::span<const kernels::AdamWTensor<float>> adamw, const kernels::AdamWConfig& cfg,
                           std::int32_t* iw, const kernels::MoeRouteArgs& moe,
                           std::span<const kernels::GemmGroup<typename B::act_t, typename B::act_t, typename B::act_t,
                                                              kernels::epilogue::None>> groups,
                           std::span<const kernels::GemmGroup<typename B::act_t, typename B::act_t, float,
                                                              kernels::epilogue::None>> groups_f32,
                           std::span<const kernels::GemmGroup<typename B::act_t, typename B::act_t, typename B::act_t,
                                                              kernels::epilogue::BiasGelu<typename B::act_t>>>
                               groups_bias_gelu) {
  typename B::space;
  requires MemorySpace<typename B::space>;
  typename B::act_t;
  typename B::stream_type;
  typename B::event_type;
  typename B::template buffer<float>;
  typename B::template buffer<typename B::act_t>;
  // whether host code may read and write its buffers' elements (false for device memory)
  { B::host_readable } -> std::convertible_to<bool>;
  { cb.stream() } -> std::same_as<typename B::stream_type>;
  { cb.record_event() } -> std::same_as<typename B::event_type>;
  cb.synchronize();
  // a named range around a layer's pass (RAII; NVTX on CUDA): cb.range("h.3 forward")
  cb.range("");
  // memory
  { cb.template allocate<float>(n) } -> std::same_as<typename B::template buffer<float>>;
  // scratch: contents unspecified (not zeroed); for temporaries written in full before any read
  { cb.template scratch<float>(n) } -> std::same_as<typename B::template buffer<float>>;
  cb.upload(f, cf, n);
  cb.download(f, cf, n);
  cb.copy(f, cf, n);
  cb.fill_zero(f, n);
  // workspace
  { cb.layernorm_backward_workspace(i, i) } -> std::same_as<std::size_t>;
  { cb.attention_backward_workspace(attn) } -> std::same_as<std::size_t>;
  { cb.column_sums_workspace(i, i) } -> std::same_as<std::size_t>;
  { cb.sum_of_squares_workspace(grads) } -> std::same_as<std::size_t>;
  { cb.moe_dispatch_plan_workspace(i, 1, i) } -> std::same_as<std::size_t>;
  b.reserve_workspace(n);
  { cb.workspace_reserved() } -> std::same_as<std::size_t>;
  // kernels
  b.convert(n, cf, x);
  b.gemm(gemm, cx, cx, x);
  b.gemm(gemm, cx, cx, f);
  b.layernorm_forward(i, i, cx, cf, cf, x, f, f, 1e-5f);
  b.layernorm_backward(i, i, cx, cx, cf, cf, cf, x, f, f, true);
  b.attention_forward(attn, cx, cx, cx, x, f);
  b.attention_backward(attn, cx, cx, cx, cx, cx, cf, x, x, x);
  b.attention_backward(attn, cx, cx, cx, cx, cx, cf, x, x, x, true);  // accumulate (ring attention)
  b.merge_attention_partials(i, i, x, f, cx, cf);
  b.rows_to_heads(heads, cx, i, x);
  b.heads_to_rows(heads, cx, x, i);
  b.xent_partial_max(i, i, i, cx, f);
  b.xent_partial_sumexp(i, i, i, cx, cf, f);
  b.xent_partial_target(i, i, i, cx, ids, i, f);
  b.xent_finish(i, cf, cf, cf, ids, f, f);
  b.xent_backward_sharded(i, i, i, cx, ids, i, cf, 1.0f, x, i);
  b.embedding_forward(emb, ids, cf, cf, x);
  b.embedding_backward(emb, ids, cx, f, f);
  b.dropout(drop, x);
  b.gelu_forward(i, cx, x);
  b.gelu_backward(i, cx, cx, x);
  b.add(i, cx, cx, x);
  b.add(i, cf, cf, f);
  b.add(i, cx, cf, f);  // mixed: an activation-typed part into an fp32 accumulator
  b.add(i, cx, cf, x);
  b.column_sums(i, i, i, cx, f);
  { b.sum_of_squares(grads) } -> std::convertible_to<double>;
  { b.sum(cf, n) } -> std::convertible_to<double>;
  b.adamw(adamw, cfg, std::int64_t{1}, 1.0f);
  // Mixture of Experts: grouped GEMMs (activation or fp32 C, with or without epilogues) and routing
  b.grouped_gemm(groups);
  b.grouped_gemm(groups_f32);
  b.grouped_gemm(groups_bias_gelu);
  b.moe_route_forward(moe, cf, f, f, iw, f, iw, f);
  b.moe_dispatch_plan(i, 1, i, i, ids, iw, iw, iw);
  b.gather_rows(i, i, cx, ids, x);
  b.moe_combine(i, 1, i, cx, ids, cf, x, true);
  b.moe_combine_backward(i, 1, i, cx, cx, ids, cf, f, x);
  b.moe_route_backward(moe, cf, cf, ids, cf, cf, cf, 1.0f, f);
};

// A communicator names the memory space its buffers live in (C::space).
template <class C>
using space_of = typename C::space;

// Layers built on backend B run collectives of communicator C on B's buffers.
template <class B, class C>
concept CompatibleWith = Backend<B> && std::same_as<typename B::space, space_of<C>>;

// A host copy of n elements of B's memory: how host code (checkpoints, tests) reads parameters,
// moments and activations on any backend.
template <Backend B, class T>
std::vector<std::remove_const_t<T>> download_vector(const B& be, T* src, std::size_t n) {
  std::vector<std::remove_const_t<T>> out(n);
  be.download(out.data(), src, n);
  return out;
}

}  // namespace trellis::backend
