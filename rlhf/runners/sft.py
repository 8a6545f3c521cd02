"""Step 1, supervised fine-tuning: setup -> loop -> save.

Trains a causal LM on the chosen answers of the SFT part of the data blend through the shared
DeepSpeed engine factory; evaluates perplexity before training, every ``step.eval_every_steps``
and after each epoch; logs loss, lr, samples/s, tokens/s, TFLOPs, latency and memory; saves a
Hugging Face model (LoRA merged) into RUN_DIR/model.

    python launch.py step=sft model=tiny-llama zero=3 optim.lr=3e-4
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from rlhf import engine as engine_factory
from rlhf import models
from rlhf.checkpoint import save_hf_model
from rlhf.config import Config
from rlhf.data.blend import DataReport, load_step_data
from rlhf.data.tokenize import IGNORE_INDEX, PadCollator, sft_dataset
from rlhf.logging import MetricsLogger, format_line, peak_memory_gb, train_flops


@torch.no_grad()
def evaluate(engine, loader) -> dict[str, float]:
    """Token-weighted loss and perplexity over the eval rows (summed over ranks)."""
    engine.eval()
    device = engine.device
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, token count
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                                                 ignore_index=IGNORE_INDEX, reduction="sum")
        totals += torch.stack([loss.double(), (labels != IGNORE_INDEX).sum().double()])
    dist.all_reduce(totals)
    engine.train()
    mean = (totals[0] / totals[1].clamp(min=1)).item()
    return {"eval/loss": mean, "eval/ppl": math.exp(min(mean, 50.0))}


def run(cfg: Config) -> dict:
    # ------------------------------------------------------------------------------- setup
    rank, world = dist.get_rank(), dist.get_world_size()
    run_dir = Path(cfg.run_dir)
    step_cfg = cfg.step
    model_path = models.resolve_path(cfg.model)
    tokenizer = models.load_tokenizer(model_path, cfg.model.trust_remote_code)

    report = DataReport()
    train_rows, eval_rows = load_step_data(cfg.data, "sft", report)
    train_ds = sft_dataset(train_rows, tokenizer, step_cfg.max_seq_len, step_cfg.loss_on, report, "train",
                           cfg.data.on_bad_row)
    eval_ds = sft_dataset(eval_rows, tokenizer, step_cfg.max_seq_len, step_cfg.loss_on, report, "eval",
                          cfg.data.on_bad_row)
    if rank == 0:
        (run_dir / "data_report.json").write_text(json.dumps(report.as_dict(), indent=2))
    collate = PadCollator(tokenizer.pad_token_id)
    sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=step_cfg.micro_batch_size_per_device, sampler=sampler,
                              collate_fn=collate, drop_last=True)
    eval_loader = DataLoader(eval_ds, batch_size=step_cfg.eval_micro_batch_size_per_device, collate_fn=collate,
                             sampler=DistributedSampler(eval_ds, num_replicas=world, rank=rank, shuffle=False))

    accumulation = cfg.gradient_accumulation_steps
    steps_per_epoch = len(train_loader) // accumulation
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_ds)} SFT rows make no full optimizer step of {cfg.global_batch_size} rows")
    total_steps = steps_per_epoch * step_cfg.epochs
    if step_cfg.max_steps > 0:
        total_steps = min(total_steps, step_cfg.max_steps)

    with engine_factory.loading_context(cfg):
        model = models.load_causal_lm(model_path, tokenizer, engine_factory.model_dtype(cfg), cfg.model.dropout,
                                      cfg.model.trust_remote_code)
    engine, ds_cfg = engine_factory.build_train_engine(model, cfg, total_steps)
    n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())
    if rank == 0:
        (run_dir / "ds_config.json").write_text(json.dumps({"model": ds_cfg}, indent=2))
        print(f"[sft] {len(train_ds)} train rows, {len(eval_ds)} eval rows, {total_steps} optimizer steps of "
              f"{cfg.global_batch_size} rows, {n_params / 1e6:.2f}M parameters", flush=True)
    logger = MetricsLogger(run_dir, enabled=rank == 0,
                           wandb_cfg={"project": cfg.logging.wandb_project, "config": asdict(cfg)}
                           if cfg.logging.wandb else None)

    # -------------------------------------------------------------------------------- loop
    first_eval = evaluate(engine, eval_loader)
    logger.log({**first_eval, "epoch": 0}, step=0)
    history = {"eval/ppl": [first_eval["eval/ppl"]]}
    step, window_loss, window_micro, window_tokens, window_padded = 0, 0.0, 0, 0, 0
    window_start = time.perf_counter()
    bar = tqdm(total=total_steps, desc="sft", disable=rank != 0 or not cfg.logging.progress_bar)
    last_eval_step = 0
    for epoch in range(step_cfg.epochs):
        sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            window_loss += loss.item()
            window_micro += 1
            window_tokens += int(batch["attention_mask"].sum())
            window_padded += batch["input_ids"].numel()
            if not boundary:
                continue
            step += 1
            bar.update(1)
            if step % step_cfg.log_every_steps == 0 or step == total_steps:
                elapsed = time.perf_counter() - window_start
                n_steps = window_micro / accumulation
                seq_len = batch["input_ids"].shape[1]
                flops = train_flops(n_params, cfg.model.num_layers, cfg.model.hidden_size, window_padded * world,
                                    seq_len, step_cfg.gradient_checkpointing)
                metrics = {"loss": window_loss / window_micro, "lr": engine.get_lr()[0], "epoch": epoch,
                           "samples_per_s": cfg.global_batch_size * n_steps / elapsed,
                           "tokens_per_s": window_tokens * world / elapsed,
                           "tflops": flops / elapsed / 1e12 / world,
                           "latency_s": elapsed / n_steps, "memory_gb": peak_memory_gb(cfg.hardware.accelerator)}
                logger.log(metrics, step=step)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}")
                if rank == 0 and not cfg.logging.progress_bar:
                    print(f"[sft] step {step}/{total_steps} {format_line(metrics)}", flush=True)
                window_loss, window_micro, window_tokens, window_padded = 0.0, 0, 0, 0
                window_start = time.perf_counter()
            if step_cfg.eval_every_steps and step % step_cfg.eval_every_steps == 0:
                metrics = evaluate(engine, eval_loader)
                logger.log({**metrics, "epoch": epoch}, step=step)
                history["eval/ppl"].append(metrics["eval/ppl"])
                last_eval_step = step
            if step >= total_steps:
                break
        if last_eval_step != step:
            metrics = evaluate(engine, eval_loader)
            logger.log({**metrics, "epoch": epoch + 1}, step=step)
            history["eval/ppl"].append(metrics["eval/ppl"])
            last_eval_step = step
            if rank == 0:
                print(f"[sft] epoch {epoch + 1}: eval ppl {first_eval['eval/ppl']:.3f} -> {metrics['eval/ppl']:.3f}",
                      flush=True)
        if step >= total_steps:
            break
    bar.close()

    # -------------------------------------------------------------------------------- save
    final = {"step": step, "eval/ppl_before": first_eval["eval/ppl"], "eval/ppl": history["eval/ppl"][-1]}
    if step_cfg.save_model:
        save_hf_model(engine, tokenizer, run_dir / "model", merge_lora=cfg.lora.merge_on_save)
        final["model_dir"] = str(run_dir / "model")
    if rank == 0:
        (run_dir / "final_metrics.json").write_text(json.dumps(final, indent=2))
    logger.close()
    return final
