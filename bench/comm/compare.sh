#!/usr/bin/env bash
# Thread backend vs OpenMPI, side by side on this machine, plus single-thread memcpy bandwidth:
# all_reduce / all_gather / reduce_scatter, fp32, 16 MiB and 64 MiB, 2 and 4 ranks.
#   bench/comm/compare.sh [BUILD_DIR] [REPEATS] [TRIALS]     (default build/comm, 3, 5)
# Every configuration runs REPEATS times, alternating the backends so that load from other
# processes hits them alike. Each run times TRIALS blocks of iterations. Two views, each the
# median over the repeats: "best" = the fastest block (what the code can do when it gets the
# cores), "mean" = all blocks (what it did on this machine as loaded at the time).
# comm_bench_mpi also times trellis' own MpiComm (column trellis_mpi) when it was built with it.
# On a shared machine, COMPARE_WAIT_IDLE=SECONDS makes every run first wait (at most that long)
# until the CPUs were >= 95% idle for one second; runs that started busy are counted at the end.
set -euo pipefail
build="${1:-build/comm}"
repeats="${2:-3}"
trials="${3:-5}"
bench="$build/bench/comm/comm_bench"
bench_mpi="$build/bench/comm/comm_bench_mpi"
ops="all_reduce,all_gather,reduce_scatter"
sizes="16M,64M"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
mpirun_flags=(--allow-run-as-root --oversubscribe --mca btl self,vader --bind-to none)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

wait_idle="${COMPARE_WAIT_IDLE:-0}"
started_busy=0
cpu_times() { read -r _ u n s i w x y z _ < /proc/stat; echo "$((u + n + s + i + w + x + y + z)) $((i + w))"; }
wait_for_idle() {
  (( wait_idle > 0 )) || return 0
  local start=$SECONDS t1 i1 t2 i2
  while (( SECONDS - start < wait_idle )); do
    read -r t1 i1 < <(cpu_times); sleep 1; read -r t2 i2 < <(cpu_times)
    (( 100 * (i2 - i1) >= 95 * (t2 - t1) )) && return 0
  done
  started_busy=$((started_busy + 1))
}

for rep in $(seq "$repeats"); do
  for n in 2 4; do
    wait_for_idle
    "$bench" --ranks "$n" --op "$ops" --sizes "$sizes" --trials "$trials" --json "$out/threads_${n}_${rep}.json" > /dev/null
    if [[ -x "$bench_mpi" ]]; then
      wait_for_idle
      mpirun -np "$n" "${mpirun_flags[@]}" "$bench_mpi" --op "$ops" --sizes "$sizes" --trials "$trials" \
        --json "$out/mpi_${n}_${rep}.json" > /dev/null
    fi
  done
done

(( wait_idle > 0 )) && echo "# runs that started on a busy machine (waited ${wait_idle} s): $started_busy"
python3 - "$out" <<'PY'
import glob, json, os, statistics, sys
rows, memcpy = {}, {}
for path in glob.glob(os.path.join(sys.argv[1], "*.json")):
    for r in json.load(open(path))["rows"]:
        r["op"] = r["op"].removeprefix("ideal:")  # comm_bench's ideal-traffic rows, backend "ideal"
        best, mean = r["busbw"], r.get("busbw_mean", r["busbw"])
        if r["backend"] == "memcpy":
            memcpy.setdefault(int(r["bytes"]), []).append((best, mean))
        else:
            key = (r["op"], int(r["ranks"]), int(r["bytes"]))
            rows.setdefault(key, {}).setdefault(r["backend"], []).append((best, mean, r["wrong"]))

def med(values, i):
    v = [x[i] for x in values]
    return statistics.median(v) if v else float("nan")

print("# busbw GB/s (nccl-tests factors), median over repeats; memcpy: single-thread memcpy, bytes copied/s")
print("#                          |------------------ best block -------------------|--------------- mean of all blocks ---------------|")
hdr = f"{'threads':>8} {'openmpi':>8} {'ratio':>6} {'trl_mpi':>8} {'memcpy':>7} {'thr/mc':>6}"
print(f"{'op':15} {'ranks':>5} {'size':>6} | {hdr} | {hdr} | wrong")
for key in sorted(rows):
    op, n, size = key
    t, m, tm = rows[key].get("threads", []), rows[key].get("openmpi", []), rows[key].get("trellis_mpi", [])
    wrong = sum(x[2] for v in rows[key].values() for x in v)
    mc = memcpy.get(size, [])
    cells = []
    for i in (0, 1):
        tv, mv, tmv, mcv = med(t, i), med(m, i), med(tm, i), med(mc, i)
        cells.append(f"{tv:8.2f} {mv:8.2f} {tv / mv if m else float('nan'):5.1f}x {tmv:8.2f} {mcv:7.2f} {tv / mcv:6.0%}")
    print(f"{op:15} {n:5d} {size >> 20:4d}Mi | {cells[0]} | {cells[1]} | {wrong:.0f}")

# The thread backend against the ideal traffic of its op (comm_bench's "ideal" rows, same runs:
# the op's reads and writes alone on all hardware threads, no synchronisation), and the goal of
# 50% of single-thread memcpy against that ideal: above 100%, no shared-memory algorithm gets there.
print()
print("# thread backend vs ideal traffic (busbw GB/s, best block, median over repeats)")
print(f"{'op':15} {'ranks':>5} {'size':>6} | {'threads':>8} {'ideal':>8} {'thr/id':>7} | {'goal':>8} {'goal/id':>8}")
for key in sorted(rows):
    op, n, size = key
    if "ideal" not in rows[key] or "threads" not in rows[key]:
        continue
    t, ideal, goal = med(rows[key]["threads"], 0), med(rows[key]["ideal"], 0), 0.5 * med(memcpy.get(size, []), 0)
    print(f"{op:15} {n:5d} {size >> 20:4d}Mi | {t:8.2f} {ideal:8.2f} {t / ideal:7.0%} | {goal:8.2f} {goal / ideal:8.0%}")
PY
