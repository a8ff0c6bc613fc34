// The cblas_sgemm peers of the benchmarks run on OpenBLAS' own threads. trellis' host GEMM leaves
// OpenBLAS single-threaded (its kernel pool runs single-threaded sgemm calls on tiles of C, see
// kernels/gemm_host.hpp), so a peer gives OpenBLAS as many threads as the kernel pool has before
// its calls.
#pragma once

#include <cblas.h>

#include "trellis/kernels/thread_pool.hpp"

namespace trellis::bench {

inline void use_openblas_threads() { openblas_set_num_threads(kernels::host::kernel_thread_count()); }

}  // namespace trellis::bench
