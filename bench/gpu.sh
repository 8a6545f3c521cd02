#!/usr/bin/env bash
# The framework on one GPU: matmul rate; SFT TFLOP/s and MFU of a random OPT-1.3B shape at 16 and at
# 64 rows per micro batch; the rollout decode loop against the memory bus's floor (default loop, the
# static step replayed as CUDA graphs, and where its time goes) on OPT-1.3B and on a grouped-query
# model of Llama 3.2 1B's shape; a PPO step (1.3B actor, 350M critic and reward model) by phase:
# default, with the graphs, with the graphs and the sampler's log-probs, and under ZeRO-3.
# bench/gpu_bench.py says what each phase measures; results go to $BENCH_OUT (default
# runs/bench-gpu): summary.md, summary.json, one JSON per phase, and the SFT and PPO run directories.
#
#   bash bench/gpu.sh                            # every phase (limits: 990 s in all)
#   bash bench/gpu.sh --phases "decode decode_gqa ppo_fast ppo_zero3"   # a set (limits: 480 s)
#   bash bench/gpu.sh zero=2                     # extra Hydra overrides for the SFT and PPO runs
#   bash bench/gpu.sh --tiny                     # toy sizes on CPU: checks the script, not the speed
#
# Each phase runs in its own process under its own time limit, so one that hangs or fails (logged,
# marked with PHASE.failed) still leaves the others' figures and the summary; a PPO phase stopped at
# its limit reports the steps it logged. Calls with different --phases add to one summary (a phase's
# old figures are replaced only when it runs again).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${BENCH_OUT:-runs/bench-gpu}
TINY=()
ALL="matmul sft sft_micro4x decode decode_gqa ppo ppo_graph ppo_fast ppo_zero3"
PHASES=$ALL
while [[ $# -gt 0 ]]; do
    case "$1" in
        --tiny) TINY=(--tiny); shift ;;
        --phases) PHASES=$2; shift 2 ;;
        *) break ;;
    esac
done
for p in $PHASES; do
    [[ " $ALL " == *" $p "* ]] || { echo "bench/gpu.sh: no phase '$p' (phases: $ALL)" >&2; exit 2; }
done
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

# Limits: a cold run on an H200 (random models built, CUDA and DeepSpeed started in each process)
# took matmul 4 s, sft 55 s, sft_micro4x 53 s, decode 44 s (two loops then; three now), ppo 124 s,
# ppo_graph 89 s; decode_gqa, ppo_fast and ppo_zero3 are sized from those.
declare -A LIMIT=([matmul]=30 [sft]=90 [sft_micro4x]=90 [decode]=90 [decode_gqa]=90 [ppo]=170 [ppo_graph]=130
                  [ppo_fast]=130 [ppo_zero3]=170)
budget=0
for p in $PHASES; do budget=$((budget + LIMIT[$p])); done
echo "=== phases: $PHASES (limits ${budget}s in all)"

phase() {  # phase NAME [overrides...]
    local name=$1; shift
    local limit=${LIMIT[$name]} start=$SECONDS
    rm -f "$OUT/$name.json" "$OUT/$name.failed"
    echo "=== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$PYTHON" bench/gpu_bench.py "$name" --out "$OUT" "${TINY[@]}" "$@"
    local rc=$?  # 124: over its limit
    if [[ $rc -ne 0 ]]; then
        echo "=== $name FAILED (exit $rc) after $((SECONDS - start))s"
        touch "$OUT/$name.failed"
    else
        echo "=== $name done in $((SECONDS - start))s"
    fi
}

for p in $PHASES; do
    case "$p" in
        matmul|decode|decode_gqa) phase "$p" ;;
        *) phase "$p" "$@" ;;
    esac
done
"$PYTHON" bench/gpu_bench.py report --out "$OUT" "${TINY[@]}" "$@"
echo "=== total ${SECONDS}s"
