"""Overhead of the SFT and reward runners against a bare torch loop, measured in the same process.

Same model (from the same from_pretrained folder), same tokenized rows (SFT) or pairs (reward:
the pairwise loss on the score at each sequence's last token), micro batch, AdamW settings,
schedule and gradient clipping; the bare loop has no DeepSpeed, no logging, no framework.
Both run on the hardware preset's thread count. Prints one JSON line with seconds per optimizer
step (median over windows of --window steps, first window dropped as warm-up) and the ratio
runner / bare. Target: ratio <= 1.15.

    python bench/step_overhead.py                                  # SFT, tiny-llama, zero 0
    python bench/step_overhead.py step=reward zero=2
    python bench/step_overhead.py --steps 300 model.hidden_size=256 model.num_layers=4 zero=2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def compose(overrides: list[str]):
    from rlhf.config import compose_config

    return compose_config(overrides)


def bare_loop(cfg, steps: int, window: int) -> tuple[list[float], int]:
    """Seconds per step for each window of a plain torch training loop; and tokens seen."""
    import torch
    from torch.utils.data import DataLoader
    from transformers import get_scheduler

    from rlhf import losses, models
    from rlhf.data.blend import DataReport, load_step_data
    from rlhf.data.tokenize import PadCollator, PairCollator, pair_dataset, sft_dataset
    from rlhf.engine import SCHEDULERS

    path = models.resolve_path(cfg.model)
    tok = models.load_tokenizer(path)
    reward = cfg.step.name == "reward"
    rows, _ = load_step_data(cfg.data, cfg.step.name, DataReport())
    if reward:
        ds = pair_dataset(rows, tok, cfg.step.max_seq_len, DataReport(), "train")
        collate = PairCollator(tok.pad_token_id)
        model = models.load_reward_model(path, tok, dropout=cfg.model.dropout)
    else:
        ds = sft_dataset(rows, tok, cfg.step.max_seq_len, cfg.step.loss_on, DataReport(), "train")
        collate = PadCollator(tok.pad_token_id)
        model = models.load_causal_lm(path, tok, dropout=cfg.model.dropout)
    loader = DataLoader(ds, batch_size=cfg.step.micro_batch_size_per_device, shuffle=True, drop_last=True,
                        collate_fn=collate, generator=torch.Generator().manual_seed(cfg.seed))

    def loss_of(batch):
        if not reward:
            return model(**batch).loss
        scores = losses.gather_at(model(batch["input_ids"], batch["attention_mask"]),
                                  losses.end_indices(batch["attention_mask"]))
        chosen, rejected = scores.chunk(2)
        loss = losses.pairwise_loss(chosen, rejected)
        if cfg.step.score_regularizer:
            loss = loss + cfg.step.score_regularizer * losses.score_regularizer(chosen, rejected)
        return loss

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                            weight_decay=cfg.optim.weight_decay, fused=True)
    sched = get_scheduler(SCHEDULERS[cfg.optim.scheduler], opt, num_warmup_steps=cfg.optim.warmup_steps,
                          num_training_steps=steps)
    times, tokens, step = [], 0, 0
    start = time.perf_counter()
    while step < steps:
        for batch in loader:
            loss = loss_of(batch)
            loss.backward()
            if cfg.optim.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss.item()  # the runner reads the loss every step; so must the baseline
            tokens += int(batch["attention_mask"].sum())
            step += 1
            if step % window == 0:
                times.append((time.perf_counter() - start) / window)
                start = time.perf_counter()
            if step >= steps:
                break
    return times, tokens


def runner_loop(dict_cfg, run_dir: Path) -> list[float]:
    from rlhf.launch import run

    run(dict_cfg)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [r["latency_s"] for r in rows if "latency_s" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    from rlhf.config import to_schema
    from rlhf.worker import init_distributed

    with tempfile.TemporaryDirectory() as tmp:
        dict_cfg = compose([*args.overrides, f"step.max_steps={args.steps}", f"step.log_every_steps={args.window}",
                            "step.save_model=false", "logging.progress_bar=false", "data.max_eval_samples=64",
                            f"run_dir={tmp}"])
        cfg = to_schema(dict_cfg)
        init_distributed(cfg)  # same thread count for both loops
        bare_a, tokens = bare_loop(cfg, args.steps, args.window)
        runner = runner_loop(dict_cfg, Path(tmp))
        bare_b, _ = bare_loop(cfg, args.steps, args.window)  # bracket the runner against drift in machine load
    bare = statistics.median(bare_a[1:] + bare_b[1:])
    ours = statistics.median(runner[1:])
    from rlhf.preflight.probes import cpu_bf16

    print(json.dumps({
        "step": cfg.step.name, "model": cfg.model.name, "hidden": cfg.model.hidden_size, "layers": cfg.model.num_layers,
        "precision": cfg.hardware.precision, "cpu_bf16": cpu_bf16(),
        "zero": cfg.zero.stage, "micro_batch": cfg.step.micro_batch_size_per_device, "steps": args.steps,
        "threads": cfg.hardware.torch_threads, "bare_s_per_step": round(bare, 5), "runner_s_per_step": round(ours, 5),
        "bare_tokens_per_s": round(tokens / args.steps / bare, 1), "ratio_runner_over_bare": round(ours / bare, 3),
        "target": 1.15}))


if __name__ == "__main__":
    main()
