// GEMM on CUDA through cuBLASLt, with cuBLASLt's own fused epilogues (bias, ReLU, GELU, GELU with
// the pre-activation saved, GELU gradient, bias gradients). Host code: compiles with g++ and the
// CUDA toolkit headers; link trellis::cuda.
//
// The problem is described by kernels::GemmArgs (kernels/epilogue.hpp), the same plain data the
// host GEMM takes:   C (m x n) = epilogue(alpha * op(A) op(B) + beta * C)
// All matrices of one call share one storage order; each may be transposed and batched with a
// stride (0 = shared by all batches, as on the host). Inputs are fp32, fp16 or bf16 (A and B the
// same type), C is fp32 or the input type; accumulation is fp32 (TF32 only when asked for).
//
// Front ends:
//   - gemm(handle, args, A, B, C, ep, stream) with the host epilogue types (epilogue::None, Bias,
//     Relu, BiasRelu, Gelu, BiasGelu, DGelu, DGeluBiasGrad): same meaning as kernels/gemm_host.hpp,
//     bias vectors indexed by the column j of C. Vector epilogues need row-major matrices here
//     (cuBLASLt's vectors run along the contiguous dimension of C); BiasGrad (column sums of C
//     without a GELU) has no cuBLASLt epilogue and is refused.
//   - grouped_gemm(handle, span<GemmGroup>, stream[, zero_k]): many GEMMs (MoE experts), one
//     cuBLASLt call per non-empty group (see the comment above it).
//   - GemmHandle::run(args, types, pointers, LtEpilogueArgs, stream): every cuBLASLt epilogue by
//     name, including BGRADA/BGRADB. Row-major problems run as the transposed column-major problem
//     C^T = op(B)^T op(A)^T, so for row-major C: bias and dgelu bias_grad have n entries (one per
//     column of C); bgrad_a = sum over k of op(A) (m entries); bgrad_b = sum over k of op(B)
//     (n entries). For column-major C, bias and dgelu bias_grad have m entries (cuBLASLt's rule).
// The aux matrix (gelu_aux*: written, dgelu*: read) has C's shape and order, leading dimension
// ld_aux (a multiple of 8, cuBLASLt's rule).
//
// A GemmHandle holds the cuBLASLt handle, a workspace (or the caller passes one per call) and a
// plan cache keyed by (shape, dtypes, order, transposes, epilogue, pointer alignment): the matmul
// descriptor, the layouts and the heuristic's algorithm are built once per key. A handle is not
// thread-safe, and its own workspace must not be used by two streams at once (one handle per
// stream, or pass a workspace per call).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include "trellis/core/check_cuda.hpp"
#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/epilogue.hpp"

namespace trellis::kernels::cuda {

// The cuBLASLt epilogues trellis uses, in the caller's terms (see the file comment).
enum class LtEpilogue : std::uint8_t {
  none,           // CUBLASLT_EPILOGUE_DEFAULT
  bias,           // D = AB + bias
  relu,           // D = relu(AB)
  relu_bias,      // D = relu(AB + bias)
  gelu,           // D = gelu(AB)              (tanh approximation, as cuBLASLt)
  gelu_aux,       // D = gelu(AB),        aux = AB
  gelu_bias,      // D = gelu(AB + bias)
  gelu_aux_bias,  // D = gelu(AB + bias), aux = AB + bias
  dgelu,          // D = AB * gelu'(aux)
  dgelu_bgrad,    // D = AB * gelu'(aux), bias_grad = sum of D over the non-contiguous dimension
  bgrad_a,        // D = AB, bias_grad = sum over k of op(A) (length m)
  bgrad_b,        // D = AB, bias_grad = sum over k of op(B) (length n)
};

constexpr const char* lt_epilogue_name(LtEpilogue e) {
  switch (e) {
    case LtEpilogue::none: return "none";
    case LtEpilogue::bias: return "bias";
    case LtEpilogue::relu: return "relu";
    case LtEpilogue::relu_bias: return "relu_bias";
    case LtEpilogue::gelu: return "gelu";
    case LtEpilogue::gelu_aux: return "gelu_aux";
    case LtEpilogue::gelu_bias: return "gelu_bias";
    case LtEpilogue::gelu_aux_bias: return "gelu_aux_bias";
    case LtEpilogue::dgelu: return "dgelu";
    case LtEpilogue::dgelu_bgrad: return "dgelu_bgrad";
    case LtEpilogue::bgrad_a: return "bgrad_a";
    case LtEpilogue::bgrad_b: return "bgrad_b";
  }
  return "?";
}

constexpr bool epilogue_reads_bias(LtEpilogue e) {
  return e == LtEpilogue::bias || e == LtEpilogue::relu_bias || e == LtEpilogue::gelu_bias ||
         e == LtEpilogue::gelu_aux_bias;
}
constexpr bool epilogue_writes_bias_grad(LtEpilogue e) {
  return e == LtEpilogue::dgelu_bgrad || e == LtEpilogue::bgrad_a || e == LtEpilogue::bgrad_b;
}
constexpr bool epilogue_uses_aux(LtEpilogue e) {
  return e == LtEpilogue::gelu_aux || e == LtEpilogue::gelu_aux_bias || e == LtEpilogue::dgelu ||
         e == LtEpilogue::dgelu_bgrad;
}

// The epilogue and its vectors/matrices (device pointers; bias, bias_grad and aux have C's type).
struct LtEpilogueArgs {
  LtEpilogue kind = LtEpilogue::none;
  const void* bias = nullptr;   // read by bias epilogues
  void* aux = nullptr;          // written by gelu_aux*, read by dgelu*
  std::int64_t ld_aux = 0;      // 0: same as C's leading dimension
  std::int64_t stride_aux = 0;  // 0: same as C's batch stride
  void* bias_grad = nullptr;    // written by dgelu_bgrad, bgrad_a, bgrad_b
};

namespace detail {

inline cudaDataType_t cuda_data_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::f16: return CUDA_R_16F;
    case DType::bf16: return CUDA_R_16BF;
    default: break;
  }
  TRELLIS_THROW("cuBLASLt GEMM: unsupported element type ", dtype_name(t), " (use float, half or bfloat16)");
}

// The largest power of two (up to 256) that divides the address: cuBLASLt picks kernels by it.
inline std::uint32_t pointer_alignment(const void* p) {
  auto v = reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t a = 256;
  while (a > 1 && (v % a) != 0) a /= 2;
  return a;
}

inline cublasLtEpilogue_t to_cublaslt(LtEpilogue e, bool swapped) {
  switch (e) {
    case LtEpilogue::none: return CUBLASLT_EPILOGUE_DEFAULT;
    case LtEpilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
    case LtEpilogue::relu: return CUBLASLT_EPILOGUE_RELU;
    case LtEpilogue::relu_bias: return CUBLASLT_EPILOGUE_RELU_BIAS;
    case LtEpilogue::gelu: return CUBLASLT_EPILOGUE_GELU;
    case LtEpilogue::gelu_aux: return CUBLASLT_EPILOGUE_GELU_AUX;
    case LtEpilogue::gelu_bias: return CUBLASLT_EPILOGUE_GELU_BIAS;
    case LtEpilogue::gelu_aux_bias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case LtEpilogue::dgelu: return CUBLASLT_EPILOGUE_DGELU;
    case LtEpilogue::dgelu_bgrad: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    // A row-major problem runs as D^T = op(B)^T op(A)^T: the caller's A is cuBLASLt's B.
    case LtEpilogue::bgrad_a: return swapped ? CUBLASLT_EPILOGUE_BGRADB : CUBLASLT_EPILOGUE_BGRADA;
    case LtEpilogue::bgrad_b: return swapped ? CUBLASLT_EPILOGUE_BGRADA : CUBLASLT_EPILOGUE_BGRADB;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// Everything that selects a plan. Pointers enter only through their alignment.
struct GemmPlanKey {
  std::int64_t m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c, ld_aux, stride_aux;
  std::uint32_t align_a, align_b, align_c, align_bias, align_aux;
  std::uint8_t trans_a, trans_b, order, epilogue, in_type, out_type, tf32;
  std::size_t workspace_bytes;
  bool operator==(const GemmPlanKey&) const = default;
};

struct GemmPlanKeyHash {
  std::size_t operator()(const GemmPlanKey& key) const noexcept {
    std::size_t h = 1469598103934665603ull;
    auto mix = [&h](std::uint64_t v) { h = (h ^ v) * 1099511628211ull; };
    for (std::int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc, key.batch, key.stride_a,
                           key.stride_b, key.stride_c, key.ld_aux, key.stride_aux})
      mix(static_cast<std::uint64_t>(v));
    for (std::uint32_t v : {key.align_a, key.align_b, key.align_c, key.align_bias, key.align_aux}) mix(v);
    for (std::uint8_t v : {key.trans_a, key.trans_b, key.order, key.epilogue, key.in_type, key.out_type, key.tf32})
      mix(v);
    mix(key.workspace_bytes);
    return h;
  }
};

// cuBLASLt objects for one key; destroyed with the plan.
struct GemmPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout_a = nullptr, layout_b = nullptr, layout_c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::size_t algo_workspace = 0;
  bool swapped = false;

  GemmPlan() = default;
  GemmPlan(const GemmPlan&) = delete;
  GemmPlan& operator=(const GemmPlan&) = delete;
  ~GemmPlan() {
    if (layout_c) (void)cublasLtMatrixLayoutDestroy(layout_c);
    if (layout_b) (void)cublasLtMatrixLayoutDestroy(layout_b);
    if (layout_a) (void)cublasLtMatrixLayoutDestroy(layout_a);
    if (desc) (void)cublasLtMatmulDescDestroy(desc);
  }
};

template <class T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  TRELLIS_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof value));
}

// Creates a column-major layout of `rows x cols` with leading dimension ld, batched.
inline cublasLtMatrixLayout_t make_layout(cudaDataType_t type, std::int64_t rows, std::int64_t cols,
                                          std::int64_t ld, std::int64_t batch, std::int64_t stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  TRELLIS_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&layout, type, static_cast<std::uint64_t>(rows),
                                                  static_cast<std::uint64_t>(cols), ld));
  if (batch > 1) {
    auto count = static_cast<std::int32_t>(batch);
    TRELLIS_CHECK_CUBLAS(
        cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
    TRELLIS_CHECK_CUBLAS(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                          &stride, sizeof stride));
  }
  return layout;
}

}  // namespace detail

class GemmHandle {
 public:
  static constexpr std::size_t default_workspace_bytes = std::size_t{32} << 20;

  // Creates the cuBLASLt handle and, when workspace_bytes > 0, a workspace owned by the handle
  // (cudaMalloc, on the current device).
  explicit GemmHandle(std::size_t workspace_bytes = default_workspace_bytes) : workspace_bytes_(workspace_bytes) {
    TRELLIS_CHECK_CUBLAS(cublasLtCreate(&handle_));
    if (workspace_bytes_ > 0) {
      cudaError_t status = cudaMalloc(&workspace_, workspace_bytes_);
      if (status != cudaSuccess) {
        (void)cublasLtDestroy(handle_);
        TRELLIS_CHECK_CUDA(status);
      }
    }
  }
  GemmHandle(const GemmHandle&) = delete;
  GemmHandle& operator=(const GemmHandle&) = delete;
  ~GemmHandle() {
    plans_.clear();
    if (workspace_) (void)cudaFree(workspace_);
    if (handle_) (void)cublasLtDestroy(handle_);
  }

  cublasLtHandle_t native() const noexcept { return handle_; }
  std::size_t workspace_bytes() const noexcept { return workspace_bytes_; }
  // Number of cached plans, and how often the heuristic ran (once per plan).
  std::size_t plan_count() const noexcept { return plans_.size(); }
  std::size_t heuristic_queries() const noexcept { return heuristic_queries_; }
  // fp32 inputs: allow TF32 tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32). Off by default.
  void set_allow_tf32(bool allow) noexcept { allow_tf32_ = allow; }

  // Type-erased entry point. `workspace` (device, `workspace_bytes` long) overrides the handle's
  // own; pass nullptr to use the handle's.
  void run(const GemmArgs& args, DType in_type, DType out_type, const void* a, const void* b, void* c,
           const LtEpilogueArgs& epilogue, cudaStream_t stream, void* workspace = nullptr,
           std::size_t workspace_bytes = 0) {
    TRELLIS_CHECK(args.m >= 0 && args.n >= 0 && args.k >= 0, "GEMM sizes must not be negative, got m=", args.m,
                  " n=", args.n, " k=", args.k);
    if (args.m == 0 || args.n == 0) return;  // empty C: nothing to do (as on the host)
    GemmArgs s = args;
    s.lda = s.lda_or_packed();
    s.ldb = s.ldb_or_packed();
    s.ldc = s.ldc_or_packed();
    validate(s, in_type, out_type, a, b, c, epilogue);
    void* ws = workspace ? workspace : workspace_;
    std::size_t ws_bytes = workspace ? workspace_bytes : workspace_bytes_;
    std::int64_t ld_aux = 0, stride_aux = 0;
    if (epilogue_uses_aux(epilogue.kind)) {
      ld_aux = epilogue.ld_aux ? epilogue.ld_aux : s.ldc;
      stride_aux = epilogue.stride_aux ? epilogue.stride_aux : s.stride_c;
    }

    detail::GemmPlanKey key{s.m, s.n, s.k, s.lda, s.ldb, s.ldc, s.batch, s.stride_a, s.stride_b, s.stride_c,
                            ld_aux, stride_aux,
                            detail::pointer_alignment(a), detail::pointer_alignment(b), detail::pointer_alignment(c),
                            epilogue_reads_bias(epilogue.kind) ? detail::pointer_alignment(epilogue.bias)
                            : epilogue_writes_bias_grad(epilogue.kind) ? detail::pointer_alignment(epilogue.bias_grad)
                                                                       : 0u,
                            epilogue_uses_aux(epilogue.kind) ? detail::pointer_alignment(epilogue.aux) : 0u,
                            static_cast<std::uint8_t>(s.op_a), static_cast<std::uint8_t>(s.op_b),
                            static_cast<std::uint8_t>(s.layout), static_cast<std::uint8_t>(epilogue.kind),
                            static_cast<std::uint8_t>(in_type), static_cast<std::uint8_t>(out_type),
                            static_cast<std::uint8_t>(allow_tf32_ && in_type == DType::f32), ws_bytes};
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      it = plans_.emplace(key, make_plan(s, in_type, out_type, epilogue, key, ws_bytes)).first;
    }
    detail::GemmPlan& plan = *it->second;

    // Pointers change from call to call; the attributes are cheap to set.
    if (epilogue_reads_bias(epilogue.kind)) {
      detail::set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, epilogue.bias);
    } else if (epilogue_writes_bias_grad(epilogue.kind)) {
      detail::set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, static_cast<const void*>(epilogue.bias_grad));
    }
    if (epilogue_uses_aux(epilogue.kind)) {
      detail::set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(epilogue.aux));
    }
    // Row-major runs as the transposed problem: cuBLASLt's A is the caller's B.
    const void* first = plan.swapped ? b : a;
    const void* second = plan.swapped ? a : b;
    const float alpha = s.alpha, beta = s.beta;
    TRELLIS_CHECK_CUBLAS(cublasLtMatmul(handle_, plan.desc, &alpha, first, plan.layout_a, second, plan.layout_b,
                                        &beta, c, plan.layout_c, c, plan.layout_c, &plan.algo,
                                        plan.algo_workspace ? ws : nullptr, plan.algo_workspace, stream));
  }

 private:
  static void validate(const GemmArgs& s, DType in_type, DType out_type, const void* a, const void* b,
                       const void* c, const LtEpilogueArgs& e) {
    TRELLIS_CHECK(s.k > 0, "GEMM (cuBLASLt): k must be positive, got k=", s.k, " (m=", s.m, ", n=", s.n, ")");
    TRELLIS_CHECK(s.batch >= 1 && s.batch <= INT32_MAX, "GEMM batch ", s.batch, " out of range");
    TRELLIS_CHECK(s.batch == 1 || s.stride_c != 0, "GEMM: batched C needs a non-zero stride_c");
    TRELLIS_CHECK(in_type == DType::f32 || in_type == DType::f16 || in_type == DType::bf16,
                  "GEMM input type ", dtype_name(in_type), " unsupported (float, half, bfloat16)");
    TRELLIS_CHECK(out_type == DType::f32 || out_type == in_type, "GEMM output type ", dtype_name(out_type),
                  " must be float or the input type ", dtype_name(in_type));
    TRELLIS_CHECK(a && b && c, "GEMM: null matrix pointer");
    TRELLIS_CHECK(s.lda >= s.packed_ld(s.a_rows(), s.a_cols()), "GEMM: lda ", s.lda, " too small");
    TRELLIS_CHECK(s.ldb >= s.packed_ld(s.b_rows(), s.b_cols()), "GEMM: ldb ", s.ldb, " too small");
    TRELLIS_CHECK(s.ldc >= s.packed_ld(s.m, s.n), "GEMM: ldc ", s.ldc, " too small");
    if (epilogue_reads_bias(e.kind))
      TRELLIS_CHECK(e.bias, "GEMM epilogue ", lt_epilogue_name(e.kind), " needs bias");
    if (epilogue_writes_bias_grad(e.kind))
      TRELLIS_CHECK(e.bias_grad, "GEMM epilogue ", lt_epilogue_name(e.kind), " needs bias_grad");
    if (epilogue_uses_aux(e.kind)) {
      TRELLIS_CHECK(e.aux, "GEMM epilogue ", lt_epilogue_name(e.kind), " needs aux");
      std::int64_t ld_aux = e.ld_aux ? e.ld_aux : s.ldc;
      TRELLIS_CHECK(ld_aux % 8 == 0 && ld_aux >= s.packed_ld(s.m, s.n), "GEMM: aux leading dimension ", ld_aux,
                    " must be a multiple of 8 and at least ", s.packed_ld(s.m, s.n), " (cuBLASLt)");
    }
  }

  std::unique_ptr<detail::GemmPlan> make_plan(const GemmArgs& s, DType in_type, DType out_type,
                                              const LtEpilogueArgs& e, const detail::GemmPlanKey& key,
                                              std::size_t ws_bytes) {
    auto plan = std::make_unique<detail::GemmPlan>();
    const bool row = s.layout == Layout::row_major;
    plan->swapped = row;
    cudaDataType_t in = detail::cuda_data_type(in_type), out = detail::cuda_data_type(out_type);
    cublasComputeType_t compute = key.tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    TRELLIS_CHECK_CUBLAS(cublasLtMatmulDescCreate(&plan->desc, compute, CUDA_R_32F));

    // cuBLASLt's column-major problem: C' (m' x n') = op(A') op(B'), with
    //   column-major caller: A' = A, B' = B;   row-major caller: C' = C^T, A' = B, B' = A.
    // A row-major stored matrix R (r x c) is the column-major matrix R^T (c x r), so an operand
    // the caller does not transpose needs no transpose in the swapped problem either.
    const std::int64_t mm = row ? s.n : s.m, nn = row ? s.m : s.n;
    const bool trans_first = (row ? s.op_b : s.op_a) == Op::transpose;
    const bool trans_second = (row ? s.op_a : s.op_b) == Op::transpose;
    const std::int64_t ld_first = row ? s.ldb : s.lda, ld_second = row ? s.lda : s.ldb;
    const std::int64_t stride_first = row ? s.stride_b : s.stride_a;
    const std::int64_t stride_second = row ? s.stride_a : s.stride_b;
    cublasOperation_t op_first = trans_first ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t op_second = trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
    detail::set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, op_first);
    detail::set_desc(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, op_second);
    // Stored extents: op(A') is m' x k, op(B') is k x n'.
    plan->layout_a = detail::make_layout(in, trans_first ? s.k : mm, trans_first ? mm : s.k, ld_first, s.batch,
                                         stride_first);
    plan->layout_b = detail::make_layout(in, trans_second ? nn : s.k, trans_second ? s.k : nn, ld_second,
                                         s.batch, stride_second);
    plan->layout_c = detail::make_layout(out, mm, nn, s.ldc, s.batch, s.stride_c);

    cublasLtEpilogue_t epi = detail::to_cublaslt(e.kind, row);
    detail::set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, epi);
    // Bias, bias gradient and aux take cuBLASLt's default type: C's type (our contract too).
    if (epilogue_reads_bias(e.kind) || epilogue_writes_bias_grad(e.kind)) {
      detail::set_desc(plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                       epilogue_reads_bias(e.kind) ? e.bias : static_cast<const void*>(e.bias_grad));
    }
    if (epilogue_uses_aux(e.kind)) {
      detail::set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, static_cast<const void*>(e.aux));
      detail::set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, key.ld_aux);
      if (s.batch > 1) detail::set_desc(plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, key.stride_aux);
    }

    cublasLtMatmulPreference_t pref = nullptr;
    TRELLIS_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
    std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, cublasStatus_t (*)(cublasLtMatmulPreference_t)>
        pref_guard(pref, &cublasLtMatmulPreferenceDestroy);
    auto set_pref = [&](cublasLtMatmulPreferenceAttributes_t attr, auto value) {
      TRELLIS_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, attr, &value, sizeof value));
    };
    set_pref(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(ws_bytes));
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, row ? key.align_b : key.align_a);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, row ? key.align_a : key.align_b);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
    set_pref(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);

    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    ++heuristic_queries_;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->layout_a, plan->layout_b,
                                                                 plan->layout_c, plan->layout_c, pref, 1, &result, &found);
    // cuBLASLt supports some epilogues only for some layouts/transposes (seen on an H200 with CUDA
    // 13: BGRADA/BGRADB on column-major problems). Say which combination it refused.
    if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
      TRELLIS_THROW("cuBLASLt does not support epilogue ", lt_epilogue_name(e.kind), " for this problem: m=", s.m,
                    " n=", s.n, " k=", s.k, " layout=", row ? "row_major" : "col_major", " in=", dtype_name(in_type),
                    " out=", dtype_name(out_type), " (CUBLAS_STATUS_NOT_SUPPORTED from the heuristic query)");
    }
    TRELLIS_CHECK_CUBLAS(status);
    TRELLIS_CHECK(found > 0, "cuBLASLt found no algorithm for m=", s.m, " n=", s.n, " k=", s.k, " in=",
                  dtype_name(in_type), " out=", dtype_name(out_type), " epilogue=", lt_epilogue_name(e.kind));
    plan->algo = result.algo;
    plan->algo_workspace = result.workspaceSize;
    return plan;
  }

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t workspace_bytes_ = 0;
  bool allow_tf32_ = false;
  std::size_t heuristic_queries_ = 0;
  std::unordered_map<detail::GemmPlanKey, std::unique_ptr<detail::GemmPlan>, detail::GemmPlanKeyHash> plans_;
};

namespace detail {
// Host epilogue type -> cuBLASLt epilogue arguments. Vectors and aux matrices must have C's type.
template <class TOut, class E>
LtEpilogueArgs to_lt_epilogue(const E& ep, const GemmArgs& args) {
  using K = EpilogueKind;
  constexpr K kind = epilogue_traits<E>::kind;
  LtEpilogueArgs lt;
  if constexpr (kind == K::none) {
    lt.kind = LtEpilogue::none;
  } else if constexpr (kind == K::bias) {
    static_assert(std::is_same_v<E, epilogue::Bias<TOut>>, "bias vector must have C's element type");
    lt.kind = LtEpilogue::bias, lt.bias = ep.bias;
  } else if constexpr (kind == K::relu) {
    lt.kind = LtEpilogue::relu;
  } else if constexpr (kind == K::bias_relu) {
    static_assert(std::is_same_v<E, epilogue::BiasRelu<TOut>>, "bias vector must have C's element type");
    lt.kind = LtEpilogue::relu_bias, lt.bias = ep.bias;
  } else if constexpr (kind == K::gelu) {
    lt.kind = LtEpilogue::gelu;
  } else if constexpr (kind == K::bias_gelu) {
    static_assert(std::is_same_v<E, epilogue::BiasGelu<TOut>>, "bias and pre-activation must have C's type");
    lt.kind = ep.pre_activation ? LtEpilogue::gelu_aux_bias : LtEpilogue::gelu_bias;
    lt.bias = ep.bias, lt.aux = ep.pre_activation, lt.ld_aux = ep.ld_pre, lt.stride_aux = ep.stride_pre;
  } else if constexpr (kind == K::dgelu) {
    static_assert(std::is_same_v<E, epilogue::DGelu<TOut>>, "pre-activation must have C's type");
    lt.kind = LtEpilogue::dgelu;
    lt.aux = const_cast<TOut*>(ep.pre_activation), lt.ld_aux = ep.ld_pre, lt.stride_aux = ep.stride_pre;
  } else if constexpr (kind == K::dgelu_bias_grad) {
    static_assert(std::is_same_v<E, epilogue::DGeluBiasGrad<TOut>>, "pre-activation and bias_grad must have C's type");
    TRELLIS_CHECK(!ep.accumulate, "cuBLASLt DGELU_BGRAD overwrites bias_grad: accumulate=true is not supported");
    TRELLIS_CHECK(args.batch == 1, "cuBLASLt DGELU_BGRAD sums one batch entry: batch must be 1");
    lt.kind = LtEpilogue::dgelu_bgrad;
    lt.aux = const_cast<TOut*>(ep.pre_activation), lt.ld_aux = ep.ld_pre, lt.stride_aux = ep.stride_pre;
    lt.bias_grad = ep.bias_grad;
  } else {
    static_assert(kind != K::bias_grad,
                  "epilogue::BiasGrad (column sums of C) has no cuBLASLt epilogue; use LtEpilogue::bgrad_a/"
                  "bgrad_b on the inputs or reduce C separately");
  }
  if (epilogue_reads_bias(lt.kind) || epilogue_writes_bias_grad(lt.kind)) {
    TRELLIS_CHECK(args.layout == Layout::row_major || lt.kind == LtEpilogue::bgrad_a || lt.kind == LtEpilogue::bgrad_b,
                  "cuBLASLt bias vectors run along C's contiguous dimension: use row-major matrices for the "
                  "host-compatible epilogue ", lt_epilogue_name(lt.kind));
  }
  return lt;
}
}  // namespace detail

// Same contract as the host gemm (kernels/epilogue.hpp): C = epilogue(alpha op(A) op(B) + beta C),
// on `stream`, with device pointers. TIn in {float, half, bfloat16}; TOut is float or TIn.
template <class TIn, class TOut, class E = epilogue::None>
  requires kernels::GemmEpilogue<E>
void gemm(GemmHandle& handle, const GemmArgs& args, const TIn* a, const TIn* b, TOut* c, cudaStream_t stream,
          const E& ep = {}) {
  static_assert(std::is_same_v<TIn, float> || std::is_same_v<TIn, half> || std::is_same_v<TIn, bfloat16>,
                "cuBLASLt GEMM inputs are float, half or bfloat16");
  static_assert(std::is_same_v<TOut, float> || std::is_same_v<TOut, TIn>, "C is float or the input type");
  handle.run(args, dtype_v<TIn>, dtype_v<TOut>, a, b, c, detail::to_lt_epilogue<TOut>(ep, args), stream);
}

// ---- grouped GEMM ----------------------------------------------------------------------------
// Many GEMMs of different sizes in one call (kernels::GemmGroup, e.g. the experts of a
// Mixture-of-Experts layer), the host's grouped_gemm contract (kernels/gemm_host.hpp): each group
// exactly as gemm(g.args, g.a, g.b, g.c, g.ep), in order; each group one GEMM (batch 1).
//
// Implementation: one cuBLASLt matmul per non-empty group through gemm() above, so each group
// keeps its fused epilogue (bias, GELU with the pre-activation saved, dGELU) and the plan cache
// (experts of equal row counts share a plan). cuBLAS' own grouped API (cublasGemmGroupedBatchedEx)
// would run all groups in one launch but has no epilogues: bias, GELU and dGELU would then be
// separate passes over every output. The per-group Lt path is the one that can fuse them; which
// is faster for MoE shapes is for the GPU benchmark to decide later.
// Groups the product does not cover, as on the host:
//   - m = 0 or n = 0: nothing to compute; a bias-gradient epilogue zeroes its vector unless
//     accumulate (where gemm() alone leaves it untouched);
//   - k = 0 (an expert that received no rows): C = epilogue(beta C). cuBLASLt refuses k = 0, and
//     this header is host code (no kernels): epilogue::None with beta 1 (the weight gradients'
//     accumulation) is a no-op and with beta 0 a memset; anything else goes to `zero_k(group)`,
//     a device pass the caller supplies (kernels::cuda::gemm_without_product in moe_cuda.cuh;
//     backend::Cuda passes it). Without one such a group is refused.
namespace detail {
struct RefuseZeroK {
  template <class G>
  void operator()(const G&) const {
    TRELLIS_THROW("grouped_gemm (CUDA): a group with k = 0 and an epilogue or beta other than 0 or 1 needs a device "
                  "pass: pass zero_k (kernels::cuda::gemm_without_product, moe_cuda.cuh)");
  }
};

// The grouped-GEMM loop shared by grouped_gemm and backend::Cuda: checks each group, handles the
// empty and k = 0 ones, and hands every other group to product(group).
template <class TIn, class TOut, class E, class Product, class ZeroK>
void for_each_gemm_group(std::span<const GemmGroup<TIn, TIn, TOut, E>> groups, cudaStream_t stream, Product&& product,
                         ZeroK&& zero_k) {
  using traits = epilogue_traits<E>;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const GemmGroup<TIn, TIn, TOut, E>& g = groups[i];
    const GemmArgs& args = g.args;
    try {
      TRELLIS_CHECK(args.batch == 1, "batch = ", args.batch, "; each group is a single GEMM (batch 1)");
      TRELLIS_CHECK(args.m >= 0 && args.n >= 0 && args.k >= 0, "negative size m=", args.m, " n=", args.n, " k=", args.k);
      if (args.m == 0 || args.n == 0) {
        if constexpr (traits::bias_grad) {
          TRELLIS_CHECK(g.ep.bias_grad != nullptr, "bias-grad epilogue without a bias_grad vector");
          if (!g.ep.accumulate && args.n > 0)
            TRELLIS_CHECK_CUDA(cudaMemsetAsync(g.ep.bias_grad, 0, static_cast<std::size_t>(args.n) * sizeof(TOut), stream));
        }
        continue;
      }
      if (args.k == 0) {
        if constexpr (traits::kind == EpilogueKind::none) {
          if (args.beta == 1.0f) continue;  // C = C
          if (args.beta == 0.0f) {          // C = 0 (C is not read: it may hold NaN)
            TRELLIS_CHECK(g.c != nullptr, "C is null");
            const bool row = args.layout == Layout::row_major;
            const std::int64_t ldc = args.ldc_or_packed();
            TRELLIS_CHECK(ldc >= args.packed_ld(args.m, args.n), "ldc ", ldc, " too small");
            TRELLIS_CHECK_CUDA(cudaMemset2DAsync(g.c, static_cast<std::size_t>(ldc) * sizeof(TOut), 0,
                                                 static_cast<std::size_t>(row ? args.n : args.m) * sizeof(TOut),
                                                 static_cast<std::size_t>(row ? args.m : args.n), stream));
            continue;
          }
        }
        zero_k(g);
        continue;
      }
      product(g);
    } catch (const Error& e) {  // name the group
      throw Error("grouped_gemm: group " + std::to_string(i) + ": " + e.message(), e.file(), e.line(), e.rank());
    }
  }
}
}  // namespace detail

template <class TIn, class TOut, class E, class ZeroK = detail::RefuseZeroK>
  requires kernels::GemmEpilogue<E>
void grouped_gemm(GemmHandle& handle, std::span<const GemmGroup<TIn, TIn, TOut, E>> groups, cudaStream_t stream,
                  ZeroK&& zero_k = {}) {
  detail::for_each_gemm_group(
      groups, stream,
      [&](const GemmGroup<TIn, TIn, TOut, E>& g) { gemm(handle, g.args, g.a, g.b, g.c, stream, g.ep); },
      std::forward<ZeroK>(zero_k));
}

}  // namespace trellis::kernels::cuda
