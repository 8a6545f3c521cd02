"""Long learning runs (marked slow: `make test-all`): the default chain, as `make run` runs it,
lifts held-out greedy accuracy by the task's rule.

    python -m pytest -m slow tests/test_learning.py
"""

from __future__ import annotations

import json

import pytest

from rlhf.launch import run
from tests.conftest import compose


@pytest.mark.slow
def test_default_chain_lifts_held_out_accuracy_by_20_points(tmp_path):
    overrides = ["pipeline=e2e", "logging.progress_bar=false", f"run_dir={tmp_path}"]
    run(compose(overrides), overrides=overrides)
    ppo = json.loads((tmp_path / "ppo" / "final_metrics.json").read_text())
    gain = ppo["eval/accuracy"] - ppo["eval/accuracy_before"]
    assert gain >= 0.20, ppo
    assert ppo["reference_weight_change"] == 0.0
