#!/usr/bin/env bash
# THE prepared GPU check, for a machine with one H200 (or any sm_90a GPU), in under 8 minutes:
#   1. configure a CUDA build for sm_90a only in build/gpu-run (tests, benches, examples);
#   2. build every GPU test (whatever `ctest -L gpu` lists), every benchmark named gpu_* and train_gpt;
#   3. run `ctest -L gpu`;
#   4. run every gpu_* benchmark with --json;
#   5. train the example on the GPU (train_gpt --backend cuda) for 100 steps: it must learn;
#   6. write a summary: $OUT/summary.txt when $OUT is set, else build/gpu-run/summary.txt, plus
#      ctest.log and benches.json (all benchmarks' JSON in one array) beside it.
# Every step runs under `timeout`, sized from one overall deadline, so the script always finishes
# and reports what it reached. Later modules' GPU tests/benches are picked up automatically
# (ctest label `gpu`, executables named gpu_*).
#   usage: bench/gpu/run.sh            (from anywhere; TRELLIS_GPU_RUN_SECONDS overrides 450)
# On a bare machine without Catch2 (the GPU image has CMake, ninja and nvcc but no Catch2): run
# bench/gpu/prepare_carry.sh here first and carry build/gpu-deps along; it is used when present.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
build="$repo/build/gpu-run"
out_dir="${OUT:-$build}"
mkdir -p "$build" "$out_dir"
summary="$out_dir/summary.txt"
ctest_log="$out_dir/ctest.log"
bench_json="$out_dir/benches.json"
jobs="$(nproc)"
budget="${TRELLIS_GPU_RUN_SECONDS:-450}"
start=$(date +%s)
export PATH="$PATH:/usr/local/cuda/bin"

: >"$summary"
say() { echo "$*" | tee -a "$summary"; }
elapsed() { echo $(( $(date +%s) - start )); }
# Seconds a step may take: its own cap, but never past the overall budget (minus a reserve for
# the steps after it).
step_limit() {  # step_limit <cap> <reserve>
  local left=$(( budget - $(elapsed) - $2 ))
  (( left > $1 )) && left=$1
  (( left < 5 )) && left=5
  echo "$left"
}
status=0

say "== trellis GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ)"
say "repo: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?') ($(git -C "$repo" status --porcelain 2>/dev/null | wc -l) uncommitted paths)"
say "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo 'nvidia-smi unavailable')"
say "nvcc: $(nvcc --version 2>/dev/null | tail -n 2 | head -n 1 || echo 'not found')"
say "cores: $jobs, budget: ${budget}s"

# ---- 1. configure ----------------------------------------------------------------------------
t0=$(date +%s)
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
prefix=()
if [[ -d "$repo/build/gpu-deps" ]]; then
  prefix=(-DCMAKE_PREFIX_PATH="$repo/build/gpu-deps")
  say "using carried dependencies in build/gpu-deps"
fi
if timeout "$(step_limit 120 300)" cmake -S "$repo" -B "$build" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DTRELLIS_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DTRELLIS_TEST_PACKAGING=OFF -DTRELLIS_BUILD_EXAMPLES=ON -DTRELLIS_BUILD_TESTS=ON \
    -DTRELLIS_BUILD_BENCH=ON "${prefix[@]}" >"$build/configure.log" 2>&1; then
  say "configure: ok ($(( $(date +%s) - t0 ))s)"
else
  say "configure: FAILED ($(( $(date +%s) - t0 ))s); last lines:"
  tail -n 30 "$build/configure.log" | tee -a "$summary"
  exit 1
fi

# ---- 2. build the GPU tests and gpu_* benches ------------------------------------------------
# Test executables: trellis_add_gpu_test names the target after the test (MPI tests add .npN);
# keep the names that are targets of this build.
all_targets=$(cmake --build "$build" --target help 2>/dev/null | sed -nE 's#^([^ :]+): .*#\1#p' | sort -u)
test_targets=""
for name in $(ctest --test-dir "$build" -L gpu -N 2>/dev/null | sed -nE 's#^ *Test +\#[0-9]+: ([^ ]+)$#\1#p' \
              | sed -E 's#\.np[0-9]+$##' | sort -u); do
  grep -qxF "$name" <<<"$all_targets" && test_targets+="$name "
done
bench_targets=$(grep -E '^gpu_[A-Za-z0-9_]+$' <<<"$all_targets" | tr '\n' ' ')
say "gpu test targets: ${test_targets:-<none found: building everything>}"
say "gpu bench targets: ${bench_targets:-<none>}"
t0=$(date +%s)
targets=()
if [[ -n "$test_targets" ]]; then
  # shellcheck disable=SC2206
  targets=(--target $test_targets $bench_targets train_gpt)
fi
if timeout "$(step_limit 300 150)" cmake --build "$build" -j "$jobs" "${targets[@]}" >"$build/build.log" 2>&1; then
  say "build: ok ($(( $(date +%s) - t0 ))s)"
else
  say "build: FAILED or timed out ($(( $(date +%s) - t0 ))s); errors:"
  grep -E 'error|FAILED' "$build/build.log" | head -n 40 | tee -a "$summary"
  status=1
fi

# ---- 3. ctest -L gpu -------------------------------------------------------------------------
t0=$(date +%s)
limit=$(step_limit 150 90)
timeout "$limit" ctest --test-dir "$build" -L gpu --output-on-failure --timeout $(( limit - 5 )) -j 2 \
  >"$ctest_log" 2>&1
rc=$?
say "ctest -L gpu: exit $rc ($(( $(date +%s) - t0 ))s)"
grep -E '^ *[0-9]+/[0-9]+ Test|tests passed|tests failed|Not Run|Skipped|Failed|Timeout' "$ctest_log" \
  | tee -a "$summary"
(( rc != 0 )) && status=1

# ---- 4. benchmarks ---------------------------------------------------------------------------
mapfile -t benches < <(find "$build/bench" -type f -name 'gpu_*' -perm -u+x 2>/dev/null | sort)
say "benchmarks: ${#benches[@]}"
json_parts=()
for exe in "${benches[@]}"; do
  name=$(basename "$exe")
  left=$(( budget - $(elapsed) - 5 ))
  if (( left < 10 )); then
    say "-- $name: skipped, out of time"
    status=1
    continue
  fi
  limit=$(( left < 150 ? left : 150 ))
  t0=$(date +%s)
  say "-- $name (limit ${limit}s)"
  timeout "$limit" "$exe" --json "$build/$name.json" >"$build/$name.out" 2>&1
  rc=$?
  cat "$build/$name.out" >>"$summary"
  say "-- $name: exit $rc ($(( $(date +%s) - t0 ))s)"
  (( rc != 0 )) && status=1
  [[ -s "$build/$name.json" ]] && json_parts+=("$build/$name.json")
done
{
  echo "["
  for i in "${!json_parts[@]}"; do
    cat "${json_parts[$i]}"
    (( i + 1 < ${#json_parts[@]} )) && echo ","
  done
  echo "]"
} >"$bench_json"

# ---- 5. the example trainer on the GPU ---------------------------------------------------------
if [[ -x "$build/examples/train_gpt/train_gpt" ]]; then
  t0=$(date +%s)
  limit=$(step_limit 90 5)
  mkdir -p "$out_dir/train_gpt"
  timeout "$limit" "$build/examples/train_gpt/train_gpt" --backend cuda --layers 4 --heads 2 --width 128 \
    --context 128 --batch 32 --microbatches 1 --steps 100 --lr 3e-3 --eval-every 25 \
    --log "$out_dir/train_gpt/metrics.jsonl" --ckpt-dir "$build/train_gpt_ckpt" >"$build/train_gpt.out" 2>&1
  rc=$?
  tail -n 12 "$build/train_gpt.out" | tee -a "$summary"
  say "-- train_gpt --backend cuda: exit $rc ($(( $(date +%s) - t0 ))s)"
  (( rc != 0 )) && status=1
  grep -q "below: the model uses context" "$build/train_gpt.out" || { say "train_gpt: did not learn"; status=1; }
else
  say "-- train_gpt: not built"
  status=1
fi

say "== done in $(elapsed)s, status $status (summary: $summary)"
exit $status
