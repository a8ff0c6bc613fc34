// The cblas_sgemm peers of the benchmarks run on the BLAS' own threads. trellis' host GEMM leaves
// the BLAS single-threaded (its kernel pool runs single-threaded sgemm calls on tiles of C, see
// kernels/gemm_host.hpp), so a peer gives the BLAS as many threads as the kernel pool has before
// its calls. Looked up at run time, so the benchmarks link against OpenBLAS or BLIS
// (TRELLIS_BLAS=blis) alike.
#pragma once

#include <dlfcn.h>

#include <cstdint>

#include "trellis/kernels/thread_pool.hpp"

namespace trellis::bench {

inline void use_openblas_threads() {
  const int n = kernels::host::kernel_thread_count();
  if (auto* openblas = reinterpret_cast<void (*)(int)>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")))
    openblas(n);
  else if (auto* blis = reinterpret_cast<void (*)(std::int64_t)>(dlsym(RTLD_DEFAULT, "bli_thread_set_num_threads")))
    blis(n);
}

}  // namespace trellis::bench
