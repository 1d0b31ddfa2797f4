#!/usr/bin/env bash
# Part A, Part B at 8192 x 4096, the 4096-column sweep and the harness against do_bench, on one
# GPU, in one go (about 9 minutes on an H200):
#   bash benchmarks/run_h200.sh [PREFIX]      # PREFIX defaults to benchmarks/results/h200-DATE
# Writes PREFIX-part-a/, PREFIX-part-b/, PREFIX-sweep-4096/ (docs/results-h200.md reads them).
# Needs torch + triton on a CUDA machine; liger-kernel joins as a row when importable.
set -uo pipefail
p=${1:-benchmarks/results/h200-$(date -u +%F)}
mkdir -p "$p-part-a" "$p-part-b" "$p-sweep-4096"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
step() { echo; echo "### $*"; timeout "${STEP_TIMEOUT:-300}" "$@" || echo "### step failed or timed out: $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,driver_version --format=csv
step python3 benchmarks/harness_vs_do_bench.py --out "$p-part-b/agree_fwd.json"
step python3 benchmarks/harness_vs_do_bench.py --backward --out "$p-part-b/agree_bwd.json"
step python3 -m profuse --skip-profile --out "$p-part-b/part_b_fwd"
step python3 -m profuse --skip-profile --backward --out "$p-part-b/part_b_bwd"
step python3 benchmarks/tune_tail.py --which bwd --cols 4096 --elements 33554432 \
  --out "$p-part-b/tune_backward_8192x4096.json"
step python3 -m profuse --profile-only --compile-step --out "$p-part-a"
step python3 -m profuse sweep --rows 1024,8192,32768 --cols 4096 --out "$p-sweep-4096/sweep_fwd"
step python3 -m profuse sweep --rows 1024,8192,32768 --cols 4096 --backward --out "$p-sweep-4096/sweep_bwd"
