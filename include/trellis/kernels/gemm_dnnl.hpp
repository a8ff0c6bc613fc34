// bf16 GEMM tiles on oneDNN (AMX / AVX512-BF16), used by host::gemm (kernels/gemm_host.hpp)
// when both operands are bfloat16 and the program links trellis::dnnl (TRELLIS_HAS_DNNL).
// A tile's product runs as one single-threaded oneDNN matmul, bf16 x bf16 with fp32 accumulation
// into the tile's fp32 C, straight from the caller's bf16 operands (no fp32 copies of A and B):
// the kernel pool owns the threads, as with OpenBLAS (docs/kernels_host.md).
// Without TRELLIS_HAS_DNNL this header declares the same names and reports "not available", so it
// compiles with g++ alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "trellis/core/error.hpp"
#include "trellis/kernels/epilogue.hpp"

#if defined(TRELLIS_HAS_DNNL)
#include <algorithm>
#include <compare>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include <dnnl.hpp>
#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
#include <omp.h>  // trellis::dnnl links libgomp itself (the runtime Debian's oneDNN is built with)
#endif
#endif

namespace trellis::kernels::host {

// What ran the products of a host::gemm call (see last_gemm_product()).
enum class GemmProduct {
  none,            // no product (empty C, k = 0 or alpha = 0)
  fp32,            // fp32 operands (16-bit ones converted first) on OpenBLAS sgemm or the fallback
  dnnl_bf16,       // bf16 operands on oneDNN's native bf16 matmul (AMX or AVX512-BF16)
};

inline const char* to_string(GemmProduct p) {
  switch (p) {
    case GemmProduct::none: return "none";
    case GemmProduct::fp32: return "fp32";
    case GemmProduct::dnnl_bf16: return "dnnl_bf16";
  }
  return "?";
}

// How host::gemm computes a product whose A and B are both bfloat16.
enum class Bf16Product {
  automatic,     // oneDNN when linked and the CPU has native bf16 (AMX / AVX512-BF16), else fp32
  convert_fp32,  // always convert A and B to fp32 and run the fp32 path (the reference behaviour)
};

namespace detail {

inline GemmProduct& last_product_slot() {
  thread_local GemmProduct last = GemmProduct::none;
  return last;
}

}  // namespace detail

// The product path of the calling thread's most recent host::gemm call.
inline GemmProduct last_gemm_product() { return detail::last_product_slot(); }

#if defined(TRELLIS_HAS_DNNL)

namespace detail {

// One per process, as oneDNN wants. Never destroyed: the kernel pool's threads (a static that may
// be destroyed after this one) release their thread_local streams of it at exit.
inline dnnl::engine& dnnl_engine() {
  static dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

// One tile's matmul: C (rows x cols, fp32) = alpha * A (rows x k, bf16) B (k x cols, bf16) [+ beta C],
// each matrix given by its two element strides (any layout or transpose).
struct DnnlKey {
  std::int64_t rows, cols, k;
  std::int64_t a_s0, a_s1, b_s0, b_s1, c_s0, c_s1;
  std::uint32_t alpha_bits, beta_bits;
  auto operator<=>(const DnnlKey&) const = default;
};

struct DnnlMatmul {
  dnnl::matmul primitive;
  dnnl::memory::desc a, b, c, scratchpad;
  std::string impl;  // oneDNN's implementation name, e.g. "brg:avx512_core_amx_bf16"
};

inline std::uint32_t float_bits(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

inline std::shared_ptr<const DnnlMatmul> make_dnnl_matmul(const DnnlKey& key) {
  using dt = dnnl::memory::data_type;
  auto out = std::make_shared<DnnlMatmul>();
  out->a = dnnl::memory::desc({key.rows, key.k}, dt::bf16, {key.a_s0, key.a_s1});
  out->b = dnnl::memory::desc({key.k, key.cols}, dt::bf16, {key.b_s0, key.b_s1});
  out->c = dnnl::memory::desc({key.rows, key.cols}, dt::f32, {key.c_s0, key.c_s1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);  // per-thread scratchpads: concurrent ranks
  float alpha, beta;
  std::memcpy(&alpha, &key.alpha_bits, sizeof alpha);
  std::memcpy(&beta, &key.beta_bits, sizeof beta);
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {  // beta = 0 never reads C (it may hold NaN)
    dnnl::post_ops ops;
    ops.append_sum(beta);
    attr.set_post_ops(ops);
  }
  dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(out->a, out->b, out->c), attr, dnnl_engine());
  out->impl = pd.impl_info_str();
  out->scratchpad = pd.scratchpad_desc();
  out->primitive = dnnl::matmul(pd);
  return out;
}

// Primitives cached per tile shape, strides, alpha and beta: creating one costs ~0.1-1 ms, a
// training step reuses a few dozen. Shared by all threads (executing one primitive from several
// threads at once is safe with user scratchpads).
inline std::shared_ptr<const DnnlMatmul> dnnl_matmul(const DnnlKey& key) {
  static std::mutex mutex;
  static std::map<DnnlKey, std::shared_ptr<const DnnlMatmul>> cache;
  std::lock_guard lock(mutex);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (cache.size() >= 1024) cache.clear();  // shapes that keep changing: bound the memory
  try {
    return cache[key] = make_dnnl_matmul(key);
  } catch (const dnnl::error& e) {
    TRELLIS_THROW("gemm: oneDNN matmul for a ", key.rows, " x ", key.cols, " x ", key.k,
                 " bf16 tile could not be created: ", e.what());
  }
}

// oneDNN's implementation for a typical bf16 tile on this CPU, probed once.
inline const std::string& dnnl_bf16_impl() {
  static const std::string impl = [] {
    try {
      return make_dnnl_matmul(DnnlKey{128, 256, 256, 256, 1, 256, 1, 256, 1, float_bits(1.0f), 0})->impl;
    } catch (const dnnl::error&) {
      return std::string("unavailable");
    }
  }();
  return impl;
}

// Single-threaded oneDNN: the calling thread (a kernel-pool task) is one of the pool's threads.
inline void dnnl_single_threaded() {
#if DNNL_CPU_RUNTIME == DNNL_RUNTIME_OMP
  thread_local bool done = [] {
    omp_set_num_threads(1);  // this thread's OpenMP default only
    return true;
  }();
  (void)done;
#endif
}

// Product of one tile (kernels/gemm_host.hpp's Tile fields passed apart): c = alpha * op(A)[rows of
// the tile] op(B)[:, cols of the tile] + beta * c, A and B bf16 as stored by the caller.
// dst (rows x k, row-major) = the matrix whose (i, p) element is src[i * si + p * sp]: op(A)'s rows
// made contiguous. A weight gradient's op(A) = X^T has si = 1, and then 8 x 8 blocks are
// transposed in registers (SSE2 unpacks): the scalar loop, one strided 2-byte store per element,
// took ~6 % of a GPT-2 124M bf16 step (perf, AVX512-BF16 machine); rows and k not multiples of 8
// finish element by element.
inline void pack_rows(const std::uint16_t* src, std::int64_t si, std::int64_t sp, std::int64_t rows, std::int64_t k,
                      std::uint16_t* dst) {
  std::int64_t i_vec = 0, p_vec = 0;
#if defined(__SSE2__)
  if (si == 1) {
    i_vec = rows / 8 * 8;
    p_vec = k / 8 * 8;
    for (std::int64_t i0 = 0; i0 < i_vec; i0 += 8)
      for (std::int64_t p0 = 0; p0 < p_vec; p0 += 8) {
        __m128i r[8];  // r[j]: elements (i0 .. i0 + 7, p0 + j)
        for (int j = 0; j < 8; ++j)
          r[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i0 + (p0 + j) * sp));
        __m128i t[8], u[8];
        for (int j = 0; j < 4; ++j) {
          t[2 * j] = _mm_unpacklo_epi16(r[2 * j], r[2 * j + 1]);
          t[2 * j + 1] = _mm_unpackhi_epi16(r[2 * j], r[2 * j + 1]);
        }
        for (int h = 0; h < 2; ++h)  // h = 0: rows 0-3, 1: rows 4-7 of the block's p
          for (int j = 0; j < 2; ++j) {
            u[4 * h + 2 * j] = _mm_unpacklo_epi32(t[4 * h + j], t[4 * h + 2 + j]);
            u[4 * h + 2 * j + 1] = _mm_unpackhi_epi32(t[4 * h + j], t[4 * h + 2 + j]);
          }
        for (int c = 0; c < 4; ++c) {  // u[c]: elements i0 + 2c, i0 + 2c + 1 of p0 .. p0 + 3
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (i0 + 2 * c) * k + p0), _mm_unpacklo_epi64(u[c], u[4 + c]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (i0 + 2 * c + 1) * k + p0),
                           _mm_unpackhi_epi64(u[c], u[4 + c]));
        }
      }
  }
#endif
  // The rest element by element: columns p_vec.. of rows ..i_vec, then rows i_vec.. whole.
  auto scalar = [&](std::int64_t i_begin, std::int64_t i_end, std::int64_t p_begin) {
    constexpr std::int64_t block = 32;  // both sides of the transpose stay in L1
    for (std::int64_t i0 = i_begin; i0 < i_end; i0 += block)
      for (std::int64_t p0 = p_begin; p0 < k; p0 += block) {
        const std::int64_t i1 = std::min(i_end, i0 + block), p1 = std::min(k, p0 + block);
        for (std::int64_t p = p0; p < p1; ++p)
          for (std::int64_t i = i0; i < i1; ++i) dst[i * k + p] = src[i * si + p * sp];
      }
  };
  scalar(0, i_vec, p_vec);
  scalar(i_vec, rows, 0);
}

inline void dnnl_tile_product(const GemmArgs& args, const void* a, std::int64_t lda, const void* b,
                              std::int64_t ldb, float* c, std::int64_t ldc, std::int64_t row0, std::int64_t rows,
                              std::int64_t col0, std::int64_t cols) {
  // Element strides of a stored matrix: (i, j) is at offset(i, j, ld).
  auto s0 = [&](std::int64_t ld) { return args.offset(1, 0, ld); };
  auto s1 = [&](std::int64_t ld) { return args.offset(0, 1, ld); };
  const bool ta = args.op_a != Op::none, tb = args.op_b != Op::none;
  DnnlKey key{rows,
              cols,
              args.k,
              ta ? s1(lda) : s0(lda),
              ta ? s0(lda) : s1(lda),
              tb ? s1(ldb) : s0(ldb),
              tb ? s0(ldb) : s1(ldb),
              s0(ldc),
              s1(ldc),
              float_bits(args.alpha),
              float_bits(args.beta)};
  const auto* a16 = static_cast<const std::uint16_t*>(a);
  const auto* b16 = static_cast<const std::uint16_t*>(b);
  const std::uint16_t* a_tile = ta ? a16 + args.offset(0, row0, lda) : a16 + args.offset(row0, 0, lda);
  const std::uint16_t* b_tile = tb ? b16 + args.offset(col0, 0, ldb) : b16 + args.offset(0, col0, ldb);
  // oneDNN 2.6 runs AMX only for an A whose rows are contiguous; any other A (weight gradients:
  // op(A) = X^T) goes to its AVX-512 gemm at ~40% of the speed (measured, single thread: 127 vs
  // 378 GFLOP/s for a 1584 x 768 x 256 tile). So such a tile's rows of op(A) are copied to a
  // packed rows x k buffer first (rows * k elements against 2 * rows * cols * k flops).
  thread_local std::vector<std::uint16_t> a_packed;
  if (key.a_s1 != 1) {
    a_packed.resize(static_cast<std::size_t>(rows * args.k));
    pack_rows(a_tile, key.a_s0, key.a_s1, rows, args.k, a_packed.data());
    a_tile = a_packed.data();
    key.a_s0 = args.k;
    key.a_s1 = 1;
  }
  const auto mm = dnnl_matmul(key);
  dnnl_single_threaded();
  dnnl::engine& engine = dnnl_engine();
  thread_local dnnl::stream stream(engine);
  thread_local std::vector<std::byte> scratch;
  const std::size_t scratch_bytes = mm->scratchpad.get_size();
  if (scratch.size() < scratch_bytes) scratch.resize(scratch_bytes);
  dnnl::memory am(mm->a, engine, const_cast<std::uint16_t*>(a_tile));
  dnnl::memory bm(mm->b, engine, const_cast<std::uint16_t*>(b_tile));
  dnnl::memory cm(mm->c, engine, c);
  dnnl::memory sm(mm->scratchpad, engine, scratch.data());
  mm->primitive.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}, {DNNL_ARG_SCRATCHPAD, sm}});
  stream.wait();
}

}  // namespace detail

// oneDNN's implementation of bf16 products on this CPU ("brg:avx512_core_amx_bf16" with AMX), or
// "" without trellis::dnnl.
inline std::string dnnl_bf16_implementation() { return detail::dnnl_bf16_impl(); }

// True when host::gemm runs bf16 x bf16 products on oneDNN: linked, oneDNN picked a native bf16
// kernel (AMX or AVX512-BF16; anything else, e.g. its reference code, is slower than fp32 sgemm),
// and the environment does not say TRELLIS_DNNL=0 (which measures the fp32 path in the same binary).
inline bool dnnl_bf16_native() {
  static const bool native = [] {
    const char* env = std::getenv("TRELLIS_DNNL");
    if (env && std::string(env) == "0") return false;
    const std::string& impl = detail::dnnl_bf16_impl();
    return impl.find("amx") != std::string::npos || impl.find("bf16") != std::string::npos;
  }();
  return native;
}

#else

namespace detail {
// Never called: dnnl_bf16_native() is false without oneDNN.
inline void dnnl_tile_product(const GemmArgs&, const void*, std::int64_t, const void*, std::int64_t, float*,
                              std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t) {
  TRELLIS_THROW("gemm: oneDNN product requested in a build without trellis::dnnl");
}
}  // namespace detail

inline std::string dnnl_bf16_implementation() { return ""; }
inline bool dnnl_bf16_native() { return false; }

#endif

}  // namespace trellis::kernels::host
