// Host GEMM with fused epilogues (contract in kernels/epilogue.hpp):
//   trellis::kernels::host::gemm(args, A, B, C, epilogue::BiasGelu<>{bias, pre});
// A, B and C may each be float, half or bfloat16; the arithmetic is fp32. With TRELLIS_HAS_CBLAS
// (link trellis::blas) the product is OpenBLAS' sgemm, called once per row block of C, and
// the epilogue runs on that block right after it is produced, while it is still in cache: there is
// no second pass over the whole output. Bias epilogues put the bias into C before the product
// (sgemm with beta = 1 adds to it), so Bias alone costs no pass at all; GELU runs as explicit SIMD
// (host::gelu_row in kernels/host_math.hpp). Without CBLAS a plain blocked kernel (threads of
// kernels/thread_pool.hpp) computes the product, so this header compiles with g++ alone.
// 16-bit A/B are converted to fp32 once per batch; 16-bit C goes through an fp32 block buffer.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/epilogue.hpp"
#include "trellis/kernels/host_math.hpp"
#include "trellis/kernels/thread_pool.hpp"

#if defined(TRELLIS_HAS_CBLAS)
// OpenBLAS' sgemm through its Fortran entry point, declared exactly as OpenBLAS' f77blas.h does
// (32-bit integers). cblas.h is not included on purpose: it declares a global `bfloat16` typedef
// that would make trellis::bfloat16 ambiguous in user code saying `using namespace trellis`.
extern "C" void sgemm_(char* transa, char* transb, int* m, int* n, int* k, float* alpha, float* a, int* lda,
                       float* b, int* ldb, float* beta, float* c, int* ldc);
#endif

namespace trellis::kernels::host {

// Tuning knobs; the defaults are what bench/kernels/gemm_bench measured best.
struct GemmOptions {
  // Rows of C per sgemm call + epilogue (0: chosen from n so a block is a few MiB).
  std::int64_t row_block = 0;
};

// True when the product runs on cblas_sgemm.
constexpr bool gemm_uses_cblas() {
#if defined(TRELLIS_HAS_CBLAS)
  return true;
#else
  return false;
#endif
}

namespace detail {

template <class T>
concept GemmElement = std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

inline constexpr std::int64_t epilogue_slices = 8;
inline constexpr std::int64_t parallel_epilogue_elements = std::int64_t{1} << 16;

inline std::int64_t gemm_row_block(const GemmArgs& args, const GemmOptions& options) {
  if (options.row_block > 0) return std::min(options.row_block, std::max<std::int64_t>(args.m, 1));
  // Each sgemm call re-packs B (k x n), which costs about as much as the epilogue itself when a
  // block has fewer than ~500 rows (measured, single thread, CPU time: 1.09x the bare sgemm at
  // 128 rows, 1.03x at 1024 for n = 3072, k = 768). So blocks are tall: ~16 MiB of C, 512 to 2048
  // rows; the epilogue still follows each block's product directly, in the last-level cache.
  constexpr std::int64_t target_bytes = std::int64_t{16} << 20;
  std::int64_t rows = target_bytes / (4 * std::max<std::int64_t>(args.n, 1));
  rows = std::clamp<std::int64_t>(rows, 512, 2048);
  rows = (rows + 15) / 16 * 16;
  return std::min(rows, std::max<std::int64_t>(args.m, 1));
}

inline void check_gemm_args(const GemmArgs& a) {
  TRELLIS_CHECK(a.m >= 0 && a.n >= 0 && a.k >= 0, "gemm: negative size m=", a.m, " n=", a.n, " k=", a.k);
  TRELLIS_CHECK(a.batch >= 1, "gemm: batch must be >= 1, got ", a.batch);
  auto check_ld = [&](const char* name, std::int64_t ld, std::int64_t rows, std::int64_t cols) {
    std::int64_t need = a.packed_ld(rows, cols);
    TRELLIS_CHECK(ld >= need, "gemm: ", name, " = ", ld, " is smaller than ", need, " for a ", rows, " x ",
                  cols, (a.layout == Layout::row_major ? " row-major" : " column-major"), " matrix");
  };
  check_ld("lda", a.lda_or_packed(), a.a_rows(), a.a_cols());
  check_ld("ldb", a.ldb_or_packed(), a.b_rows(), a.b_cols());
  check_ld("ldc", a.ldc_or_packed(), a.m, a.n);
  constexpr std::int64_t int_max = 2147483647;
  TRELLIS_CHECK(a.m <= int_max && a.n <= int_max && a.k <= int_max && a.lda_or_packed() <= int_max &&
                    a.ldb_or_packed() <= int_max && a.ldc_or_packed() <= int_max,
                "gemm: sizes and leading dimensions must fit in 32 bits (BLAS interface)");
  TRELLIS_CHECK(a.batch == 1 || a.stride_c != 0 || a.m * a.n == 0,
                "gemm: stride_c is 0 with batch ", a.batch, " (batches would overwrite each other)");
}

// Converts stored rows x cols of a (possibly 16-bit) matrix to a packed fp32 copy, same layout.
template <class T>
void convert_matrix(const GemmArgs& args, const T* src, std::int64_t ld, std::int64_t rows, std::int64_t cols,
                    std::vector<float>& dst) {
  std::int64_t outer = args.layout == Layout::row_major ? rows : cols;
  std::int64_t inner = args.layout == Layout::row_major ? cols : rows;
  dst.resize(static_cast<std::size_t>(outer * inner));
  for (std::int64_t o = 0; o < outer; ++o) {
    const T* s = src + o * ld;
    float* d = dst.data() + o * inner;
    for (std::int64_t i = 0; i < inner; ++i) d[i] = static_cast<float>(s[i]);
  }
}

// One row block of C in fp32: rows [row0, row0 + rows) of the logical C, at `c` (already offset to
// row0) with leading dimension ldc in args.layout.
struct CBlock {
  float* c;
  std::int64_t ldc;
  std::int64_t row0, rows;
};

// Product of one row block: c = alpha * op(A)[rows] op(B) + beta * c, A and B fp32.
inline void block_product(const GemmArgs& args, const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
                          const CBlock& blk) {
  const std::int64_t n = args.n, k = args.k;
  // A row of op(A): element (i, p) of op(A).
  auto a_at = [&](std::int64_t i, std::int64_t p) {
    return args.op_a == Op::none ? a[args.offset(i, p, lda)] : a[args.offset(p, i, lda)];
  };
  if (k == 0 || args.alpha == 0.0f) {
    for (std::int64_t r = 0; r < blk.rows; ++r)
      for (std::int64_t j = 0; j < n; ++j) {
        float& cv = blk.c[args.offset(r, j, blk.ldc)];
        cv = args.beta == 0.0f ? 0.0f : args.beta * cv;
      }
    return;
  }
#if defined(TRELLIS_HAS_CBLAS)
  (void)a_at;
  const float* a_block = args.op_a == Op::none ? a + args.offset(blk.row0, 0, lda) : a + args.offset(0, blk.row0, lda);
  char ta = args.op_a == Op::none ? 'N' : 'T', tb = args.op_b == Op::none ? 'N' : 'T';
  int rows = static_cast<int>(blk.rows), cols = static_cast<int>(n), depth = static_cast<int>(k);
  int ld_a = static_cast<int>(lda), ld_b = static_cast<int>(ldb), ld_c = static_cast<int>(blk.ldc);
  float alpha = args.alpha, beta = args.beta;
  float* am = const_cast<float*>(a_block);
  float* bm = const_cast<float*>(b);
  if (args.layout == Layout::row_major) {
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
    sgemm_(&tb, &ta, &cols, &rows, &depth, &alpha, bm, &ld_b, am, &ld_a, &beta, blk.c, &ld_c);
  } else {
    sgemm_(&ta, &tb, &rows, &cols, &depth, &alpha, am, &ld_a, bm, &ld_b, &beta, blk.c, &ld_c);
  }
#else
  // b holds op(B) packed row-major (k x n), prepared by the caller. Four rows of C at a time share
  // each streamed row of B; columns go in panels so the 4 x panel accumulators stay in L1.
  (void)ldb;
  constexpr std::int64_t group = 4, panel = 256;
  float acc[group][panel];
  float a_vals[group];
  for (std::int64_t r0 = 0; r0 < blk.rows; r0 += group) {
    const std::int64_t g = std::min(group, blk.rows - r0);
    for (std::int64_t j0 = 0; j0 < n; j0 += panel) {
      const std::int64_t w = std::min(panel, n - j0);
      for (std::int64_t i = 0; i < group; ++i)
        for (std::int64_t j = 0; j < panel; ++j) acc[i][j] = 0.0f;
      for (std::int64_t p = 0; p < k; ++p) {
        for (std::int64_t i = 0; i < group; ++i) a_vals[i] = i < g ? a_at(blk.row0 + r0 + i, p) : 0.0f;
        const float* TRELLIS_RESTRICT brow = b + p * n + j0;
        for (std::int64_t i = 0; i < group; ++i) {
          const float av = a_vals[i];
          float* TRELLIS_RESTRICT arow = acc[i];
          for (std::int64_t j = 0; j < w; ++j) arow[j] += av * brow[j];
        }
      }
      for (std::int64_t i = 0; i < g; ++i)
        for (std::int64_t j = 0; j < w; ++j) {
          float& cv = blk.c[args.offset(r0 + i, j0 + j, blk.ldc)];
          cv = args.alpha * acc[i][j] + (args.beta == 0.0f ? 0.0f : args.beta * cv);
        }
    }
  }
#endif
}

// Bias epilogues put the bias into C before the product, which then runs with beta = 1: sgemm
// with beta = 0 spends a pass zeroing C, so the bias costs nothing and the pass after the product
// is left with the activation only (none for Bias). This is the block's C = beta * C + bias[j].
inline void prefill_bias(const GemmArgs& args, const CBlock& blk, const float* bias) {
  const std::int64_t n = args.n;
  const float beta = args.beta;
  if (args.layout == Layout::row_major) {
    for (std::int64_t r = 0; r < blk.rows; ++r) {
      float* TRELLIS_RESTRICT crow = blk.c + r * blk.ldc;
      if (beta == 0.0f) {
        std::memcpy(crow, bias, static_cast<std::size_t>(n) * sizeof(float));  // C may hold NaN
      } else {
        for (std::int64_t j = 0; j < n; ++j) crow[j] = beta * crow[j] + bias[j];
      }
    }
  } else {
    for (std::int64_t j = 0; j < n; ++j) {
      float* TRELLIS_RESTRICT ccol = blk.c + j * blk.ldc;
      const float bj = bias[j];
      if (beta == 0.0f) {
        for (std::int64_t r = 0; r < blk.rows; ++r) ccol[r] = bj;
      } else {
        for (std::int64_t r = 0; r < blk.rows; ++r) ccol[r] = beta * ccol[r] + bj;
      }
    }
  }
}

// The elementwise part left after the product, the bias being in C already.
template <EpilogueKind K>
TRELLIS_FORCEINLINE float apply_after_bias(float acc, float pre) {
  if constexpr (K == EpilogueKind::relu || K == EpilogueKind::bias_relu) return acc > 0.0f ? acc : 0.0f;
  else if constexpr (K == EpilogueKind::gelu || K == EpilogueKind::bias_gelu) return fast_gelu(acc);
  else if constexpr (K == EpilogueKind::dgelu || K == EpilogueKind::dgelu_bias_grad) return acc * fast_gelu_grad(pre);
  else return acc;
}

// Applies the epilogue to one fp32 block in place, after prefill_bias and the product. pre: the
// block's pre-activation matrix (offset to row0) for epilogues that read or write one; colsum: n
// floats receiving this block's column sums (bias-grad epilogues).
template <EpilogueKind K, class TP>
void apply_epilogue_block(const GemmArgs& args, const CBlock& blk, TP* pre, std::int64_t ld_pre, float* colsum) {
  constexpr bool is_gelu = K == EpilogueKind::gelu || K == EpilogueKind::bias_gelu;
  constexpr bool writes_pre = K == EpilogueKind::bias_gelu;
  constexpr bool reads_pre = K == EpilogueKind::dgelu || K == EpilogueKind::dgelu_bias_grad;
  constexpr bool elementwise = K == EpilogueKind::relu || K == EpilogueKind::bias_relu || reads_pre;
  constexpr bool sums = K == EpilogueKind::bias_grad || K == EpilogueKind::dgelu_bias_grad;
  using PreT = std::remove_const_t<TP>;
  const bool row_major = args.layout == Layout::row_major;
  // Row-major: rows of C are contiguous; column-major: columns are. Either way the loops below run
  // along contiguous lines (`lines` of them, `len` long).
  const std::int64_t lines = row_major ? blk.rows : args.n, len = row_major ? args.n : blk.rows;
  for (std::int64_t l = 0; l < lines; ++l) {
    float* TRELLIS_RESTRICT cline = blk.c + l * blk.ldc;
    if constexpr (is_gelu) {
      // pre-activation out (if asked), activation in place: one pass.
      if constexpr (std::is_same_v<PreT, float>) {
        gelu_row(len, cline, nullptr, writes_pre && pre ? pre + l * ld_pre : nullptr);
      } else {
        if (pre) {
          PreT* TRELLIS_RESTRICT pline = pre + l * ld_pre;
          for (std::int64_t i = 0; i < len; ++i) pline[i] = from_float<PreT>(cline[i]);
        }
        gelu_row(len, cline, nullptr, nullptr);
      }
    } else if constexpr (elementwise) {
      if constexpr (reads_pre && std::is_same_v<PreT, float>) {
        gelu_grad_row(len, cline, pre + l * ld_pre);
      } else if constexpr (reads_pre) {
        const TP* pline = pre + l * ld_pre;
        for (std::int64_t i = 0; i < len; ++i) cline[i] = apply_after_bias<K>(cline[i], to_float(pline[i]));
      } else {
        for (std::int64_t i = 0; i < len; ++i) cline[i] = apply_after_bias<K>(cline[i], 0.0f);
      }
    }
    if constexpr (sums) {
      if (row_major) {
        float* TRELLIS_RESTRICT s = colsum;
        for (std::int64_t j = 0; j < len; ++j) s[j] += cline[j];
      } else {
        // 8 independent partial sums: vectorisable and a fixed order.
        float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        std::int64_t r = 0;
        for (; r + 8 <= len; r += 8)
          for (int q = 0; q < 8; ++q) part[q] += cline[r + q];
        float s = 0.0f;
        for (; r < len; ++r) s += cline[r];
        for (int q = 0; q < 8; ++q) s += part[q];
        colsum[l] += s;
      }
    }
  }
}

template <class E>
struct epilogue_element {
  using type = float;
};
template <template <class> class Tmpl, class T>
struct epilogue_element<Tmpl<T>> {
  using type = T;
};

}  // namespace detail

// C = epilogue(alpha * op(A) op(B) + beta * C), for every batch. See kernels/epilogue.hpp.
template <class TA, class TB, class TC, GemmEpilogue E = epilogue::None>
  requires detail::GemmElement<TA> && detail::GemmElement<TB> && detail::GemmElement<TC>
void gemm(const GemmArgs& args, const TA* a, const TB* b, TC* c, E ep = {}, GemmOptions options = {}) {
  using traits = epilogue_traits<E>;
  constexpr EpilogueKind kind = traits::kind;
  using TE = typename detail::epilogue_element<E>::type;
  detail::check_gemm_args(args);
  const std::int64_t m = args.m, n = args.n, k = args.k;
  const std::int64_t ldc = args.ldc_or_packed();
  if constexpr (traits::bias_grad) {
    TRELLIS_CHECK(ep.bias_grad != nullptr, "gemm: bias-grad epilogue without a bias_grad vector");
  }
  if (m == 0 || n == 0) {
    if constexpr (traits::bias_grad) {
      if (!ep.accumulate)
        for (std::int64_t j = 0; j < n; ++j) ep.bias_grad[j] = from_float<TE>(0.0f);
    }
    return;
  }
  TRELLIS_CHECK(a != nullptr || k == 0, "gemm: A is null");
  TRELLIS_CHECK(b != nullptr || k == 0, "gemm: B is null");
  TRELLIS_CHECK(c != nullptr, "gemm: C is null");

  // Bias as fp32, once.
  std::vector<float> bias;
  if constexpr (traits::has_bias) {
    TRELLIS_CHECK(ep.bias != nullptr, "gemm: bias epilogue without a bias vector");
    bias.resize(static_cast<std::size_t>(n));
    for (std::int64_t j = 0; j < n; ++j) bias[j] = to_float(ep.bias[j]);
  }
  std::int64_t ld_pre = 0, stride_pre = 0;
  if constexpr (traits::reads_pre || traits::writes_pre) {
    if constexpr (traits::reads_pre) TRELLIS_CHECK(ep.pre_activation != nullptr, "gemm: DGelu epilogue without pre_activation");
    ld_pre = ep.ld_pre ? ep.ld_pre : ldc;
    stride_pre = ep.stride_pre ? ep.stride_pre : args.stride_c;
    TRELLIS_CHECK(ld_pre >= args.packed_ld(m, n), "gemm: ld_pre = ", ld_pre, " too small");
  }

  // Bias epilogues: the product adds to C prefilled with beta * C + bias (see prefill_bias).
  GemmArgs product_args = args;
  product_args.beta = 1.0f;

  // Without an epilogue, or with a bias only (fp32 C), nothing runs after the product: one call.
  const bool single_block = (kind == EpilogueKind::none || kind == EpilogueKind::bias) && std::is_same_v<TC, float> &&
                            gemm_uses_cblas() && options.row_block == 0;
  const std::int64_t row_block = single_block ? m : detail::gemm_row_block(args, options);
  const std::int64_t blocks = (m + row_block - 1) / row_block;
  // The epilogue of a block runs on the thread pool over a fixed number of row slices (fixed, so
  // the bias-gradient sums do not depend on the thread count).
  constexpr std::int64_t slices = detail::epilogue_slices;
  std::vector<float> colsums;  // (batch, blocks, slices, n): per-slice column sums, reduced in order
  if constexpr (traits::bias_grad) colsums.assign(static_cast<std::size_t>(args.batch * blocks * slices * n), 0.0f);

  std::vector<float> a32, b32, bpack;
  for (std::int64_t batch = 0; batch < args.batch; ++batch) {
    const TA* a_b = a ? a + batch * args.stride_a : nullptr;
    const TB* b_b = b ? b + batch * args.stride_b : nullptr;
    TC* c_b = c + batch * args.stride_c;
    // fp32 operands.
    const float* af;
    const float* bf;
    std::int64_t lda = args.lda_or_packed(), ldb = args.ldb_or_packed();
    if constexpr (std::is_same_v<TA, float>) {
      af = a_b;
    } else {
      if (batch == 0 || args.stride_a != 0) detail::convert_matrix(args, a_b, lda, args.a_rows(), args.a_cols(), a32);
      af = a32.data();
      lda = args.packed_ld(args.a_rows(), args.a_cols());
    }
    if constexpr (std::is_same_v<TB, float>) {
      bf = b_b;
    } else {
      if (batch == 0 || args.stride_b != 0) detail::convert_matrix(args, b_b, ldb, args.b_rows(), args.b_cols(), b32);
      bf = b32.data();
      ldb = args.packed_ld(args.b_rows(), args.b_cols());
    }
    if (!gemm_uses_cblas() && k > 0) {
      // The fallback kernel streams rows of op(B): pack it row-major k x n.
      if (batch == 0 || args.stride_b != 0 || !std::is_same_v<TB, float>) {
        bpack.resize(static_cast<std::size_t>(k * n));
        for (std::int64_t p = 0; p < k; ++p)
          for (std::int64_t j = 0; j < n; ++j)
            bpack[p * n + j] = args.op_b == Op::none ? bf[args.offset(p, j, ldb)] : bf[args.offset(j, p, ldb)];
      }
      bf = bpack.data();
    }

    auto run_block = [&](std::int64_t blk_index, std::vector<float>& cbuf) {
      const std::int64_t row0 = blk_index * row_block;
      const std::int64_t rows = std::min(row_block, m - row0);
      detail::CBlock blk{};
      blk.row0 = row0;
      blk.rows = rows;
      if constexpr (std::is_same_v<TC, float>) {
        blk.c = c_b + args.offset(row0, 0, ldc);
        blk.ldc = ldc;
      } else {
        // fp32 block buffer in C's layout, packed.
        blk.ldc = args.packed_ld(rows, n);
        cbuf.resize(static_cast<std::size_t>(rows * n));
        blk.c = cbuf.data();
        if (args.beta != 0.0f)
          for (std::int64_t r = 0; r < rows; ++r)
            for (std::int64_t j = 0; j < n; ++j)
              blk.c[args.offset(r, j, blk.ldc)] = to_float(c_b[args.offset(row0 + r, j, ldc)]);
      }
      // The block in `slices` fixed row slices, on the thread pool when it is big enough.
      const std::int64_t slice_rows = (rows + slices - 1) / slices;
      const bool threaded = gemm_uses_cblas() && rows * n >= detail::parallel_epilogue_elements;
      auto for_slices = [&](auto&& fn) {  // fn(slice index, sub-block)
        auto one = [&](std::int64_t slice) {
          detail::CBlock sub = blk;
          sub.row0 = blk.row0 + slice * slice_rows;
          sub.rows = std::min(slice_rows, rows - slice * slice_rows);
          if (sub.rows <= 0) return;
          sub.c = blk.c + args.offset(slice * slice_rows, 0, blk.ldc);
          fn(slice, sub);
        };
        if (threaded) {
          parallel_for(slices, one);
        } else {
          for (std::int64_t slice = 0; slice < slices; ++slice) one(slice);
        }
      };
      if constexpr (traits::has_bias) {
        for_slices([&](std::int64_t, const detail::CBlock& sub) { detail::prefill_bias(args, sub, bias.data()); });
        detail::block_product(product_args, af, lda, bf, ldb, blk);
      } else {
        detail::block_product(args, af, lda, bf, ldb, blk);
      }
      TE* pre = nullptr;
      if constexpr (traits::reads_pre || traits::writes_pre) {
        using PreT = std::remove_const_t<std::remove_pointer_t<decltype(ep.pre_activation)>>;
        static_assert(std::is_same_v<PreT, TE>);
        if (ep.pre_activation) pre = const_cast<TE*>(ep.pre_activation) + batch * stride_pre + args.offset(row0, 0, ld_pre);
      }
      if constexpr (kind != EpilogueKind::none && kind != EpilogueKind::bias) {
        for_slices([&](std::int64_t slice, const detail::CBlock& sub) {
          TE* sub_pre = pre ? pre + args.offset(slice * slice_rows, 0, ld_pre) : nullptr;
          float* colsum = nullptr;
          if constexpr (traits::bias_grad) colsum = colsums.data() + ((batch * blocks + blk_index) * slices + slice) * n;
          detail::apply_epilogue_block<kind, TE>(args, sub, sub_pre, ld_pre, colsum);
        });
      }
      if constexpr (!std::is_same_v<TC, float>) {
        for (std::int64_t r = 0; r < rows; ++r)
          for (std::int64_t j = 0; j < n; ++j)
            c_b[args.offset(row0 + r, j, ldc)] = from_float<TC>(blk.c[args.offset(r, j, blk.ldc)]);
      }
    };

    if constexpr (gemm_uses_cblas()) {
      std::vector<float> cbuf;  // fp32 block of a 16-bit C
      for (std::int64_t blk = 0; blk < blocks; ++blk) run_block(blk, cbuf);
    } else {
      parallel_for(blocks, [&](std::int64_t blk) {
        std::vector<float> cbuf;
        run_block(blk, cbuf);
      });
    }
  }

  if constexpr (traits::bias_grad) {
    for (std::int64_t j = 0; j < n; ++j) {
      float s = ep.accumulate ? to_float(ep.bias_grad[j]) : 0.0f;
      for (std::int64_t i = 0; i < args.batch * blocks * slices; ++i) s += colsums[i * n + j];
      ep.bias_grad[j] = from_float<TE>(s);
    }
  }
}

}  // namespace trellis::kernels::host
