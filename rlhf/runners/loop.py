"""The training loop of the supervised steps (SFT, reward model, DPO), written once: epochs and the
step counter, resume at the checkpoint's micro batch, the metrics window and its log line, the
evaluation cadence with the step's readiness rule, checkpoints after a step and at each epoch's end,
stop requests and non-finite losses (decided over all ranks), the progress bar.

A runner gives it the engine and data, ``micro_step(batch) -> (loss, sums)`` (the loss to back-
propagate and what its metrics window adds up), and ``ready(epoch) -> bool`` (evaluate, log, and say
whether a readiness rule ends the step); the loop leaves the final state in ``state``.

    python launch.py step=sft     # every supervised runner trains through train()
"""

from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm

from rlhf.checkpoint import StopRequest
from rlhf.config import Config
from rlhf.distributed import mean_over_ranks
from rlhf.observe.logging import format_line
from rlhf.observe.profiling import StepProfiler
from rlhf.runners import common


def train(cfg: Config, engine, loader, sampler, ckpt, state: common.LoopState, logger, n_params: int,
          micro_step: Callable[[dict], tuple], ready: Callable[[int], bool], what: str,
          derive: Callable[[dict], dict] | None = None, postfix: tuple[str, ...] = ("loss",)) -> None:
    """Train from ``state`` (fresh or resumed by common.start_loop) until its last step or a readiness
    rule; ``what`` names the loss in a non-finite stop; ``derive`` adds figures computed from the
    window's means (e.g. DPO's margin); ``postfix``: window keys shown on the progress bar."""
    import torch.distributed as dist

    rank, world, step_cfg, name = dist.get_rank(), dist.get_world_size(), cfg.step, cfg.step.name
    meter = common.Throughput(cfg, n_params, world)
    meter.micro = state.window_micro
    skip = state.batch_index
    stop, profiler = StopRequest(), StepProfiler(cfg, rank)
    bar = tqdm(total=state.total_steps, initial=state.step, desc=name, disable=rank != 0 or not cfg.logging.progress_bar)
    for epoch in range(state.epoch, step_cfg.epochs):
        for index, batch in common.micro_batches(loader, sampler, epoch, skip, engine.device):
            profiler.before(state.step + 1)
            loss, sums = micro_step(batch)
            value, boundary = common.optimize(engine, loss, ckpt, state, epoch, index, meter, batch, what)
            state.window["loss"] += value
            for key, v in sums.items():  # get: a checkpoint's window may predate a key
                state.window[key] = state.window.get(key, 0.0) + v
            if not boundary:
                continue
            state.step += 1
            profiler.after(state.step)
            bar.update(1)
            if state.step % step_cfg.log_every_steps == 0 or state.step == state.total_steps:
                metrics = mean_over_ranks({k: v / meter.micro for k, v in state.window.items()})
                metrics.update((derive or dict)(metrics))
                metrics.update(lr=engine.get_lr()[0], epoch=epoch, **meter.summary(step_cfg.global_batch_size))
                logger.log(metrics, step=state.step)
                bar.set_postfix({k: f"{metrics[k]:.4f}" for k in postfix})
                if rank == 0 and not cfg.logging.progress_bar:
                    common.say(f"[{name}] step {state.step}/{state.total_steps} {format_line(metrics)}")
                state.window = dict.fromkeys(state.window, 0.0)
            if step_cfg.eval_every_steps and state.step % step_cfg.eval_every_steps == 0 and ready(epoch):
                state.total_steps = state.step
            if state.step >= state.total_steps:
                break
            ckpt.after_step(state.step, state.at(epoch, index + 1, meter.micro), stop, logger, name)
        skip = 0
        # Every epoch ends with an evaluation (unless its last step just had one).
        if state.last_eval_step != state.step and ready(epoch + 1):
            state.total_steps = state.step
        if state.step >= state.total_steps:
            break
        # The epoch boundary: a resume trains the remaining epochs.
        ckpt.save(state.step, state.at(epoch + 1, 0, meter.micro))
    bar.close()
