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
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["failed_phases"] == [], done.stdout[-3000:] + done.stderr[-3000:]
    for phase in ("matmul", "sft", "sft_micro4x", "decode", "ppo", "ppo_graph"):
        assert phase in summary, phase
    decode = summary["decode"]
    # In fp32 the static step decodes the default loop's tokens; both loops' log-probs are those of one
    # forward over their tokens; both are timed against a positive floor.
    assert decode["same_tokens"] and decode["median_first_differing_token"] == decode["answer_tokens"]
    assert decode["default_logprob_vs_forward_max"] <= 1e-5 and decode["static_graph_logprob_vs_forward_max"] <= 1e-5
    assert decode["floor_ms_measured"] > 0 and decode["default_ms_per_token"] > 0
    assert decode["static_graph_ms_per_token"] > 0
    assert summary["sft_micro4x"]["micro_batch"] == 4 * summary["sft"]["micro_batch"]
    assert summary["overrides"] == ["zero=1"]
    assert {summary[p]["zero_stage"] for p in ("sft", "sft_micro4x", "ppo", "ppo_graph")} == {1}
    for phase in ("ppo", "ppo_graph"):
        assert summary[phase]["measured_steps"] == 2 and summary[phase]["generate_s"] > 0
    assert "static step recorded as a graph" in (tmp_path / "out" / "summary.md").read_text()
