#!/usr/bin/env bash
# issue 35, the pair form: old (main before it, dfbe130) and new alternating, one 2-rank run each
# (benchmarks/bf16.py), under the benchmark lock, load recorded before each run.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OLD=${OLD:-/tmp/oldtree2}   # git archive dfbe130 | tar -x -C /tmp/oldtree2
i=0
for t in old new old new old new; do
    i=$((i + 1)); uptime
    [ $t = old ] && P=$OLD || P=$PWD
    flock /tmp/streamcoll-bench.lock env PYTHONPATH=$P timeout 600 torchrun --nproc-per-node 2 \
        --master-addr 127.0.0.1 benchmarks/bf16.py --tree $t --rounds 15 --no-async \
        --out benchmarks/results/bf16_pair/run$i-$t 2>&1 | grep -v "^W1203\|Warn"
done
