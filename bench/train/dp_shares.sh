#!/usr/bin/env bash
# Data-parallel replicas of different speeds: train_gpt with dp 2 on thread ranks where dp rank 1
# computes 2x slower (--dp-speed 1,0.5 --simulate-rank-speed: it sleeps after each unit's compute
# for as long as that took, a slow device SIMULATED on the host), with equal shares of
# the batch (--dp-rows 16,16) and with the shares balanced for the speeds (--dp-speed alone: the
# shares whose slowest rank finishes first), the same steps and seed. Per run: the shares, the
# predicted compute of the slowest rank (rows / speed) and the measured seconds for the steps
# (evaluation included, the same in both runs); the ratios equal / balanced side by side.
#   bench/train/dp_shares.sh [BUILD_DIR] [extra train_gpt flags...]
set -euo pipefail
source "$(dirname "$0")/train_gpt_env.sh"
shift "$train_gpt_args"
model=(--layers 4 --width 256 --heads 4 --context 96 --batch 32 --val-fraction 0.25 --microbatches 1 --dp 2 --steps 20
       --eval-every 100 --sample-tokens 0 --warmup 5 --dp-speed 1,0.5 --simulate-rank-speed)
printf '%-10s %8s %22s %10s %12s\n' "shares" "rows" "predicted (rows/speed)" "seconds" "final loss"
declare -A pred secs
for shares in equal balanced; do
  extra=()
  [[ $shares == equal ]] && extra=(--dp-rows 16,16)
  out=$("$bin" "${model[@]}" "${extra[@]}" --ckpt-dir "$ckpt/$shares" "$@" 2>&1)
  rows=$(grep '^dp shares' <<<"$out" | sed -E 's/dp shares: ([0-9, ]+) rows.*/\1/' | tr -d ' ')
  pred[$shares]=$(awk -v r="$rows" 'BEGIN { n = split(r, x, ","); split("1,0.5", s, ","); m = 0;
    for (i = 1; i <= n; ++i) if (x[i] / s[i] > m) m = x[i] / s[i]; print m }')
  secs[$shares]=$(grep '^trained' <<<"$out" | sed -E 's/.* in ([0-9.]+) s:.*/\1/')
  loss=$(grep '^trained' <<<"$out" | sed -E 's/.*-> ([0-9.]+);.*/\1/')
  printf '%-10s %8s %22s %10s %12s\n' "$shares" "$rows" "${pred[$shares]}" "${secs[$shares]}" "$loss"
done
awk -v pe="${pred[equal]}" -v pb="${pred[balanced]}" -v se="${secs[equal]}" -v sb="${secs[balanced]}" \
  'BEGIN { printf "equal / balanced: predicted %.2fx (compute of the slowest rank only), measured %.2fx\n", pe / pb, se / sb }'
