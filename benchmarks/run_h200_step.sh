#!/usr/bin/env bash
# Part C and the host path on one GPU, in two halves of under 10 minutes each:
#   bash benchmarks/run_h200_step.sh [PREFIX] 1   # tests that need the card, host_overhead, step --preset small
#   bash benchmarks/run_h200_step.sh [PREFIX] 2   # step --preset medium and lab, Part A at the lab's size
# PREFIX defaults to benchmarks/results/h200-DATE; writes PREFIX-host-path/ and PREFIX-part-c/.
set -uo pipefail
if [ $# -ge 2 ]; then p=$1; half=$2; else p=benchmarks/results/h200-$(date -u +%F); half=${1:?usage: run_h200_step.sh [PREFIX] 1|2}; fi
mkdir -p "$p-host-path" "$p-part-c"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
step() { echo; echo "### $*"; timeout "${STEP_TIMEOUT:-300}" "$@" || echo "### step failed or timed out: $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,driver_version --format=csv
if [ "$half" = 1 ]; then
  STEP_TIMEOUT=150 step python3 -m pytest -q -x -p no:cacheprovider tests/test_graphs.py tests/test_blockops.py
  step python3 benchmarks/host_overhead.py --out "$p-host-path/host_overhead.json"
  step python3 -m profuse step --preset small --out "$p-part-c/step_small"
else
  step python3 -m profuse step --preset medium --out "$p-part-c/step_medium"
  step python3 -m profuse step --preset lab --out "$p-part-c/step_lab"
  step python3 -m profuse profile --out "$p-part-c/part_a_lab"
fi
