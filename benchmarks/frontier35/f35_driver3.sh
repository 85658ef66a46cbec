#!/bin/bash
# Issue-35 study, third driver (lag 1 ordered by interest): waits for the running catch-up, then lag 128's edges (a lower
# rate for the methods unstable at 1e-3, a higher one for those stable), lag 1 at 2e-3 for every
# method, then further edges; no new block after 01:04 UTC.
cd /work/wt/study
export PYTHONPATH=$PWD JAX_PLATFORMS=cpu
OUT=runs/f35
BASE="--out $OUT --seeds 3 --knob-quantiles --gspo-methods --workers 2 --log-every 0"
ALL="GRPO GRPO+SAT GRPO+VCPO GRPO+M2PO GRPO+TIS GRPO+IcePop GRPO+SeqMask GRPO+DPPO-TV GRPO+R3 GRPO+SAT+R3 GRPO+SAT-mbq"
while kill -0 9940 2>/dev/null; do sleep 5; done
late() { now=$(date -u +%H%M); [ "$now" -ge 0104 ] && [ "$now" -lt 1200 ]; }
run_block() {  # lag lr methods...
  late && { echo "driver2: stop at $(date -u +%T)"; exit 0; }
  lag=$1; lr=$2; shift 2
  echo "=== $(date -u +%T) block lag $lag lr $lr: $*"
  nice -n 19 .venv/bin/python benchmarks/frontier.py $BASE --lags $lag --lrs $lr --methods "$@" || echo "driver2: failed"
}
edges() {  # one pass of the edge blocks at a lag (128, 1 or all)
  .venv/bin/python runs/f35_edges.py | while read -r lag lr methods; do
    { [ "$1" = all ] || [ "$lag" = "$1" ]; } && echo "$lag $lr $methods"
  done
}
# (lag 128 edges ran under driver2)
run_block 1 2e-3 $ALL
for pass in 1 2 3; do
  edges all > $OUT/.todo; [ -s $OUT/.todo ] || break
  while read -r line; do run_block $line; done < $OUT/.todo
done
echo "=== $(date -u +%T) driver2 done"
