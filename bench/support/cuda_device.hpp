// The first CUDA device's properties, or nothing (after saying so) when there is no usable
// device: GPU benchmarks then exit 0 with nothing measured, so the GPU script and CI go on.
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

}  // namespace trellis::bench
