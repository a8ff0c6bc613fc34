#!/usr/bin/env bash
# The planner on ranks of unequal speed: train_gpt --plan auto on 2 thread ranks whose speeds come
# from a cluster file (the second 2x slower; --simulate-rank-speed makes it so: after each unit's
# compute it sleeps for as long as that took, a slow device SIMULATED on the host; one kernel thread
# per rank, so its idle core is not lent to the other). The planner times this machine's kernels,
# takes the file's speeds, and gives its layouts uneven dp shares and stage splits
# (plan::balance_for_speeds). Beside its choice, measured the same way: dp 2, pp 2 and tp 2 with
# even shares or splits, and dp 2 and pp 2 balanced by train_gpt itself (--cluster). The same
# model, steps and seed throughout.
#   bench/plan/mixed_speeds.sh [BUILD_DIR] [extra train_gpt flags...]
set -euo pipefail
source "$(dirname "$0")/../train/train_gpt_env.sh"
shift "$train_gpt_args"
model=(--layers 8 --width 128 --heads 2 --context 128 --vocab 2048 --batch 16 --val-fraction 0.2 --steps 20 --eval-every 100
       --sample-tokens 0 --warmup 5 --simulate-rank-speed --kernel-threads 1 --cluster "$here/bench/train/slow_second_rank.json")
extra=("$@")
run() {  # label, flags...: prints the row; sets secs and out
  local label=$1; shift
  out=$("$bin" "${model[@]}" "$@" --ckpt-dir "$ckpt/run" "${extra[@]}" 2>&1) || { echo "$label failed:"; echo "$out"; exit 1; }
  rm -rf "$ckpt/run"
  secs=$(grep '^trained' <<<"$out" | sed -E 's/.* in ([0-9.]+) s:.*/\1/')
  local layout
  layout=$(grep '^layout:' <<<"$out" | sed -E 's/^layout: ([^,]*),.*/\1/')
  printf '%-44s %-34s %8s\n' "$label" "$layout" "$secs"
}
printf '%-44s %-34s %8s\n' "run" "layout" "seconds"
declare -A at
run "dp 2, equal shares, m2" --dp 2 --microbatches 2 --dp-rows 8,8; at[dp_even]=$secs
run "dp 2, balanced shares (--cluster), m2" --dp 2 --microbatches 2; at[dp_balanced]=$secs
run "pp 2 1f1b, even split, m8" --pp 2 --microbatches 8 --stage-layers 4,4; at[pp_even]=$secs
run "pp 2 1f1b, balanced split (--cluster), m8" --pp 2 --microbatches 8; at[pp_balanced]=$secs
run "tp 2, m1" --tp 2 --microbatches 1; at[tp]=$secs
run "--plan auto --ranks 2" --plan auto --ranks 2
planned=$secs
grep -E '^  [0-9]\.' <<<"$out" | sed 's/^/  planned: /'
best=$(for k in "${!at[@]}"; do echo "${at[$k]} $k"; done | sort -n | head -1)
echo "fastest of the others: ${best#* } (${best%% *} s); the planner's choice: $planned s"
awk -v p="$planned" -v b="${best%% *}" -v e="${at[dp_even]}" \
  'BEGIN { printf "planned / fastest other: %.2fx; dp equal shares / planned: %.2fx\n", p / b, e / p }'
