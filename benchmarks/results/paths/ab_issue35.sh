#!/bin/bash
# issue 35's process-group figures: old tree (b0d4ad9) and this tree alternately, the same driver
# (this tree's benchmarks/paths.py: both controls), 3 runs each, then the line-by-line table
cd /work/main
R=benchmarks/results/paths
for i in 1 2 3; do
  for tree in old main; do
    echo "== ws1 $tree run $i: $(uptime)"
    PYTHONPATH=/work/$tree python benchmarks/paths.py --rounds 7 --label "$tree" --out $R/ab_ws1_${tree}_$i 2>&1 | grep -v "^\[W"
  done
done
for i in 1 2 3; do
  for tree in old main; do
    echo "== 2 ranks $tree run $i: $(uptime)"
    PYTHONPATH=/work/$tree torchrun --nproc-per-node 2 --master-port 29590 benchmarks/paths.py --rounds 7 --label "$tree" \
      --out $R/ab_2ranks_${tree}_$i 2>&1 | grep -v "^\[W\|OMP\|\*\*\*\|^W1"
  done
done
echo "== lines: $(uptime)"
python benchmarks/pg_lines.py --rounds 7 --out $R/pg_lines 2>&1 | grep -v "^\[W"
echo "== end: $(uptime)"
