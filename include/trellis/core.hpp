// trellis core: config, version, errors, numeric types, memory spaces, buffers and tensors.
// Host-only; the CUDA parts are core/cuda_buffer.hpp and core/check_cuda.hpp (see trellis/cuda.cuh).
#pragma once

#include "trellis/core/buffer.hpp"      // defines: Buffer<T, Host>
#include "trellis/core/config.hpp"      // defines: TRELLIS_HD and friends
#include "trellis/core/dtype.hpp"       // defines: half, bfloat16, DType
#include "trellis/core/error.hpp"       // defines: Error, TRELLIS_CHECK*
#include "trellis/core/hash.hpp"        // defines: splitmix64, name_hash
#include "trellis/core/space.hpp"       // defines: Host, Cuda
#include "trellis/core/subnormals.hpp"  // defines: flush_subnormals_on_this_thread, subnormals_flushed_on_this_thread
#include "trellis/core/tensor.hpp"      // defines: Extents, TensorView, Tensor
#include "trellis/core/version.hpp"     // defines: TRELLIS_VERSION_*
