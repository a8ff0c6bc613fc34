// Backend-neutral GEMM description and fused epilogues, shared by kernels/gemm_host.hpp and the
// CUDA GEMM. Everything here is plain data plus TRELLIS_HD scalar formulas: the host and the
// device kernels implement the same contract, and the scalar formulas are the reference.
//
// Contract of gemm<Epilogue>(args, A, B, C, ep), for every batch b:
//   acc(i, j) = alpha * sum_p op(A)(i, p) * op(B)(p, j) + beta * C(i, j)     (fp32)
//   C(i, j)   = epilogue(acc(i, j), i, j)
// with C logically m x n, op(A) m x k, op(B) k x n. `layout` is the storage order of all three
// matrices (as in cblas/cuBLAS); a matrix stored in the other order is expressed with op = transpose.
// With beta == 0, C is never read (it may hold NaN).
// host::grouped_gemm(groups) applies this contract to each GemmGroup (its own sizes, operands and
// epilogue values), as one call.
//
// Epilogues (bias vectors have n entries, indexed by the column j of the logical C, whatever the
// layout; auxiliary matrices have the shape, layout and batch stride of C unless given their own ld):
//   None                       C = acc
//   Bias{b}                    C = acc + b[j]
//   Relu                       C = max(acc, 0)
//   BiasRelu{b}                C = max(acc + b[j], 0)
//   Gelu                       C = gelu_tanh(acc)
//   BiasGelu{b, pre}           pre = acc + b[j] (if pre != nullptr);  C = gelu_tanh(acc + b[j])
//   DGelu{pre}                 C = acc * gelu_tanh_grad(pre(i, j))          (backward of GELU)
//   BiasGrad{g}                C = acc;  g[j] (+)= sum over i and batches of C(i, j)
//   DGeluBiasGrad{pre, g}      C = acc * gelu_tanh_grad(pre(i, j));  g[j] (+)= column sums of C
// BiasGrad sums are accumulated in fp32 in a fixed order (host: per tile of C, tiles in order), so they are
// deterministic for a given shape; `accumulate` adds to g instead of overwriting it.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "trellis/core/config.hpp"

namespace trellis::kernels {

// Storage order of the matrices of a GEMM.
enum class Layout : std::uint8_t { row_major, col_major };
// op(X) = X or X^T.
enum class Op : std::uint8_t { none, transpose };

// One (possibly strided-batched) GEMM. Leading dimensions and batch strides are in elements.
// A leading dimension of 0 means "packed" (the smallest legal value); a batch stride of 0 means the
// operand is shared by every batch (broadcast), except stride_c, which must be non-zero when
// batch > 1 (see packed()).
struct GemmArgs {
  std::int64_t m = 0, n = 0, k = 0;  // C: m x n, op(A): m x k, op(B): k x n
  Layout layout = Layout::row_major;
  Op op_a = Op::none, op_b = Op::none;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  std::int64_t batch = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;
  float alpha = 1.0f, beta = 0.0f;

  // Rows/columns of A and B as stored (before op).
  TRELLIS_HD constexpr std::int64_t a_rows() const { return op_a == Op::none ? m : k; }
  TRELLIS_HD constexpr std::int64_t a_cols() const { return op_a == Op::none ? k : m; }
  TRELLIS_HD constexpr std::int64_t b_rows() const { return op_b == Op::none ? k : n; }
  TRELLIS_HD constexpr std::int64_t b_cols() const { return op_b == Op::none ? n : k; }
  // Smallest legal leading dimension of a stored rows x cols matrix.
  TRELLIS_HD constexpr std::int64_t packed_ld(std::int64_t rows, std::int64_t cols) const {
    std::int64_t ld = layout == Layout::row_major ? cols : rows;
    return ld > 0 ? ld : 1;
  }
  TRELLIS_HD constexpr std::int64_t lda_or_packed() const { return lda ? lda : packed_ld(a_rows(), a_cols()); }
  TRELLIS_HD constexpr std::int64_t ldb_or_packed() const { return ldb ? ldb : packed_ld(b_rows(), b_cols()); }
  TRELLIS_HD constexpr std::int64_t ldc_or_packed() const { return ldc ? ldc : packed_ld(m, n); }

  // Offset of element (row, col) of a stored matrix with leading dimension ld.
  TRELLIS_HD constexpr std::int64_t offset(std::int64_t row, std::int64_t col, std::int64_t ld) const {
    return layout == Layout::row_major ? row * ld + col : col * ld + row;
  }

  // Sets every batch stride to the packed size of its matrix (independent batches back to back).
  constexpr GemmArgs& packed() {
    stride_a = lda_or_packed() * (layout == Layout::row_major ? a_rows() : a_cols());
    stride_b = ldb_or_packed() * (layout == Layout::row_major ? b_rows() : b_cols());
    stride_c = ldc_or_packed() * (layout == Layout::row_major ? m : n);
    return *this;
  }
};

// One member of a grouped GEMM (host::grouped_gemm): its own sizes, operands and epilogue values
// (bias, pre-activation, bias-gradient vector), all members sharing the operand types and the
// epilogue kind. args.batch must be 1.
template <class TA, class TB, class TC, class E>
struct GemmGroup {
  GemmArgs args;
  const TA* a = nullptr;
  const TB* b = nullptr;
  TC* c = nullptr;
  E ep{};
};

// Plain-data builders for the common cases.
constexpr GemmArgs gemm_args(std::int64_t m, std::int64_t n, std::int64_t k, Op op_a = Op::none,
                             Op op_b = Op::none, float alpha = 1.0f, float beta = 0.0f,
                             Layout layout = Layout::row_major) {
  GemmArgs a;
  a.m = m, a.n = n, a.k = k, a.op_a = op_a, a.op_b = op_b, a.alpha = alpha, a.beta = beta;
  a.layout = layout;
  return a;
}

// ---- scalar reference formulas (GPT-2's tanh form of GELU) ----------------------------------
inline constexpr float gelu_sqrt_2_over_pi = 0.7978845608028654f;
inline constexpr float gelu_cubic = 0.044715f;

TRELLIS_HD inline float gelu_tanh(float x) {
  float u = gelu_sqrt_2_over_pi * (x + gelu_cubic * x * x * x);
  return 0.5f * x * (1.0f + ::tanhf(u));
}
// d gelu_tanh(x) / dx.
TRELLIS_HD inline float gelu_tanh_grad(float x) {
  float u = gelu_sqrt_2_over_pi * (x + gelu_cubic * x * x * x);
  float t = ::tanhf(u);
  float du = gelu_sqrt_2_over_pi * (1.0f + 3.0f * gelu_cubic * x * x);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

// ---- epilogue types --------------------------------------------------------------------------
// T is the element type of the vectors/matrices an epilogue reads or writes (float, half or
// bfloat16); the arithmetic is fp32.
namespace epilogue {

struct None {};

template <class T = float>
struct Bias {
  const T* bias = nullptr;  // (n)
};

struct Relu {};

template <class T = float>
struct BiasRelu {
  const T* bias = nullptr;  // (n)
};

struct Gelu {};

template <class T = float>
struct BiasGelu {
  const T* bias = nullptr;     // (n)
  T* pre_activation = nullptr;  // (m, n) like C, optional: saved for the backward pass
  std::int64_t ld_pre = 0;     // 0: same as C's leading dimension
  std::int64_t stride_pre = 0;  // 0: same as C's batch stride
};

template <class T = float>
struct DGelu {
  const T* pre_activation = nullptr;  // (m, n) like C: the forward's BiasGelu pre_activation
  std::int64_t ld_pre = 0;
  std::int64_t stride_pre = 0;
};

template <class T = float>
struct BiasGrad {
  T* bias_grad = nullptr;  // (n)
  bool accumulate = false;
};

template <class T = float>
struct DGeluBiasGrad {
  const T* pre_activation = nullptr;  // (m, n) like C
  std::int64_t ld_pre = 0;
  std::int64_t stride_pre = 0;
  T* bias_grad = nullptr;  // (n)
  bool accumulate = false;
};

}  // namespace epilogue

// What each epilogue does, for backends to dispatch on (e.g. to cuBLASLt epilogue enums).
enum class EpilogueKind : std::uint8_t {
  none, bias, relu, bias_relu, gelu, bias_gelu, dgelu, bias_grad, dgelu_bias_grad
};

template <class E> struct epilogue_traits {
  static constexpr bool known = false;
};
template <EpilogueKind K, bool Bias, bool ReadsPre, bool WritesPre, bool BiasGrad>
struct epilogue_traits_base {
  static constexpr bool known = true;
  static constexpr EpilogueKind kind = K;
  static constexpr bool has_bias = Bias, reads_pre = ReadsPre, writes_pre = WritesPre,
                        bias_grad = BiasGrad;
};
template <> struct epilogue_traits<epilogue::None>
    : epilogue_traits_base<EpilogueKind::none, false, false, false, false> {};
template <class T> struct epilogue_traits<epilogue::Bias<T>>
    : epilogue_traits_base<EpilogueKind::bias, true, false, false, false> {};
template <> struct epilogue_traits<epilogue::Relu>
    : epilogue_traits_base<EpilogueKind::relu, false, false, false, false> {};
template <class T> struct epilogue_traits<epilogue::BiasRelu<T>>
    : epilogue_traits_base<EpilogueKind::bias_relu, true, false, false, false> {};
template <> struct epilogue_traits<epilogue::Gelu>
    : epilogue_traits_base<EpilogueKind::gelu, false, false, false, false> {};
template <class T> struct epilogue_traits<epilogue::BiasGelu<T>>
    : epilogue_traits_base<EpilogueKind::bias_gelu, true, false, true, false> {};
template <class T> struct epilogue_traits<epilogue::DGelu<T>>
    : epilogue_traits_base<EpilogueKind::dgelu, false, true, false, false> {};
template <class T> struct epilogue_traits<epilogue::BiasGrad<T>>
    : epilogue_traits_base<EpilogueKind::bias_grad, false, false, false, true> {};
template <class T> struct epilogue_traits<epilogue::DGeluBiasGrad<T>>
    : epilogue_traits_base<EpilogueKind::dgelu_bias_grad, false, true, false, true> {};

template <class E>
concept GemmEpilogue = epilogue_traits<std::remove_cvref_t<E>>::known;

// Scalar reference of the elementwise part of an epilogue: acc -> C value, given the bias entry
// (ignored without a bias) and the saved pre-activation (ignored unless the epilogue reads one).
template <EpilogueKind K>
TRELLIS_HD inline float epilogue_apply(float acc, float bias, float pre) {
  if constexpr (K == EpilogueKind::bias) return acc + bias;
  else if constexpr (K == EpilogueKind::relu) return acc > 0.0f ? acc : 0.0f;
  else if constexpr (K == EpilogueKind::bias_relu) return acc + bias > 0.0f ? acc + bias : 0.0f;
  else if constexpr (K == EpilogueKind::gelu) return gelu_tanh(acc);
  else if constexpr (K == EpilogueKind::bias_gelu) return gelu_tanh(acc + bias);
  else if constexpr (K == EpilogueKind::dgelu || K == EpilogueKind::dgelu_bias_grad)
    return acc * gelu_tanh_grad(pre);
  else return acc;
}

}  // namespace trellis::kernels
