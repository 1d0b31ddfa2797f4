#!/usr/bin/env bash
# The published presets of the dense families and the mixtures of experts against Liger-Kernel's
# patch for each family, each part one 10-minute call:
#   dense: Gemma-3-1B, OLMo-2-1B, Phi-4-mini in bf16: eager, fused, liger (no compile, no
#          profiles: three cold compiles of 1-4B models alone take the call's time)
#   moe:   OLMoE-1B-7B and Qwen3-30B-A3B-12L in bf16: eager, moe-best, moe-best+fused, liger
#          (liger-kernel 0.8.5 has no OLMoE patch: the run says so), one profiled step a variant
#          for the routing, activation and loss shares
#   ops:   bench_rope.py's dense-family ops (GeGLU, the (1 + w) and post-norm RMSNorms, partial
#          rope, LayerNorm) at Gemma-3-1B, OLMo-2-1B and Phi-4-mini shapes: % of the copy ceiling
#
#   bash benchmarks/run_h200_families.sh [PREFIX] [dense|moe|ops]
#
# Sized for an H200's 141 GB. On an 80 GB card Phi-4-mini runs at BATCH_PHI (default 4; 1 fits an
# H100) and the mixtures of experts at the depth such a card holds (OLMoE-1B-7B-8L, Qwen3-30B-A3B-4L). PREFIX defaults
# to benchmarks/results/CARD-DATE, CARD the GPU found; writes PREFIX-families/: one folder a step
# (step.json, its console output as produced, stamped by stamp.py) and driver.log. Needs torch,
# triton, transformers and liger-kernel on a CUDA machine, PYTHONPATH=src; PROFUSE_SOURCE_COMMIT
# names the tree where its copy has no trustworthy git history (see run_h200_targets.sh).
set -uo pipefail
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E 'h100|h200|a100|b200' | tr A-Z a-z)
p=${1:-benchmarks/results/${card:-gpu}-$(date -u +%F)}
part=${2:-dense}
out="$p-families"
mkdir -p "$out"
exec > >(tee -a "$out/driver.log") 2>&1
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}src PYTHONUNBUFFERED=1
here=$(dirname "$0")
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
echo "### driver $(date -u +%FT%TZ) commit $commit part $part"
nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.max.sm,clocks.mem,power.limit,driver_version --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
python3 -c "import importlib.metadata as m; print('liger-kernel', m.version('liger-kernel'))"
run() {  # run NAME LIMIT ARCH PRESET VARIANTS TRIALS PROFILES [more args]
  local name=$1 limit=$2 arch=$3 preset=$4 variants=$5 trials=$6 profiles=$7; shift 7
  step "$name" "$limit" python3 -m profuse step --model "hf:$arch" --preset "$preset" --precision bf16 \
    --variants "$variants" --trials "$trials" --profile-steps "$profiles" --out "$out/$name" "$@"
}
if [ "$part" = dense ]; then
  run gemma3-bf16 170 gemma3_text Gemma-3-1B eager,fused,liger 10 0
  run olmo2-bf16 150 olmo2 OLMo-2-1B eager,fused,liger 10 0
  run phi4-bf16 240 phi3 Phi-4-mini eager,fused,liger 6 0 --batch-size "${BATCH_PHI:-4}"
elif [ "$part" = moe ]; then
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  if [ "${mem:-0}" -gt 100000 ]; then olmoe=OLMoE-1B-7B; qwen=Qwen3-30B-A3B-12L; else olmoe=OLMoE-1B-7B-8L; qwen=Qwen3-30B-A3B-4L; fi
  run olmoe-bf16 260 olmoe "$olmoe" eager,moe-best,moe-best+fused,liger 8 1
  run qwen3moe-bf16 300 qwen3_moe "$qwen" eager,moe-best,moe-best+fused,liger 8 1
elif [ "$part" = ops ]; then
  step ops 420 python3 "$here/bench_rope.py" --ops gelu_mul,rms_norm_offset,rms_norm_add,add_rms_norm,partial_rope,layer_norm \
    --out "$out/ops"
else
  echo "unknown part '$part': dense, moe or ops" >&2
  exit 2
fi
echo "### done $(date -u +%FT%TZ)"
date -u +%FT%TZ > "$out/done-$part"
