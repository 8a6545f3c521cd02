"""Prompt batches, generation and greedy evaluation shared by PPO (rollouts) and SFT (accuracy).

    python -c "from rlhf.generation.rollout import generate; ..."   # used by the runners
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf import losses
from rlhf.data.blend import DataReport
from rlhf.distributed import first_copies, rank_share, sum_over_ranks
from rlhf.generation.decode import accepts, decode
from rlhf.generation.sampling import Sampling


@dataclass
class Scores:
    """Per-sequence scores of a rollout batch (host tensors of shape [batch])."""

    # The score the policy optimizes: reward model and reward function, weighted and summed.
    total: torch.Tensor
    # The reward model's score at each sequence's last real token; None without a reward model.
    rm: torch.Tensor | None = None
    # The reward function's value (e.g. the shipped task's rule); None without one.
    fn: torch.Tensor | None = None


@dataclass
class Experience:
    """One PPO step's rollouts and everything the update needs, made once by make_experience.

    Token tensors are [batch, response length] over the answer tokens (``start`` is where their
    logits begin in the full sequence); ``seq``/``attn``/``pos`` cover prompt + answer."""

    seq: torch.Tensor
    attn: torch.Tensor
    pos: torch.Tensor
    response: torch.Tensor
    # 1 on answer tokens up to and including eos, as float.
    mask: torch.Tensor
    # The tokens the losses train on: ``mask``, without the answers step.truncated_answers=mask drops.
    loss_mask: torch.Tensor
    # Answers cut at max_new_tokens without an eos ([batch] bool).
    truncated: torch.Tensor
    eos_id: int
    start: int
    # How the answers were drawn: the update's log-probs read its temperature and minimum length, as the
    # sampler's did.
    sampling: Sampling
    old_logprobs: torch.Tensor
    # The reference's log-probs of the answer tokens: the KL term of the loss (step.kl_in=loss) needs them.
    ref_logprobs: torch.Tensor
    # The critic's values and GAE's returns; None for the estimators that build no critic.
    old_values: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor | None
    # Per-sequence KL to the reference (summed over the answer's tokens) by step.kl_estimator, and by k1
    # (the plain sum of log-ratios, comparable across estimators).
    kl: torch.Tensor
    kl_k1: torch.Tensor
    prompts: list[str]
    answers: list[str]
    scores: Scores
    # Seconds spent generating (the rest of make_experience is scoring).
    generate_s: float
    # step.rollout_correction's per-token importance weights (sampler against trainer), detached; None: off.
    is_weights: torch.Tensor | None = None
    # The drawing's figures over all ranks (rollout/zero_std_frac, dynamic sampling's, the correction's).
    stats: dict[str, float] = field(default_factory=dict)


def prompt_dataset(rows, tokenizer, max_prompt_len: int, report: DataReport, split: str,
                   long_prompts: str = "drop") -> list[dict]:
    """Tokenized prompts (bos included). Longer than max_prompt_len: dropped and counted (DeepSpeed-Chat's
    rule), or with ``truncate_left`` cut to their last tokens (bos kept) and counted as truncated; a
    truncated prompt keeps its row's text as ``prompt``, the key a rule's reference answer and the
    shipped rule's parsing read (the task is the whole question, whatever part of it the policy sees)."""
    out, seen = [], set()
    for row in rows:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            report.drop(split, "empty prompt")
            continue
        if prompt in seen:  # pairs share prompts; a prompt is one PPO example
            continue
        seen.add(prompt)
        ids = tokenizer(prompt).input_ids
        if len(ids) > max_prompt_len:
            if long_prompts == "drop":
                report.drop(split, f"prompt longer than step.max_prompt_len={max_prompt_len}")
                continue
            keep_bos = ids[:1] if ids[0] == tokenizer.bos_token_id else []
            ids = keep_bos + ids[len(ids) - (max_prompt_len - len(keep_bos)):]
            report.truncated[split] = report.truncated.get(split, 0) + 1
        out.append({"input_ids": ids, "prompt": prompt})
    if not out:
        raise ValueError(f"no usable {split} prompts: {report.dropped.get(split)}")
    return out


def left_pad(batch: list[dict], pad_id: int) -> dict:
    """Prompts padded on the left so that every answer starts at the same position."""
    width = max(len(b["input_ids"]) for b in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, b in enumerate(batch):
        n = len(b["input_ids"])
        ids[i, width - n:], mask[i, width - n:] = torch.tensor(b["input_ids"]), 1
    return {"input_ids": ids, "attention_mask": mask, "prompts": [b["prompt"] for b in batch]}


def response_mask(response: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 up to and including the first eos (an action like any other), 0 after it."""
    is_eos = (response == eos_id).long()
    return ((is_eos.cumsum(-1) - is_eos) == 0).long()


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    # From the mask, so left-padded prompts get the positions they would have unpadded.
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _zero3_offload(engine):
    """The object that owns ZeRO-3's per-module gather/release hooks: the optimizer's
    ``parameter_offload`` on a trainable engine, the optimizer itself on an inference-only one
    (DeepSpeed builds a ``DeepSpeedZeRoOffload`` there in place of an optimizer)."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    optimizer = engine.optimizer
    if isinstance(optimizer, DeepSpeedZeRoOffload):
        return optimizer
    offload = getattr(optimizer, "parameter_offload", None)
    if offload is None:
        raise RuntimeError(f"a ZeRO-3 engine without parameter offload hooks (optimizer: {type(optimizer).__name__})")
    return offload


@contextlib.contextmanager
def gathered_whole(engine):
    """Hold every ZeRO-3 parameter of ``engine`` gathered, with ZeRO-3's module hooks off.

    Gathering alone is not enough: the hooks still release each layer after its forward and
    gather it again for the next token. The hooks are put back even when the body raises, or the
    next training step would run on released (empty) parameters.
    """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    offload = _zero3_offload(engine)
    # Persistent parameters already resident stay out: the context's exit would free them, and the
    # next forward would have to gather them again.
    params = [p for p in engine.module.parameters()
              if not (getattr(p, "ds_persist", False) and p.ds_status == ZeroParamStatus.AVAILABLE)]
    # DeepSpeed's memory-efficient linear (zero.memory_efficient_linear) replaces F.linear for the
    # whole process with an autograd Function, a Python call per linear and token. It saves memory
    # only for a backward; generation has none, so torch's own serves here (docs/design-notes.md).
    linear = F.linear
    with deepspeed.zero.GatheredParameters(params):
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        F.linear = torch._C._nn.linear
        try:
            yield engine.module
        finally:
            F.linear = linear
            # Re-registering on the root also invalidates the coordinator's recorded fetch order,
            # which the hook-free forwards above left empty.
            offload._register_deepspeed_module(offload.module)


@torch.no_grad()
def generate(actor, batch: dict, tokenizer, sampling: Sampling | int, *, gathering: int = 0,
             with_logprobs: bool = False, static: bool = False, **settings):
    """Answers (response tokens only) for a left-padded prompt batch, drawn as ``sampling`` says
    (or its short form, as ``decode`` takes it); stops at eos. With ``with_logprobs``, (answers,
    their log-probs at the temperature) as ``decode`` gives them; ``static``: through the static
    (CUDA-graph) decode step, ``decode``'s ``static``.

    Under ZeRO-3, ``gathering`` (``rlhf.preflight.memory.generation_gathering``) says how the actor generates:
    0, ZeRO-3's hooks gather one layer at a time, every token; 1, the whole actor held gathered for
    the call; t > 1, in tensor-parallel slices over groups of t ranks (rlhf.generation.shards).
    """
    actor.eval()
    zero3 = actor.zero_optimization_stage() == 3
    ids, mask = batch["input_ids"].to(actor.device), batch["attention_mask"].to(actor.device)
    args = (Sampling.coerce(sampling, settings), tokenizer.eos_token_id, tokenizer.pad_token_id)
    if zero3 and gathering > 1:
        # Eagerly: the static (CUDA-graph) step with the group's all-reduces inside is not measured.
        out = _generate_sliced(actor, ids, mask, gathering, args, with_logprobs)
    else:
        with gathered_whole(actor) if zero3 and gathering == 1 else contextlib.nullcontext():
            # Synced even when gathered, for families decoded through the model's own forward: the
            # root's start-of-forward hook stays, and it may run a collective while the fetch trace is
            # recorded, so every rank runs the same number of forwards. Our family forwards
            # (decode.FORWARDS) call no hook and skip the sync.
            out = decode(actor.module, ids, mask, *args, synced=zero3 and dist.get_world_size() > 1,
                         with_logprobs=with_logprobs, static=static)
    actor.train()
    return out


def _generate_sliced(actor, ids, mask, t: int, args: tuple, with_logprobs: bool):
    """``generate`` through tensor-parallel slices: the group decodes all its ranks' prompts as one
    batch (each rank's left-padded to the group's longest, its rows to the most, with copies of its
    first row) and each rank keeps its own rows."""
    from rlhf.generation import shards

    group, pad_id = shards.tp_group(t), args[2]
    shape = torch.tensor(ids.shape, device=ids.device)
    shapes = [torch.zeros_like(shape) for _ in range(t)]
    dist.all_gather(shapes, shape, group=group)
    rows, length = (max(int(s[i]) for s in shapes) for i in (0, 1))
    pad = length - ids.shape[1]
    ids = F.pad(ids, (pad, 0), value=pad_id)
    mask = F.pad(mask, (pad, 0), value=0)
    extra = rows - ids.shape[0]
    ids, mask = (torch.cat([x, x[:1].expand(extra, -1)]) for x in (ids, mask))
    parts = [[torch.empty_like(x) for _ in range(t)] for x in (ids, mask)]
    for gathered, x in zip(parts, (ids, mask), strict=True):
        dist.all_gather(gathered, x.contiguous(), group=group)
    mine = slice(dist.get_rank(group) * rows, dist.get_rank(group) * rows + rows - extra)
    with shards.tensor_parallel_copy(actor.module, t) as (copy, group):
        out = decode(copy, torch.cat(parts[0]), torch.cat(parts[1]), *args, with_logprobs=with_logprobs,
                     tp_group=group)
    return (out[0][mine], out[1][mine]) if with_logprobs else out[mine]


def sampled_answers(engine, rows: list[dict], tokenizer, chunk: int, seed: int, sampling: Sampling | None = None,
                    **options):
    """(batch, response, response mask, answer texts) for ``rows`` (this rank's prompt rows), ``chunk``
    at a time, drawn from a forked RNG seeded ``seed``: the training around a check or a sample of the
    policy draws the same numbers with or without it. ``sampling``: how (or its settings among
    ``options``, max_new_tokens=... do_sample=...); the other ``options`` go to ``generate``."""
    if sampling is None:
        sampling = Sampling(**{f.name: options.pop(f.name) for f in fields(Sampling) if f.name in options})
    device = engine.device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.manual_seed(seed)
        for i in range(0, len(rows), chunk):
            batch = left_pad(rows[i:i + chunk], tokenizer.pad_token_id)
            response = generate(engine, batch, tokenizer, sampling, **options)
            mask = response_mask(response, tokenizer.eos_token_id)
            yield batch, response, mask, answer_texts(tokenizer, response, mask)


def answer_logits(model, seq: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, start: int) -> torch.Tensor:
    """Logits at positions start .. end-1, the ones that predict the answer tokens. The LM head runs
    on those positions only where the model allows it (``logits_to_keep``): the prompt's positions
    predict nothing scored, and with a large vocabulary the head is a big share of a small model's
    FLOPs (docs/design-notes.md)."""
    if accepts(model, "logits_to_keep"):
        # The positions as an index tensor, not a count: the model then gathers them into a contiguous
        # [batch, positions, hidden] that the head multiplies as one matrix product. A count slices a
        # strided view, which a product without gradients (the scoring forwards) runs as a batched
        # product over a copy of the head's weights per sequence.
        keep = torch.arange(start, seq.shape[1] - 1, device=seq.device)
        return model(input_ids=seq, attention_mask=attn, position_ids=pos, logits_to_keep=keep).logits
    return model(input_ids=seq, attention_mask=attn, position_ids=pos).logits[:, start:-1]


def answer_texts(tokenizer, response: torch.Tensor, mask: torch.Tensor) -> list[str]:
    return [tokenizer.decode(r[: int(m.sum())], skip_special_tokens=True) for r, m in zip(response, mask, strict=True)]


@torch.no_grad()
def evaluate(actor, reward, rule_fn, prompts: list[dict], tokenizer, max_new_tokens: int,
             batch_size: int, gathering: int = 0, samples: list | None = None) -> dict[str, float]:
    """Greedy answers to held-out prompts: rule accuracy (where the rule applies), reward-model
    score, answer length, each prompt counted once. Each rank takes an equal share (ZeRO-3 needs equal
    forward counts), the last ranks' filled up with copies that are answered and not counted.
    ``samples``: a list this rank's first batch of (prompt, answer, rule, reward) rows is appended to."""
    if not prompts:
        return {}
    rank, world = dist.get_rank(), dist.get_world_size()
    mine, counted = rank_share(prompts, rank, world), first_copies(len(prompts), rank, world)
    # count, rule correct, rm score, length, rm score squared, answers cut at the budget
    sums = torch.zeros(6, dtype=torch.float64)
    for i in range(0, len(mine), batch_size):
        batch = left_pad(mine[i:i + batch_size], tokenizer.pad_token_id)
        response = generate(actor, batch, tokenizer, Sampling(max_new_tokens), gathering=gathering)
        rmask = response_mask(response, tokenizer.eos_token_id)
        answers = answer_texts(tokenizer, response, rmask)
        k = max(0, min(len(answers), counted - i))  # this batch's rows that are first copies
        sums[0] += k
        sums[3] += rmask[:k].sum().item()
        # Cut: no end (eos or the template's end of turn) within the budget. A rule reads such an
        # answer as it is, so a budget shorter than the answers reads as a model that is always wrong.
        sums[5] += ((response[:k] == tokenizer.eos_token_id).sum(-1) == 0).sum().item() \
            if response.shape[1] >= max_new_tokens else 0
        rules = [rule_fn(p, a) for p, a in zip(batch["prompts"], answers, strict=True)] if rule_fn else None
        rm = None
        if rules is not None:
            sums[1] += sum(rules[:k])
        if reward is not None:
            seq = torch.cat([batch["input_ids"].to(actor.device), response], 1)
            attn = torch.cat([batch["attention_mask"].to(actor.device), rmask], 1)
            rm = losses.gather_at(reward(input_ids=seq, attention_mask=attn), losses.end_indices(attn)).float().cpu()
            sums[2] += rm[:k].sum().item()
            sums[4] += rm[:k].double().pow(2).sum().item()
        if samples is not None and i == 0:
            samples += [{"prompt": p, "answer": a, "rule": rules[j] if rules else None,
                         "rm_score": round(rm[j].item(), 4) if rm is not None else None}
                        for j, (p, a) in enumerate(zip(batch["prompts"], answers, strict=True))]
    sums = sum_over_ranks(sums)
    n = sums[0].item()
    out = {"eval/answer_len": sums[3].item() / n, "eval/truncated_frac": sums[5].item() / n}
    if rule_fn is not None:
        out["eval/accuracy"] = sums[1].item() / n
    if reward is not None:
        out["eval/rm_score"] = sums[2].item() / n
        # The spread over prompts: what the noise of a difference of two evaluations is made of.
        out["eval/rm_score_std"] = max(sums[4].item() / n - out["eval/rm_score"] ** 2, 0.0) ** 0.5
    return out
