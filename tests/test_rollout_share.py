"""Greedy evaluation over ranks counts each held-out prompt once, though the ranks' equal shares
repeat some (real DeepSpeed engines on 2 CPU ranks).

    .venv/bin/python -m pytest -q tests/test_rollout_share.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rlhf import models
from rlhf.config import to_schema
from rlhf.distributed import first_copies, rank_share
from tests.conftest import ROOT, clean_env, compose, free_port


@pytest.mark.parametrize("n,world", [(3, 2), (5, 4), (4, 2), (1, 3), (7, 3)])
def test_the_first_copies_of_the_ranks_shares_are_each_item_once(n, world):
    items = list(range(n))
    counted = [x for r in range(world) for x in rank_share(items, r, world)[:first_copies(n, r, world)]]
    assert counted == items


def test_greedy_accuracy_and_cut_answers_on_two_ranks_count_the_wrapped_round_prompt_once(tmp_path):
    # 3 prompts on 2 ranks: shares [p0, p1] and [p2, p0]. Right for p0 alone: 1/3, not 2/4.
    out = tmp_path / "figures.json"
    model = models.resolve_path(to_schema(compose(["step=ppo", "model=tiny-llama"])).model)  # built once, here
    ranks = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank",
                            "--master_port", str(free_port()), str(ROOT / "tests" / "eval_share_worker.py"), model,
                            str(out)],
                           cwd=tmp_path, capture_output=True, text=True, env=clean_env(PYTHONPATH=str(ROOT)),
                           timeout=600)
    assert ranks.returncode == 0, (ranks.stdout + ranks.stderr)[-3000:]
    found = json.loads(out.read_text())
    assert found["plain"]["eval/accuracy"] == pytest.approx(1 / 3)
    assert found["never_ends"]["eval/accuracy"] == pytest.approx(1 / 3)
    assert found["never_ends"]["eval/truncated_frac"] == 1.0  # each prompt counted once, every answer cut
