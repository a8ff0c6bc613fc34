// Is the BLAS running kernels made for this CPU? OpenBLAS picks its kernels from a table of CPU
// models at load time; a CPU newer than the library (e.g. OpenBLAS 0.3.21 on a Sapphire Rapids
// Xeon) falls back to its generic Prescott (SSE3) kernels, 2-4x slower, and says so only through
// openblas_get_corename(). trellis compares that report with the CPU's vector features (cpuid +
// the OS's enabled register state) and warns once, at the first host GEMM, naming the fix:
// OPENBLAS_CORETYPE=<core> in the environment before the program starts (scripts/blas_env.sh
// sets it for the project's scripts). The decision itself is a pure function, tested on faked
// inputs (tests/kernels/test_gemm.cpp).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#if defined(TRELLIS_HAS_CBLAS)
extern "C" char* openblas_get_corename() __attribute__((weak));
#endif

namespace trellis::kernels::host {

// Vector units the CPU has and the OS enabled.
struct CpuFeatures {
  bool avx2 = false;
  bool avx512f = false;
  bool avx512_bf16 = false;
  bool amx_bf16 = false;
};

inline CpuFeatures cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return f;  // no OSXSAVE: no AVX state
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const std::uint64_t xcr0 = (static_cast<std::uint64_t>(xcr0_hi) << 32) | xcr0_lo;
  const bool ymm = (xcr0 & 0x6u) == 0x6u;           // SSE + AVX state
  const bool zmm = (xcr0 & 0xE6u) == 0xE6u;         // + opmask, ZMM upper halves, ZMM16-31
  const bool tiles = (xcr0 & 0x60000u) == 0x60000u;  // AMX TILECFG + TILEDATA
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  f.avx2 = ymm && (b & (1u << 5));
  f.avx512f = zmm && (b & (1u << 16));
  f.amx_bf16 = tiles && (d & (1u << 22));
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) f.avx512_bf16 = f.avx512f && (a & (1u << 5));
#endif
  return f;
}

// The OPENBLAS_CORETYPE whose kernels use the widest units of `f`, or "" (nothing better than
// what any build runs).
inline std::string recommended_openblas_core(const CpuFeatures& f) {
  if (f.avx512_bf16) return "Cooperlake";  // AVX-512 + bf16 dot products (sbgemm)
  if (f.avx512f) return "SkylakeX";
  if (f.avx2) return "Haswell";
  return "";
}

// How wide a core type's kernels are: 0 SSE, 1 AVX, 2 AVX2, 3 AVX-512, 4 AVX-512 + BF16;
// -1 for a name this table does not know (not judged).
inline int openblas_core_level(std::string_view core) {
  for (std::string_view n : {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom", "Katmai", "Coppermine",
                             "Northwood", "Banias", "Opteron", "Opteron(SSE3)", "Barcelona", "Nano", "Unknown"})
    if (core == n) return 0;
  for (std::string_view n : {"Sandybridge", "Bulldozer", "Piledriver"})
    if (core == n) return 1;
  for (std::string_view n : {"Haswell", "Zen", "Steamroller", "Excavator"})
    if (core == n) return 2;
  if (core == "SkylakeX") return 3;
  for (std::string_view n : {"Cooperlake", "SapphireRapids"})
    if (core == n) return 4;
  return -1;
}

// The warning to print when the BLAS runs narrower kernels than the CPU offers, else "".
inline std::string blas_core_warning(std::string_view core, const CpuFeatures& f) {
  const std::string want = recommended_openblas_core(f);
  const int have = openblas_core_level(core);
  if (want.empty() || have < 0 || have >= openblas_core_level(want)) return "";
  return "trellis: OpenBLAS runs its " + std::string(core) + " kernels on a CPU with " +
         (f.avx512_bf16 ? "AVX-512 + BF16" : f.avx512f ? "AVX-512" : "AVX2") +
         " (this OpenBLAS does not know the CPU model): host GEMMs run several times slower than "
         "they could. Set OPENBLAS_CORETYPE=" +
         want + " before starting the program (scripts/blas_env.sh does), or install a newer OpenBLAS.";
}

// At the first host GEMM: the warning above on stderr, once per process (OpenBLAS only).
inline void warn_if_generic_blas() {
#if defined(TRELLIS_HAS_CBLAS)
  static const bool once = [] {
    if (openblas_get_corename != nullptr && std::getenv("TRELLIS_QUIET_BLAS_CHECK") == nullptr) {
      const char* core = openblas_get_corename();
      const std::string w = core ? blas_core_warning(core, cpu_features()) : std::string();
      if (!w.empty()) std::fprintf(stderr, "%s\n", w.c_str());
    }
    return true;
  }();
  (void)once;
#endif
}

}  // namespace trellis::kernels::host
