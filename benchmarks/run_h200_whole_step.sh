#!/usr/bin/env bash
# The whole memory-bound step on one GPU, in three calls of under 10 minutes each (limits from a
# fresh H100's run, 2026-12-05, where the Llama-3.2-1B bf16 run took 254 s, compiles included):
#   bash benchmarks/run_h200_whole_step.sh [PREFIX] 1   # Llama-3.2-1B in bf16 against Liger and
#                                                      # torch.compile; Part C at the small preset
#   bash benchmarks/run_h200_whole_step.sh [PREFIX] 2   # Llama-3.2-1B in amp; the bf16 accumulator;
#                                                      # Qwen3-0.6B; lab and medium; host time per op
#   bash benchmarks/run_h200_whole_step.sh [PREFIX] 3   # fuse checked with the real kernels; with
#                                                      # OLD_SRC, an older tree's small step beside this one's
# PREFIX defaults to benchmarks/results/h200-DATE. Writes PREFIX-whole-step/ (step.json per run) and
# PREFIX-host-path/. Needs torch, triton and transformers on a CUDA machine; liger-kernel for the
# Liger rows. OLD_SRC=DIR (a `git archive` of an older tree's src/) adds that tree's small step
# beside this one's in call 3, one after the other.
set -uo pipefail
p=${1:-benchmarks/results/h200-$(date -u +%F)}
part=${2:-1}
out="$p-whole-step"
mkdir -p "$out" "$p-host-path"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
step() { echo; echo "### $* ($(date +%T))"; local t0=$SECONDS; timeout -s INT -k 10 "$T" "$@"; echo "### rc=$? after $((SECONDS - t0)) s: $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,driver_version,power.draw --format=csv
llama=(--model hf:llama --preset Llama-3.2-1B)
qwen=(--model hf:qwen3 --preset Qwen3-0.6B)
case "$part" in
1)
  T=400 step python3 -m profuse step "${llama[@]}" --precision bf16 \
    --variants eager,fused,liger,compile,compile+fused --profile-steps 1 --out "$out/llama-bf16"
  T=150 step python3 -m profuse step --preset small --out "$out/small"
  ;;
2)
  T=150 step python3 -m profuse step "${llama[@]}" --precision amp --variants eager,fused,liger \
    --profile-steps 0 --out "$out/llama-amp"
  T=50 step env PROFUSE_CE_ACCUM=weight python3 -m profuse step "${llama[@]}" --precision bf16 \
    --variants eager,fused --trials 4 --profile-steps 0 --out "$out/llama-bf16-accumulate-weight"
  T=140 step python3 -m profuse step "${qwen[@]}" --precision bf16 --variants eager,fused,liger \
    --profile-steps 0 --out "$out/qwen3-bf16"
  T=45 step python3 -m profuse step --preset lab --variants eager,fused --profile-steps 0 --out "$out/lab"
  T=70 step python3 -m profuse step --preset medium --variants eager,fused --profile-steps 0 --out "$out/medium"
  T=80 step python3 benchmarks/host_overhead.py --out "$p-host-path"
  ;;
3)
  T=150 step python3 benchmarks/check_fuse.py --out "$out/check-fuse"
  if [ -n "${OLD_SRC:-}" ]; then
    for tree in "$OLD_SRC" src; do
      T=35 step env PYTHONPATH="$tree:${PYTHONPATH}" python3 -m profuse step --preset small \
        --variants eager,fused --trials 8 --profile-steps 0 --out "$out/small-$(basename "$(dirname "$tree")")"
    done
  fi
  ;;
*) echo "usage: $0 [PREFIX] 1|2|3" >&2; exit 2 ;;
esac
echo "### done $(date +%T)"
