"""The one training driver under every runner, written once: epochs and the step counter, resume at
the checkpoint's batch, the evaluation cadence and a readiness rule ending the step, an evaluation at
the run's end (and at each epoch's, where the step asks), checkpoints after a step (when due, or asked
by a stop request) and at each epoch's boundary, the profiler window and the progress bar.

What a step is belongs to its runner, through a ``Steps`` object: the supervised steps (SFT, reward
model, the DPO family) use ``Supervised`` below, one optimizer step over the micro batches of one
accumulation; PPO's step (rlhf/runners/ppo.py) is a prompt batch's rollouts and their updates.

    python launch.py step=sft     # every runner trains through train()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from tqdm import tqdm

from rlhf.checkpoint import StopRequest
from rlhf.config import Config
from rlhf.distributed import mean_over_ranks
from rlhf.observe.logging import format_line
from rlhf.observe.profiling import StepProfiler
from rlhf.runners import common


class Steps(Protocol):
    """A runner's hooks: what one step does, what it logs, how it is judged and what a checkpoint keeps."""

    # Whether every epoch ends with an evaluation, or only the run (and the step.eval_every_steps cadence).
    evaluates_each_epoch: bool

    @property
    def total(self) -> int:
        """The step the run ends at (a readiness rule may end it sooner)."""

    def batches(self, epoch: int, skip: int) -> Iterator[tuple[int, Any]]:
        """The epoch's batches with their index, after the first ``skip`` (consumed before the
        checkpoint a run resumed from), with the run's RNG where the straight run had it."""

    def step(self, epoch: int, index: int, batch: Any, more: Iterator[tuple[int, Any]]) -> tuple[int, bool]:
        """Train on ``batch`` and on as many of ``more`` as one step takes. Returns the index of the
        last batch it used and whether a step completed (False: the epoch ran out mid-step)."""

    def record(self, epoch: int, index: int) -> dict[str, str] | None:
        """After the step counter moved: the step's figures logged; the progress bar's postfix, if new."""

    def evaluate(self, epoch: int, final: bool) -> bool:
        """Evaluate (``final``: the run's last evaluation); True where a readiness rule ends the step."""

    def saved(self, epoch: int, index: int) -> dict:
        """What a checkpoint keeps, with the next batch at ``index`` of ``epoch``."""


def train(cfg: Config, state, ckpt, logger, steps: Steps) -> None:
    """Train from ``state`` (fresh or resumed: its step, epoch, batch_index and last_eval_step) until
    ``steps.total`` or a readiness rule."""
    import torch.distributed as dist

    rank, step_cfg, name = dist.get_rank(), cfg.step, cfg.step.name
    stop, profiler, done, skip = StopRequest(), StepProfiler(cfg, rank), False, state.batch_index
    bar = tqdm(total=steps.total, initial=state.step, desc=name, disable=rank != 0 or not cfg.logging.progress_bar)

    def evaluate(epoch: int, final: bool) -> bool:
        ready = steps.evaluate(epoch, final)
        state.last_eval_step = state.step
        return ready

    for epoch in range(state.epoch, step_cfg.epochs):
        batches = steps.batches(epoch, skip)
        for index, batch in batches:
            profiler.before(state.step + 1)
            index, stepped = steps.step(epoch, index, batch, batches)
            if not stepped:  # the epoch ended inside an accumulation: the next epoch's batches finish it
                continue
            state.step += 1
            profiler.after(state.step)
            bar.update(1)
            if postfix := steps.record(epoch, index):
                bar.set_postfix(postfix)
            if step_cfg.eval_every_steps and state.step % step_cfg.eval_every_steps == 0:
                done = evaluate(epoch, state.step >= steps.total)
            if done or state.step >= steps.total:
                break
            ckpt.after_step(state.step, steps.saved(epoch, index + 1), stop, logger, name)
        skip = 0
        # The run ends with an evaluation, and so does every epoch where the step asks (unless its last
        # step just had one).
        final = state.step >= steps.total or epoch + 1 == step_cfg.epochs
        if not done and state.last_eval_step != state.step and (final or steps.evaluates_each_epoch):
            done = evaluate(epoch + 1, final)
        if done or state.step >= steps.total:
            break
        # The epoch boundary: a resume trains the remaining epochs.
        ckpt.save(state.step, steps.saved(epoch + 1, 0))
    bar.close()


@dataclass
class Supervised:
    """The supervised steps' hooks: a step is one optimizer step over the micro batches of one
    accumulation, and its figures are the means over a window of steps, logged every
    step.log_every_steps. A runner gives ``micro_step(batch) -> (loss, sums)`` (the loss to back-
    propagate and what the window adds up) and ``ready(epoch) -> bool`` (evaluate, log, and say whether
    a readiness rule ends the step); ``what`` names the loss in a non-finite stop; ``derive`` adds
    figures computed from the window's means (DPO's margin); ``postfix``: window keys on the bar."""

    cfg: Config
    engine: Any
    loader: Any
    sampler: Any
    ckpt: Any
    state: common.LoopState
    logger: Any
    n_params: int
    micro_step: Callable[[dict], tuple]
    ready: Callable[[int], bool]
    what: str
    derive: Callable[[dict], dict] | None = None
    postfix: tuple[str, ...] = ("loss",)
    meter: common.Throughput = field(init=False)
    # A pass over the data is where a supervised step's readiness is judged, whatever the cadence.
    evaluates_each_epoch = True

    def __post_init__(self) -> None:
        import torch.distributed as dist

        self.meter = common.Throughput(self.cfg, self.n_params, dist.get_world_size())
        self.meter.micro = self.state.window_micro

    @property
    def total(self) -> int:
        return self.state.total_steps

    def batches(self, epoch: int, skip: int):
        return common.micro_batches(self.loader, self.sampler, epoch, skip, self.engine.device)

    def step(self, epoch: int, index: int, batch: dict, more) -> tuple[int, bool]:
        state = self.state
        while True:
            loss, sums = self.micro_step(batch)
            value, boundary = common.optimize(self.engine, loss, self.ckpt, state, epoch, index, self.meter, batch,
                                              self.what)
            state.window["loss"] += value
            for key, v in sums.items():  # get: a checkpoint's window may predate a key
                state.window[key] = state.window.get(key, 0.0) + v
            if boundary:
                return index, True
            if (following := next(more, None)) is None:
                return index, False
            index, batch = following

    def record(self, epoch: int, index: int) -> dict[str, str] | None:
        import torch.distributed as dist

        state, step_cfg = self.state, self.cfg.step
        if state.step % step_cfg.log_every_steps and state.step != state.total_steps:
            return None
        metrics = mean_over_ranks({k: v / self.meter.micro for k, v in state.window.items()})
        metrics.update((self.derive or dict)(metrics))
        metrics.update(lr=self.engine.get_lr()[0], epoch=epoch, **self.meter.summary(step_cfg.global_batch_size))
        self.logger.log(metrics, step=state.step)
        if dist.get_rank() == 0 and not self.cfg.logging.progress_bar:
            common.say(f"[{step_cfg.name}] step {state.step}/{state.total_steps} {format_line(metrics)}")
        state.window = dict.fromkeys(state.window, 0.0)
        return {k: f"{metrics[k]:.4f}" for k in self.postfix}

    def evaluate(self, epoch: int, final: bool) -> bool:
        if not self.ready(epoch):
            return False
        self.state.total_steps = self.state.step  # a readiness rule ended the step here
        return True

    def saved(self, epoch: int, index: int) -> dict:
        return self.state.at(epoch, index, self.meter.micro)
