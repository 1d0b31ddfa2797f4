#!/usr/bin/env bash
# Every H200 figure in the README and the results folder, in one go (about 9 minutes):
#   bash benchmarks/run_h200.sh OUTDIR
# Needs torch + triton on a CUDA machine; liger-kernel joins as a row when importable.
set -uo pipefail
out=${1:?usage: run_h200.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
step() { echo; echo "### $*"; timeout "${STEP_TIMEOUT:-300}" "$@" || echo "### step failed or timed out: $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,driver_version --format=csv
step python3 benchmarks/backward_breakdown.py --out "$out/breakdown.json"
step python3 benchmarks/harness_vs_do_bench.py --out "$out/agree_fwd.json"
step python3 benchmarks/harness_vs_do_bench.py --backward --out "$out/agree_bwd.json"
step python3 -m profuse --skip-profile --out "$out/part_b_fwd"
step python3 -m profuse --skip-profile --backward --out "$out/part_b_bwd"
step python3 -m profuse --profile-only --compile-step --out "$out/part_a"
step python3 -m profuse sweep --rows 1024,8192,32768 --cols 4096 --out "$out/sweep_fwd"
step python3 -m profuse sweep --rows 1024,8192,32768 --cols 4096 --backward --out "$out/sweep_bwd"
