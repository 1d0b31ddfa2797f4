#!/usr/bin/env bash
# The wide-row kernels (teams, row teams) on one GPU:
#   bash benchmarks/run_h200_teams.sh [PREFIX] tune    # every team candidate timed per width
#                                                      # (tune_tail --kinds team), then test_teams.py
#   bash benchmarks/run_h200_teams.sh [PREFIX] tests   # the kernels' GPU tests, every candidate
#   bash benchmarks/run_h200_teams.sh [PREFIX] fwd     # the forward: 32M at every width, 4M and 128M from 14336
#   bash benchmarks/run_h200_teams.sh [PREFIX] bwd     # forward + backward: 32M from 4096, 4M and 128M from 14336
# PREFIX defaults to benchmarks/results/h200-DATE; writes PREFIX-wide-rows/ (the wide-row table).
# The grids time the Triton kernels against eager only (the compile baselines are in the shape
# grid, benchmarks/run_h200_grid.sh); rows of 4096 columns or fewer never take a team kernel.
# A team waits for its partners: every step runs under a timeout, so a hang costs its step only.
set -uo pipefail
if [ $# -ge 2 ]; then p=$1; what=$2; else p=benchmarks/results/h200-$(date -u +%F); what=${1:?usage: run_h200_teams.sh [PREFIX] tune|tests|bwd|fwd}; fi
out="$p-wide-rows"
mkdir -p "$out"
# Team launches are autotune candidates by default (configs.teams_enabled).
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
step() { echo; echo "### $*"; timeout -s KILL "${STEP_TIMEOUT:-300}" "$@" || echo "### step failed or timed out: $*"; }
all=1024,2048,4096,5120,8192,11008,14336,16384,32768,65536
from4096=4096,5120,8192,11008,14336,16384,32768,65536
widest=14336,16384,32768,65536
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
  fwd)
    step python3 -m profuse sweep --elements 32M --cols $all --variants eager,triton --out "$out/grid_fwd_32M"
    step python3 -m profuse sweep --elements 4M,128M --cols $widest --variants eager,triton --out "$out/grid_fwd_4M_128M"
    ;;
  bwd)
    step python3 -m profuse sweep --elements 32M --cols $from4096 --backward --variants eager,triton --out "$out/grid_bwd_32M"
    step python3 -m profuse sweep --elements 4M,128M --cols $widest --backward --variants eager,triton --out "$out/grid_bwd_4M_128M"
    ;;
esac
