// Everything in trellis that compiles with a host compiler alone.
// CUDA parts: include <trellis/cuda.cuh> (nvcc). MPI: <trellis/comm/mpi.hpp> (trellis::mpi).
#pragma once

#include "trellis/backend.hpp"
#include "trellis/comm.hpp"
#include "trellis/core.hpp"
#include "trellis/io.hpp"
#include "trellis/kernels.hpp"
#include "trellis/nn.hpp"
#include "trellis/optim.hpp"
#include "trellis/pipe.hpp"
#include "trellis/plan.hpp"
#include "trellis/report.hpp"
#include "trellis/shard.hpp"
#include "trellis/train.hpp"
