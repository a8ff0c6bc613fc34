// Host GEMM with fused epilogues (contract in kernels/epilogue.hpp):
//   trellis::kernels::host::gemm(args, A, B, C, epilogue::BiasGelu<>{bias, pre});
// A, B and C may each be float, half or bfloat16; the arithmetic is fp32. C is cut into tiles
// chosen from the shape alone (a few MiB each, 8 or more when the product is big enough); each
// tile is one task on the kernel thread pool, which computes the tile's product and at once runs
// the epilogue on it while it is still in cache: there is no second pass over the whole output.
// With TRELLIS_HAS_CBLAS (link trellis::blas) a tile's product is one single-threaded OpenBLAS
// sgemm call: the pool, not OpenBLAS, owns the threads (OpenBLAS' own workers would keep spinning
// after each call and take the cores the epilogue needs; see docs/kernels_host.md). Bias epilogues
// put the bias into C before the product (sgemm with beta = 1 adds to it), so Bias alone costs no
// pass at all; GELU runs as explicit SIMD (host::gelu_row in kernels/host_math.hpp). Without
// CBLAS a plain blocked kernel computes each tile, so this header compiles with g++ alone.
// 16-bit A/B are converted to fp32 once per batch; 16-bit C goes through an fp32 tile buffer.
// Except bf16 x bf16 with TRELLIS_HAS_DNNL (link trellis::dnnl) on a CPU with AMX or AVX512-BF16:
// each tile's product is then a single-threaded oneDNN matmul on the bf16 operands as stored, fp32
// accumulation into the tile's fp32 C (kernels/gemm_dnnl.hpp); epilogues run as for fp32.
// grouped_gemm(groups) runs many GEMMs of different sizes (GemmGroup, e.g. MoE experts) as one
// call: every group's tiles are tasks of a single parallel_for, each group's bits those of gemm.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "trellis/core/dtype.hpp"
#include "trellis/core/error.hpp"
#include "trellis/kernels/epilogue.hpp"
#include "trellis/kernels/blas_core.hpp"
#include "trellis/kernels/gemm_dnnl.hpp"
#include "trellis/kernels/host_math.hpp"
#include "trellis/kernels/thread_pool.hpp"

#if defined(TRELLIS_HAS_CBLAS)
// OpenBLAS' sgemm through its Fortran entry point, declared exactly as OpenBLAS' f77blas.h does
// (32-bit integers). cblas.h is not included on purpose: it declares a global `bfloat16` typedef
// that would make trellis::bfloat16 ambiguous in user code saying `using namespace trellis`.
extern "C" void sgemm_(char* transa, char* transb, int* m, int* n, int* k, float* alpha, float* a, int* lda,
                       float* b, int* ldb, float* beta, float* c, int* ldc);
// OpenBLAS' thread control, weak: other CBLAS libraries link too (and are then expected to run
// single-threaded, e.g. MKL_NUM_THREADS=1).
extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" int openblas_get_num_threads() __attribute__((weak));
// BLIS' (TRELLIS_BLAS=blis; dim_t is 64-bit): it threads when BLIS_NUM_THREADS or OMP_NUM_THREADS say so.
extern "C" void bli_thread_set_num_threads(std::int64_t) __attribute__((weak));
extern "C" std::int64_t bli_thread_get_num_threads() __attribute__((weak));
#endif

namespace trellis::kernels::host {

// Tuning knobs; the defaults are what bench/kernels/gemm_bench measured best.
struct GemmOptions {
  // Rows and columns of C per task (product + epilogue); 0: chosen from the shape (tile_shape).
  std::int64_t tile_rows = 0;
  std::int64_t tile_cols = 0;
  // bf16 x bf16 products: oneDNN where available (automatic) or always via fp32 (convert_fp32).
  Bf16Product bf16_product = Bf16Product::automatic;
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

struct TileShape {
  std::int64_t rows, cols;
};

// The tile of C one task computes. It depends on the shape only, never on the thread count, so the
// bias-gradient sums (per tile, then in tile order) are the same bits on any number of threads.
// Each sgemm call packs its rows of A and its columns of B again (re-packing B costs ~1/rows of
// the product, re-packing A ~1/cols), so tiles are large. First, while there are fewer than 8
// tiles or a tile holds more than 8 MiB of C: halve the rows while they stay >= 512, else the
// columns while they stay >= 1024. Then, if that left a single tile, split it in two (rows while
// >= 128, else columns while >= 256; each half >= 4 MFLOP), so that small products still run on
// two threads. Measured with gemm_bench on 2 threads against the bare 2-thread sgemm, "none"
// epilogue: 512 x 3072 tiles for 4096 x 3072 x 768: 1.01x; 128-row tiles: 1.09x; four tiles
// instead of two for 256 x 768 x 768: 1.07x instead of 1.03x.
inline TileShape tile_shape(const GemmArgs& args, const GemmOptions& options) {
  const std::int64_t m = std::max<std::int64_t>(args.m, 1), n = std::max<std::int64_t>(args.n, 1);
  if (options.tile_rows > 0 || options.tile_cols > 0)
    return {options.tile_rows > 0 ? std::min(options.tile_rows, m) : m,
            options.tile_cols > 0 ? std::min(options.tile_cols, n) : n};
  constexpr std::int64_t target_tiles = 8, max_elements = std::int64_t{2} << 20;
  auto half_of = [](std::int64_t v) { return ((v + 1) / 2 + 15) / 16 * 16; };
  auto tiles = [&](std::int64_t rows, std::int64_t cols) { return ((m + rows - 1) / rows) * ((n + cols - 1) / cols); };
  std::int64_t rows = m, cols = n;
  while (tiles(rows, cols) < target_tiles || rows * cols > max_elements) {
    if (rows >= 2 * 512) rows = half_of(rows);
    else if (cols >= 2 * 1024) cols = half_of(cols);
    else break;
  }
  if (tiles(rows, cols) == 1) {
    const double flops_per_half = static_cast<double>(m) * n * std::max<std::int64_t>(args.k, 1);  // 2mnk / 2
    if (flops_per_half >= 4e6) {
      if (rows >= 2 * 128) rows = half_of(rows);
      else if (cols >= 2 * 256) cols = half_of(cols);
    }
  }
  return {rows, cols};
}

// Makes this thread's OpenBLAS calls single-threaded (process-wide for the pthreads build, per
// calling thread for the OpenMP one), and BLIS' (process-wide): tiles run in parallel on the
// kernel pool instead.
inline void use_single_threaded_blas() {
#if defined(TRELLIS_HAS_CBLAS)
  warn_if_generic_blas();
  if (openblas_set_num_threads && openblas_get_num_threads && openblas_get_num_threads() != 1)
    openblas_set_num_threads(1);
  if (bli_thread_set_num_threads && bli_thread_get_num_threads && bli_thread_get_num_threads() != 1)
    bli_thread_set_num_threads(1);
#endif
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

// One tile of C in fp32: rows [row0, row0 + rows) and columns [col0, col0 + cols) of the logical
// C, at `c` (already offset to (row0, col0)) with leading dimension ldc in args.layout.
struct Tile {
  float* c;
  std::int64_t ldc;
  std::int64_t row0, rows;
  std::int64_t col0, cols;
};

// Product of one tile: c = alpha * op(A)[rows] op(B)[:, cols] + beta * c, A and B fp32.
inline void tile_product(const GemmArgs& args, const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
                         const Tile& t) {
  const std::int64_t k = args.k;
  if (k == 0 || args.alpha == 0.0f) {
    for (std::int64_t r = 0; r < t.rows; ++r)
      for (std::int64_t j = 0; j < t.cols; ++j) {
        float& cv = t.c[args.offset(r, j, t.ldc)];
        cv = args.beta == 0.0f ? 0.0f : args.beta * cv;
      }
    return;
  }
#if defined(TRELLIS_HAS_CBLAS)
  const float* a_tile = args.op_a == Op::none ? a + args.offset(t.row0, 0, lda) : a + args.offset(0, t.row0, lda);
  const float* b_tile = args.op_b == Op::none ? b + args.offset(0, t.col0, ldb) : b + args.offset(t.col0, 0, ldb);
  char ta = args.op_a == Op::none ? 'N' : 'T', tb = args.op_b == Op::none ? 'N' : 'T';
  int rows = static_cast<int>(t.rows), cols = static_cast<int>(t.cols), depth = static_cast<int>(k);
  int ld_a = static_cast<int>(lda), ld_b = static_cast<int>(ldb), ld_c = static_cast<int>(t.ldc);
  float alpha = args.alpha, beta = args.beta;
  float* am = const_cast<float*>(a_tile);
  float* bm = const_cast<float*>(b_tile);
  if (args.layout == Layout::row_major) {
    // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the operands.
    sgemm_(&tb, &ta, &cols, &rows, &depth, &alpha, bm, &ld_b, am, &ld_a, &beta, t.c, &ld_c);
  } else {
    sgemm_(&ta, &tb, &rows, &cols, &depth, &alpha, am, &ld_a, bm, &ld_b, &beta, t.c, &ld_c);
  }
#else
  // b holds op(B) packed row-major (k x n), prepared by the caller. Four rows of C at a time share
  // each streamed row of B; columns go in panels so the 4 x panel accumulators stay in L1.
  (void)ldb;
  const std::int64_t n = args.n;
  auto a_at = [&](std::int64_t i, std::int64_t p) {  // element (i, p) of op(A)
    return args.op_a == Op::none ? a[args.offset(i, p, lda)] : a[args.offset(p, i, lda)];
  };
  constexpr std::int64_t group = 4, panel = 256;
  float acc[group][panel];
  float a_vals[group];
  for (std::int64_t r0 = 0; r0 < t.rows; r0 += group) {
    const std::int64_t g = std::min(group, t.rows - r0);
    for (std::int64_t j0 = 0; j0 < t.cols; j0 += panel) {
      const std::int64_t w = std::min(panel, t.cols - j0);
      for (std::int64_t i = 0; i < group; ++i)
        for (std::int64_t j = 0; j < panel; ++j) acc[i][j] = 0.0f;
      for (std::int64_t p = 0; p < k; ++p) {
        for (std::int64_t i = 0; i < group; ++i) a_vals[i] = i < g ? a_at(t.row0 + r0 + i, p) : 0.0f;
        const float* TRELLIS_RESTRICT brow = b + p * n + t.col0 + j0;
        for (std::int64_t i = 0; i < group; ++i) {
          const float av = a_vals[i];
          float* TRELLIS_RESTRICT arow = acc[i];
          for (std::int64_t j = 0; j < w; ++j) arow[j] += av * brow[j];
        }
      }
      for (std::int64_t i = 0; i < g; ++i)
        for (std::int64_t j = 0; j < w; ++j) {
          float& cv = t.c[args.offset(r0 + i, j0 + j, t.ldc)];
          cv = args.alpha * acc[i][j] + (args.beta == 0.0f ? 0.0f : args.beta * cv);
        }
    }
  }
#endif
}

// Bias epilogues put the bias into C before the product, which then runs with beta = 1: sgemm
// with beta = 0 spends a pass zeroing C, so the bias costs nothing and the pass after the product
// is left with the activation only (none for Bias). This is the tile's C = beta * C + bias[j].
inline void prefill_bias(const GemmArgs& args, const Tile& t, const float* bias) {
  const float beta = args.beta;
  const float* tile_bias = bias + t.col0;
  if (args.layout == Layout::row_major) {
    for (std::int64_t r = 0; r < t.rows; ++r) {
      float* TRELLIS_RESTRICT crow = t.c + r * t.ldc;
      if (beta == 0.0f) {
        std::memcpy(crow, tile_bias, static_cast<std::size_t>(t.cols) * sizeof(float));  // C may hold NaN
      } else {
        for (std::int64_t j = 0; j < t.cols; ++j) crow[j] = beta * crow[j] + tile_bias[j];
      }
    }
  } else {
    for (std::int64_t j = 0; j < t.cols; ++j) {
      float* TRELLIS_RESTRICT ccol = t.c + j * t.ldc;
      const float bj = tile_bias[j];
      if (beta == 0.0f) {
        for (std::int64_t r = 0; r < t.rows; ++r) ccol[r] = bj;
      } else {
        for (std::int64_t r = 0; r < t.rows; ++r) ccol[r] = beta * ccol[r] + bj;
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

// Applies the epilogue to one fp32 tile in place, after prefill_bias and the product. pre: the
// tile's pre-activation matrix (offset to (row0, col0)) for epilogues that read or write one;
// colsum: n floats receiving this tile's column sums at [col0, col0 + cols) (bias-grad epilogues).
template <EpilogueKind K, class TP>
void apply_epilogue_tile(const GemmArgs& args, const Tile& t, TP* pre, std::int64_t ld_pre, float* colsum) {
  constexpr bool is_gelu = K == EpilogueKind::gelu || K == EpilogueKind::bias_gelu;
  constexpr bool writes_pre = K == EpilogueKind::bias_gelu;
  constexpr bool reads_pre = K == EpilogueKind::dgelu || K == EpilogueKind::dgelu_bias_grad;
  constexpr bool elementwise = K == EpilogueKind::relu || K == EpilogueKind::bias_relu || reads_pre;
  constexpr bool sums = K == EpilogueKind::bias_grad || K == EpilogueKind::dgelu_bias_grad;
  using PreT = std::remove_const_t<TP>;
  const bool row_major = args.layout == Layout::row_major;
  // Row-major: rows of C are contiguous; column-major: columns are. Either way the loops below run
  // along contiguous lines (`lines` of them, `len` long).
  const std::int64_t lines = row_major ? t.rows : t.cols, len = row_major ? t.cols : t.rows;
  for (std::int64_t l = 0; l < lines; ++l) {
    float* TRELLIS_RESTRICT cline = t.c + l * t.ldc;
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
        float* TRELLIS_RESTRICT s = colsum + t.col0;
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
        colsum[t.col0 + l] += s;
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

// The fp32 operands of one product (one batch of a gemm, one group of a grouped_gemm): fp32
// matrices as the caller stored them, 16-bit ones as packed fp32 copies held here, and for the
// fallback kernel op(B) packed row-major k x n. Unused (null) on the oneDNN path, which reads
// the bf16 operands as stored; lda and ldb are then the caller's.
struct Fp32Operands {
  const float* a = nullptr;
  const float* b = nullptr;
  std::int64_t lda = 0, ldb = 0;
  std::vector<float> a32, b32, bpack;
};

// One GEMM call (all its batches), checked and prepared to run as tasks on the kernel pool, one
// task per tile of C. host::gemm runs one plan, a parallel_for per batch; host::grouped_gemm one
// plan per group, the tiles of all groups in a single parallel_for. The constructor checks the
// arguments and prepares what the batches share (bias in fp32, tiling, room for the bias-gradient
// partial sums); prepare_operands readies one batch's A and B; run_tile computes one tile
// (product, then the epilogue while the tile is in cache), in any order and on any thread;
// finish() writes the bias gradient, reducing the per-tile sums in a fixed order.
template <class TA, class TB, class TC, class E>
class GemmPlan {
 public:
  using traits = epilogue_traits<E>;
  using TE = typename epilogue_element<E>::type;
  static constexpr EpilogueKind kind = traits::kind;

  GemmPlan(const GemmArgs& args, const TA* a, const TB* b, TC* c, const E& ep, const GemmOptions& options)
      : args_(args), product_args_(args), a_(a), b_(b), c_(c), ep_(ep) {
    check_gemm_args(args);
    const std::int64_t m = args.m, n = args.n;
    if constexpr (traits::bias_grad) {
      TRELLIS_CHECK(ep.bias_grad != nullptr, "gemm: bias-grad epilogue without a bias_grad vector");
    }
    if (empty()) return;  // nothing to compute; finish() zeroes an overwritten bias gradient
    TRELLIS_CHECK(a != nullptr || args.k == 0, "gemm: A is null");
    TRELLIS_CHECK(b != nullptr || args.k == 0, "gemm: B is null");
    TRELLIS_CHECK(c != nullptr, "gemm: C is null");
    ldc_ = args.ldc_or_packed();
    // Bias as fp32, once.
    if constexpr (traits::has_bias) {
      TRELLIS_CHECK(ep.bias != nullptr, "gemm: bias epilogue without a bias vector");
      bias_.resize(static_cast<std::size_t>(n));
      for (std::int64_t j = 0; j < n; ++j) bias_[j] = to_float(ep.bias[j]);
    }
    if constexpr (traits::reads_pre || traits::writes_pre) {
      if constexpr (traits::reads_pre) TRELLIS_CHECK(ep.pre_activation != nullptr, "gemm: DGelu epilogue without pre_activation");
      ld_pre_ = ep.ld_pre ? ep.ld_pre : ldc_;
      stride_pre_ = ep.stride_pre ? ep.stride_pre : args.stride_c;
      TRELLIS_CHECK(ld_pre_ >= args.packed_ld(m, n), "gemm: ld_pre = ", ld_pre_, " too small");
    }
    // Bias epilogues: the product adds to C prefilled with beta * C + bias (see prefill_bias).
    if constexpr (traits::has_bias) product_args_.beta = 1.0f;
    tile_ = tile_shape(args, options);
    row_tiles_ = (m + tile_.rows - 1) / tile_.rows;
    col_tiles_ = (n + tile_.cols - 1) / tile_.cols;
    // (batch, row tile, n): column sums per row of tiles, reduced in order by finish()
    if constexpr (traits::bias_grad) colsums_.assign(static_cast<std::size_t>(args.batch * row_tiles_ * n), 0.0f);
    // bf16 x bf16 on oneDNN (no fp32 copies of A and B), when linked and native on this CPU.
    if constexpr (std::is_same_v<TA, bfloat16> && std::is_same_v<TB, bfloat16>)
      use_dnnl_ = options.bf16_product == Bf16Product::automatic && has_product() && dnnl_bf16_native();
  }

  const GemmArgs& args() const { return args_; }
  // C has no element: no tile to run.
  bool empty() const { return args_.m == 0 || args_.n == 0; }
  // Tiles of C per batch (0 when empty).
  std::int64_t tiles() const { return row_tiles_ * col_tiles_; }
  // What computes the products (as last_gemm_product() reports it).
  GemmProduct product() const {
    if (empty() || !has_product()) return GemmProduct::none;
    return use_dnnl_ ? GemmProduct::dnnl_bf16 : GemmProduct::fp32;
  }
  // Rough cost of one tile (multiply-adds, plus one per element for the passes over C), for ordering tasks.
  double tile_cost() const {
    return static_cast<double>(tile_.rows) * static_cast<double>(tile_.cols) * static_cast<double>(args_.k + 1);
  }

  // Readies batch `batch`'s A and B in `ops` (see Fp32Operands). fresh_a / fresh_b false: that
  // operand is the one `ops` was last prepared with (a batch stride of 0), whose copy is reused.
  void prepare_operands(std::int64_t batch, bool fresh_a, bool fresh_b, Fp32Operands& ops) const {
    const GemmArgs& args = args_;
    const TA* a_b = a_ ? a_ + batch * args.stride_a : nullptr;
    const TB* b_b = b_ ? b_ + batch * args.stride_b : nullptr;
    ops.lda = args.lda_or_packed();
    ops.ldb = args.ldb_or_packed();
    if (use_dnnl_) {  // bf16 x bf16: each tile reads the operands as stored
      ops.a = ops.b = nullptr;
      return;
    }
    if constexpr (std::is_same_v<TA, float>) {
      ops.a = a_b;
    } else {
      if (fresh_a) convert_matrix(args, a_b, ops.lda, args.a_rows(), args.a_cols(), ops.a32);
      ops.a = ops.a32.data();
      ops.lda = args.packed_ld(args.a_rows(), args.a_cols());
    }
    if constexpr (std::is_same_v<TB, float>) {
      ops.b = b_b;
    } else {
      if (fresh_b) convert_matrix(args, b_b, ops.ldb, args.b_rows(), args.b_cols(), ops.b32);
      ops.b = ops.b32.data();
      ops.ldb = args.packed_ld(args.b_rows(), args.b_cols());
    }
    const std::int64_t k = args.k, n = args.n;
    if (!gemm_uses_cblas() && k > 0) {
      // The fallback kernel streams rows of op(B): pack it row-major k x n.
      if (fresh_b || !std::is_same_v<TB, float>) {
        const float* bf = ops.b;
        const std::int64_t ldb = ops.ldb;
        ops.bpack.resize(static_cast<std::size_t>(k * n));
        for (std::int64_t p = 0; p < k; ++p)
          for (std::int64_t j = 0; j < n; ++j)
            ops.bpack[p * n + j] = args.op_b == Op::none ? bf[args.offset(p, j, ldb)] : bf[args.offset(j, p, ldb)];
      }
      ops.b = ops.bpack.data();
    }
  }

  // Tile `index` (tiles numbered row-major over the tile grid) of batch `batch`, whose operands
  // `ops` holds: product, then the epilogue while the tile is in cache. Tiles write disjoint parts
  // of C, the pre-activation and the partial column sums, so they may run concurrently.
  void run_tile(std::int64_t batch, const Fp32Operands& ops, std::int64_t index) {
    use_single_threaded_blas();  // OpenMP OpenBLAS: per thread
    const GemmArgs& args = args_;
    const std::int64_t m = args.m, n = args.n, ldc = ldc_;
    const TA* a_b = a_ ? a_ + batch * args.stride_a : nullptr;
    const TB* b_b = b_ ? b_ + batch * args.stride_b : nullptr;
    TC* c_b = c_ + batch * args.stride_c;
    const std::int64_t tile_row = index / col_tiles_, tile_col = index % col_tiles_;
    Tile t{};
    t.row0 = tile_row * tile_.rows;
    t.rows = std::min(tile_.rows, m - t.row0);
    t.col0 = tile_col * tile_.cols;
    t.cols = std::min(tile_.cols, n - t.col0);
    if constexpr (std::is_same_v<TC, float>) {
      t.c = c_b + args.offset(t.row0, t.col0, ldc);
      t.ldc = ldc;
    } else {
      // fp32 tile buffer in C's layout, packed; kept per thread so big tiles are not re-faulted.
      thread_local std::vector<float> buffer;
      t.ldc = args.packed_ld(t.rows, t.cols);
      buffer.resize(static_cast<std::size_t>(t.rows * t.cols));
      t.c = buffer.data();
      if (args.beta != 0.0f)
        for (std::int64_t r = 0; r < t.rows; ++r)
          for (std::int64_t j = 0; j < t.cols; ++j)
            t.c[args.offset(r, j, t.ldc)] = to_float(c_b[args.offset(t.row0 + r, t.col0 + j, ldc)]);
    }
    if constexpr (traits::has_bias) prefill_bias(args, t, bias_.data());
    if (use_dnnl_) {
      dnnl_tile_product(product_args_, a_b, ops.lda, b_b, ops.ldb, t.c, t.ldc, t.row0, t.rows, t.col0, t.cols);
    } else {
      tile_product(product_args_, ops.a, ops.lda, ops.b, ops.ldb, t);
    }
    if constexpr (kind != EpilogueKind::none && kind != EpilogueKind::bias) {
      TE* pre = nullptr;
      if constexpr (traits::reads_pre || traits::writes_pre) {
        using PreT = std::remove_const_t<std::remove_pointer_t<decltype(ep_.pre_activation)>>;
        static_assert(std::is_same_v<PreT, TE>);
        if (ep_.pre_activation)
          pre = const_cast<TE*>(ep_.pre_activation) + batch * stride_pre_ + args.offset(t.row0, t.col0, ld_pre_);
      }
      float* colsum = nullptr;
      if constexpr (traits::bias_grad) colsum = colsums_.data() + (batch * row_tiles_ + tile_row) * n;
      apply_epilogue_tile<kind, TE>(args, t, pre, ld_pre_, colsum);
    }
    if constexpr (!std::is_same_v<TC, float>) {
      for (std::int64_t r = 0; r < t.rows; ++r)
        for (std::int64_t j = 0; j < t.cols; ++j)
          c_b[args.offset(t.row0 + r, t.col0 + j, ldc)] = from_float<TC>(t.c[args.offset(r, j, t.ldc)]);
    }
  }

  // After every tile: the bias gradient (bias-grad epilogues), g[j] (+)= the tiles' column sums in
  // (batch, row tile) order; an empty C leaves an overwritten gradient at 0.
  void finish() {
    if constexpr (traits::bias_grad) {
      const std::int64_t n = args_.n;
      if (empty()) {
        if (!ep_.accumulate)
          for (std::int64_t j = 0; j < n; ++j) ep_.bias_grad[j] = from_float<TE>(0.0f);
        return;
      }
      for (std::int64_t j = 0; j < n; ++j) {
        float s = ep_.accumulate ? to_float(ep_.bias_grad[j]) : 0.0f;
        for (std::int64_t i = 0; i < args_.batch * row_tiles_; ++i) s += colsums_[i * n + j];
        ep_.bias_grad[j] = from_float<TE>(s);
      }
    }
  }

 private:
  bool has_product() const { return args_.k > 0 && args_.alpha != 0.0f; }

  GemmArgs args_, product_args_;
  const TA* a_;
  const TB* b_;
  TC* c_;
  E ep_;
  std::int64_t ldc_ = 0, ld_pre_ = 0, stride_pre_ = 0;
  TileShape tile_{1, 1};
  std::int64_t row_tiles_ = 0, col_tiles_ = 0;
  bool use_dnnl_ = false;
  std::vector<float> bias_;     // fp32 bias (bias epilogues)
  std::vector<float> colsums_;  // (batch, row tile, n) column sums (bias-grad epilogues)
};

}  // namespace detail

// C = epilogue(alpha * op(A) op(B) + beta * C), for every batch. See kernels/epilogue.hpp.
template <class TA, class TB, class TC, GemmEpilogue E = epilogue::None>
  requires detail::GemmElement<TA> && detail::GemmElement<TB> && detail::GemmElement<TC>
void gemm(const GemmArgs& args, const TA* a, const TB* b, TC* c, E ep = {}, GemmOptions options = {}) {
  detail::GemmPlan<TA, TB, TC, E> plan(args, a, b, c, ep, options);
  detail::last_product_slot() = plan.product();
  if (!plan.empty()) {
    detail::Fp32Operands ops;
    for (std::int64_t batch = 0; batch < args.batch; ++batch) {
      plan.prepare_operands(batch, batch == 0 || args.stride_a != 0, batch == 0 || args.stride_b != 0, ops);
      // One task per tile: product, then the epilogue while the tile is in cache.
      detail::use_single_threaded_blas();  // before any task starts (pthreads OpenBLAS: process-wide)
      parallel_for(plan.tiles(), [&](std::int64_t index) { plan.run_tile(batch, ops, index); });
    }
  }
  plan.finish();
}

// Many GEMMs of different sizes in one call (e.g. the experts of a Mixture-of-Experts layer):
// the same results, bit for bit, as gemm(g.args, g.a, g.b, g.c, g.ep, options) for each group g in
// order, but the tiles of all groups are tasks of a single parallel_for, so that one big group
// among small or empty ones keeps every thread busy and the pool is dispatched once. Each group
// is one GEMM (args.batch == 1). The groups' outputs (C, pre-activation) must not overlap each
// other nor any group's inputs; groups may share a bias-gradient vector (accumulate: each adds
// its sums, in group order). 16-bit operands are converted to fp32 per group before the tiles run
// (the copies live for the call), or read as stored on the oneDNN bf16 path.
template <class TA, class TB, class TC, GemmEpilogue E = epilogue::None>
  requires detail::GemmElement<TA> && detail::GemmElement<TB> && detail::GemmElement<TC>
void grouped_gemm(std::span<const GemmGroup<TA, TB, TC, E>> groups, GemmOptions options = {}) {
  using Plan = detail::GemmPlan<TA, TB, TC, E>;
  const std::size_t count = groups.size();
  std::vector<Plan> plans;
  plans.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    const GemmGroup<TA, TB, TC, E>& g = groups[i];
    TRELLIS_CHECK(g.args.batch == 1, "grouped_gemm: group ", i, " has batch = ", g.args.batch,
                  "; each group is a single GEMM (batch 1)");
    try {
      plans.emplace_back(g.args, g.a, g.b, g.c, g.ep, options);
    } catch (const Error& e) {  // name the group
      throw Error("grouped_gemm: group " + std::to_string(i) + ": " + e.message(), e.file(), e.line(), e.rank());
    }
  }
  // Operands, then the task list: groups by decreasing cost per tile (the results do not depend
  // on the order), so that the last tasks to start are the smallest ones.
  std::vector<detail::Fp32Operands> ops(count);
  std::vector<std::size_t> order;
  GemmProduct product = GemmProduct::none;
  for (std::size_t i = 0; i < count; ++i) {
    if (plans[i].empty()) continue;
    plans[i].prepare_operands(0, true, true, ops[i]);
    order.push_back(i);
    if (product == GemmProduct::none) product = plans[i].product();
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t x, std::size_t y) { return plans[x].tile_cost() > plans[y].tile_cost(); });
  std::vector<std::int64_t> first(order.size() + 1, 0);  // first task of each group in `order`
  for (std::size_t s = 0; s < order.size(); ++s) first[s + 1] = first[s] + plans[order[s]].tiles();
  detail::last_product_slot() = product;
  detail::use_single_threaded_blas();  // before any task starts (pthreads OpenBLAS: process-wide)
  parallel_for(first.back(), [&](std::int64_t task) {
    const std::size_t s = static_cast<std::size_t>(std::upper_bound(first.begin(), first.end(), task) - first.begin()) - 1;
    const std::size_t i = order[s];
    plans[i].run_tile(0, ops[i], task - first[s]);
  });
  for (Plan& plan : plans) plan.finish();
}

// The same for groups held in a vector (a span parameter does not deduce from one).
template <class TA, class TB, class TC, GemmEpilogue E>
  requires detail::GemmElement<TA> && detail::GemmElement<TB> && detail::GemmElement<TC>
void grouped_gemm(const std::vector<GemmGroup<TA, TB, TC, E>>& groups, GemmOptions options = {}) {
  grouped_gemm(std::span<const GemmGroup<TA, TB, TC, E>>(groups), options);
}

}  // namespace trellis::kernels::host
