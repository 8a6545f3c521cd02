"""Long learning runs (marked slow: `make test-all`): the default chain, as `make run` runs it,
lifts held-out greedy accuracy by the task's rule.

    python -m pytest -m slow tests/test_learning.py
"""

from __future__ import annotations

import json

import pytest

from rlhf.launch import run
from tests.conftest import check_margin, compose, trajectory_overrides


@pytest.mark.slow
@pytest.mark.trajectory
def test_default_chain_lifts_held_out_accuracy_by_20_points(tmp_path, record_property):
    overrides = ["pipeline=e2e", "logging.progress_bar=false", *trajectory_overrides(), f"run_dir={tmp_path}"]
    run(compose(overrides), overrides=overrides)
    ppo = json.loads((tmp_path / "ppo" / "final_metrics.json").read_text())
    gain = ppo["eval/accuracy"] - ppo["eval/accuracy_before"]
    check_margin(record_property, "eval/accuracy gain", gain, 0.20)
    assert ppo["reference_weight_change"] == 0.0
