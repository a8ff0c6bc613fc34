#!/usr/bin/env bash
# What the balanced pipeline split weighs: FLOP counts, or each block's and head's F+B+W timed on
# this machine (--stage-costs measured: the planner's cost model with plan::MeasuredRates). pp 2 on
# thread ranks, the speeds from a cluster file whose second device is 2x slower (--cluster; with
# --simulate-rank-speed rank 1 sleeps after each unit's compute for as long as it took: a slow device
# SIMULATED on the host). The LM head of vocab 4096 is where FLOPs and time part: its
# cross-entropy and norms cost time that no FLOP counts, attention costs more than its FLOPs.
# Every split with the slow stage holding 1-6 of the 12 blocks is run too (--stage-layers, the same
# speeds, with the step the timed costs predict for it), so the two choices stand beside the best
# measured split. One kernel thread per rank (--kernel-threads 1): the slow rank's idle core is not
# lent to the other rank. The same steps and seed throughout.
#   bench/train/stage_costs.sh [BUILD_DIR] [extra train_gpt flags...]
set -euo pipefail
source "$(dirname "$0")/train_gpt_env.sh"
shift "$train_gpt_args"
model=(--layers 12 --width 128 --heads 2 --context 256 --vocab 4096 --batch 8 --microbatches 8 --val-fraction 0.4
       --pp 2 --steps 20 --eval-every 100 --sample-tokens 0 --warmup 5 --simulate-rank-speed --kernel-threads 1)
run() {  # label, flags...: prints the row; sets split and secs
  local label=$1; shift
  local out
  out=$("$bin" "${model[@]}" "$@" --ckpt-dir "$ckpt/run" "${extra[@]}" 2>&1)
  rm -rf "$ckpt/run"
  split=$(grep '^pipeline stages' <<<"$out" | sed -E 's/pipeline stages: ([0-9, ]+) blocks.*/\1/' | tr -d ' ')
  pred=$(grep '^pipeline stages' <<<"$out" | sed -E 's/.*a step of ([0-9.]+) block passes.*/\1/')
  secs=$(grep '^trained' <<<"$out" | sed -E 's/.* in ([0-9.]+) s:.*/\1/')
  printf '%-34s %8s %12s %10s\n' "$label" "$split" "$pred" "$secs"
}
extra=("$@")
printf '%-34s %8s %12s %10s\n' "run" "blocks" "predicted" "seconds"
echo "(predicted: the step simulated with the timed costs, in block passes)"
declare -A at
for slow in 1 2 3 4 5 6; do
  run "split $((12 - slow)),$slow" --stage-layers $((12 - slow)),$slow --rank-speed 1,0.5 --stage-costs measured
  at[$split]=$secs
done
run "--cluster, --stage-costs flops" --cluster "$here/bench/train/slow_second_rank.json" --stage-costs flops
flops_split=$split flops_secs=$secs
run "--cluster, --stage-costs measured" --cluster "$here/bench/train/slow_second_rank.json" --stage-costs measured
best=$(for s in "${!at[@]}"; do echo "${at[$s]} $s"; done | sort -n | head -1)
echo "fastest fixed split: ${best#* } (${best%% *} s); flops chose $flops_split ($flops_secs s), measured chose $split ($secs s)"
awk -v f="$flops_secs" -v m="$secs" -v b="${best%% *}" \
  'BEGIN { printf "chosen / fastest fixed split: flops %.2fx, measured %.2fx\n", f / b, m / b }'
