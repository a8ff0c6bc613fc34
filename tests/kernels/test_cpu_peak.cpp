// host::peak_flops (kernels/cpu_peak.hpp) against peaks worked out by hand for given feature sets,
// core counts and clocks; and measure_cpu_peak on this machine: the clock chain gives a plausible
// clock, and the fp32 FMA loop reaches a sane fraction of the theoretical peak computed from cpuid
// and that clock (a loop that is latency-bound, or a wrong lane / unit count, lands outside); on AMX
// CPUs the same for the TDPBF16PS tile loop against the theoretical bf16 (AMX) peak.
// Part of the kernels.host_math executable (one compile unit fewer).
#include <catch2/catch.hpp>
#include <cstdio>
#include <thread>

#include "trellis/kernels/cpu_peak.hpp"

using namespace trellis::kernels::host;

TEST_CASE("peak_flops: lanes x FMA units x 2 x cores x clock; bf16 per its widest unit", "[kernels][cpu_peak]") {
  CpuFeatures spr;  // Sapphire / Emerald Rapids: AVX-512, AVX512-BF16, AMX
  spr.avx2 = spr.avx512f = spr.avx512_bf16 = spr.amx_bf16 = true;
  // 2 cores x 2.0 GHz: fp32 16 lanes x 2 units x 2 FLOP = 64 FLOP/cycle -> 256 GFLOP/s;
  // AMX 1024 FLOP/cycle -> 4096 GFLOP/s
  PeakFlops p = peak_flops(spr, 2, 2.0e9, 2);
  CHECK(p.fp32 == Approx(256e9));
  CHECK(p.bf16 == Approx(4096e9));
  CHECK(std::string(bf16_peak_unit(spr)) == "AMX");

  CpuFeatures cpl = spr;  // Cooper Lake: AVX512-BF16, no AMX: vdpbf16ps, 2x the fp32 rate
  cpl.amx_bf16 = false;
  p = peak_flops(cpl, 4, 3.0e9, 2);  // 4 x 3e9 x 64 = 768e9; bf16 1536e9
  CHECK(p.fp32 == Approx(768e9));
  CHECK(p.bf16 == Approx(1536e9));
  p = peak_flops(cpl, 4, 3.0e9, 1);  // one 512-bit unit (Xeon Silver): half
  CHECK(p.fp32 == Approx(384e9));
  CHECK(p.bf16 == Approx(768e9));

  CpuFeatures skx;  // Skylake-X: AVX-512 only; bf16 runs on the fp32 FMAs
  skx.avx2 = skx.avx512f = true;
  p = peak_flops(skx, 1, 2.5e9);  // default 2 units: 2.5e9 x 64 = 160e9
  CHECK(p.fp32 == Approx(160e9));
  CHECK(p.bf16 == Approx(160e9));

  CpuFeatures hsw;  // Haswell: AVX2 + FMA, 8 lanes: 32 FLOP/cycle
  hsw.avx2 = true;
  p = peak_flops(hsw, 8, 3.5e9, 2);  // 8 x 3.5e9 x 32 = 896e9
  CHECK(p.fp32 == Approx(896e9));
  CHECK(p.bf16 == Approx(896e9));
  CHECK(std::string(bf16_peak_unit(hsw)) == "fp32 FMA");

  CpuFeatures sse;  // nothing wide: 4 lanes, a multiply and an add pipe = 8 FLOP/cycle at 1 "unit"
  p = peak_flops(sse, 1, 1.0e9, 1);
  CHECK(p.fp32 == Approx(8e9));
  CHECK(peak_flops(sse, 0, 1.0e9).fp32 == 0);
}

TEST_CASE("measure_cpu_peak: clock and FMA loop agree with the theoretical peak on this machine",
          "[kernels][cpu_peak]") {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int threads : {1, cores}) {
    const CpuPeak p = measure_cpu_peak(threads);
    INFO(p.describe());
    std::printf("measure_cpu_peak(%d): %s\n", threads, p.describe().c_str());
    CHECK(p.threads == threads);
    CHECK(p.clock_hz > 0.5e9);  // a dependent add per cycle: no CPU of this decade is outside 0.5-7 GHz
    CHECK(p.clock_hz < 7e9);
    const PeakFlops hand = peak_flops(p.features, threads, p.clock_hz, p.fma_units);
    CHECK(p.theoretical.fp32 == Approx(hand.fp32));
    CHECK(p.theoretical.bf16 == Approx(hand.bf16));
    if (p.fp32_lanes == 0) continue;  // no AVX2: nothing measured
    CHECK(p.fp32_lanes == (p.features.avx512f ? 16 : 8));
    CHECK((p.fma_units == 1 || p.fma_units == 2));
    // The loop against the theoretical figure: 1.0 at full rate; below when AVX-512 lowers the clock
    // or other work shares the cores; above 1.2 means a wrong count (or a clock chain that ran slow).
    const double ratio = p.fma_flops / p.theoretical.fp32;
    CHECK(ratio > 0.3);
    CHECK(ratio < 1.2);
    CHECK(p.vector_clock_hz == Approx(p.fma_flops / (threads * 2.0 * p.fp32_lanes * p.fma_units)));
  }
}

TEST_CASE("measure_cpu_peak: the AMX tile loop against the theoretical AMX peak on this machine",
          "[kernels][cpu_peak]") {
  const CpuFeatures f = cpu_features();
  if (!f.amx_bf16) {
    WARN("no AMX on this CPU (or the OS did not enable its state): the AMX loop is not measured");
    CHECK(measure_cpu_peak(1).amx_flops == 0);  // nothing reported, not a zero rate
    return;
  }
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int threads : {1, cores}) {
    const CpuPeak p = measure_cpu_peak(threads);
    INFO(p.describe());
    if (!p.amx_skipped.empty()) {  // an AMX CPU whose OS (or compiler) does not let the loop run
      WARN("AMX loop not measured: " << p.amx_skipped);
      CHECK(p.amx_flops == 0);
      return;
    }
    std::printf("AMX (%d threads): theoretical %.1f GFLOP/s, loop measured %.1f (%.2f)\n", threads,
                p.theoretical.bf16 / 1e9, p.amx_flops / 1e9, p.amx_flops / p.theoretical.bf16);
    CHECK(std::string(bf16_peak_unit(p.features)) == "AMX");
    CHECK(p.describe().find("AMX loop measured") != std::string::npos);
    // As the FMA loop: 1.0 at Intel's 1024 FLOP/cycle/core; below when AMX lowers the clock or other
    // work shares the cores; above 1.2 means a wrong FLOP count per instruction (or a slow clock chain).
    const double ratio = p.amx_flops / p.theoretical.bf16;
    CHECK(ratio > 0.3);
    CHECK(ratio < 1.2);
  }
}
