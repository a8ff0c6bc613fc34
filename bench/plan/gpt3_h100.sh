#!/usr/bin/env bash
# The planner's choices for GPT-3 shapes (Brown et al. 2020, Table 2.1: layers, width, heads; the
# batch in sequences of 2048 tokens) on the H100 cluster file, each on a cluster sized as large
# training runs of that shape were (1.3B and 2.7B on 32 GPUs, 6.7B on 64, 13B on 128, 175B on 1024
# as in Narayanan et al. 2021). PLANNED ON PAPER: nothing here runs on a GPU; the figures are the
# cost model's predictions from the cluster file's peaks and efficiencies (docs/plan.md).
#   bench/plan/gpt3_h100.sh [BUILD_DIR] [extra trellis_plan flags...]
set -euo pipefail
build=${1:-build/host}
shift || true
here=$(cd "$(dirname "$0")/../.." && pwd)
bin=$build/examples/trellis_plan/trellis_plan
cluster=$here/examples/trellis_plan/clusters/h100_sxm_16x8.json
for run in "gpt3-1.3b 4" "gpt3-2.7b 4" "gpt3-6.7b 8" "gpt3-13b 16" "gpt3-175b 128"; do
  set -- $run "$@"
  model=$1 nodes=$2
  shift 2
  echo "=== $model on $nodes nodes of 8 H100"
  "$bin" --cluster "$cluster" --model "$model" --nodes "$nodes" --top 3 --max-microbatches 32 "$@" | tail -n +3
done
