// Is the BLAS running kernels made for this CPU? OpenBLAS picks its kernels from a table of CPU
// models at load time; a CPU newer than the library (e.g. OpenBLAS 0.3.21 on a Sapphire Rapids
// Xeon) falls back to its generic Prescott (SSE3) kernels, 2-4x slower, and says so only through
// openblas_get_corename(). trellis compares that report with the CPU's vector features (cpuid +
// the OS's enabled register state) and warns once, at the first host GEMM, naming the fix:
// OPENBLAS_CORETYPE=<core> in the environment before the program starts (scripts/blas_env.sh
// sets it for the project's scripts). The decision itself is a pure function, tested on faked
// inputs (tests/kernels/test_gemm.cpp). The same for BLIS (TRELLIS_BLAS=blis): its sub-configuration
// (bli_arch_query_id) against the CPU, naming BLIS_ARCH_TYPE.
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
// BLIS' bli_arch_query_id / bli_arch_string are found with dlsym: declaring them here (their
// arch_t is an enum) would clash with blis.h in a program that includes both.
#if __has_include(<dlfcn.h>)
#include <dlfcn.h>
#define TRELLIS_BLAS_CORE_DLSYM 1
#endif
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

// BLIS has the same blind spot (0.9.0 picks its AVX2 "haswell" kernels on Sapphire Rapids) and its
// own override, BLIS_ARCH_TYPE=<the arch_t id>: ids differ between BLIS versions, so the caller
// looks the id up in the running library (`wanted_id`; -1: not found).
inline std::string recommended_blis_arch(const CpuFeatures& f) {
  if (f.avx512f) return "skx";
  if (f.avx2) return "haswell";
  return "";
}

// How wide a BLIS sub-configuration's kernels are: 0 SSE, 1 AVX, 2 AVX2, 3 AVX-512; -1 unknown.
inline int blis_arch_level(std::string_view arch) {
  for (std::string_view n : {"penryn", "generic"})
    if (arch == n) return 0;
  for (std::string_view n : {"sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"})
    if (arch == n) return 1;
  for (std::string_view n : {"haswell", "zen", "zen2", "zen3"})
    if (arch == n) return 2;
  for (std::string_view n : {"skx", "knl", "zen4", "zen5"})
    if (arch == n) return 3;
  return -1;
}

inline std::string blis_arch_warning(std::string_view arch, const CpuFeatures& f, int wanted_id) {
  const std::string want = recommended_blis_arch(f);
  const int have = blis_arch_level(arch);
  if (want.empty() || have < 0 || have >= blis_arch_level(want)) return "";
  return "trellis: BLIS runs its " + std::string(arch) + " kernels on a CPU with " +
         (f.avx512f ? "AVX-512" : "AVX2") +
         " (this BLIS does not know the CPU model): host GEMMs run slower than they could. " +
         (wanted_id >= 0 ? "Set BLIS_ARCH_TYPE=" + std::to_string(wanted_id) + " (this BLIS' id of \"" + want + "\")"
                         : "Set BLIS_ARCH_TYPE to this BLIS' id of \"" + want + "\"") +
         " before starting the program, or build with OpenBLAS (TRELLIS_BLAS=openblas, OPENBLAS_CORETYPE).";
}

// The linked BLIS' arch functions (null when the BLAS is not BLIS).
struct BlisArchApi {
  int (*query_id)() = nullptr;  // bli_arch_query_id: the sub-configuration in use
  char* (*name)(int) = nullptr;  // bli_arch_string
};
inline const BlisArchApi& blis_arch_api() {
  static const BlisArchApi api = [] {
    BlisArchApi a;
#if defined(TRELLIS_BLAS_CORE_DLSYM)
    a.query_id = reinterpret_cast<int (*)()>(dlsym(RTLD_DEFAULT, "bli_arch_query_id"));
    a.name = reinterpret_cast<char* (*)(int)>(dlsym(RTLD_DEFAULT, "bli_arch_string"));
    auto init = reinterpret_cast<void (*)()>(dlsym(RTLD_DEFAULT, "bli_init"));
    if (!a.query_id || !a.name || !init) return BlisArchApi{};
    init();  // BLIS 0.9 aborts in bli_arch_query_id when BLIS_ARCH_TYPE is set and BLIS is not initialised
#endif
    return a;
  }();
  return api;
}

// The running BLIS' arch_t id named `name`, or -1 (ids run from 0 to "generic", always the last).
inline int blis_arch_id(std::string_view name) {
  const BlisArchApi& api = blis_arch_api();
  if (api.name == nullptr) return -1;
  for (int id = 0; id < 64; ++id) {
    const char* s = api.name(id);
    if (s == nullptr) return -1;
    if (name == s) return id;
    if (std::string_view(s) == "generic") return -1;
  }
  return -1;
}

// At the first host GEMM: the warnings above on stderr, once per process (OpenBLAS or BLIS).
inline void warn_if_generic_blas() {
#if defined(TRELLIS_HAS_CBLAS)
  static const bool once = [] {
    if (std::getenv("TRELLIS_QUIET_BLAS_CHECK") != nullptr) return true;
    if (openblas_get_corename != nullptr) {
      const char* core = openblas_get_corename();
      const std::string w = core ? blas_core_warning(core, cpu_features()) : std::string();
      if (!w.empty()) std::fprintf(stderr, "%s\n", w.c_str());
    } else if (const BlisArchApi& blis = blis_arch_api(); blis.query_id != nullptr) {
      const CpuFeatures f = cpu_features();
      const char* arch = blis.name(blis.query_id());
      const std::string w =
          arch ? blis_arch_warning(arch, f, blis_arch_id(recommended_blis_arch(f))) : std::string();
      if (!w.empty()) std::fprintf(stderr, "%s\n", w.c_str());
    }
    return true;
  }();
  (void)once;
#endif
}

}  // namespace trellis::kernels::host
