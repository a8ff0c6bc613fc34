// The Catch2 main shared by test executables (compiled once per flavour):
//  - plain: runs the tests;
//  - TRELLIS_GPU_TEST: exits 77 (ctest: skipped) when no usable CUDA device exists;
//  - TRELLIS_MPI_TEST: wraps the run in MPI_Init_thread / MPI_Finalize; a failure on any rank
//    makes that rank exit non-zero, so mpiexec fails.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#if defined(TRELLIS_GPU_TEST)
#include <cuda_runtime_api.h>
#endif
#if defined(TRELLIS_MPI_TEST)
#include <mpi.h>
#endif

int main(int argc, char** argv) {
#if defined(TRELLIS_GPU_TEST)
  int devices = 0;
  cudaError_t status = cudaGetDeviceCount(&devices);
  if (status != cudaSuccess || devices == 0) {
    std::printf("no usable CUDA device (%s): skipping\n",
                status != cudaSuccess ? cudaGetErrorString(status) : "device count is 0");
    return 77;
  }
#endif
#if defined(TRELLIS_MPI_TEST)
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int result = Catch::Session().run(argc, argv);
  // Every rank learns whether any rank failed, so all exit with the same verdict.
  int any_failed = 0, failed = result != 0 ? 1 : 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any_failed ? 1 : 0;
#else
  return Catch::Session().run(argc, argv);
#endif
}
