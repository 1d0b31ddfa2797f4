#!/usr/bin/env bash
# Every H200 target of the whole fused step in one run, most important first, each under a time
# limit so one failure costs its step only:
#   1. profuse step --model hf:llama --preset Llama-3.2-1B --precision both   (every default variant:
#      the fused step against eager, Liger-Kernel and torch.compile with the causal-mask fix, in bf16
#      and amp; its wall time from a cold machine and the longest gap between two progress lines)
#   2. profuse --out ...   (the default job: Parts A, B and C at the small preset)
#   3. profuse step --model hf:qwen3 --preset Qwen3-0.6B --precision both --variants eager,fused,liger
#   4. research/memory_peak.py: where the fused and Liger steps peak (Llama-3.2-1B, Qwen3-0.6B)
#   5. benchmarks/check_fuse.py: profuse.fuse with the real kernels, every op against float64
#
#   bash benchmarks/run_h200_targets.sh [PREFIX]
#
# PREFIX defaults to benchmarks/results/CARD-DATE, CARD the GPU found (h100, h200); writes
# PREFIX-targets/: one folder a step (its
# step.json or other files, its console output as produced, stamped with seconds since the step
# began) and driver.log, this script's own output. Needs torch, triton, transformers and
# liger-kernel on a CUDA machine, PYTHONPATH=src. Writes PREFIX-targets/done when it ends. A tree
# copied to the machine without its git history names its commit in PROFUSE_SOURCE_COMMIT (and
# PROFUSE_SOURCE_DIRTY=1 where it held uncommitted changes): every file's provenance records it.
set -uo pipefail
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E 'h100|h200|a100|b200' | tr A-Z a-z)
p=${1:-benchmarks/results/${card:-gpu}-$(date -u +%F)}
out="$p-targets"
mkdir -p "$out"
exec > >(tee -a "$out/driver.log") 2>&1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
here=$(dirname "$0")
# step NAME LIMIT CMD...: runs CMD under LIMIT seconds; its output, stamped, to NAME/console.log
step() {
  local name=$1 limit=$2; shift 2
  mkdir -p "$out/$name"
  echo "### $name: $* ($(date -u +%FT%TZ), limit ${limit} s)"
  local t0=$SECONDS
  timeout -s INT -k 10 "$limit" "$@" 2>&1 | python3 "$here/stamp.py" "$out/$name/console.log"
  local rc=${PIPESTATUS[0]}
  echo "### $name: rc=$rc after $((SECONDS - t0)) s"
}
commit=${PROFUSE_SOURCE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo -dirty)}
echo "### driver $(date -u +%FT%TZ) commit $commit"
nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.max.sm,clocks.mem,power.limit,driver_version --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -c "import liger_kernel, importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))"
step llama 560 python3 -m profuse step --model hf:llama --preset Llama-3.2-1B --precision both --out "$out/llama"
step main 300 python3 -m profuse --out "$out/main"
step qwen3 360 python3 -m profuse step --model hf:qwen3 --preset Qwen3-0.6B --precision both \
  --variants eager,fused,liger --out "$out/qwen3"
step memory-llama 200 python3 research/memory_peak.py --out "$out/memory-llama" --only eager,fused,liger
step memory-qwen3 120 python3 research/memory_peak.py --out "$out/memory-qwen3" --arch qwen3 \
  --preset Qwen3-0.6B --only eager,fused,liger
step check-fuse 180 python3 "$here/check_fuse.py" --out "$out/check-fuse"
echo "### done $(date -u +%FT%TZ)"
date -u +%FT%TZ > "$out/done"
