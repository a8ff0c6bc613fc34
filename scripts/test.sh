#!/usr/bin/env bash
# The test command: installs what is missing, then
#   1. host build (g++) and every host test (unit, MPI, header self-containment, packaging:
#      install + consumer projects + conan create);
#   2. the `asan` preset: ASan + UBSan over a fast subset (the parsers with the fuzz corpus,
#      checkpoints, collectives, the pipe executor; CMakePresets.json);
#   3. the `tsan` preset: ThreadSanitizer over the thread backend (comm.threads, comm.mesh,
#      comm.errors, pipe.executor; the size-scaling cases at smaller sizes, TRELLIS_TEST_SMALL_SIZES);
#      about 2 minutes on a cold cache, build included (docs/design.md);
#   4. the `cuda` preset with nvcc for sm_80 and sm_90a: every CUDA translation unit (tests,
#      examples, benches, .cuh header checks) compiles; GPU tests run and are reported skipped
#      when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/blas_env.sh  # OPENBLAS_CORETYPE / BLIS_ARCH_TYPE where the installed BLAS does not know the CPU

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
jobs="${TRELLIS_JOBS:-$(nproc)}"
# Relative paths in ccache keys: a fresh clone elsewhere reuses this machine's cache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"

echo "== host: configure, build, test"
cmake --preset host
cmake --build --preset host -j "$jobs"
ctest --preset host -j "$jobs"

echo "== asan: ASan + UBSan over the fast subset"
cmake --preset asan
cmake --build --preset asan -j "$jobs"
ctest --preset asan

echo "== tsan: ThreadSanitizer over the thread backend"
cmake --preset tsan
cmake --build --preset tsan -j "$jobs"
ctest --preset tsan

if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH="$PATH:/usr/local/cuda/bin"
  echo "== cuda: configure, build every CUDA translation unit, run (GPU tests skip without a GPU)"
  cmake --preset cuda
  cmake --build --preset cuda -j "$jobs"
  ctest --preset cuda -j "$jobs" -L "gpu|core"
else
  echo "== cuda: nvcc not found, CUDA build skipped" >&2
  exit 1
fi
