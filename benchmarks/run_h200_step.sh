#!/usr/bin/env bash
# Part C and the host path on one GPU, in two halves of under 10 minutes each:
#   bash benchmarks/run_h200_step.sh OUTDIR 1   # tests that need the card, host_overhead, step --preset small
#   bash benchmarks/run_h200_step.sh OUTDIR 2   # step --preset medium and lab, Part A at the lab's size
set -uo pipefail
out=${1:?usage: run_h200_step.sh OUTDIR 1|2}
half=${2:?usage: run_h200_step.sh OUTDIR 1|2}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
step() { echo; echo "### $*"; timeout "${STEP_TIMEOUT:-300}" "$@" || echo "### step failed or timed out: $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,driver_version --format=csv
if [ "$half" = 1 ]; then
  STEP_TIMEOUT=150 step python3 -m pytest -q -x -p no:cacheprovider tests/test_graphs.py tests/test_blockops.py
  step python3 benchmarks/host_overhead.py --out "$out/host_overhead.json"
  step python3 -m profuse step --preset small --out "$out/step_small"
else
  step python3 -m profuse step --preset medium --out "$out/step_medium"
  step python3 -m profuse step --preset lab --out "$out/step_lab"
  step python3 -m profuse profile --out "$out/part_a_lab"
fi
