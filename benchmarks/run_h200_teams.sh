#!/usr/bin/env bash
# Team kernels (issue 18) on one GPU:
#   bash benchmarks/run_h200_teams.sh OUTDIR tune   # every team candidate timed per width
#                                                   # (tune_tail --kinds team), then test_teams.py
#   bash benchmarks/run_h200_teams.sh OUTDIR tests  # the kernels' GPU tests, every candidate
#   bash benchmarks/run_h200_teams.sh OUTDIR bwd    # forward + backward, the grid's widths above 2048
#   bash benchmarks/run_h200_teams.sh OUTDIR fwd    # the forward, the same sizes
# The grids time the Triton kernels against eager only (the compile baselines are in the
# issue-6 grid, benchmarks/run_h200_grid.sh); narrower rows never take a team kernel.
# A team waits for its partners: every step runs under a timeout, so a hang costs its step only.
set -uo pipefail
out=${1:?usage: run_h200_teams.sh OUTDIR tune|tests|bwd|fwd}
what=${2:?usage: run_h200_teams.sh OUTDIR tune|tests|bwd|fwd}
mkdir -p "$out"
# Team launches are autotune candidates by default (configs.teams_enabled).
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
step() { echo; echo "### $*"; timeout -s KILL "${STEP_TIMEOUT:-300}" "$@" || echo "### step failed or timed out: $*"; }
grid=4096,5120,8192,11008,14336,16384,32768,65536
wide=5120,8192,11008,16384,32768,65536
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,driver_version --format=csv
case "$what" in
  tune)
    STEP_TIMEOUT=230 step python3 benchmarks/tune_tail.py --kinds team --which fwd,bwd --elements 33554432 \
      --budget-s 200 --cols $wide --out "$out/tune_team_32M.json"
    STEP_TIMEOUT=90 step python3 benchmarks/tune_tail.py --kinds team --which fwd,bwd --elements 134217728 \
      --cols 32768,65536 --out "$out/tune_team_128M.json"
    # ~100 s with a cold Triton cache (every candidate compiles), ~20 s warm
    STEP_TIMEOUT=300 step python3 -m pytest -q -x -p no:cacheprovider tests/test_teams.py
    ;;
  tests)
    STEP_TIMEOUT=300 step python3 -m pytest -q -x -p no:cacheprovider tests/test_graphs.py \
      tests/test_kernels_backward.py -k "candidate or explicit or deterministic or replay or capture or team"
    ;;
  bwd)
    step python3 -m profuse sweep --elements 4M,32M,128M --cols $grid --variants eager,triton --backward \
      --out "$out/grid_bwd"
    ;;
  fwd)
    step python3 -m profuse sweep --elements 4M,32M,128M --cols $grid --variants eager,triton \
      --out "$out/grid_fwd"
    ;;
esac
