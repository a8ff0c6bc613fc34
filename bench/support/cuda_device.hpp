// CUDA helpers of the GPU benchmarks:
//   first_cuda_device(name): the first device's properties, or nothing (after saying so) when there
//     is no usable device: the benchmark then exits 0 with nothing measured, so the GPU script and
//     CI go on;
//   cuda_time_ms(stream, fn, warmup, iters): mean milliseconds per call, timed with CUDA events.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <optional>

#include "trellis/core/check_cuda.hpp"

namespace trellis::bench {

inline std::optional<cudaDeviceProp> first_cuda_device(const char* bench_name) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("%s: no usable CUDA device, nothing measured\n", bench_name);
    return std::nullopt;
  }
  cudaDeviceProp prop{};
  TRELLIS_CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  return prop;
}

template <class Fn>
double cuda_time_ms(cudaStream_t stream, Fn&& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t start, stop;
  TRELLIS_CHECK_CUDA(cudaEventCreate(&start));
  TRELLIS_CHECK_CUDA(cudaEventCreate(&stop));
  TRELLIS_CHECK_CUDA(cudaEventRecord(start, stream));
  for (int i = 0; i < iters; ++i) fn();
  TRELLIS_CHECK_CUDA(cudaEventRecord(stop, stream));
  TRELLIS_CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  TRELLIS_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  (void)cudaEventDestroy(start);
  (void)cudaEventDestroy(stop);
  return ms / iters;
}

}  // namespace trellis::bench
