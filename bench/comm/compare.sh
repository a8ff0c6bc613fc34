#!/usr/bin/env bash
# Thread backend vs OpenMPI, side by side on this machine, plus single-thread memcpy bandwidth:
# all_reduce / all_gather / reduce_scatter, fp32, 16 MiB and 64 MiB, 2 and 4 ranks.
#   bench/comm/compare.sh [BUILD_DIR] [REPEATS]     (default build/comm, 3)
# Every configuration runs REPEATS times, alternating the two backends so that load from other
# processes hits both alike; the table gives the median busbw of the repeats (and the best).
set -euo pipefail
build="${1:-build/comm}"
repeats="${2:-3}"
bench="$build/bench/comm/comm_bench"
bench_mpi="$build/bench/comm/comm_bench_mpi"
ops="all_reduce,all_gather,reduce_scatter"
sizes="16M,64M"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
mpirun_flags=(--allow-run-as-root --oversubscribe --mca btl self,vader --bind-to none)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

for rep in $(seq "$repeats"); do
  for n in 2 4; do
    "$bench" --ranks "$n" --op "$ops" --sizes "$sizes" --json "$out/threads_${n}_${rep}.json" > /dev/null
    if [[ -x "$bench_mpi" ]]; then
      mpirun -np "$n" "${mpirun_flags[@]}" "$bench_mpi" --op "$ops" --sizes "$sizes" \
        --json "$out/mpi_${n}_${rep}.json" > /dev/null
    fi
  done
done

python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
rows = {}
memcpy = {}
for path in glob.glob(os.path.join(sys.argv[1], "*.json")):
    for r in json.load(open(path))["rows"]:
        if r["backend"] == "memcpy":
            memcpy.setdefault(int(r["bytes"]), []).append(r["busbw"])
        else:
            key = (r["op"], int(r["ranks"]), int(r["bytes"]))
            rows.setdefault(key, {}).setdefault(r["backend"], []).append((r["busbw"], r["wrong"]))

def med(v): return statistics.median(v) if v else float("nan")
print("# busbw in GB/s (nccl-tests factors), median of repeats [best]; memcpy = single-thread memcpy, bytes/s")
print(f"{'op':15} {'ranks':>5} {'size':>6} | {'threads':>15} {'openmpi':>15} {'ratio':>6} | {'memcpy':>7} {'thr/memcpy':>10} | wrong")
for key in sorted(rows):
    op, n, size = key
    t = [b for b, _ in rows[key].get("threads", [])]
    m = [b for b, _ in rows[key].get("openmpi", [])]
    wrong = sum(w for b, w in rows[key].get("threads", []) + rows[key].get("openmpi", []))
    mc = med(memcpy.get(size, []))
    ratio = med(t) / med(m) if m else float("nan")
    print(f"{op:15} {n:5d} {size >> 20:4d}Mi | {med(t):7.2f} [{max(t):5.2f}] "
          f"{med(m) if m else float('nan'):7.2f} [{max(m) if m else float('nan'):5.2f}] {ratio:6.1f} | "
          f"{mc:7.2f} {med(t) / mc:9.0%} | {wrong:.0f}")
PY
