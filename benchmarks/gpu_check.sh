#!/usr/bin/env bash
# The accelerator checks, as one script: the `small` train step in bfloat16 (tokens/s and MFU
# against the device's own bfloat16 matmul peak, remat off/on, 1 and 4 microbatches, T = 512 and
# 2048) and the serving engine's decode tokens/s in bfloat16.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (default $OUT, else runs/gpu_check)
#
# PYTHON picks the interpreter (default .venv/bin/python, else python3); it needs this project's
# dependencies and a jax that sees the accelerator. QUICK=1 runs the same commands at toy sizes
# (the tiny preset; any backend), which is how the tests check the script itself.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/gpu_check}}
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "${QUICK:-0}" = 1 ]; then
  train=(--quick --dtype bfloat16)
  engine=(--quick --preset tiny --slots 2 --new-tokens 4)
else
  train=(--preset small --seq-lens 512,2048 --batch 8 --repeats 5 --dtype bfloat16)
  engine=(--preset small --slots 64 --new-tokens 256)
fi
"$py" -c 'import jax; print("jax", jax.__version__, jax.devices())' | tee "$out/devices.txt"
"$py" benchmarks/train_step.py "${train[@]}" --json "$out/train_step.json" | tee "$out/train_step.md"
"$py" benchmarks/rollout.py --engine --dtype bfloat16 "${engine[@]}" | tee "$out/engine.txt"
echo "gpu_check: results in $out"
