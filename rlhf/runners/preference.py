"""Every preference method (DPO, SimPO, ...), an alternative to steps 2-3: setup -> loop -> save.

The policy (from the SFT output, ``actor.path``) learns straight from the reward part's preference
pairs, with no reward model and no rollouts. What differs between methods is only their loss, named
by the step's spec (rlhf.config.STEPS[name].loss, a key of rlhf.losses.PREFERENCE_LOSSES), whether
the spec has a frozen reference, and its rows: pairs, or unpaired (each pair's chosen answer a
desirable row and its rejected one an undesirable row). A reference's log-probs are computed once
before training and the reference freed (``step.reference_logprobs=precompute``), or scored on every
batch (``online``). Logs the implicit rewards of chosen and rejected answers, their margin and the
preference accuracy; on data a rule knows, greedy held-out accuracy too. Saves a folder that
``AutoModelForCausalLM.from_pretrained`` loads, like SFT.

    python launch.py step=dpo actor.path=<sft out>/model
    python launch.py pipeline=simpo                          # SFT -> SimPO
"""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
from datasets import Dataset, concatenate_datasets
from torch.utils.data import DistributedSampler

from rlhf import engine as engine_factory
from rlhf import losses, models, sequence
from rlhf.config import STEPS, Config
from rlhf.data.tokenize import PairCollator, pair_dataset
from rlhf.generation import rollout
from rlhf.preflight import memory
from rlhf.runners import common, loop


def pair_logprobs(engine, batch: dict, partner_grad: bool = True) -> torch.Tensor:
    """Summed answer log-probs of every sequence of a PairCollator batch (the rows' answers, then their
    partners). ``partner_grad=False``: the partners in a forward of their own without a graph (an
    unpaired row's partner, another prompt's answer, sets KTO's detached reference point only), so
    the backward and its activations cover the rows' answers alone."""
    def logp(rows: slice) -> torch.Tensor:
        ids = batch["input_ids"][rows]
        next_logp = sequence.per_token(engine, ids, batch["attention_mask"][rows], sequence.next_tokens(ids),
                                       lambda out, nxt: losses.token_logprobs(out.logits, nxt))
        return losses.sequence_logprob(next_logp, batch["answer_mask"][rows])

    if partner_grad or not torch.is_grad_enabled():
        return logp(slice(None))
    n = len(batch["input_ids"]) // 2
    with torch.no_grad():
        partners = logp(slice(n, None))
    return torch.cat([logp(slice(None, n)), partners])


def scored(engine, ref, batch: dict, step_cfg) -> losses.PreferenceResult:
    """The step's preference loss on one batch from the policy's log-probs, the reference's (precomputed
    columns, or the reference engine's forward), the answers' lengths and labels."""
    ref_logp = None
    if "ref_chosen" in batch:
        ref_logp = torch.cat([batch["ref_chosen"], batch["ref_rejected"]])
        if torch.isnan(ref_logp).any():
            raise RuntimeError("a train row without its precomputed reference log-probs: they were computed for the "
                               "rows this run's settings read (step.max_steps, the batch, the seed), and these changed; "
                               "run with step.reference_logprobs=online, or start over (resume=never)")
    elif ref is not None:
        with torch.no_grad():
            ref_logp = pair_logprobs(ref, batch)
    spec = STEPS[step_cfg.name]
    logp = pair_logprobs(engine, batch, partner_grad=spec.rows != "unpaired")
    pb = losses.PreferenceBatch(logp, batch["answer_mask"].sum(-1), ref_logp, batch.get("desirable"))
    return losses.PREFERENCE_LOSSES[spec.loss](pb, step_cfg)


def visited_rows(ds, cfg: Config, world: int, steps: int) -> list[int]:
    """The train rows ``steps`` optimizer steps read, over every rank: each rank's shuffled order per
    epoch (common.train_loader's sampler, set to the epoch as the loop sets it), micro batch after micro
    batch across epochs (DeepSpeed counts accumulation over the run, not per epoch), as far as the steps
    go. A run capped by step.max_steps reads a fraction of a large preference set."""
    micro = cfg.step.micro_batch_size_per_device
    seen: set[int] = set()
    for rank in range(world):
        sampler = common.train_sampler(ds, cfg, rank, world)
        per_epoch, left, epoch = len(sampler) // micro, steps * cfg.step.gradient_accumulation_steps, 0
        while left > 0 and per_epoch > 0:
            sampler.set_epoch(epoch)
            seen.update(list(sampler)[: min(left, per_epoch) * micro])
            left, epoch = left - per_epoch, epoch + 1
    return sorted(seen)


@torch.no_grad()
def precompute_reference(ref, ds, collate, batch_size: int, rows: list[int] | None = None):
    """ds with the reference's summed log-probs of each row's two answers as columns ref_chosen /
    ref_rejected, for ``rows`` (default: all; the others get NaN, which scored() refuses to train on).
    Each rank scores its share; the shares are gathered so that every rank holds all."""
    # The ranks that share each sequence (parallel.sequence) score the same rows.
    rank, world = sequence.data_rank(dist.get_rank()), sequence.data_world(dist.get_world_size())
    ref.eval()
    rows = list(range(len(ds))) if rows is None else rows
    # No shuffle: the share is a fixed slice; padded to equal length (ZeRO-3 ranks must run alike).
    mine = [rows[i] for i in DistributedSampler(rows, num_replicas=world, rank=rank, shuffle=False)]
    found: dict[int, tuple[float, float]] = {}
    for i in range(0, len(mine), batch_size):
        idx = mine[i:i + batch_size]
        batch = {k: v.to(ref.device) for k, v in collate([ds[j] for j in idx]).items()}
        chosen, rejected = losses.halves(pair_logprobs(ref, batch))
        found.update(zip(idx, zip(chosen.float().tolist(), rejected.float().tolist(), strict=True), strict=True))
    shares = [None] * dist.get_world_size()
    dist.all_gather_object(shares, found)
    merged = {k: v for share in shares for k, v in share.items()}
    nan = (float("nan"), float("nan"))
    return ds.add_column("ref_chosen", [merged.get(i, nan)[0] for i in range(len(ds))]).add_column(
        "ref_rejected", [merged.get(i, nan)[1] for i in range(len(ds))])


def evaluate(engine, ref, loader, step_cfg) -> dict[str, float]:
    """Loss, preference accuracy, the chosen and rejected answers' rewards and their margin, and the
    chosen (KTO: desirable) answers' summed log-probs under the policy."""
    def figures(batch: dict) -> tuple:
        r = scored(engine, ref, batch, step_cfg)
        return r.loss.expand(len(r.right)), r.right, r.chosen, r.rejected, r.chosen_logp

    m = common.mean_eval(engine, loader, ("loss", "pref_acc", "chosen_reward", "rejected_reward", "chosen_logp"),
                         figures)
    return {**m, "eval/margin": m["eval/chosen_reward"] - m["eval/rejected_reward"]}


def unpaired_rows(rows, seed: int) -> tuple[list[dict], list[dict]]:
    """Each pair's chosen answer as a desirable row and its rejected answer as an undesirable row, each
    with a partner: the answer of another row (the next one, in an order shuffled by ``seed``, whose
    prompt and answer differ), the mismatched answer that a reference point is estimated from."""
    answers = [(r["prompt"], r[c], c == "chosen") for r in rows for c in ("chosen", "rejected")]
    order = random.Random(seed).sample(range(len(answers)), len(answers))
    out: tuple[list[dict], list[dict]] = ([], [])
    for k, i in enumerate(order):
        prompt, answer, good = answers[i]
        for step in range(1, len(order)):
            other = answers[order[(k + step) % len(order)]]
            if other[0] != prompt and other[1].strip() != answer.strip():
                out[0 if good else 1].append({"prompt": prompt, "chosen": answer, "rejected": other[1]})
                break
    return out


def tokenized(cfg: Config, tokenizer):
    """The build function of the step's rows for rlhf.runners.common.step_data: pairs, or unpaired
    rows (pairs of a row's answer and its partner, with a ``desirable`` column)."""
    max_len, bad = cfg.step.max_seq_len, cfg.data.on_bad_row

    def build(rows, split, rep):
        if STEPS[cfg.step.name].rows == "pairs":
            return pair_dataset(rows, tokenizer, max_len, rep, split, bad)
        parts = [pair_dataset(Dataset.from_list(part), tokenizer, max_len, rep, split, bad)
                 for part in unpaired_rows(rows, cfg.data.seed)]
        return concatenate_datasets([ds.add_column("desirable", [float(label)] * len(ds))
                                     for ds, label in zip(parts, (1, 0), strict=True) if len(ds)])
    return build


def window_rewards(window: dict) -> dict:
    """The training window's mean reward of each kind of answer, from its sums and row counts (nan where
    it held none of a kind), and their margin."""
    chosen, rejected = (window[f"{k}_reward"] / window[f"{k}_rows"] if window[f"{k}_rows"] else float("nan")
                        for k in ("chosen", "rejected"))
    return {"chosen_reward": chosen, "rejected_reward": rejected, "margin": chosen - rejected}


def run(cfg: Config) -> dict:
    # ------------------------------------------------------------------------------- setup
    rank, world, step_cfg, spec = dist.get_rank(), dist.get_world_size(), cfg.step, STEPS[cfg.step.name]
    model_path = models.checkpoint_path(cfg.actor.path) or models.resolve_path(cfg.model)
    tokenizer = models.load_tokenizer(model_path, cfg.model.trust_remote_code)
    train_ds, eval_ds, eval_prompts, report = common.step_data(
        cfg, step_cfg.name, tokenizer, {"max_seq_len": step_cfg.max_seq_len, "rows": spec.rows}, tokenized(cfg, tokenizer))
    rule, accuracy_prompts = common.greedy_check(cfg, eval_prompts, tokenizer, report)
    collate = PairCollator(tokenizer.pad_token_id, answer_mask=True)
    gathering = memory.generation_gathering(cfg)

    ref = ref_ds = None
    if spec.has_role("reference"):
        with engine_factory.loading_context(cfg):
            ref_model = models.load_causal_lm(model_path, tokenizer, engine_factory.model_dtype(cfg), 0.0,
                                              cfg.model.trust_remote_code)
        ref, ref_ds = engine_factory.build_frozen_engine(ref_model, cfg, offload=step_cfg.offload_reference)
    loader, sampler = common.train_loader(train_ds, cfg, rank, world, collate)
    total_steps = common.plan_steps(cfg, len(loader), len(train_ds))
    if ref is not None and step_cfg.reference_logprobs == "precompute":
        # One pass over the rows the run reads (not the whole set when step.max_steps caps it), then
        # the reference is gone: training holds one model.
        batch, read = step_cfg.eval_micro_batch_size_per_device, visited_rows(train_ds, cfg, world, total_steps)
        if rank == 0:
            common.say(f"[{step_cfg.name}] the reference's log-probs of the {len(read)} of {len(train_ds)} train rows "
                       f"that {total_steps} optimizer steps read, then the reference is freed")
        train_ds = precompute_reference(ref, train_ds, collate, batch, read)
        eval_ds = precompute_reference(ref, eval_ds, collate, batch)
        loader, sampler = common.train_loader(train_ds, cfg, rank, world, collate)
        del ref, ref_model
        ref = None
    evaluation = common.eval_loader(eval_ds, cfg, rank, world, collate)

    # The reference is scored without dropout (eval mode); so is the policy unless step.disable_dropout=false.
    engine, n_params, ckpt = common.train_engine(cfg, models.load_causal_lm, model_path, tokenizer, total_steps, "actor",
                                                 frozen={"reference": ref_ds} if ref_ds else None,
                                                 dropout=0.0 if step_cfg.disable_dropout else None)
    name = step_cfg.name
    if rank == 0:
        common.say(f"[{name}] {len(train_ds)} train {spec.rows} rows, {len(eval_ds)} eval rows, {total_steps} optimizer "
                   f"steps of {step_cfg.global_batch_size} rows, {n_params / 1e6:.2f}M parameters"
                   + (f", reference log-probs {step_cfg.reference_logprobs}" if spec.has_role("reference") else ""))
    state, resumed, logger = common.start_loop(ckpt, cfg, rank, total_steps,
                                               ("loss", "pref_acc", "chosen_reward", "chosen_rows", "rejected_reward",
                                                "rejected_rows"), name)

    def ready(epoch: int) -> bool:
        """Evaluate; a preference step has no readiness rule: it trains its full length."""
        metrics = evaluate(engine, ref, evaluation, step_cfg)
        if accuracy_prompts:
            metrics.update(rollout.evaluate(engine, None, rule, accuracy_prompts, tokenizer, step_cfg.max_new_tokens,
                                            step_cfg.eval_micro_batch_size_per_device, gathering))
        state.last, state.last_eval_step = metrics, state.step
        logger.log({**metrics, "epoch": epoch}, step=state.step)
        if rank == 0:
            common.say(f"[{name}] step {state.step} " + " ".join(f"{k[5:]}={v:.4f}" for k, v in metrics.items()))
        return False

    def micro_step(batch: dict) -> tuple:
        r = scored(engine, ref, batch, step_cfg)
        # Sums and row counts, not means: a micro batch of unpaired rows can hold no answer of one kind
        # (at one row per micro batch every one lacks a kind), and the window's means are over its rows.
        return r.loss, {"pref_acc": r.right.mean().item(), "chosen_reward": r.chosen.sum().item(),
                        "chosen_rows": float(len(r.chosen)), "rejected_reward": r.rejected.sum().item(),
                        "rejected_rows": float(len(r.rejected))}

    # -------------------------------------------------------------------------------- loop
    if not resumed:
        ready(0)
        state.first = state.last
    loop.train(cfg, state, ckpt, logger, loop.Supervised(
        cfg, engine, loader, sampler, ckpt, state, logger, n_params, micro_step, ready, f"{spec.title} loss",
        derive=window_rewards, postfix=("loss", "pref_acc")))

    # -------------------------------------------------------------------------------- save
    return common.finish(cfg, engine, tokenizer, rank, state.step, state.first, state.last, logger)
