# Sourced by the train_gpt benchmark scripts of this folder, after `set -euo pipefail`, with the
# script's arguments: BUILD_DIR (default build/host) is taken off them (the rest are extra
# train_gpt flags, in "$@" of the caller after `shift "$train_gpt_args"`). Sets bin (the
# train_gpt binary), here (the repository root) and ckpt (a scratch checkpoint directory removed
# at exit), and the BLAS core type scripts/blas_env.sh picks.
build=${1:-build/host}
train_gpt_args=$(( $# > 0 ? 1 : 0 ))
bin=$build/examples/train_gpt/train_gpt
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source "$here/scripts/blas_env.sh" >/dev/null 2>&1 || true
ckpt=$(mktemp -d)
trap 'rm -rf "$ckpt"' EXIT
