// The CUDA parts of trellis (nvcc): everything in trellis.hpp plus device buffers, CUDA checks
// and the CUDA kernels.
#pragma once

#include "trellis/backend/cuda.cuh"
#include "trellis/core/check_cuda.hpp"
#include "trellis/core/cuda_buffer.hpp"
#include "trellis/kernels_cuda.cuh"
#include "trellis/shard/cuda.cuh"
#include "trellis/trellis.hpp"
