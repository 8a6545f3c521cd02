"""The supervised loop (rlhf/runners/loop.py) on its own, around a toy regression model in a real
DeepSpeed engine: a resume from a mid-epoch checkpoint and from an epoch-boundary checkpoint ends
with the weights of the straight run, a stop request saves and resumes where it stopped, a readiness
rule ends the run early, and a non-finite loss stops with a marked checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from rlhf import engine as engine_factory
from rlhf.checkpoint import Checkpointer
from rlhf.config import to_schema
from rlhf.runners import common, loop
from rlhf.worker import init_distributed
from tests.conftest import compose

# 24 rows, micro batches of 4, 2 accumulated: 3 optimizer steps per epoch, 2 epochs.
ROWS, STEPS = 24, 6


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(3, generator=g), "y": torch.randn(1, generator=g), "attention_mask": torch.ones(2)}
            for _ in range(ROWS)]


def _train(run_dir: Path, stop_at: int = 0, nan_at: int = 0, ready_at: int = 0) -> tuple[dict, common.LoopState]:
    """Build the loop's pieces as a runner does and train; the final weights and the loop state.
    ``stop_at``: send this process SIGTERM during that optimizer step; ``nan_at``: a NaN loss there;
    ``ready_at``: the readiness function says done at that step's evaluation."""
    cfg = to_schema(compose([
        "step=sft", "step.epochs=2", "step.micro_batch_size_per_device=4", "step.gradient_accumulation_steps=2",
        "step.log_every_steps=1", "step.eval_every_steps=1", "checkpoint.every_steps=1", "checkpoint.keep_last=100",
        "optim.warmup_steps=0", "logging.progress_bar=false", f"run_dir={run_dir}"]))
    init_distributed(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows = _rows()
    loader, sampler = common.train_loader(rows, cfg, 0, 1, default_collate)
    total = common.plan_steps(cfg, len(loader), len(rows))
    engine, _ = engine_factory.build_train_engine(torch.nn.Linear(3, 1), cfg, total)
    ckpt = Checkpointer(run_dir, {"model": engine}, cfg.checkpoint.every_steps, cfg.checkpoint.keep_last)
    state, _, logger = common.start_loop(ckpt, cfg, 0, total, ("loss",), "sft")
    previous = signal.getsignal(signal.SIGTERM)

    def micro_step(batch: dict) -> tuple:
        if stop_at and state.step + 1 == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        loss = ((engine(batch["x"]) - batch["y"]) ** 2).mean()
        return (loss * float("nan") if nan_at and state.step + 1 == nan_at else loss), {}

    def ready(epoch: int) -> bool:
        state.last, state.last_eval_step = {"eval/loss": float(state.step)}, state.step
        if ready_at and state.step >= ready_at:
            state.stopped_by = f"ready at {state.step}"
            return True
        return False

    try:
        loop.train(cfg, engine, loader, sampler, ckpt, state, logger, 4, micro_step, ready, "toy loss")
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    logger.close()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}, state


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    weights, state = _train(run_dir)
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
    resumed, state = _train(tmp_path)
    assert state.step == STEPS and _same(resumed, weights), where
    logged = [json.loads(x)["step"] for x in open(tmp_path / "metrics.jsonl") if '"loss"' in x]
    assert logged == list(range(step + 1, STEPS + 1)), "each step after the checkpoint logged once"


def test_a_stop_request_saves_and_the_run_resumes_where_it_stopped(tmp_path, straight):
    _, weights, _ = straight
    with pytest.raises(SystemExit, match=r"stopped by signal 15 after step 4; checkpoint saved"):
        _train(tmp_path, stop_at=4)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    resumed, state = _train(tmp_path)
    assert state.step == STEPS and _same(resumed, weights)


def test_a_readiness_rule_ends_the_run_at_its_evaluation(tmp_path):
    _, state = _train(tmp_path, ready_at=2)
    assert state.step == 2 and state.total_steps == 2 and state.stopped_by == "ready at 2"


def test_a_nonfinite_loss_stops_with_a_marked_checkpoint(tmp_path):
    with pytest.raises(FloatingPointError, match=r"toy loss is nan at optimizer step 3"):
        _train(tmp_path, nan_at=3)
    assert (tmp_path / "checkpoints" / "nonfinite_step_00000003").is_dir()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"
