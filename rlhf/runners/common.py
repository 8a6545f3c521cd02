"""Pieces every runner uses the same way: loaders, step plans, throughput windows, the logger.

Plain functions and one small class, no base runner: each runner still reads top to bottom.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from rlhf import sequence
from rlhf.chain.readiness import cut_answers
from rlhf.checkpoint import save_hf_model
from rlhf.config import Config
from rlhf.data.tokenize import packed_row_lengths
from rlhf.observe.logging import MetricsLogger, peak_memory_gb, train_flops


def train_sampler(ds, cfg: Config, rank: int, world: int) -> DistributedSampler:
    """Rank ``rank``'s shuffled share of the train rows (set to each epoch by the loop); the ranks that
    share each sequence (parallel.sequence) read the same rows."""
    return DistributedSampler(ds, num_replicas=sequence.data_world(world), rank=sequence.data_rank(rank),
                              shuffle=True, seed=cfg.seed, drop_last=True)


def train_loader(ds, cfg: Config, rank: int, world: int, collate) -> tuple[DataLoader, DistributedSampler]:
    sampler = train_sampler(ds, cfg, rank, world)
    loader = DataLoader(ds, batch_size=cfg.step.micro_batch_size_per_device, sampler=sampler, collate_fn=collate,
                        drop_last=True)
    return loader, sampler


def eval_loader(ds, cfg: Config, rank: int, world: int, collate) -> DataLoader:
    # DistributedSampler pads ranks to equal length: under ZeRO-3 every rank must run as many forwards.
    return DataLoader(ds, batch_size=cfg.step.eval_micro_batch_size_per_device, collate_fn=collate,
                      sampler=DistributedSampler(ds, num_replicas=sequence.data_world(world),
                                                 rank=sequence.data_rank(rank), shuffle=False))


def mean_eval(engine, loader, names: tuple[str, ...], figures) -> dict[str, float]:
    """``eval/<name>``: the mean over every held-out row of all ranks of each figure that
    ``figures(batch)`` gives per row (a tuple of tensors in the order of ``names``; each its own count)."""
    import torch
    import torch.distributed as dist

    engine.eval()
    sums = torch.zeros(2, len(names), dtype=torch.float64, device=engine.device)  # sums, counts
    with torch.no_grad():
        for batch in loader:
            values = figures({k: v.to(engine.device) for k, v in batch.items()})
            sums += torch.stack([torch.stack([v.double().sum() for v in values]),
                                 torch.tensor([float(len(v)) for v in values], dtype=torch.float64, device=sums.device)])
    dist.all_reduce(sums)
    engine.train()
    return {f"eval/{name}": (sums[0, i] / sums[1, i].clamp(min=1)).item() for i, name in enumerate(names)}


def model_and_tokenizer(cfg: Config) -> tuple[str, object]:
    """The model group's path for from_pretrained (a random model is built on first use) and its tokenizer."""
    from rlhf import models

    path = models.resolve_path(cfg.model)
    return path, models.load_tokenizer(path, cfg.model.trust_remote_code)


def step_data(cfg: Config, step: str, tokenizer, params: dict, build) -> tuple:
    """The step's tokenized train and eval sets (cached; see rlhf.data.cache) and its eval prompts;
    rank 0 writes data_report.json, which counts every row dropped and why."""
    import torch.distributed as dist

    from rlhf.data.blend import DataReport
    from rlhf.data.cache import cached_step_data

    report = DataReport()
    out = cached_step_data(step, cfg.data, tokenizer, params, report, build)
    if dist.get_rank() == 0:
        write_data_report(cfg, step, report)
    return (*out, report)


def write_data_report(cfg: Config, step: str, report) -> None:
    """data_report.json in the run directory, and on the console every reason rows were dropped for,
    with its count (and file and line where it has them): nothing is dropped quietly."""
    (Path(cfg.run_dir) / "data_report.json").write_text(json.dumps(report.as_dict(), indent=2))
    dropped = [f"{n} {split}: {why}" for split, reasons in report.dropped.items() for why, n in reasons.items()]
    if dropped:
        say(f"[{step}] rows dropped (data.on_bad_row={cfg.data.on_bad_row}; data_report.json): " + "; ".join(dropped))


def as_select(metrics: dict[str, float]) -> dict[str, float]:
    """An evaluation on the held-out half that readiness rules read, named select/* (eval/* is the
    reported half's; see rlhf.data.blend.heldout_split)."""
    return {"select/" + k.split("/", 1)[1]: v for k, v in metrics.items()}


def greedy_check(cfg: Config, eval_prompts: list[str], tokenizer, report) -> tuple:
    """The data's rule and the held-out prompts a step with no readiness rule scores greedy answers on
    (step.eval_accuracy_prompts of the reported half, the prompts every step of a chain reports on);
    no prompts where no rule scores them."""
    from rlhf.data.blend import data_rule, heldout_split
    from rlhf.generation import rollout

    rule = data_rule(cfg.data, eval_prompts, tokenizer)
    rows = heldout_split(eval_prompts, cfg.data.seed, cfg.step.eval_accuracy_prompts)[1]
    if not cfg.step.eval_accuracy_prompts or rule is None or not rows:
        return rule, []
    return rule, rollout.prompt_dataset([{"prompt": eval_prompts[i]} for i in rows], tokenizer, cfg.step.max_seq_len,
                                        report, "eval")


def train_engine(cfg: Config, load, model_path: str, tokenizer, total_steps: int, role: str,
                 frozen: dict | None = None, dropout: float | None = None):
    """The step's one trainable model, loaded with ``load`` (models.load_causal_lm or
    load_reward_model; sharded while loading under ZeRO-3) and wrapped by the engine factory, its
    DeepSpeed JSON written to ds_config.json beside those of the step's ``frozen`` roles (name ->
    DeepSpeed JSON); returns it with its parameter count and the checkpointer that saves it.
    ``dropout`` overrides model.dropout; 0.0 also turns off LoRA's dropout (lora.dropout)."""
    import torch.distributed as dist

    from rlhf import engine as engine_factory
    from rlhf.checkpoint import Checkpointer

    with engine_factory.loading_context(cfg):
        model = load(model_path, tokenizer, engine_factory.model_dtype(cfg),
                     cfg.model.dropout if dropout is None else dropout,
                     cfg.model.trust_remote_code)
    engine, ds_cfg = engine_factory.build_train_engine(model, cfg, total_steps)
    if dropout == 0.0:  # the model's and the LoRA adapters' alike
        engine_factory.disable_dropout(engine.module)
    if dist.get_rank() == 0:
        (Path(cfg.run_dir) / "ds_config.json").write_text(json.dumps({role: ds_cfg, **(frozen or {})}, indent=2))
    ckpt = Checkpointer(Path(cfg.run_dir), {role: engine}, cfg.checkpoint.every_steps, cfg.checkpoint.keep_last)
    return engine, count_params(engine.module), ckpt


def micro_batches(loader, sampler, epoch: int, skip: int, device):
    """The epoch's micro batches on ``device`` with their index, after the first ``skip`` (consumed
    before the checkpoint a run resumed from)."""
    sampler.set_epoch(epoch)
    for index, batch in enumerate(loader):
        if index >= skip:
            yield index, {k: v.to(device) for k, v in batch.items()}


def optimize(engine, loss, ckpt, state: LoopState, epoch: int, index: int, meter: Throughput, batch: dict,
             what: str) -> tuple[float, bool]:
    """Backward and step one micro batch, after a check (decided over ranks) that its loss is
    finite; DeepSpeed steps the optimizer at accumulation boundaries. Returns the loss value and
    whether this micro batch ended an optimizer step."""
    value = loss.item()
    ckpt.stop_if_nonfinite(state.step + 1, state.at(epoch, index, meter.micro), what, value)
    engine.backward(loss)
    boundary = engine.is_gradient_accumulation_boundary()
    engine.step()
    meter.add(batch)
    return value, boundary


def plan_steps(cfg: Config, micro_batches_per_epoch: int, rows: int) -> int:
    """Optimizer steps of the run: all epochs, capped by step.max_steps."""
    steps_per_epoch = micro_batches_per_epoch // cfg.step.gradient_accumulation_steps
    if steps_per_epoch == 0:
        raise ValueError(f"{rows} rows make no full optimizer step of {cfg.step.global_batch_size} rows "
                         "(lower step.micro_batch_size_per_device or the accumulation)")
    total = steps_per_epoch * cfg.step.epochs
    return min(total, cfg.step.max_steps) if cfg.step.max_steps > 0 else total


def open_logger(cfg: Config, rank: int, fresh: bool = True) -> MetricsLogger:
    """metrics.jsonl: started over for a fresh run, appended to when the run resumed."""
    wandb_cfg = ({"project": cfg.logging.wandb_project, "group": cfg.logging.wandb_group or None,
                  "name": Path(cfg.run_dir).name, "config": asdict(cfg)} if cfg.logging.wandb else None)
    return MetricsLogger(cfg.run_dir, enabled=rank == 0, wandb_cfg=wandb_cfg, tensorboard=cfg.logging.tensorboard,
                         fresh=fresh, wandb_mode=cfg.logging.wandb_mode)


class Throughput:
    """Counts micro batches, real and padded tokens between two log lines, and turns them into
    DeepSpeed-Chat's figures: samples/s, tokens/s, TFLOPs per device, step latency, peak memory."""

    def __init__(self, cfg: Config, n_params: int, world: int):
        from rlhf.models import model_sizes

        # The ranks that share each sequence (parallel.sequence) each count the same rows: the rows and
        # tokens are those of the data-parallel groups, the FLOPs per device over all ranks.
        self.cfg, self.n_params, self.world, self.readers = cfg, n_params, world, sequence.data_world(world)
        # Layers and width from the model's config.json (as the pre-flight read them), not conf/model's numbers.
        sizes = model_sizes(cfg.model)
        self.layers, self.hidden = sizes.num_layers, sizes.hidden_size
        self.reset()

    def reset(self) -> None:
        self.micro, self.tokens, self.padded, self.seq_len = 0, 0, 0, 0
        self.start = time.perf_counter()

    def add(self, batch: dict) -> None:
        self.micro += 1
        if "attention_mask" in batch:
            mask = batch["attention_mask"]
            self.tokens += int(mask.sum())
            self.padded += mask.numel()
            self.seq_len = mask.shape[-1]
            return
        # A packed batch (step.packing) has no padding, and a token attends within its own row only:
        # the attention term is over the rows' lengths, sum(L^2) / sum(L) per token, not the packed width.
        lengths = packed_row_lengths(batch["position_ids"])
        tokens = int(lengths.sum())
        self.tokens += tokens
        self.padded += tokens
        self.seq_len = float((lengths ** 2).sum()) / tokens

    def summary(self, rows_per_step: int) -> dict[str, float]:
        elapsed = time.perf_counter() - self.start
        steps = self.micro / self.cfg.step.gradient_accumulation_steps
        flops = train_flops(self.n_params, self.layers, self.hidden,
                            self.padded * self.readers, self.seq_len, self.cfg.step.gradient_checkpointing)
        out = {"samples_per_s": rows_per_step * steps / elapsed, "tokens_per_s": self.tokens * self.readers / elapsed,
               "tflops": flops / elapsed / 1e12 / self.world, "latency_s": elapsed / max(steps, 1e-9),
               "memory_gb": peak_memory_gb(self.cfg.hardware.accelerator)}
        self.reset()
        return out


def count_params(module) -> int:
    # Under ZeRO-3 a parameter's local tensor is a shard; ds_numel is its full size.
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())


def say(line: str) -> None:
    """A console line (rank 0) that does not land on the progress bar's line: tqdm clears the bar,
    prints, and redraws it below."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()


def finish(cfg: Config, engine, tokenizer, rank: int, step: int, first: dict, last: dict, logger,
           save_more=None, stopped_by: str | None = None) -> dict:
    """Save the model (HF format), then whatever ``save_more(final)`` saves besides, and write
    final_metrics.json -- the marker of a finished step, so it is written last."""
    run_dir = Path(cfg.run_dir)
    final = {"step": step, **{f"{k}_before": v for k, v in first.items()}, **last}
    if (planned := run_dir / "forecast.json").exists():
        # Forecast and actual side by side: the forecast at the steps this run took (a readiness rule
        # may stop it before its cap), the actual since the launch that finished it.
        f = json.loads(planned.read_text())
        final.update(forecast_s=round(f.get("startup_s", 0.0) + f["seconds_per_step"] * step, 1), actual_s=round(time.time() - f["started_at"], 1))
    # Every step's final figures say what ended it: a readiness rule's reason, else its cap.
    final["stopped_by"] = stopped_by or cap_reason(cfg, step)
    if stopped_by and not stopped_by.startswith("the cap ") and rank == 0:
        say(f"[{cfg.step.name}] stopped at step {step} by {stopped_by}")
    if why := cut_answers(final, cfg.step.answer_budget()):
        # Kept with the step's other warnings: the chain's summary lists them.
        final.setdefault("warnings", []).append(why)
        if rank == 0:
            say(f"[{cfg.step.name}] WARNING {why}")
    if cfg.step.save_model:
        save_hf_model(engine, tokenizer, run_dir / "model", merge_lora=cfg.lora.merge_on_save)
        final["model_dir"] = str(run_dir / "model")
        if save_more is not None:
            save_more(final)
    if rank == 0:
        from rlhf.observe import curves

        (run_dir / "final_metrics.json").write_text(json.dumps(final, indent=2))
        curves.refresh(run_dir)
        where = f"model {run_dir / 'model'}, " if cfg.step.save_model else ""
        say(f"[{cfg.step.name}] done: {where}metrics {run_dir / 'metrics.jsonl'}, curves {run_dir / curves.FIGURE}, "
            f"final figures {run_dir / 'final_metrics.json'}")
    logger.summarize(final, step)
    logger.close()
    return final


def cap_reason(cfg: Config, step: int) -> str:
    """The cap that ended a step at ``step``: step.max_steps where it was reached, else its epochs."""
    if cfg.step.max_steps > 0 and step >= cfg.step.max_steps:
        return f"the cap step.max_steps={cfg.step.max_steps}"
    return f"the cap step.epochs={cfg.step.epochs}"


@dataclass
class LoopState:
    """Where a supervised loop (SFT, reward) stands: what a checkpoint saves and a resume restores.

    One shape for both runners, so their checkpoints cannot drift apart key by key."""

    total_steps: int
    step: int = 0
    # Position of the next micro batch: the epoch and its index in that epoch's loader.
    epoch: int = 0
    batch_index: int = 0
    # Evaluation before training, the latest one, and the step it was taken at.
    first: dict = field(default_factory=dict)
    last: dict = field(default_factory=dict)
    last_eval_step: int = 0
    # Sums since the last log line, and how many micro batches they cover.
    window: dict = field(default_factory=dict)
    window_micro: int = 0
    # The best evaluation by the step's readiness figure, its step, evaluations since without a better
    # one, and the rule that ended the step (said in the final figures).
    best: dict = field(default_factory=dict)
    best_step: int = 0
    stale_evals: int = 0
    stopped_by: str = ""
    # Times a loss plateau short of the accuracy bar divided the learning rate (SFT's step.plateau_lr_drops).
    lr_drops: int = 0

    def judge(self, metrics: dict, key: str, higher_is_better: bool, patience: int) -> bool:
        """Fold an evaluation into the best so far by ``key``; True, with ``stopped_by`` saying why,
        once ``patience`` evaluations in a row (0: never) have not beaten the best."""
        if key not in metrics:
            return False
        best = self.best.get(key)
        if best is None or (metrics[key] > best if higher_is_better else metrics[key] < best):
            self.best, self.best_step, self.stale_evals = dict(metrics), self.step, 0
            return False
        self.stale_evals += 1
        if patience and self.stale_evals >= patience:
            self.stopped_by = (f"{key} did not beat its best ({best:.4f}, step {self.best_step}) for {patience} "
                               "evaluations (step.early_stop_patience)")
            return True
        return False

    def stop_reason(self, cfg: Config) -> str:
        """Why the loop ended: a readiness rule's reason, or the cap on its length."""
        return self.stopped_by or cap_reason(cfg, self.step)

    def at(self, epoch: int, batch_index: int, window_micro: int) -> dict:
        """Client state for a checkpoint taken before micro batch ``batch_index`` of ``epoch``."""
        return {**asdict(self), "epoch": epoch, "batch_index": batch_index, "window_micro": window_micro}


def start_loop(ckpt, cfg: Config, rank: int, total_steps: int, window_keys: tuple[str, ...],
               what: str) -> tuple[LoopState, bool, MetricsLogger]:
    """Resume from the run directory's latest checkpoint (resume=auto), or start at step 0.
    Returns the state, whether it was resumed, and the metrics logger (appending on resume)."""
    from rlhf.checkpoint import set_rng_state

    resumed = ckpt.load() if cfg.resume == "auto" else None
    logger = open_logger(cfg, rank, fresh=resumed is None)
    if resumed is None:
        return LoopState(total_steps, window=dict.fromkeys(window_keys, 0.0)), False, logger
    state = LoopState(**{f.name: resumed[f.name] for f in fields(LoopState) if f.name in resumed})
    logger.truncate_after(state.step)
    set_rng_state(resumed["rng"])
    if rank == 0:
        say(f"[{what}] resumed at step {state.step} (epoch {state.epoch}, micro batch {state.batch_index})")
    return state, True, logger
