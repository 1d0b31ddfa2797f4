#!/usr/bin/env bash
# Part C and the host path on one GPU, in parts of under 10 minutes each (3 and 4 need transformers:
# carry its wheels, pip install --no-index --find-links .whl transformers, where nothing downloads):
#   bash benchmarks/run_h200_step.sh [PREFIX] 1   # tests that need the card, host_overhead, step --preset small
#   bash benchmarks/run_h200_step.sh [PREFIX] 2   # step --preset medium and lab, Part A at the lab's size
#   bash benchmarks/run_h200_step.sh [PREFIX] 3   # Hugging Face Llama-3.2-1B: its profile and its step, every variant
#   bash benchmarks/run_h200_step.sh [PREFIX] 4   # Hugging Face Qwen3-0.6B: the same
# PREFIX defaults to benchmarks/results/h200-DATE; writes PREFIX-host-path/, PREFIX-part-c/ and PREFIX-hf-step/.
set -uo pipefail
if [ $# -ge 2 ]; then p=$1; half=$2; else p=benchmarks/results/h200-$(date -u +%F); half=${1:?usage: run_h200_step.sh [PREFIX] 1|2|3|4}; fi
mkdir -p "$p-host-path" "$p-part-c" "$p-hf-step"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
step() { echo; echo "### $*"; timeout "${STEP_TIMEOUT:-300}" "$@" || echo "### step failed or timed out: $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,driver_version --format=csv
if [ "$half" = 1 ]; then
  STEP_TIMEOUT=150 step python3 -m pytest -q -x -p no:cacheprovider tests/test_graphs.py tests/test_blockops.py
  step python3 benchmarks/host_overhead.py --out "$p-host-path/host_overhead.json"
  step python3 -m profuse step --preset small --out "$p-part-c/step_small"
elif [ "$half" = 3 ] || [ "$half" = 4 ]; then
  if [ "$half" = 3 ]; then arch=llama; preset=Llama-3.2-1B; else arch=qwen3; preset=Qwen3-0.6B; fi
  STEP_TIMEOUT=120 step python3 -m profuse profile --model hf:$arch --preset $preset --out "$p-hf-step/profile_$preset"
  STEP_TIMEOUT=450 step python3 -m profuse step --model hf:$arch --preset $preset --out "$p-hf-step/step_$preset"
else
  step python3 -m profuse step --preset medium --out "$p-part-c/step_medium"
  step python3 -m profuse step --preset lab --out "$p-part-c/step_lab"
  step python3 -m profuse profile --out "$p-part-c/part_a_lab"
fi
