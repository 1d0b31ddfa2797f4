#!/usr/bin/env bash
# Every target of the whole fused step on a card, in four parts that each fit one 10-minute call:
#   part 1, cold as the target is set (Triton and Inductor caches in empty folders of its own, so
#   it may follow other parts on one machine), run in the background and waited on over as many
#   calls of part 1 as it takes:
#     profuse step --model hf:llama --preset Llama-3.2-1B --precision both: every default variant
#       (eager, fused, liger-ops, liger, compile, compile+fused, cudagraphs) with its profiles,
#       amp then bf16, trials fitted to the step (--trials left out). Its wall time is the
#       target (8 minutes); its tables are the Llama targets: fused vs eager and Liger, memory,
#       amp, compile+fused vs compile with their profiles   658 s on a fresh H100 (2026-12-07)
#   part 2 (limits 150 + 420 s):
#     research/memory_peak.py: where each variant's step peaks (Llama-3.2-1B): eager, fused with
#       the loss's chunk and accumulator as set and overridden, Liger; the allocator's split
#       blocks at the end of the forward                                                  ~90 s
#     Llama-3.2-1B bf16, 12 trials, one profile step each: eager, fused, liger (the speed and
#       memory targets), compile, compile+fused (every op) and compile+loss (the fused loss
#       alone, the rest left to Inductor), the mask fix in all three          ~6 min (est.)
#   part 3 (limits 220 + 180 + 200 s):
#     profuse --out ...   (the default job: Parts A, B and C at the small preset)        ~105-145 s
#       (a 140 s limit stopped it in Part C's profiles on a fresh H100, 2026-12-07)
#       its Part C traces also packed in main/traces.tgz (a few MB), kept where the large
#       Llama traces are left behind: they hold each fused op's host time on the card
#     profuse step Qwen3-0.6B bf16 and amp: eager, fused, liger        bf16 118 s on an H100
#   part 4 (limits 240 + 150 s):
#     benchmarks/check_fuse.py: profuse.fuse with the real kernels, every op against float64: 68 s
#       with warm caches, over 100 s on a fresh machine (H100, 2026-12-07)
#     research/host_gap.py: where the fused small step's extra host time goes (the backward's
#       thread, the forward, the Python)                                          ~1 min (est.)
#   part 5 (limit 330 s):
#     research/kernel_analysis_time.py: compile+fused's longer compile: torch's analysis of each
#       Triton launch, and profuse's memo of it (PROFUSE_ANALYSIS_MEMO) off and on, Llama-3.2-1B
#       bf16, three cold compiles in processes of their own                        ~4 min (est.)
#
#   bash benchmarks/run_h200_targets.sh [PREFIX] [1|2|3|4|5]
#
# PREFIX defaults to benchmarks/results/CARD-DATE, CARD the GPU found (h100, h200); writes
# PREFIX-targets/: one folder a step (its step.json or other files, its console output as
# produced, stamped with seconds since the step began) and driver.log, this script's own output.
# Needs torch, triton, transformers and liger-kernel on a CUDA machine, PYTHONPATH=src. Writes
# PREFIX-targets/done-PART when a part ends. A tree copied to the machine without its git history
# names its commit in PROFUSE_SOURCE_COMMIT (and PROFUSE_SOURCE_DIRTY=1 where it held uncommitted
# changes), set on the machine that sends the tree: a copied .git can be stale, and every file's
# provenance records what it is told.
set -uo pipefail
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i -E 'h100|h200|a100|b200' | tr A-Z a-z)
p=${1:-benchmarks/results/${card:-gpu}-$(date -u +%F)}
part=${2:-1}
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
if [ "$part" = 1 ]; then
  # Longer than one call (about 12 minutes on an H100, 2026-12-07): the first call of part 1 starts
  # it in its own session, in the background, and every call of part 1 waits for it up to WAIT_S
  # seconds (default 540), so two calls chained within the machine's idle release see it through.
  both="$out/llama-both"
  if [ ! -e "$both/pid" ]; then
    mkdir -p "$both"
    # Cold wherever it runs: Inductor's and Triton's caches start empty in folders of its own, so
    # parts run before it on the same machine do not warm its compiles (COLD=0 keeps the defaults).
    if [ "${COLD:-1}" != 0 ]; then
      export TORCHINDUCTOR_CACHE_DIR=$(mktemp -d /tmp/profuse-cold-inductor.XXXXXX)
      export TRITON_CACHE_DIR=$(mktemp -d /tmp/profuse-cold-triton.XXXXXX)
    fi
    echo "### llama-both: started $(date -u +%FT%TZ) in the background, limit 1500 s, caches ${TORCHINDUCTOR_CACHE_DIR:-as set}"
    setsid bash -c "timeout -s INT -k 10 1500 python3 -m profuse step --model hf:llama --preset Llama-3.2-1B \
      --precision both --out '$both' 2>&1 | python3 '$here/stamp.py' '$both/console.log' > /dev/null; \
      echo \${PIPESTATUS[0]} > '$both/rc'" < /dev/null > /dev/null 2>&1 &
    echo $! > "$both/pid"
  fi
  waited=0
  while [ ! -e "$both/rc" ] && [ "$waited" -lt "${WAIT_S:-540}" ]; do
    sleep 10; waited=$((waited + 10))
    [ $((waited % 60)) = 0 ] && echo "### llama-both: running; last line: $(tail -c 300 "$both/console.log" | tr '\r' '\n' | tail -1)"
  done
  if [ ! -e "$both/rc" ]; then
    echo "### llama-both: still running after this call's ${WAIT_S:-540} s: call part 1 again to wait on"
    exit 0
  fi
  echo "### llama-both: rc=$(cat "$both/rc")"
elif [ "$part" = 2 ]; then
  step memory-llama 150 python3 research/memory_peak.py --out "$out/memory-llama"
  step llama-bf16 420 python3 -m profuse step --model hf:llama --preset Llama-3.2-1B --precision bf16 \
    --variants eager,fused,liger,compile,compile+fused,compile+loss --trials 12 --profile-steps 1 \
    --out "$out/llama-bf16"
elif [ "$part" = 3 ]; then
  step main 220 python3 -m profuse --out "$out/main"
  (cd "$out/main" && ls trace-step-*.json > /dev/null 2>&1 && tar czf traces.tgz trace-step-*.json)
  step qwen3-bf16 180 python3 -m profuse step --model hf:qwen3 --preset Qwen3-0.6B --precision bf16 \
    --variants eager,fused,liger --trials 12 --profile-steps 0 --out "$out/qwen3-bf16"
  step qwen3-amp 200 python3 -m profuse step --model hf:qwen3 --preset Qwen3-0.6B --precision amp \
    --variants eager,fused,liger --trials 12 --profile-steps 0 --out "$out/qwen3-amp"
elif [ "$part" = 4 ]; then
  step check-fuse 240 python3 "$here/check_fuse.py" --out "$out/check-fuse"
  step host-gap 150 python3 research/host_gap.py --out "$out/host-gap"
else
  step kernel-analysis 330 python3 research/kernel_analysis_time.py --out "$out/kernel-analysis"
fi
echo "### done $(date -u +%FT%TZ)"
date -u +%FT%TZ > "$out/done-$part"
