#!/usr/bin/env bash
# Devices of different speeds: train_gpt with pp 2 on thread ranks where pipeline rank 1 computes
# 2x slower (--rank-speed 1,0.5 --simulate-rank-speed: it sleeps after each unit's compute for as
# long as that took, a slow device SIMULATED on the host), with the even split (--stage-layers 4,4)
# and the balanced split (chosen from the FLOP count and the speeds), the same steps and seed.
# Per run: the split, the simulator's predicted step (block passes) and the measured seconds for
# the steps (evaluation included, the same in both runs); the ratios even / balanced side by side.
#   bench/train/uneven_stages.sh [BUILD_DIR] [extra train_gpt flags...]
set -euo pipefail
source "$(dirname "$0")/train_gpt_env.sh"
shift "$train_gpt_args"
model=(--layers 8 --width 256 --heads 4 --context 64 --batch 16 --microbatches 8 --pp 2 --steps 40
       --eval-every 100 --sample-tokens 0 --warmup 5 --rank-speed 1,0.5 --simulate-rank-speed)
printf '%-10s %8s %18s %10s\n' "split" "blocks" "predicted (passes)" "seconds"
declare -A pred secs
for split in even balanced; do
  extra=()
  [[ $split == even ]] && extra=(--stage-layers 4,4)
  out=$("$bin" "${model[@]}" "${extra[@]}" --ckpt-dir "$ckpt/$split" "$@" 2>&1)
  blocks=$(grep '^pipeline stages' <<<"$out" | sed -E 's/pipeline stages: ([0-9, ]+) blocks.*/\1/' | tr -d ' ')
  pred[$split]=$(grep '^pipeline stages' <<<"$out" | sed -E 's/.*a step of ([0-9.]+) block passes.*/\1/')
  secs[$split]=$(grep '^trained' <<<"$out" | sed -E 's/.* in ([0-9.]+) s:.*/\1/')
  printf '%-10s %8s %18s %10s\n' "$split" "$blocks" "${pred[$split]}" "${secs[$split]}"
done
awk -v pe="${pred[even]}" -v pb="${pred[balanced]}" -v se="${secs[even]}" -v sb="${secs[balanced]}" \
  'BEGIN { printf "even / balanced: predicted %.2fx, measured %.2fx\n", pe / pb, se / sb }'
