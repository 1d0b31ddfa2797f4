#!/usr/bin/env bash
# The host path's figures on one GPU, in one go (about 7 minutes on an H200):
#   bash benchmarks/run_h200_host.sh OUTDIR
# The tests that need the card (CUDA graphs, the kernels on the GPU), host time per call and
# every timing mode against do_bench (benchmarks/host_overhead.py), Part B in loop timing, and a
# spot check of the grid's device times against the committed grid (profuse diff).
set -uo pipefail
out=${1:?usage: run_h200_host.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
step() { echo; echo "### $*"; timeout "${STEP_TIMEOUT:-240}" "$@" || echo "### step failed or timed out: $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,driver_version --format=csv
step python3 -m pytest -q -x -p no:cacheprovider tests/test_graphs.py tests/test_autotune.py tests/test_tail.py
step python3 benchmarks/host_overhead.py --out "$out/host_overhead.json"
step python3 -m profuse --skip-profile --backward --timing loop --out "$out/part_b_bwd_loop"
spot=4096,11008,32768,65536
step python3 -m profuse sweep --elements 32M --cols $spot --variants eager,triton --out "$out/spot_fwd"
step python3 -m profuse sweep --elements 32M --cols $spot --variants eager,triton --backward --out "$out/spot_bwd"
grid=benchmarks/results/h200-2026-12-02
step python3 -m profuse diff "$grid/grid_fwd/results.json" "$out/spot_fwd/results.json"
step python3 -m profuse diff "$grid/grid_bwd/results.json" "$out/spot_bwd/results.json"
