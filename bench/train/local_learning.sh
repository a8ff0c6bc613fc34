#!/usr/bin/env bash
# Local learning (PPLL) against back-propagated pipelines on the same model and ranks: train_gpt on
# the shipped corpus, pp 2 on thread ranks (one per core of a 2-core machine), 1f1b, zb_h1 and
# local_learning with a tied and an own head, the same steps, batches and seed. Per run: seconds
# for the steps (evaluation included, the same in every run), the last step's training loss and
# the final validation loss, i.e. what local learning buys in time and costs in quality.
#   bench/train/local_learning.sh [BUILD_DIR] [extra train_gpt flags...]
set -euo pipefail
source "$(dirname "$0")/train_gpt_env.sh"
shift "$train_gpt_args"
model=(--layers 8 --width 256 --heads 4 --context 64 --batch 16 --microbatches 8 --pp 2 --steps 150
       --eval-every 50 --sample-tokens 0 --warmup 10)
printf '%-28s %10s %12s %12s\n' "schedule" "seconds" "train loss" "val loss"
for run in "1f1b" "zb_h1" "local_learning --local-head tied" "local_learning --local-head own"; do
  # shellcheck disable=SC2086
  out=$("$bin" "${model[@]}" --ckpt-dir "$ckpt/$RANDOM" --schedule $run "$@" 2>&1 | grep '^trained')
  secs=$(sed -E 's/.* in ([0-9.]+) s:.*/\1/' <<<"$out")
  train=$(sed -E 's/.*-> ([0-9.]+);.*/\1/' <<<"$out")
  val=$(sed -E 's/.*validation loss ([0-9.]+).*/\1/' <<<"$out")
  printf '%-28s %10s %12s %12s\n' "$run" "$secs" "$train" "$val"
done
