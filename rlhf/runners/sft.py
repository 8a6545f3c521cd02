"""Step 1, supervised fine-tuning: setup -> loop -> save.

Trains a causal LM on the chosen answers of the SFT part of the data blend through the shared
DeepSpeed engine factory; evaluates perplexity before training, every ``step.eval_every_steps``
and after each epoch; logs loss, lr, samples/s, tokens/s, TFLOPs, latency and memory; saves a
Hugging Face model (LoRA merged) into RUN_DIR/model.

    python launch.py step=sft model=tiny-llama zero=3 optim.lr=3e-4
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlhf import models, sequence
from rlhf.chain import readiness
from rlhf.config import Config
from rlhf.data.blend import data_rule, heldout_split
from rlhf.data.tokenize import IGNORE_INDEX, PackCollator, PadCollator, sft_dataset
from rlhf.generation import rollout
from rlhf.preflight import memory
from rlhf.runners import common, loop


def token_nll(out, labels: torch.Tensor) -> torch.Tensor:
    """Each position's loss on the label after it (0 where that label is ignored)."""
    return torch.nn.functional.cross_entropy(out.logits.transpose(1, 2).float(), labels, ignore_index=IGNORE_INDEX,
                                             reduction="none")


def lm_loss(engine, batch: dict) -> torch.Tensor:
    """The mean next-token loss over the micro batch's labelled tokens: transformers' own, or, with the
    rows' tokens split over ranks (parallel.sequence), the same mean from the gathered per-token losses."""
    if sequence.size() == 1:
        return engine(**batch, use_cache=False).loss
    labels = batch["labels"]
    nll = sequence.per_token(engine, batch["input_ids"], batch["attention_mask"],
                             sequence.next_tokens(labels, IGNORE_INDEX), token_nll, use_cache=False)
    return nll.sum() / (labels[:, 1:] != IGNORE_INDEX).sum()


@torch.no_grad()
def perplexity(engine, loader) -> dict[str, float]:
    """Token-weighted loss and perplexity over the eval rows (summed over ranks)."""
    engine.eval()
    device = engine.device
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # summed loss, token count
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        nll = sequence.per_token(engine, batch["input_ids"], batch["attention_mask"],
                                 sequence.next_tokens(batch["labels"], IGNORE_INDEX), token_nll)
        totals += torch.stack([nll.sum().double(), (batch["labels"][:, 1:] != IGNORE_INDEX).sum().double()])
    dist.all_reduce(totals)
    engine.train()
    mean = (totals[0] / totals[1].clamp(min=1)).item()
    return {"eval/loss": mean, "eval/ppl": math.exp(min(mean, 50.0))}


def train_answers(train_ds, tokenizer, rows: int = 2000) -> list[str]:
    """The answers (the tokens the loss is on) of the first ``rows`` training rows, as text."""
    part = train_ds.select(range(min(rows, len(train_ds))))
    return [tokenizer.decode([t for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX],
                             skip_special_tokens=True) for ids, labels in zip(part["input_ids"], part["labels"], strict=True)]


def peak_lr(engine) -> float:
    """The learning rate the schedule scales (its base), after any plateau drops."""
    return float(engine.lr_scheduler.base_lrs[0])


def plateau_ends(engine, state: common.LoopState, step_cfg, lr0: float, bar: float | None, logger) -> bool:
    """Whether a held-out loss plateau (``state.stopped_by`` says it) ends SFT. Short of the accuracy
    bar a plateau is, on every untuned task measured, a learning rate too high for the task, not a
    finished step: the rate is divided by step.plateau_lr_factor and training goes on, at most
    step.plateau_lr_drops times; after that the stop says the rate is the likely cause and the
    override that starts over at a lower one (``lr0``: the configured rate)."""
    acc = state.last.get("select/accuracy")
    if acc is None or bar is None or acc >= bar:
        return True
    lr, factor = peak_lr(engine), step_cfg.plateau_lr_factor
    if state.lr_drops < step_cfg.plateau_lr_drops:
        scheduler = engine.lr_scheduler
        scheduler.base_lrs = [b / factor for b in scheduler.base_lrs]
        for group in scheduler.optimizer.param_groups:
            group["lr"] /= factor
        state.lr_drops, state.stale_evals = state.lr_drops + 1, 0
        plateau, state.stopped_by = state.stopped_by, ""
        logger.log({"lr_drops": float(state.lr_drops), "lr_peak": lr / factor}, step=state.step)
        if dist.get_rank() == 0:
            common.say(f"[sft] {plateau} at held-out accuracy {acc:.1%}, short of its bar {bar:.1%}: the learning "
                       f"rate is likely too high for the task; dividing it by {factor:g} to {lr / factor:.3g} "
                       f"(drop {state.lr_drops} of step.plateau_lr_drops={step_cfg.plateau_lr_drops}) and going on")
        return False
    # The override starts over from the configured rate lowered once, without the plateau stop: a run
    # that starts at the lower rate learns where one continued from a plateau at the higher rate
    # did not (docs/design-notes.md).
    drops = (f" after {state.lr_drops} drops of the rate to {lr:.3g} (step.plateau_lr_drops={step_cfg.plateau_lr_drops})"
             if state.lr_drops else "")
    state.stopped_by += (f" at held-out accuracy {acc:.1%}, short of its bar {bar:.1%}{drops}: the likely cause is a "
                         f"learning rate too high for the task: start over at a lower one, optim.lr={lr0 / factor:.2g} "
                         "step.early_stop_patience=0")
    return True


def accuracy_check(cfg: Config, eval_prompts: list[str], tokenizer, report, train_ds, rank: int) -> tuple:
    """Greedy accuracy by the data's rule (data.rule, or the shipped tasks' where it knows the prompts):
    the rule, the select half of the held-out prompts that the stop rule reads (select/accuracy) and
    the report half the reported figure (eval/accuracy, before training and of the output) comes from;
    the accuracy stop bar, the best constant answer's accuracy and its figures beside the report."""
    step_cfg = cfg.step
    select_prompts, report_prompts = [], []
    rule = data_rule(cfg.data, eval_prompts, tokenizer)
    parts = heldout_split(eval_prompts, cfg.data.seed, step_cfg.eval_accuracy_prompts)
    if step_cfg.eval_accuracy_prompts and rule is not None and all(parts):
        select_prompts, report_prompts = (
            rollout.prompt_dataset([{"prompt": eval_prompts[i]} for i in part], tokenizer, step_cfg.max_seq_len,
                                   report, "eval") for part in parts)

    # The best constant answer, chosen on the select half (of 16 candidates: optimistic there), and
    # its accuracy on the report half, where SFT's reported accuracy is measured: what the chain's
    # pipeline.sft_beyond_constant compares, over the real number of report prompts.
    bar, constant, beside_report = step_cfg.stop_at_accuracy, None, {}
    if select_prompts and step_cfg.loss_on == "answer":
        constant, answer = readiness.constant_answer_accuracy(rule, [eval_prompts[i] for i in parts[0]],
                                                              train_answers(train_ds, tokenizer))
        texts = [p["prompt"] for p in report_prompts]
        beside_report = {"eval/constant_accuracy": sum(rule(p, answer) for p in texts) / len(texts),
                         "eval/prompts": float(len(texts))}
    if bar is not None and constant is not None:
        bar = readiness.accuracy_bar(bar, constant)
        if constant >= 0.01 and rank == 0:
            common.say(f"[sft] the one answer {answer!r} is right for {constant:.1%} of the held-out prompts: SFT's "
                       f"accuracy stop is {bar:.1%}, step.stop_at_accuracy={step_cfg.stop_at_accuracy} of the way "
                       "from there to 100%")
    if step_cfg.stop_at_accuracy is not None and not select_prompts and rank == 0:
        common.say(f"[sft] no rule scores these prompts (data.rule), so held-out accuracy cannot be measured: "
              f"step.stop_at_accuracy={step_cfg.stop_at_accuracy} is ignored and SFT runs its full length "
              "(step.epochs / step.max_steps)")
    return rule, select_prompts, report_prompts, bar, constant, beside_report


def run(cfg: Config) -> dict:
    # ------------------------------------------------------------------------------- setup
    rank, world, step_cfg = dist.get_rank(), dist.get_world_size(), cfg.step
    model_path, tokenizer = common.model_and_tokenizer(cfg)
    if step_cfg.packing:
        models.check_packed_rows(model_path, cfg.model.trust_remote_code)

    train_ds, eval_ds, eval_prompts, report = common.step_data(
        cfg, cfg.step.name, tokenizer, {"max_seq_len": step_cfg.max_seq_len, "loss_on": step_cfg.loss_on},
        lambda rows, split, rep: sft_dataset(rows, tokenizer, step_cfg.max_seq_len, step_cfg.loss_on, rep, split,
                                             cfg.data.on_bad_row))
    pad = PadCollator(tokenizer.pad_token_id)
    loader, sampler = common.train_loader(train_ds, cfg, rank, world, PackCollator() if step_cfg.packing else pad)
    # Evaluation stays padded under step.packing: it runs without gradients, a small part of the time,
    # and perplexity() reads the rows from attention_mask.
    evaluation = common.eval_loader(eval_ds, cfg, rank, world, pad)
    total_steps = common.plan_steps(cfg, len(loader), len(train_ds))
    rule, select_prompts, report_prompts, bar, constant, beside_report = accuracy_check(
        cfg, eval_prompts, tokenizer, report, train_ds, rank)
    gathering = memory.generation_gathering(cfg)  # decided once, as the pre-flight did

    def greedy(prompts: list[dict]) -> dict[str, float]:
        return rollout.evaluate(engine, None, rule, prompts, tokenizer, step_cfg.max_new_tokens,
                                step_cfg.eval_micro_batch_size_per_device, gathering) if prompts else {}

    def evaluate(reported: bool) -> dict[str, float]:
        """Held-out loss, the select half's accuracy, and with ``reported`` the report half's."""
        return {**perplexity(engine, evaluation), **common.as_select(greedy(select_prompts)),
                **({"select/accuracy_bar": bar, "select/constant_accuracy": constant}
                   if bar is not None and constant is not None else {}),
                **(greedy(report_prompts) if reported else {})}

    engine, n_params, ckpt = common.train_engine(cfg, models.load_causal_lm, model_path, tokenizer, total_steps, "model")
    if rank == 0:
        common.say(f"[sft] {len(train_ds)} train rows, {len(eval_ds)} eval rows, {total_steps} optimizer steps of "
              f"{step_cfg.global_batch_size} rows, {n_params / 1e6:.2f}M parameters")
    state, resumed, logger = common.start_loop(ckpt, cfg, rank, total_steps, ("loss",), cfg.step.name)

    # -------------------------------------------------------------------------------- loop
    def ready(epoch: int) -> bool:
        """Evaluate, and whether a readiness rule says SFT is done (the reason in state.stopped_by)."""
        state.last, state.last_eval_step = evaluate(False), state.step
        logger.log({**state.last, "epoch": epoch}, step=state.step)
        if select_prompts and bar is not None and state.last["select/accuracy"] >= bar:
            state.stopped_by = (f"held-out accuracy {state.last['select/accuracy']:.3f} >= "
                                + (f"step.stop_at_accuracy={bar}" if bar == step_cfg.stop_at_accuracy else
                                   f"{bar:.3f} (step.stop_at_accuracy={step_cfg.stop_at_accuracy} of the way from the "
                                   "best constant answer's accuracy to 1)"))
            return True
        if not state.judge(state.last, "eval/loss", False, step_cfg.early_stop_patience):
            return False
        return plateau_ends(engine, state, step_cfg, cfg.optim.lr, bar, logger)

    if not resumed:
        state.first = state.last = evaluate(True)
        logger.log({**state.first, "epoch": 0}, step=0)
        state.judge(state.first, "eval/loss", False, 0)
    # No KV cache in training: with one, transformers would not read a packed batch's rows from its
    # position_ids (step.packing) and attention would cross them.
    loop.train(cfg, state, ckpt, logger, loop.Supervised(
        cfg, engine, loader, sampler, ckpt, state, logger, n_params,
        lambda batch: (lm_loss(engine, batch), {}), ready, "SFT loss"))
    if report_prompts:  # the output's reported accuracy, on prompts the stop rule never read
        reported = {**greedy(report_prompts), **beside_report, "lr_drops": float(state.lr_drops),
                    "lr_peak": peak_lr(engine)}
        state.last = {**state.last, **reported}
        logger.log(reported, step=state.step)

    # -------------------------------------------------------------------------------- save
    return common.finish(cfg, engine, tokenizer, rank, state.step, state.first, state.last, logger,
                         stopped_by=state.stop_reason(cfg))
