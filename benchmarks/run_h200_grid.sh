#!/usr/bin/env bash
# The shape grid (every width a transformer uses, bf16, fp32 and fp16) and the single-rank DDP
# run, on one GPU, in one go (about 9 minutes on an H200):
#   bash benchmarks/run_h200_grid.sh [PREFIX]   # PREFIX defaults to benchmarks/results/h200-DATE
# Writes PREFIX-grid/ and PREFIX-ddp1/. Then:
#   profuse report PREFIX-grid/grid_fwd/results.json --vs compile-max --variants triton
set -uo pipefail
p=${1:-benchmarks/results/h200-$(date -u +%F)}
mkdir -p "$p-grid" "$p-ddp1"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
# NVLink multicast stays off: on a shared host it can take GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
step() { echo; echo "### $*"; timeout "${STEP_TIMEOUT:-330}" "$@" || echo "### step failed or timed out: $*"; }
grid=1024,2048,4096,5120,8192,11008,14336,16384,32768,65536
some=1024,4096,11008,16384,65536
step python3 -m profuse profile --nproc 1 --device cuda --out "$p-ddp1"
step python3 -m profuse sweep --elements 4M,32M,128M --cols $grid --variants eager,compile,triton --backward --out "$p-grid/grid_bwd"
step python3 -m profuse sweep --elements 4M,32M,128M --cols $grid --variants eager,compile-max,triton --out "$p-grid/grid_fwd"
step python3 -m profuse sweep --dtype fp32 --elements 32M --cols $some --variants eager,compile-max,triton --out "$p-grid/fp32_fwd"
step python3 -m profuse sweep --dtype fp32 --elements 32M --cols $some --variants eager,compile,triton --backward --out "$p-grid/fp32_bwd"
step python3 -m profuse sweep --dtype fp16 --elements 32M --cols 1024,5120,16384,65536 --variants eager,compile,triton --backward --out "$p-grid/fp16_bwd"
