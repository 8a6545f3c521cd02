"""The supervised loop (rlhf/runners/loop.py) around a toy regression model in a real DeepSpeed engine,
built as a runner builds its pieces; tests/test_loop.py calls ``train`` in-process, and starts this
file on two ranks to check that a non-finite loss on one rank stops both. Rank 0 writes what each
rank raised to OUT.

    python -m deepspeed.launcher.runner --num_gpus 2 --no_local_rank tests/loop_worker.py RUN_DIR OUT
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from rlhf import engine as engine_factory
from rlhf.checkpoint import Checkpointer
from rlhf.config import compose_config, to_schema
from rlhf.runners import common, loop
from rlhf.worker import init_distributed

# 24 rows, micro batches of 4, 2 accumulated: 3 optimizer steps per epoch, 2 epochs.
ROWS, STEPS = 24, 6


def rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"x": torch.randn(3, generator=g), "y": torch.randn(1, generator=g), "attention_mask": torch.ones(2)}
            for _ in range(ROWS)]


def train(run_dir: Path, stop_at: int = 0, nan_at: int = 0, ready_at: int = 0, nan_rank: int | None = None,
          extra: tuple[str, ...] = ()) -> tuple[dict, common.LoopState]:
    """Build the loop's pieces as a runner does and train; the final weights and the loop state.
    ``stop_at``: send this process SIGTERM during that optimizer step; ``nan_at``: a NaN loss there;
    ``ready_at``: the readiness function says done at that step's evaluation."""
    cfg = to_schema(compose_config([
        "step=sft", "step.epochs=2", "step.micro_batch_size_per_device=4", "step.gradient_accumulation_steps=2",
        "step.log_every_steps=1", "step.eval_every_steps=1", "checkpoint.every_steps=1", "checkpoint.keep_last=100",
        "optim.warmup_steps=0", "logging.progress_bar=false", f"run_dir={run_dir}", *extra]))
    init_distributed(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    data = rows()
    loader, sampler = common.train_loader(data, cfg, dist.get_rank(), dist.get_world_size(), default_collate)
    total = common.plan_steps(cfg, len(loader), len(data))
    engine, _ = engine_factory.build_train_engine(torch.nn.Linear(3, 1), cfg, total)
    ckpt = Checkpointer(run_dir, {"model": engine}, cfg.checkpoint.every_steps, cfg.checkpoint.keep_last)
    state, _, logger = common.start_loop(ckpt, cfg, dist.get_rank(), total, ("loss",), "sft")
    previous = signal.getsignal(signal.SIGTERM)

    def micro_step(batch: dict) -> tuple:
        if stop_at and state.step + 1 == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        loss = ((engine(batch["x"]) - batch["y"]) ** 2).mean()
        nan = nan_at and state.step + 1 == nan_at and nan_rank in (None, dist.get_rank())
        return (loss * float("nan") if nan else loss), {}

    def ready(epoch: int) -> bool:
        state.last, state.last_eval_step = {"eval/loss": float(state.step)}, state.step
        if ready_at and state.step >= ready_at:
            state.stopped_by = f"ready at {state.step}"
            return True
        return False

    try:
        loop.train(cfg, state, ckpt, logger,
                   loop.Supervised(cfg, engine, loader, sampler, ckpt, state, logger, 4, micro_step, ready, "toy loss"))
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    logger.close()
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}, state



if __name__ == "__main__":
    run_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    try:  # 12 rows per rank: 3 micro batches per epoch, one optimizer step each; rank 1 alone sees a NaN
        train(run_dir, nan_at=2, nan_rank=1, extra=("hardware=cpu-2rank", "step.gradient_accumulation_steps=1",
                                                     "step.micro_batch_size_per_device=4"))
        outcome = "finished"
    except FloatingPointError as err:
        outcome = f"FloatingPointError: {err}"
    outcomes = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, outcome)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(outcomes))
