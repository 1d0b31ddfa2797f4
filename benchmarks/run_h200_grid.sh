#!/usr/bin/env bash
# The shape grid (every width a transformer uses) and the single-rank DDP run, on one GPU, in
# one go (about 9 minutes on an H200):
#   bash benchmarks/run_h200_grid.sh OUTDIR
# Then: profuse report OUTDIR/grid_fwd/results.json --vs compile-max --variants triton
set -uo pipefail
out=${1:?usage: run_h200_grid.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
# NVLink multicast stays off: on a shared host it can take GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
step() { echo; echo "### $*"; timeout "${STEP_TIMEOUT:-330}" "$@" || echo "### step failed or timed out: $*"; }
grid=1024,2048,4096,5120,8192,11008,14336,16384,32768,65536
some=1024,4096,11008,16384,65536
step python3 -m profuse profile --nproc 1 --device cuda --out "$out/ddp1"
step python3 -m profuse sweep --elements 4M,32M,128M --cols $grid --variants eager,compile,triton --backward --out "$out/grid_bwd"
step python3 -m profuse sweep --elements 4M,32M,128M --cols $grid --variants eager,compile-max,triton --out "$out/grid_fwd"
step python3 -m profuse sweep --dtype fp32 --elements 32M --cols $some --variants eager,compile-max,triton --out "$out/fp32_fwd"
step python3 -m profuse sweep --dtype fp32 --elements 32M --cols $some --variants eager,compile,triton --backward --out "$out/fp32_bwd"
step python3 -m profuse sweep --dtype fp16 --elements 32M --cols 1024,5120,16384,65536 --variants eager,compile,triton --backward --out "$out/fp16_bwd"
