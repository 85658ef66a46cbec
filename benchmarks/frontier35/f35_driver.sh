#!/bin/bash
# Issue-35 study driver: blocks of (lag, lr) with every method and 3 seeds, most important first.
# GRPO+VCPO joins once runs/f35/vcpo_ready exists (its baseline landed), with a catch-up of the
# blocks already run. Stops starting new blocks after 01:05 UTC.
cd /work/wt/study
export PYTHONPATH=$PWD JAX_PLATFORMS=cpu
OUT=runs/f35
BASE="--out $OUT --seeds 3 --knob-quantiles --gspo-methods --workers 2 --log-every 0"
M10="GRPO GRPO+SAT GRPO+R3 GRPO+SAT+R3 GRPO+SAT-mbq GRPO+TIS GRPO+IcePop GRPO+SeqMask GRPO+DPPO-TV GRPO+M2PO"
BLOCKS=("128 1e-3" "128 1.5e-3" "1 2e-3" "1 1.5e-3" "128 5e-4" "32 1e-3" "32 1.5e-3" "8 1.5e-3" "8 2e-3" "64 1e-3" "64 1.5e-3")
done_blocks=()
caught_up=0
for b in "${BLOCKS[@]}"; do
  set -- $b; lag=$1; lr=$2
  now=$(date -u +%H%M); if [ "$now" -ge 0105 ] && [ "$now" -lt 1200 ]; then echo "driver: stop at $now"; break; fi
  if [ -f $OUT/vcpo_ready ] && [ $caught_up = 0 ]; then
    for d in "${done_blocks[@]}"; do set -- $d
      echo "=== $(date -u +%T) catch-up VCPO lag $1 lr $2"
      nice -n 19 .venv/bin/python benchmarks/frontier.py $BASE --lags $1 --lrs $2 --methods GRPO+VCPO || echo "driver: failed"
    done; caught_up=1
  fi
  methods="$M10"; [ -f $OUT/vcpo_ready ] && methods="$M10 GRPO+VCPO"
  echo "=== $(date -u +%T) block lag $lag lr $lr: $methods"
  nice -n 19 .venv/bin/python benchmarks/frontier.py $BASE --lags $lag --lrs $lr --methods $methods || echo "driver: failed"
  done_blocks+=("$lag $lr")
done
echo "=== $(date -u +%T) driver done"
