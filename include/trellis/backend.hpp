// trellis compute backends, host half: the Backend concept and backend::Host<float | bfloat16>.
// The CUDA backend (backend::Cuda) is in <trellis/cuda.cuh>.
#pragma once

#include "trellis/backend/backend.hpp"  // defines: Backend, CompatibleWith, space_of
#include "trellis/backend/host.hpp"     // defines: backend::Host<Act>
