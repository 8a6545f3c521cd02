"""bench/gpu.sh at toy size on CPU (``--tiny``): every phase runs through the real runners and the
decode loop, and the summary carries each phase's figures; what the GPU run will report, checked
before a GPU is at hand. The figures themselves mean nothing on CPU.

    python -m pytest -q tests/test_gpu_bench.py -m slow
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import clean_env

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_bench_script_runs_every_phase_at_toy_size(tmp_path):
    # Without the rank variables an in-process run of this worker left behind (its port, its world).
    env = clean_env(BENCH_OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    # An override after the flags, as the README's `bash bench/gpu.sh zero=2` passes it, reaches the runs.
    done = subprocess.run(["bash", "bench/gpu.sh", "--tiny", "zero=1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    log = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, log
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_phases"] == [], log
    for phase in ("matmul", "sft", "sft_micro4x", "decode", "decode_gqa", "ppo", "ppo_graph", "ppo_fast", "ppo_zero3"):
        assert phase in summary, phase
    for key in ("decode", "decode_gqa"):
        decode = summary[key]
        # In fp32 the static step decodes the default loop's tokens; both loops' log-probs are those of one
        # forward over their tokens; every way is timed against a positive floor.
        assert decode["same_tokens"] and decode["median_first_differing_token"] == decode["answer_tokens"]
        assert decode["default_logprob_vs_forward_max"] <= 1e-5 and decode["static_graph_logprob_vs_forward_max"] <= 1e-5
        assert decode["floor_ms_measured"] > 0
        for way in ("default", "static_graph", "static_graph_whole_cache"):
            assert decode[f"{way}_ms_per_token"] > 0, way
        # The static step reads at least the cache the tokens need, at most the whole cache.
        assert decode["kv_gb_at_mean"] <= decode["kv_gb_static_reads"]
        breakdown = decode["breakdown"]
        assert breakdown["forward_ms_per_token"] > 0 and breakdown["sampler_ms_per_token"] > 0
        assert breakdown["eager_forward_ms_by_kind"]["matmul"] > 0, breakdown
    # The grouped-query model's KV cache is sized from its own config: 2 of its 4 heads.
    assert (summary["decode_gqa"]["family"], summary["decode_gqa"]["kv_heads"], summary["decode_gqa"]["heads"]) == (
        "llama", 2, 4)
    assert summary["decode"]["kv_heads"] == summary["decode"]["heads"]
    assert summary["sft_micro4x"]["micro_batch"] == 4 * summary["sft"]["micro_batch"]
    assert summary["overrides"] == ["zero=1"]
    assert {summary[p]["zero_stage"] for p in ("sft", "sft_micro4x", "ppo", "ppo_graph", "ppo_fast")} == {1}
    assert summary["ppo_zero3"]["zero_stage"] == 3 and summary["ppo_zero3"]["generation_gathering"] == 1
    assert summary["ppo_fast"]["old_logprobs"] == "rollout" and summary["ppo_fast"]["decode_graph"]
    for phase in ("ppo", "ppo_graph", "ppo_fast", "ppo_zero3"):
        assert summary[phase]["measured_steps"] == 2 and summary[phase]["generate_s"] > 0, phase
        assert not summary[phase]["partial"] and summary[phase]["logprob_diff"] >= 0, phase
        # The last warm-up step is profiled (logging.profile_step), outside the measured steps.
        assert summary[phase]["profile"]["step"] == summary[phase]["warmup_steps"], phase
    assert summary["sft"]["profile"]["step"] == summary["sft"]["warmup_steps"]
    assert summary["sft"]["profile"]["by_kind_ms"]["matmul"] > 0
    assert "static step as graphs over spans" in (out / "summary.md").read_text()

    # A PPO phase killed at its time limit after two of its three steps: the report gives the one
    # measured step and says the figures are partial.
    metrics = out / "ppo_zero3" / "metrics.jsonl"
    steps = [line for line in metrics.read_text().splitlines() if '"step_s"' in line]
    metrics.write_text("\n".join(steps[:2]) + "\n")
    (out / "ppo_zero3.json").unlink()
    (out / "ppo_zero3.failed").touch()
    done = subprocess.run([sys.executable, "bench/gpu_bench.py", "report", "--out", str(out), "--tiny"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_phases"] == ["ppo_zero3"]
    assert summary["ppo_zero3"]["partial"] and summary["ppo_zero3"]["measured_steps"] == 1
    assert "stopped at its time limit" in (out / "summary.md").read_text()


def test_gpu_sh_refuses_a_phase_it_does_not_have(tmp_path):
    done = subprocess.run(["bash", "bench/gpu.sh", "--tiny", "--phases", "decode decod_gqa"], cwd=ROOT,
                          env=clean_env(BENCH_OUT=str(tmp_path / "out"), PYTHON=sys.executable), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "no phase 'decod_gqa'" in done.stderr
    assert "decode_gqa" in done.stderr, "the message lists the phases there are"
