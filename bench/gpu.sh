#!/usr/bin/env bash
# The framework on one GPU in one go: matmul rate; SFT TFLOP/s and MFU of a random OPT-1.3B shape at
# 16 and at 64 rows per micro batch; the rollout decode loop against the memory bus's floor (default
# loop and the static step recorded as a CUDA graph); a PPO step (1.3B actor, 350M critic and reward
# model) by phase, both ways. bench/gpu_bench.py says what each phase measures; results go to
# $BENCH_OUT (default runs/bench-gpu): summary.md, summary.json, one JSON per phase, and the SFT and
# PPO run directories.
#
#   bash bench/gpu.sh                # one GPU: under 10 min (phase limits) on an H200
#   bash bench/gpu.sh zero=2         # extra Hydra overrides for the SFT and PPO runs
#   bash bench/gpu.sh --tiny         # toy sizes on CPU: checks the script, not the speed
#
# Each phase runs in its own process under its own time limit, so one that hangs or fails (logged,
# marked with PHASE.failed) still leaves the others' figures and the summary.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${BENCH_OUT:-runs/bench-gpu}
TINY=()
if [[ "${1:-}" == "--tiny" ]]; then TINY=(--tiny); shift; fi
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.failed

phase() {  # phase NAME SECONDS [overrides...]
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
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

# Limits: a cold run on an H200 (random models built, CUDA and DeepSpeed started in each process)
# took matmul 4 s, sft 55 s, sft_micro4x 53 s, decode 44 s, ppo 124 s, ppo_graph 89 s (376 s in all).
# The limits keep the whole under 10 minutes (590 s), with the most room where the time was longest.
phase matmul 30
phase sft 90 "$@"
phase sft_micro4x 90 "$@"
phase decode 80
phase ppo 170 "$@"
phase ppo_graph 130 "$@"
"$PYTHON" bench/gpu_bench.py report --out "$OUT" "${TINY[@]}" "$@"
echo "=== total ${SECONDS}s"
