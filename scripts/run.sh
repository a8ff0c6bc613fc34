#!/usr/bin/env bash
# The main job: installs what is missing, builds the host preset and runs the example GPT trainer
# on the host backend with dp2 x tp2 x pp2 on 8 thread ranks, on text the project ships.
# Extra arguments go to the trainer (see examples/train_gpt/README.md or --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
source scripts/blas_env.sh  # OPENBLAS_CORETYPE / BLIS_ARCH_TYPE where the installed BLAS does not know the CPU
cmake --preset host >/dev/null
cmake --build --preset host -j "${TRELLIS_JOBS:-$(nproc)}" --target train_gpt
mkdir -p out
exec build/host/examples/train_gpt/train_gpt --dp 2 --tp 2 --pp 2 --log out/metrics.jsonl "$@"
