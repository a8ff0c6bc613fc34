#!/usr/bin/env bash
# Instruction counts (valgrind --tool=callgrind) of redistribute vs calling the collective
# directly, for each op, on one thread rank; only the measured loop is instrumented
# (CALLGRIND_START/STOP_INSTRUMENTATION in shard_bench --callgrind). Exits 1 when redistribute
# executes more than LIMIT percent (default 2) more instructions than the direct call.
#   bench/shard/callgrind_compare.sh [ELEMENTS...]        (default: 4096 65536 262144 1048576)
#   env: ITERS (calls per run, default 4), LIMIT (percent, default 2), CXX (default g++)
# The program is compiled here with -O2 for the baseline x86-64 ISA: the project's benches use
# -march=native, and valgrind cannot decode AVX-512.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
sizes=("$@")
[[ ${#sizes[@]} -gt 0 ]] || sizes=(4096 65536 262144 1048576)
iters=${ITERS:-4}
limit=${LIMIT:-2}
command -v valgrind >/dev/null || { echo "valgrind not found" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bench="$out/shard_bench"
${CXX:-g++} -std=c++20 -O2 -DNDEBUG -I"$root/include" -I"$root/bench" "$root/bench/shard/shard_bench.cpp" \
  -o "$bench" -pthread

count() {  # op variant elements -> instructions in the instrumented region
  local file="$out/$1.$2.$3.out"
  valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$file" \
    "$bench" --callgrind "$1" "$2" --elements "$3" --iters "$iters" >/dev/null 2>"$out/$1.$2.log"
  awk '/^totals:/ {print $2; exit}' "$file"
}

status=0
printf "callgrind: redistribute vs the direct collective, fp32, %s calls, 1 thread rank\n" "$iters"
printf "%-15s %10s %14s %14s %11s %9s\n" op elements direct redistribute difference percent
for elements in "${sizes[@]}"; do
  for op in all_gather all_reduce reduce_scatter; do
    d=$(count "$op" direct "$elements")
    r=$(count "$op" redistribute "$elements")
    pct=$(awk -v d="$d" -v r="$r" 'BEGIN { printf "%.3f", 100 * (r - d) / d }')
    printf "%-15s %10s %14s %14s %11s %8s%%\n" "$op" "$elements" "$d" "$r" "$((r - d))" "$pct"
    if awk -v p="$pct" -v l="$limit" 'BEGIN { exit !(p > l) }'; then status=1; fi
  done
done
if [[ $status -eq 0 ]]; then echo "all within ${limit}%"; else echo "some OVER ${limit}%"; fi
exit $status
