// The machine's peak FLOP/s per dtype, for MFU that means "fraction of what this CPU can do"
// (issue #19). Before, train_gpt divided by a measured 512^3 sgemm: a figure of the BLAS, not of
// the machine (it halves when OpenBLAS runs its generic kernels, and it says nothing of bf16).
//
// Two figures, both reported:
//   theoretical  peak_flops(features, cores, clock, fma_units): cpuid's vector width x FMA units x
//                2 FLOP per FMA x cores x clock; bf16 per the widest bf16 unit (AMX tiles,
//                AVX512-BF16 dot products, else the fp32 FMAs). The clock is measured (a chain of
//                dependent integer adds runs at one add per cycle), since KVM guests and turbo make
//                the nominal clock meaningless.
//   measured     a throughput-bound fp32 FMA loop on every thread at once (a few ms): what the
//                FMA units deliver at the clock they actually run (AVX-512 may run slower); on AMX
//                CPUs also a TDPBF16PS tile loop (Linux, once the OS grants the tile state): what
//                the AMX unit delivers beside Intel's per-cycle figure.
// The FMA-unit count is not in cpuid (Xeon Silver had one 512-bit unit, Gold/Platinum two; Zen 4
// splits a 512-bit FMA over two 256-bit pipes): it is measured as the loop's FMAs per cycle per
// thread over the vector width, rounded, in [1, 2]. Two threads on one core's hyperthreads each
// measure half a core's rate, so the figure counts physical units either way.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <ctime>
#include <thread>
#include <vector>

#include "trellis/kernels/blas_core.hpp"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define TRELLIS_CPU_PEAK_X86 1
#include <immintrin.h>
// The AMX loop: GCC 11 / Clang 12 have the tile intrinsics (under a target attribute, whatever the
// project's flags); Linux hands out the tile state on request (arch_prctl, kernel 5.16+).
#if defined(__linux__) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11))
#define TRELLIS_CPU_PEAK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace trellis::kernels::host {

// FLOP/s of a whole machine (or of `cores` cores), per compute dtype.
struct PeakFlops {
  double fp32 = 0;
  double bf16 = 0;
};

// fp32 lanes of the widest FMA the CPU has: 16 (AVX-512), 8 (AVX2 + FMA), 4 (SSE: no FMA; counted
// as one multiply and one add pipe per "unit", the same 2 FLOP per lane per cycle).
inline int fp32_lanes(const CpuFeatures& f) { return f.avx512f ? 16 : f.avx2 ? 8 : 4; }

// Dense bf16 FLOP per cycle per core:
//  * AMX (TDPBF16PS): 1024. Intel states "1,024 BF16 operations per cycle" per core for 4th-gen
//    Xeon (solution brief "Accelerate AI Workloads with Intel AMX"; Wikipedia, Advanced Matrix
//    Extensions). Worked out: one TDPBF16PS on full tiles is 16 x 16 fp32 outputs x 32 bf16
//    products = 8192 FMAs and issues every 16 cycles, i.e. 512 FMAs = 1024 FLOP per cycle. (Reading
//    the 1024 as FMAs, i.e. 2048 FLOP, double counts.)
//  * AVX512-BF16 (VDPBF16PS): a 512-bit register holds 32 bf16 pairs, twice the fp32 lanes, at
//    the fp32 FMA's throughput: 2x the fp32 rate.
//  * otherwise bf16 runs on the fp32 FMAs (converted): the fp32 rate.
inline double bf16_flop_per_cycle(const CpuFeatures& f, int fma_units) {
  if (f.amx_bf16) return 1024.0;
  const double fp32 = 2.0 * fp32_lanes(f) * fma_units;
  return f.avx512_bf16 ? 2.0 * fp32 : fp32;
}

// Theoretical peak of `cores` cores at `clock_hz`: lanes x FMA units x 2 FLOP (fp32), and the bf16
// unit above. fma_units: vector FMA pipes per core (2 on Intel's server cores since Skylake-SP
// Gold; measure_cpu_peak measures it).
inline PeakFlops peak_flops(const CpuFeatures& f, int cores, double clock_hz, int fma_units = 2) {
  const double cycles = static_cast<double>(std::max(cores, 0)) * clock_hz;
  return {cycles * 2.0 * fp32_lanes(f) * fma_units, cycles * bf16_flop_per_cycle(f, fma_units)};
}

// Which unit the bf16 peak counts.
inline const char* bf16_peak_unit(const CpuFeatures& f) {
  return f.amx_bf16 ? "AMX" : f.avx512_bf16 ? "AVX512-BF16" : "fp32 FMA";
}

namespace detail {

// The calling thread's CPU time (Linux: CLOCK_THREAD_CPUTIME_ID, ns resolution), so that time the
// thread spent preempted by other work on a shared machine does not count against the rates;
// wall time where there is no such clock.
inline double thread_seconds() {
#if defined(CLOCK_THREAD_CPUTIME_ID)
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) == 0) return static_cast<double>(ts.tv_sec) + 1e-9 * ts.tv_nsec;
#endif
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// `iters` x 100 dependent register-register adds: latency-bound at one add per cycle on x86 cores,
// so cycles = 100 x iters whatever the ports. Not `add $imm`: Golden Cove's renamer folds chains of
// immediate adds (measured here: 12 "GHz"). Returns the adds' sum (kept live).
inline std::uint64_t add_chain(std::int64_t iters) {
  std::uint64_t x = 0;
#if defined(TRELLIS_CPU_PEAK_X86)
  std::uint64_t one = 1;
  __asm__ volatile("" : "+r"(one));  // not a known constant
  for (std::int64_t i = 0; i < iters; ++i) __asm__ volatile(".rept 100\n\taddq %1, %0\n\t.endr" : "+r"(x) : "r"(one));
#else
  (void)iters;
#endif
  return x;
}

// `iters` x 12 independent vector FMAs (latency 4 x 2 pipes = 8 in flight needed; 12 keeps them
// busy), so the loop is throughput-bound. acc = acc * m + a converges to a / (1 - m): no overflow,
// no denormals. Returns a sum of the accumulators (kept live).
#if defined(TRELLIS_CPU_PEAK_X86)
#define TRELLIS_FMA12(fma, acc, m, a)                                                                       \
  acc##0 = fma(acc##0, m, a), acc##1 = fma(acc##1, m, a), acc##2 = fma(acc##2, m, a),                       \
  acc##3 = fma(acc##3, m, a), acc##4 = fma(acc##4, m, a), acc##5 = fma(acc##5, m, a),                       \
  acc##6 = fma(acc##6, m, a), acc##7 = fma(acc##7, m, a), acc##8 = fma(acc##8, m, a),                       \
  acc##9 = fma(acc##9, m, a), acc##10 = fma(acc##10, m, a), acc##11 = fma(acc##11, m, a)

__attribute__((target("avx512f"))) inline float fma_loop_avx512(std::int64_t iters) {
  const __m512 m = _mm512_set1_ps(0.999f), a = _mm512_set1_ps(1e-3f);
  __m512 v0 = _mm512_set1_ps(0.f), v1 = _mm512_set1_ps(.1f), v2 = _mm512_set1_ps(.2f), v3 = _mm512_set1_ps(.3f),
         v4 = _mm512_set1_ps(.4f), v5 = _mm512_set1_ps(.5f), v6 = _mm512_set1_ps(.6f), v7 = _mm512_set1_ps(.7f),
         v8 = _mm512_set1_ps(.8f), v9 = _mm512_set1_ps(.9f), v10 = _mm512_set1_ps(1.f), v11 = _mm512_set1_ps(1.1f);
  for (std::int64_t i = 0; i < iters; ++i) {
    TRELLIS_FMA12(_mm512_fmadd_ps, v, m, a);
    __asm__ volatile("" : "+v"(v0), "+v"(v1), "+v"(v2), "+v"(v3), "+v"(v4), "+v"(v5));  // no folding
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v0, v1), _mm512_add_ps(v2, v3)),
                                     _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(v4, v5), _mm512_add_ps(v6, v7)),
                                                   _mm512_add_ps(_mm512_add_ps(v8, v9), _mm512_add_ps(v10, v11)))));
  float s = 0;
  for (float x : out) s += x;
  return s;
}

__attribute__((target("avx2,fma"))) inline float fma_loop_avx2(std::int64_t iters) {
  const __m256 m = _mm256_set1_ps(0.999f), a = _mm256_set1_ps(1e-3f);
  __m256 v0 = _mm256_set1_ps(0.f), v1 = _mm256_set1_ps(.1f), v2 = _mm256_set1_ps(.2f), v3 = _mm256_set1_ps(.3f),
         v4 = _mm256_set1_ps(.4f), v5 = _mm256_set1_ps(.5f), v6 = _mm256_set1_ps(.6f), v7 = _mm256_set1_ps(.7f),
         v8 = _mm256_set1_ps(.8f), v9 = _mm256_set1_ps(.9f), v10 = _mm256_set1_ps(1.f), v11 = _mm256_set1_ps(1.1f);
  for (std::int64_t i = 0; i < iters; ++i) {
    TRELLIS_FMA12(_mm256_fmadd_ps, v, m, a);
    __asm__ volatile("" : "+x"(v0), "+x"(v1), "+x"(v2), "+x"(v3), "+x"(v4), "+x"(v5));
  }
  alignas(32) float out[8];
  _mm256_store_ps(out, _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)),
                                     _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v4, v5), _mm256_add_ps(v6, v7)),
                                                   _mm256_add_ps(_mm256_add_ps(v8, v9), _mm256_add_ps(v10, v11)))));
  float s = 0;
  for (float x : out) s += x;
  return s;
}
#undef TRELLIS_FMA12
#endif

// Linux gives a process the AMX tile data state only on request: arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA = 18); without it the first tile instruction raises SIGILL. Asked once per
// process (process-wide, so threads started later have it too; oneDNN asks the same way). "" when
// granted, else why not.
inline const char* request_amx_permission() {
#if defined(TRELLIS_CPU_PEAK_AMX)
  static const char* const why = []() -> const char* {
    constexpr long kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
      return "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)";
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 || !(granted & (1ul << kXfeatureXtiledata)))
      return "Linux did not grant the AMX tile state (arch_prctl ARCH_GET_XCOMP_PERM)";
    return "";
  }();
  return why;
#else
  return "not compiled in (x86-64 Linux with GCC 11+ or Clang 12+ only; not nvcc)";
#endif
}

#if defined(TRELLIS_CPU_PEAK_AMX)
// `iters` x 6 TDPBF16PS on full tiles (16 rows x 64 bytes: 16 x 16 fp32 outputs, 32 bf16 products
// each = 8192 FMAs = 16384 FLOP per instruction): six independent accumulator tiles (tmm0-5) over
// one A and one B tile (tmm6, tmm7) loaded once, so nothing but the tile unit is timed and no
// accumulator waits for its own previous product. Inputs 2^-10: sums grow by 2^-15 per product,
// no overflow, no denormals. Only after request_amx_permission() granted the state, on AMX CPUs.
// Returns one accumulator's element (kept live).
struct alignas(64) AmxTileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

__attribute__((target("amx-tile,amx-bf16"))) inline float amx_loop(std::int64_t iters) {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
  alignas(64) std::uint16_t ab[16 * 32];
  for (auto& x : ab) x = 0x3A80;  // bf16 2^-10
  alignas(64) float out[16 * 16];
  __asm__ volatile("" : : "r"(&cfg), "r"(ab) : "memory");  // GCC's tile loads take bare pointers: store first
  _tile_loadconfig(&cfg);
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  for (std::int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 6, 7);
    _tile_dpbf16ps(1, 6, 7);
    _tile_dpbf16ps(2, 6, 7);
    _tile_dpbf16ps(3, 6, 7);
    _tile_dpbf16ps(4, 6, 7);
    _tile_dpbf16ps(5, 6, 7);
  }
  _tile_stored(5, out, 64);
  __asm__ volatile("" : : "r"(out) : "memory");  // ... and the store is seen before `out` is read
  _tile_release();
  return out[0];
}
inline constexpr double kAmxLoopFlopPerIter = 6.0 * 16 * 16 * 32 * 2;
#endif

// The best rate (work units per CPU second of this thread) of `reps` timed windows of about
// `window_s` each, after one untimed window (frequency ramp, AVX-512 licence). `run(iters)` does
// `iters` x `per_iter` units.
template <class F>
double best_rate(F&& run, double per_iter, double window_s, int reps, volatile float* sink) {
  std::int64_t iters = 256;
  for (;;) {  // calibrate: grow until one call takes a quarter window
    const double t0 = thread_seconds();
    *sink = *sink + static_cast<float>(run(iters));
    if (thread_seconds() - t0 > window_s / 4 || iters > (std::int64_t{1} << 40)) break;
    iters *= 2;
  }
  iters *= 4;
  *sink = *sink + static_cast<float>(run(iters));  // untimed warm-up window
  double best = 0;
  for (int r = 0; r < reps; ++r) {
    const double t0 = thread_seconds();
    *sink = *sink + static_cast<float>(run(iters));
    const double dt = thread_seconds() - t0;
    if (dt > 0) best = std::max(best, static_cast<double>(iters) * per_iter / dt);
  }
  return best;
}

}  // namespace detail

// What measure_cpu_peak found, and the theoretical peak it implies.
struct CpuPeak {
  CpuFeatures features{};
  int threads = 0;             // measured at once (one per core the run uses)
  int fp32_lanes = 0;          // of the FMA loop that ran (0: none ran, not x86 or no AVX2)
  double clock_hz = 0;         // mean over threads: dependent adds per second
  double fma_flops = 0;        // measured: all threads' fp32 FMA loop, FLOP/s
  int fma_units = 2;           // measured FMA pipes per core (assumed 2 when no loop ran)
  double vector_clock_hz = 0;  // the clock the FMA loop implies: fma_flops / (threads x lanes x 2 x units)
  double amx_flops = 0;        // measured: all threads' TDPBF16PS loop, FLOP/s; 0: not measured (see amx_skipped)
  std::string amx_skipped;     // why an AMX CPU's loop did not run ("" when it ran, or the CPU has no AMX)
  PeakFlops theoretical{};     // peak_flops(features, threads, clock_hz, fma_units)

  double peak(bool bf16) const { return bf16 ? theoretical.bf16 : theoretical.fp32; }
  // "2 cores at 2.70 GHz (measured): fp32 16 lanes x 2 FMA units = 345.6 GFLOP/s (FMA loop measured
  // 331.0, ...), bf16 AMX 5529.6 GFLOP/s (AMX loop measured 4800.0)"
  std::string describe() const {
    char buf[600];
    int n = std::snprintf(buf, sizeof buf,
                          "%d cores at %.2f GHz (measured): fp32 %d lanes x %d FMA units = %.1f GFLOP/s (FMA loop "
                          "measured %.1f, i.e. %.2f GHz under vector load), bf16 %s %.1f GFLOP/s",
                          threads, clock_hz / 1e9, fp32_lanes > 0 ? fp32_lanes : kernels::host::fp32_lanes(features),
                          fma_units, theoretical.fp32 / 1e9, fma_flops / 1e9, vector_clock_hz / 1e9,
                          bf16_peak_unit(features), theoretical.bf16 / 1e9);
    if (n < 0 || n >= static_cast<int>(sizeof buf)) return buf;
    if (amx_flops > 0)
      std::snprintf(buf + n, sizeof buf - n, " (AMX loop measured %.1f)", amx_flops / 1e9);
    else if (!amx_skipped.empty())
      std::snprintf(buf + n, sizeof buf - n, " (AMX loop not run: %s)", amx_skipped.c_str());
    return buf;
  }
};

// Runs the clock chain and the FMA loop (and on AMX CPUs the tile loop) on `threads` threads at
// once (they start together; each takes the best of `reps` windows of `window_s` of its own CPU time: ~0.1 s in all at the
// defaults), then computes the theoretical peak of `threads` cores. Rates are per CPU second, so
// other work preempting the threads on a shared machine does not lower them (measured: a build at
// the same nice level beside it took the wall-clock version's clock from 2.7 to 1.9 GHz). A
// virtual CPU the hypervisor takes away still counts as the thread's CPU time, so a window can
// read low: the best of many short windows (20, not 3: with 3, one bench_trainer run on this
// shared 2-vCPU machine read a fp32 peak of about half the usual and printed an MFU above 100 %).
inline CpuPeak measure_cpu_peak(int threads, double window_s = 0.002, int reps = 20) {
  CpuPeak p;
  p.features = cpu_features();
  p.threads = std::max(threads, 1);
  std::vector<double> clock(static_cast<std::size_t>(p.threads)), fma(static_cast<std::size_t>(p.threads)),
      amx(static_cast<std::size_t>(p.threads));
  std::atomic<int> ready{0};
  int lanes = 0;
#if defined(TRELLIS_CPU_PEAK_X86)
  lanes = p.features.avx512f ? 16 : p.features.avx2 ? 8 : 0;
#endif
  p.fp32_lanes = lanes;
  // Before the threads start: the permission is the process's.
  if (p.features.amx_bf16) p.amx_skipped = detail::request_amx_permission();
  [[maybe_unused]] const bool run_amx = p.features.amx_bf16 && p.amx_skipped.empty();
  auto body = [&](int t) {
    volatile float sink = 0;
    ready.fetch_add(1);
    while (ready.load() < p.threads) std::this_thread::yield();  // start together: all cores busy
    clock[static_cast<std::size_t>(t)] = detail::best_rate(
        [](std::int64_t n) { return static_cast<float>(detail::add_chain(n) & 1); }, 100.0, window_s, reps, &sink);
#if defined(TRELLIS_CPU_PEAK_X86)
    if (lanes == 16)
      fma[static_cast<std::size_t>(t)] =
          detail::best_rate(detail::fma_loop_avx512, 12.0 * 16 * 2, window_s, reps, &sink);
    else if (lanes == 8)
      fma[static_cast<std::size_t>(t)] = detail::best_rate(detail::fma_loop_avx2, 12.0 * 8 * 2, window_s, reps, &sink);
#endif
#if defined(TRELLIS_CPU_PEAK_AMX)
    if (run_amx)
      amx[static_cast<std::size_t>(t)] =
          detail::best_rate(detail::amx_loop, detail::kAmxLoopFlopPerIter, window_s, reps, &sink);
#endif
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < p.threads; ++t) pool.emplace_back(body, t);
  body(0);
  for (auto& th : pool) th.join();
  for (int t = 0; t < p.threads; ++t) {
    p.clock_hz += clock[static_cast<std::size_t>(t)] / p.threads;
    p.fma_flops += fma[static_cast<std::size_t>(t)];
    p.amx_flops += amx[static_cast<std::size_t>(t)];
  }
  if (lanes > 0 && p.clock_hz > 0 && p.fma_flops > 0) {
    const double per_cycle = p.fma_flops / p.threads / p.clock_hz / (2.0 * lanes);  // FMA instr / cycle
    p.fma_units = std::clamp(static_cast<int>(std::lround(per_cycle)), 1, 2);
    p.vector_clock_hz = p.fma_flops / (p.threads * 2.0 * lanes * p.fma_units);
  }
  p.theoretical = peak_flops(p.features, p.threads, p.clock_hz, p.fma_units);
  return p;
}

}  // namespace trellis::kernels::host
