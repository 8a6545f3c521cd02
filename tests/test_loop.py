"""The supervised loop (rlhf/runners/loop.py) on its own, around a toy regression model in a real
DeepSpeed engine: a resume from a mid-epoch checkpoint and from an epoch-boundary checkpoint ends
with the weights of the straight run, a stop request saves and resumes where it stopped, a readiness
rule ends the run early, and a non-finite loss stops with a marked checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, clean_env, free_port
from tests.loop_worker import STEPS, train


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    weights, state = train(run_dir)
    return run_dir, weights, state


def test_the_straight_run_trains_every_step_of_both_epochs(straight):
    run_dir, _, state = straight
    assert state.step == STEPS and state.stopped_by == ""
    logged = [json.loads(x)["step"] for x in open(run_dir / "metrics.jsonl") if '"loss"' in x]
    assert logged == list(range(1, STEPS + 1))


@pytest.mark.parametrize("step,where", [(2, "mid-epoch"), (3, "epoch boundary")])
def test_a_resume_from_a_checkpoint_ends_with_the_straight_runs_weights(tmp_path, straight, step, where):
    run_dir, weights, _ = straight
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    shutil.copytree(run_dir / "checkpoints" / f"step_{step:08d}", ckpts / f"step_{step:08d}")
    (ckpts / "latest").write_text(f"step_{step:08d}")
    client = torch.load(ckpts / f"step_{step:08d}" / "client_rank0.pt", weights_only=False)["state"]
    assert (client["epoch"], client["batch_index"]) == ((0, 4) if where == "mid-epoch" else (1, 0))
    resumed, state = train(tmp_path)
    assert state.step == STEPS and _same(resumed, weights), where
    logged = [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl") if '"loss"' in x]
    assert logged == list(range(step + 1, STEPS + 1)), "each step after the checkpoint logged once"


def test_a_stop_request_saves_and_the_run_resumes_where_it_stopped(tmp_path, straight):
    _, weights, _ = straight
    with pytest.raises(SystemExit, match=r"stopped by signal 15 after step 4; checkpoint saved"):
        train(tmp_path, stop_at=4)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    resumed, state = train(tmp_path)
    assert state.step == STEPS and _same(resumed, weights)


def test_a_readiness_rule_ends_the_run_at_its_evaluation(tmp_path):
    _, state = train(tmp_path, ready_at=2)
    assert state.step == 2 and state.total_steps == 2 and state.stopped_by == "ready at 2"


def test_a_nonfinite_loss_stops_with_a_marked_checkpoint(tmp_path):
    with pytest.raises(FloatingPointError, match=r"toy loss is nan at optimizer step 3"):
        train(tmp_path, nan_at=3)
    assert (tmp_path / "checkpoints" / "nonfinite_step_00000003").is_dir()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"


@pytest.mark.slow  # a 2-rank launch; make test starts 2 ranks in test_loss_agg and one PPO run
def test_a_nonfinite_loss_on_one_of_two_ranks_stops_both(tmp_path):
    """Rank 1 alone sees a NaN at step 2: both ranks stop there (the flag is reduced over ranks), the
    state saved once, marked, never made latest."""
    out = tmp_path / "outcomes.json"
    proc = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank",
                           "--master_port", str(free_port()), str(ROOT / "tests" / "loop_worker.py"), str(tmp_path / "run"),
                           str(out)], cwd=tmp_path, capture_output=True, text=True,
                          env=clean_env(PYTHONPATH=str(ROOT)), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    outcomes = json.loads(out.read_text())
    assert len(outcomes) == 2 and all("toy loss is" in o and "at optimizer step 2 (on this or another rank)" in o
                                      for o in outcomes), outcomes
    assert (tmp_path / "run" / "checkpoints" / "nonfinite_step_00000002").is_dir()
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000001"
