"""Step 3, RLHF with PPO: setup -> loop (rollout, score, advantages, update) -> save.

Four roles through the one engine factory: the actor (trainable, from the SFT output) and its
frozen reference copy, the critic (trainable, from the reward model) and the frozen reward model.
Each PPO step samples answers to a batch of left-padded prompts, scores them (reward model and/or
a reward function such as the shipped task's rule), turns the scores into advantages by
step.advantage_estimator -- GAE against the critic, or a critic-free GRPO, RLOO, REINFORCE++ (then
no critic is built) -- with the KL to the reference in the reward or in the loss (step.kl_in), and
runs ppo_epochs of clipped policy (and value) updates. The RL math is in rlhf/losses.py.

    python launch.py step=ppo actor.path=<sft out>/model critic.path=<reward out>/model
    python launch.py step=ppo step.advantage_estimator=rloo step.samples_per_prompt=4 actor.path=... critic.path=...
    python launch.py step=ppo step.reward_fn=rule step.reward_model_weight=0 actor.path=<sft out>/model
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import Dataset
from torch.utils.data import DataLoader, DistributedSampler
from tqdm import tqdm

from rlhf import engine as engine_factory
from rlhf import losses, memory, models, readiness, rewards
from rlhf.checkpoint import (
    Checkpointer,
    StopRequest,
    gather_state_dict,
    param_fingerprint,
    save_hf_model,
    set_rng_state,
)
from rlhf.config import Config, ConfigError, ppo_updates_per_step
from rlhf.data.blend import DataReport, data_rule, heldout_split, load_step_data, load_text_sources, named_rule
from rlhf.data.tokenize import PadCollator, sft_dataset
from rlhf.distributed import cat_over_ranks, first_copies, rank_share, sum_over_ranks, world_size
from rlhf.logging import peak_memory_gb
from rlhf.rollout import (
    Experience,
    Scores,
    answer_logits,
    answer_texts,
    evaluate,
    generate,
    left_pad,
    position_ids,
    prompt_dataset,
    response_mask,
    sampled_answers,
)
from rlhf.sampling import Sampling
from rlhf.runners.common import as_select, count_params, finish, open_logger, say


# ------------------------------------------------------------------------------- rollouts
def by_chunks(fn, rows: int, chunk: int) -> torch.Tensor:
    """``fn(rows slice)`` for each ``chunk`` of the batch's rows, concatenated: a scoring forward holds
    one chunk's activations and logits at a time ([chunk, answer length, vocabulary] in fp32 for the
    log-probs), the bound step.generation_batch_size_per_device puts on generation. Every rank
    makes the same calls (the same rows per device), as ZeRO-3's gathers need."""
    return torch.cat([fn(slice(i, i + chunk)) for i in range(0, rows, chunk)])


@torch.no_grad()
def sequence_scores(reward, rule_fn, seq, attn, prompts, answers, step_cfg, chunk: int) -> Scores:
    """The reward model's score at each sequence's last real token, the reward function's value, and
    their weighted sum (the score PPO optimizes)."""
    scores = Scores(total=torch.zeros(seq.shape[0]))
    if reward is not None:
        values = by_chunks(lambda r: reward(input_ids=seq[r], attention_mask=attn[r]), seq.shape[0], chunk)
        scores.rm = losses.gather_at(values, losses.end_indices(attn)).float().cpu()
        scores.total = scores.total + step_cfg.reward_model_weight * scores.rm
    if rule_fn is not None:
        scores.fn = torch.tensor([rule_fn(p, a) for p, a in zip(prompts, answers, strict=True)])
        scores.total = scores.total + step_cfg.reward_fn_weight * scores.fn
    return scores


@torch.no_grad()
def make_experience(actor, ref, critic, reward, rule_fn, batch, tokenizer, step_cfg, kl_ctl, moments,
                    gathering: int = 0) -> Experience:
    """Generate the step's rollouts, score them (log-probs, reference, critic, reward) and turn the
    scores into advantages with step.advantage_estimator (rlhf.losses.ESTIMATORS)."""
    t0 = time.perf_counter()
    chunk = step_cfg.generation_batch_size_per_device or batch["input_ids"].shape[0]
    from_rollout = step_cfg.old_logprobs == "rollout"
    pieces = [generate(actor, {k: v[i:i + chunk] for k, v in batch.items() if k != "prompts"}, tokenizer,
                       Sampling.of(step_cfg), gathering=gathering, with_logprobs=from_rollout,
                       static=step_cfg.decode_graph)
              for i in range(0, batch["input_ids"].shape[0], chunk)]
    tokens = [p[0] if from_rollout else p for p in pieces]
    width = max(p.shape[1] for p in tokens)  # chunks may stop at different lengths; pad after their eos
    response = torch.cat([F.pad(p, (0, width - p.shape[1]), value=tokenizer.pad_token_id) for p in tokens])
    t_generated = time.perf_counter()
    device = actor.device
    prompt_ids, prompt_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    rmask = response_mask(response, tokenizer.eos_token_id)
    seq = torch.cat([prompt_ids, response], dim=1)
    attn = torch.cat([prompt_mask, rmask], dim=1)
    pos = position_ids(attn)
    start = prompt_ids.shape[1] - 1  # logits at start predict the first answer token

    rows = seq.shape[0]

    eos = tokenizer.eos_token_id

    def logprobs(model):  # of the distribution the sampler drew from: no eos before min_new_tokens
        return by_chunks(lambda r: losses.token_logprobs(losses.forbid_early_eos(
            answer_logits(model, seq[r], attn[r], pos[r], start), eos, step_cfg.min_new_tokens),
            response[r], step_cfg.temperature), rows, chunk)

    if from_rollout:  # the sampler's own log-probs (0 after eos, like every masked position)
        old_logprobs = torch.cat([F.pad(p[1], (0, width - p[1].shape[1])) for p in pieces]).to(device)
    else:
        actor.eval()
        old_logprobs = logprobs(actor)
        actor.train()
    ref_logprobs = logprobs(ref)
    old_values = None
    if critic is not None:
        critic.eval()
        old_values = by_chunks(lambda r: critic(input_ids=seq[r], attention_mask=attn[r])[:, start:-1], rows, chunk)
        critic.train()

    answers = answer_texts(tokenizer, response, rmask)
    scores = sequence_scores(reward, rule_fn, seq, attn, batch["prompts"], answers, step_cfg, chunk)
    score = scores.total.to(device)
    # Answers cut at max_new_tokens without an eos: the reward model never saw such answers.
    truncated = ~(response == eos).any(-1)
    if step_cfg.truncated_answers == "penalty":
        score = score - step_cfg.truncated_penalty * truncated.to(score.dtype)
    if step_cfg.reward_normalize:
        moments.update(score, reduce=sum_over_ranks)  # the global batch's moments: ranks normalize alike
        score = moments.normalize(score)
    if step_cfg.reward_clip:
        score = score.clamp(-step_cfg.reward_clip, step_cfg.reward_clip)
    rmask_f = rmask.float()
    kl = losses.kl_penalty(old_logprobs, ref_logprobs, step_cfg.kl_estimator) * rmask_f
    inputs = losses.AdvantageInputs(
        score=score, kl=kl, kl_coef=kl_ctl.value if step_cfg.kl_in == "reward" else 0.0, mask=rmask_f,
        values=old_values, group_size=step_cfg.samples_per_prompt, gamma=step_cfg.gamma, lam=step_cfg.lam,
        whiten=step_cfg.whiten_advantages, reduce=sum_over_ranks)
    advantages, returns = losses.ESTIMATORS[step_cfg.advantage_estimator].fn(inputs)
    # DAPO's overlong filtering: truncated answers keep their place in the advantages, not in the loss.
    loss_mask = rmask_f * (~truncated).unsqueeze(-1) if step_cfg.truncated_answers == "mask" else rmask_f
    return Experience(seq=seq, attn=attn, pos=pos, response=response, mask=rmask_f, loss_mask=loss_mask,
                      truncated=truncated, eos_id=eos, start=start,
                      old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, old_values=old_values,
                      advantages=advantages, returns=returns, kl=kl.sum(-1),
                      kl_k1=((old_logprobs - ref_logprobs) * rmask_f).sum(-1), prompts=batch["prompts"],
                      answers=answers, scores=scores, generate_s=t_generated - t0)


# --------------------------------------------------------------------------------- update
def step_counts(exp: Experience, order: torch.Tensor, micro: int, accumulation: int) -> torch.Tensor:
    """For each optimizer step of one pass over the rollout batch in ``order``: its answer tokens and
    its answers, over all its micro-batches and every rank ([steps, 2], float64). The step's loss is
    divided by these, so that no token's weight depends on how the step is split."""
    mask = exp.loss_mask
    per_micro = torch.stack([torch.stack([mask[order[i:i + micro]].sum(), (mask[order[i:i + micro]].sum(-1) > 0).sum()])
                             for i in range(0, len(order), micro)]).double()
    return sum_over_ranks(per_micro.view(-1, accumulation, 2).sum(1).cpu()).clamp(min=1)


def ppo_update(actor, critic, exp: Experience, step_cfg, kl_coef: float, generator: torch.Generator,
               ptx_iter) -> dict[str, float]:
    """step_cfg.ppo_epochs passes of clipped policy updates over the rollout batch in shuffled micro
    batches, each followed by the critic's clipped value update (when there is a critic).

    The per-token loss (clipped surrogate, plus the KL where step.kl_in=loss, minus the entropy
    bonus) is aggregated by step.loss_agg (rlhf.losses.LOSS_AGGS) over the whole optimizer step:
    every micro-batch divides by the step's count over all its micro-batches and ranks, and is
    scaled by accumulation x ranks because DeepSpeed divides each micro-batch's loss by the
    accumulation and averages gradients over ranks. The value loss is a mean over the step's tokens;
    ``loss`` is the sum of every term that reached backward, actor's and critic's."""
    n = exp.seq.shape[0]
    micro, accumulation = step_cfg.micro_batch_size_per_device, step_cfg.gradient_accumulation_steps
    scale = accumulation * world_size()
    agg, budget = step_cfg.loss_agg, step_cfg.max_new_tokens
    token_col = 0 if losses.LOSS_AGGS[agg].unit == "token" else 1  # the column of step_counts agg divides by
    sums = dict.fromkeys(("loss", "policy_loss", "value_loss", "kl_loss", "entropy", "clip_frac", "ptx_loss"), 0.0)
    count = steps = 0
    start = exp.start
    for epoch in range(step_cfg.ppo_epochs):
        order = torch.randperm(n, generator=generator)
        counts = step_counts(exp, order, micro, accumulation)
        for j, i in enumerate(range(0, n, micro)):
            idx = order[i:i + micro].to(exp.seq.device)
            mask = exp.loss_mask[idx]
            denom, tokens = counts[j // accumulation, token_col].item(), counts[j // accumulation, 0].item()
            logits = losses.forbid_early_eos(answer_logits(actor, exp.seq[idx], exp.attn[idx], exp.pos[idx], start),
                                             exp.eos_id, step_cfg.min_new_tokens)
            logprobs, token_entropy = losses.token_logprobs_and_entropy(
                logits, exp.response[idx], step_cfg.temperature, entropy_grad=step_cfg.entropy_coef > 0)
            pg_tokens, clipped = losses.clipped_surrogate(logprobs, exp.old_logprobs[idx], exp.advantages[idx],
                                                          step_cfg.clip_range)
            per_token = pg_tokens
            if step_cfg.kl_in == "loss":  # GRPO's place for the KL: its gradient pulls toward the reference
                kl_tokens = losses.kl_penalty(logprobs, exp.ref_logprobs[idx], step_cfg.kl_estimator)
                per_token = per_token + kl_coef * kl_tokens
                sums["kl_loss"] += world_size() * losses.aggregate(kl_tokens.detach(), mask, agg, denom, budget).item()
            if step_cfg.entropy_coef > 0:
                per_token = per_token - step_cfg.entropy_coef * token_entropy
            loss = scale * losses.aggregate(per_token, mask, agg, denom, budget)
            if ptx_iter is not None:  # a plain mean per micro-batch: DeepSpeed's scaling averages it over the step
                ptx = next(ptx_iter)
                ptx_loss = actor(**{k: v.to(actor.device) for k, v in ptx.items()}).loss
                loss = loss + step_cfg.ptx_coef * ptx_loss
                sums["ptx_loss"] += ptx_loss.item() / accumulation
            # Every term that reaches backward, on the scale of the other logged losses: the non-finite
            # stop reads this sum, so no term (entropy bonus, ptx) can poison the weights unseen.
            sums["loss"] += loss.item() / accumulation
            if epoch == 0 and i == 0:  # how far the sampler's log-probs are from a training forward's
                sums["logprob_diff"] = losses.masked_mean((logprobs.detach() - exp.old_logprobs[idx]).abs(), mask).item()
            actor.backward(loss)
            actor.step()

            if critic is not None:
                values = critic(input_ids=exp.seq[idx], attention_mask=exp.attn[idx])[:, start:-1]
                v_err = losses.clipped_value_error(values, exp.old_values[idx], exp.returns[idx],
                                                   step_cfg.value_clip_range)
                v_loss = losses.aggregate(v_err, mask, "token_mean", tokens, budget)
                critic.backward(scale * step_cfg.vf_coef * v_loss)
                critic.step()
                sums["value_loss"] += world_size() * v_loss.item()
                sums["loss"] += world_size() * step_cfg.vf_coef * v_loss.item()

            # Logged per optimizer step: this rank's share x ranks, the step's loss where ranks agree.
            sums["policy_loss"] += world_size() * losses.aggregate(pg_tokens.detach(), mask, agg, denom, budget).item()
            sums["entropy"] += losses.masked_mean(token_entropy.detach(), mask).item()
            sums["clip_frac"] += losses.masked_mean(clipped.float(), mask).item()
            count += 1
            steps += (j + 1) % accumulation == 0
    out = {k: v / (count if k in ("entropy", "clip_frac") else steps) for k, v in sums.items() if k != "logprob_diff"}
    out["rollout/logprob_diff"] = sums["logprob_diff"]
    if critic is None:
        del out["value_loss"]
    if step_cfg.kl_in != "loss":
        del out["kl_loss"]
    return out


@torch.no_grad()
def policy_check(roles: Roles, prompts: Prompts, cfg: Config, gathering: int) -> tuple[dict[str, float], list]:
    """The reward model judged on the policy's own answers before any update:
    readiness.POLICY_CHECK_SAMPLES answers per select prompt, sampled as the rollouts are, scored by
    the reward model and by the rule (sequence_scores);
    the AUC of the scores for the rule's right/wrong (select/policy_rm_auc). Held-out pairs show
    only the mistakes their writer thought of; PPO climbs the reward model's scores of the mistakes
    this policy makes. Returns the figures and this rank's scored rows, best-scored first. The draws
    come from a forked RNG seeded by cfg.seed: the training run is the same with or without it."""
    step_cfg, rank, world = cfg.step, dist.get_rank(), dist.get_world_size()
    if roles.reward is None or roles.eval_rule is None or not rewards.knows(roles.eval_rule, [p["prompt"] for p in prompts.select]):
        return {}, []
    rows = [p for p in prompts.select for _ in range(readiness.POLICY_CHECK_SAMPLES)]
    mine = rank_share(rows, rank, world)
    chunk = step_cfg.generation_batch_size_per_device or step_cfg.rollout_batch_size_per_device
    scored: list[dict] = []
    device = roles.actor.device
    sampled = sampled_answers(roles.actor, mine, roles.tokenizer, chunk, cfg.seed + rank, Sampling.of(step_cfg),
                              gathering=gathering, static=step_cfg.decode_graph)
    for batch, response, rmask, answers in sampled:
        seq = torch.cat([batch["input_ids"].to(device), response], 1)
        attn = torch.cat([batch["attention_mask"].to(device), rmask], 1)
        scores = sequence_scores(roles.reward, roles.eval_rule, seq, attn, batch["prompts"], answers, step_cfg, chunk)
        scored += [{"prompt": p, "answer": a, "rule": rule, "rm_score": round(r, 4)}
                   for p, a, rule, r in zip(batch["prompts"], answers, scores.fn.tolist(), scores.rm.tolist(),
                                            strict=True)]
    # Rank order is row order and the wrapped-round copies are the last rank's tail: each row once.
    both = cat_over_ranks(torch.tensor([[r["rm_score"], r["rule"]] for r in scored], dtype=torch.float32))[:len(rows)]
    scored = scored[:first_copies(len(rows), rank, world)]
    out = {"select/policy_sampled_accuracy": both[:, 1].mean().item()}
    if bool(((both[:, 1] == 0) | (both[:, 1] == 1)).all()):  # a right/wrong rule
        out["select/policy_rm_auc"] = losses.auc(both[:, 0], both[:, 1])
    return out, sorted(scored, key=lambda r: -r["rm_score"])


def rollout_metrics(exp: Experience, truth) -> dict[str, float]:
    """Statistics of the global rollout batch (every rank's rows), identical on every rank: the KL
    controller acts on them, so no rank may decide from its own share."""
    rows = {"score": exp.scores.total.float(), "kl": exp.kl.float().cpu(), "kl_k1": exp.kl_k1.float().cpu(),
            "len": exp.mask.sum(-1).float().cpu(), "truncated": exp.truncated.float().cpu()}
    if exp.scores.rm is not None:
        rows["rm_score"] = exp.scores.rm.float()
    # Truth on the rollouts themselves, where the rule knows the prompts: the accuracy PPO
    # really reaches, and how well the reward model's scores separate right from wrong (AUC).
    if truth is not None and rewards.knows(truth, exp.prompts):
        rows["truth"] = torch.tensor([truth(p, a) for p, a in zip(exp.prompts, exp.answers, strict=True)],
                                     dtype=torch.float32)
    keys = list(rows)
    # A rank whose prompts the rule does not know contributes no truth; decide together.
    has_truth = sum_over_ranks(torch.tensor(["truth" in rows], dtype=torch.float32)).item()
    if 0 < has_truth < world_size():
        keys.remove("truth")
    stacked = cat_over_ranks(torch.stack([rows[k] for k in keys], dim=1))
    rows = {k: stacked[:, i] for i, k in enumerate(keys)}
    out = {"reward/score_mean": rows["score"].mean().item(), "reward/score_std": rows["score"].std().item(),
           "kl": rows["kl"].mean().item(), "kl_k1": rows["kl_k1"].mean().item(), "answer_len": rows["len"].mean().item(),
           "rollout/truncated_frac": rows["truncated"].mean().item()}
    if "rm_score" in rows:
        out["reward/rm_score"] = rows["rm_score"].mean().item()
    if "truth" in rows:
        out["rollout/rule_accuracy"] = rows["truth"].mean().item()
        if "rm_score" in rows and bool(((rows["truth"] == 0) | (rows["truth"] == 1)).all()):  # right/wrong rules
            out["rollout/rm_rule_auc"] = losses.auc(rows["rm_score"], rows["truth"])
    return out


# The warnings' false-alarm level: one-sided, the tail of two standard errors of a normal estimate.
FALSE_ALARM = NormalDist().cdf(-2.0)


def hacking_warning(best: dict, now: dict, n_prompts: int, earlier: int = 1) -> str | None:
    """The reward model is being gamed: since the best evaluation, picked as the most accurate of
    ``earlier`` evaluations of the same ``n_prompts`` prompts, both
    (1) the rule's accuracy fell by more than z standard errors of the difference of two evaluations,
        sqrt(2 p (1 - p) / n) at p their mean accuracy, with z = Phi^-1(1 - FALSE_ALARM / earlier):
        the best of ``earlier`` is their maximum, and by the union bound noise alone puts a maximum of
        ``earlier`` that far above a new evaluation with probability at most FALSE_ALARM; and
    (2) the reward model's mean score rose by more than two standard errors of the difference, each
        from the spread of its scores over the prompts (eval/rm_score_std).
    Each condition alone is met by noise with probability at most FALSE_ALARM (2.3%), so noise alone
    fires the warning at any one evaluation with probability at most that (far less where the two
    noises are independent)."""
    keys = ("eval/accuracy", "eval/rm_score")
    if not all(k in d for d in (best, now) for k in keys):
        return None
    p = (best["eval/accuracy"] + now["eval/accuracy"]) / 2
    n = max(n_prompts, 1)
    z = NormalDist().inv_cdf(1 - FALSE_ALARM / max(earlier, 1))
    drop, rise = best["eval/accuracy"] - now["eval/accuracy"], now["eval/rm_score"] - best["eval/rm_score"]
    noise = z * (2 * max(p * (1 - p), 0.01) / n) ** 0.5
    rm_noise = 2 * ((best.get("eval/rm_score_std", 0.0) ** 2 + now.get("eval/rm_score_std", 0.0) ** 2) / n) ** 0.5
    if drop > noise and rise > rm_noise:
        return (f"reward hacking: the reward model's score on held-out greedy answers rose {best['eval/rm_score']:.3f} -> "
                f"{now['eval/rm_score']:.3f} (more than its {rm_noise:.3f} noise) while rule accuracy fell "
                f"{best['eval/accuracy']:.3f} -> {now['eval/accuracy']:.3f} (more than the {noise:.3f} noise of "
                f"{n_prompts} prompts below the best of {earlier} evaluations): the policy is learning the reward "
                "model's mistakes. Lower optim.lr, raise step.kl_coef or set step.kl_target, or train a better "
                "reward model")
    return None


def still_rising(history: list[tuple[int, float]], n_prompts: int, window: int = 4) -> str | None:
    """PPO ended while it was still learning: its last evaluation was its best, and the select half's
    accuracy rose over the last ``window`` evaluations by more than two standard errors of the
    difference between two evaluations of ``n_prompts`` prompts (noise alone rarely says so)."""
    if len(history) < window + 1:
        return None
    (start_step, start), (end_step, end) = history[-window - 1], history[-1]
    if end < max(acc for _, acc in history):
        return None
    noise = 2 * (2 * max(start * (1 - start), 0.01) / max(n_prompts, 1)) ** 0.5
    if end - start <= noise:
        return None
    return (f"PPO was still improving when it stopped: held-out accuracy rose {start:.3f} -> {end:.3f} over its last "
            f"{window} evaluations (steps {start_step} -> {end_step}, more than the {noise:.3f} noise of {n_prompts} "
            "prompts) and its last evaluation was its best. Train it longer: step.epochs=N (in a chain "
            "pipeline.ppo.step.epochs=N)")


def unjudged_note(first: dict, last: dict, kl: float) -> str | None:
    """Without a rule, a rising reward score cannot be told from reward hacking: say so with the figures."""
    if "eval/accuracy" in last or "eval/rm_score" not in last or "eval/rm_score" not in first:
        return None
    return (f"the reward model's score on held-out greedy answers went {first['eval/rm_score']:.3f} -> "
            f"{last['eval/rm_score']:.3f} at a KL of {kl:.3f} to the reference; no rule scores these prompts "
            "(data.rule), so this run cannot tell learning from reward hacking: read the answers in "
            "samples.jsonl")


@dataclass
class Roles:
    """PPO's models and scorers, built once (build_roles): engines for the actor and its frozen
    reference, the critic (None for critic-free estimators) and the frozen reward model (None without
    a reward-model weight); the reward rule and the rule that judges greedy answers."""

    tokenizer: object
    actor_path: str
    actor: object
    ref: object
    critic: object | None
    reward: object | None
    rule_fn: object | None
    eval_rule: object | None
    ds_configs: dict
    n_actor: int
    n_critic: int
    n_reward: int


@dataclass
class Prompts:
    """PPO's data: the train prompts' loader (prompts repeated samples_per_prompt times, left-padded),
    the held-out halves (select/* picks the best actor; eval/* reports), the PPO-ptx batches, the
    number of PPO steps and the data report."""

    loader: DataLoader
    sampler: DistributedSampler
    count: int
    select: list[dict]
    report_half: list[dict]
    ptx: object | None
    steps: int
    report: DataReport


def checked_tokenizer(cfg: Config) -> tuple[object, str, str, str]:
    """The actor's tokenizer (left padding) and the actor, critic and reward paths; refuses a critic or
    reward model of another tokenizer (it would score the actor's token ids as noise)."""
    actor_path = cfg.actor.path or models.resolve_path(cfg.model)
    reward_path = cfg.reward.path or cfg.critic.path
    if problems := models.ppo_role_problems(cfg):
        raise ConfigError("; ".join(problems))
    # Critic-free estimators (GRPO, RLOO, REINFORCE++) build no critic: no model, optimizer or checkpoint.
    critic_path = (cfg.critic.path or reward_path or actor_path) \
        if losses.ESTIMATORS[cfg.step.advantage_estimator].needs_critic else ""
    tokenizer = models.load_tokenizer(actor_path, cfg.model.trust_remote_code)
    for role, path in (("critic", critic_path), ("reward", reward_path if cfg.step.reward_model_weight > 0 else "")):
        if path and path != actor_path:
            why = models.tokenizer_mismatch(tokenizer, models.load_tokenizer(path, cfg.model.trust_remote_code))
            if why:
                raise ConfigError(f"PPO's {role} model {path} uses another tokenizer than the actor {actor_path} "
                                  f"({why}): it would score the actor's token ids as noise. Train the reward model "
                                  "from a model of the actor's family")
    tokenizer.padding_side = "left"
    return tokenizer, actor_path, critic_path, reward_path


def build_prompts(cfg: Config, tokenizer, rank: int, world: int) -> Prompts:
    step_cfg = cfg.step
    report = DataReport()
    train_rows, eval_rows = load_step_data(cfg.data, "ppo", report, tokenizer)
    train_prompts = prompt_dataset(train_rows, tokenizer, step_cfg.max_prompt_len, report, "train",
                                   cfg.data.long_prompts)
    # Held-out prompts, halved: keeping the best actor and the hacking warning read one half
    # (select/*), every reported figure (before, after, the output's) comes from the other (eval/*).
    select, report_half = (
        prompt_dataset(eval_rows.select(part), tokenizer, step_cfg.max_prompt_len, report, "eval",
                       cfg.data.long_prompts) for part in heldout_split(eval_rows["prompt"], cfg.data.seed, step_cfg.eval_prompts))
    per_step = step_cfg.rollout_batch_size_per_device // step_cfg.samples_per_prompt
    sampler = DistributedSampler(train_prompts, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed,
                                 drop_last=True)
    loader = DataLoader(train_prompts, batch_size=per_step, sampler=sampler, drop_last=True,
                        collate_fn=lambda b: left_pad([x for x in b for _ in range(step_cfg.samples_per_prompt)],
                                                      tokenizer.pad_token_id))
    steps = len(loader) * step_cfg.epochs
    if step_cfg.max_steps > 0:
        steps = min(steps, step_cfg.max_steps)
    if steps == 0:
        raise ValueError(f"{len(train_prompts)} prompts make no PPO step of {per_step} prompts per device")
    ptx = None
    if step_cfg.ptx_coef > 0:
        ptx_len = step_cfg.max_prompt_len + step_cfg.max_new_tokens
        if cfg.data.ptx_sources:  # unsupervised text: next-token loss on all of it, cut to the rollout length
            ids = [(tokenizer(t).input_ids + [tokenizer.eos_token_id])[:ptx_len] for t in load_text_sources(cfg.data)]
            ptx_ds = Dataset.from_dict({"input_ids": ids, "labels": ids})
        else:
            ptx_rows, _ = load_step_data(cfg.data, "sft", report, tokenizer)
            ptx_ds = sft_dataset(ptx_rows, tokenizer, ptx_len, "all", report, "ptx", cfg.data.on_bad_row)
        ptx_loader = DataLoader(ptx_ds, batch_size=step_cfg.micro_batch_size_per_device, drop_last=True,
                                sampler=DistributedSampler(ptx_ds, num_replicas=world, rank=rank, seed=cfg.seed),
                                collate_fn=PadCollator(tokenizer.pad_token_id))
        ptx = iter(_forever(ptx_loader))
    if rank == 0:
        (Path(cfg.run_dir) / "data_report.json").write_text(json.dumps(report.as_dict(), indent=2))
    return Prompts(loader, sampler, len(train_prompts), select, report_half, ptx, steps, report)


def build_roles(cfg: Config, tokenizer, paths: tuple[str, str, str], eval_prompts: list[dict],
                total_updates: int) -> Roles:
    """Load the four models through the one engine factory (sharded while loading under ZeRO-3) and
    resolve the reward rule and the rule that judges greedy answers."""
    step_cfg, (actor_path, critic_path, reward_path) = cfg.step, paths
    # The data's rule (data.rule, or the shipped tasks' on their prompts) measures greedy accuracy and
    # the truth of the rollouts even when it is not part of the reward: the check against the truth.
    truth = data_rule(cfg.data, [p["prompt"] for p in eval_prompts], tokenizer)
    rule_fn = None
    if step_cfg.reward_fn == rewards.DATA_RULE:
        if truth is None:
            raise ConfigError("step.reward_fn=rule but no rule scores these prompts: set data.rule="
                              "package.module:function, or give step.reward_fn such a reference")
        rule_fn = truth
    elif step_cfg.reward_fn:
        rule_fn = named_rule(step_cfg.reward_fn, "step.reward_fn", cfg.data, tokenizer)
    dtype, trust = engine_factory.model_dtype(cfg), cfg.model.trust_remote_code
    with engine_factory.loading_context(cfg):
        actor_model = models.load_causal_lm(actor_path, tokenizer, dtype, 0.0, trust)
        ref_model = models.load_causal_lm(actor_path, tokenizer, dtype, 0.0, trust)
        critic_model = models.load_reward_model(critic_path, tokenizer, dtype, 0.0, trust) if critic_path else None
        reward_model = (models.load_reward_model(reward_path, tokenizer, dtype, 0.0, trust)
                        if step_cfg.reward_model_weight > 0 else None)
    actor, actor_ds = engine_factory.build_train_engine(actor_model, cfg, max(total_updates, 1))
    # Updated without dropout, LoRA's included: the ratio's old and new log-probs and the reference's
    # are all of the same dropout-free forward.
    engine_factory.disable_dropout(actor.module)
    ref, ref_ds = engine_factory.build_frozen_engine(ref_model, cfg, offload=step_cfg.offload_reference)
    critic, critic_ds = (engine_factory.build_train_engine(critic_model, cfg, max(total_updates, 1),
                                                           lr=step_cfg.critic_lr, use_lora=False)
                         if critic_model is not None else (None, None))
    reward, reward_ds = (engine_factory.build_frozen_engine(reward_model, cfg, offload=step_cfg.offload_reward)
                         if reward_model is not None else (None, None))
    ds_configs = {k: v for k, v in {"actor": actor_ds, "reference": ref_ds, "critic": critic_ds,
                                    "reward": reward_ds}.items() if v}
    return Roles(tokenizer, actor_path, actor, ref, critic, reward, rule_fn, truth or rule_fn, ds_configs,
                 count_params(actor.module), count_params(critic.module) if critic else 0,
                 count_params(reward.module) if reward else 0)


@dataclass
class Judge:
    """Greedy evaluations and what they decide: the best held-out evaluation so far ({} until the
    first: its step, its metrics and its select-half figures) and the warnings said so far."""

    cfg: Config
    roles: Roles
    prompts: Prompts
    logger: object
    gathering: int
    best: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    history: list[tuple[int, float]] = field(default_factory=list)  # (step, select accuracy) of every evaluation

    def evaluate(self, step: int, reported: bool, final_step: int) -> dict[str, float]:
        """Greedy answers to the select half (select/*), and to the reported half (eval/*) where
        ``reported`` or where the select half makes this actor the best so far (it may be the output);
        keeps a new best actor in best_model/ and warns once of reward hacking."""
        cfg, roles, step_cfg = self.cfg, self.roles, self.cfg.step
        rank, run_dir = dist.get_rank(), Path(cfg.run_dir)
        samples: list[dict] = []
        greedy = functools.partial(evaluate, roles.actor, roles.reward, roles.eval_rule, tokenizer=roles.tokenizer,
                                   max_new_tokens=step_cfg.max_new_tokens,
                                   batch_size=step_cfg.eval_micro_batch_size_per_device, gathering=self.gathering)
        chosen = greedy(prompts=self.prompts.select, samples=samples)
        metrics = as_select(chosen)
        better = "eval/accuracy" in chosen and (not self.best or
                                                chosen["eval/accuracy"] > self.best["select"]["eval/accuracy"])
        if reported or better:
            metrics.update(greedy(prompts=self.prompts.report_half))
        self.logger.log(metrics, step=step)
        if rank == 0 and metrics:
            say(f"[ppo] step {step} " + " ".join(f"{k.removeprefix('eval/')}={v:.4f}" for k, v in metrics.items()))
            with open(run_dir / "samples.jsonl", "a") as f:  # what the greedy answers look like, per evaluation
                f.writelines(json.dumps({"step": step, **row}) + "\n" for row in samples[:16])
        if "eval/accuracy" not in chosen:
            return metrics
        self.history.append((step, chosen["eval/accuracy"]))
        earlier = len(self.history) - 1  # the evaluations the best was picked from
        if self.best and (why := hacking_warning(self.best["select"], chosen, len(self.prompts.select), earlier)) \
                and not any("reward hacking" in w for w in self.warnings):
            self.warnings.append(f"step {step}: {why}")
            if rank == 0:
                say(f"[ppo] WARNING {self.warnings[-1]}")
        if better:
            self.best = {"step": step, "metrics": metrics, "select": chosen}
            # Step 0's actor is the start (on disk as the SFT output); the final one is saved as model/ anyway.
            if self.keeps_best and 0 < step < final_step:
                save_hf_model(roles.actor, roles.tokenizer, run_dir / "best_model", merge_lora=cfg.lora.merge_on_save)
        return metrics

    @property
    def keeps_best(self) -> bool:
        return self.cfg.step.keep_best and self.roles.eval_rule is not None and self.cfg.step.save_model


def start_check(cfg: Config, roles: Roles, prompts: Prompts, judge: Judge, gathering: int) -> dict[str, float]:
    """policy_check's figures, logged at step 0 with every scored answer in policy_check.jsonl; in a
    chain whose reward model misjudges the policy (rlhf.readiness.reward_misjudges_policy) PPO stops
    here (pipeline.on_weak_step=stop) or carries the warning."""
    figures, scored = policy_check(roles, prompts, cfg, gathering)
    if not figures:
        return {}
    run_dir, rank = Path(cfg.run_dir), dist.get_rank()
    judge.logger.log(figures, step=0)
    if rank == 0:
        with open(run_dir / "policy_check.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in scored)
        say("[ppo] the reward model on the policy's own sampled answers: " +
            " ".join(f"{k.removeprefix('select/')}={v:.4f}" for k, v in figures.items()))
    pipe = readiness.chain_settings(run_dir)
    why = pipe and readiness.reward_misjudges_policy(pipe, figures, scored, cfg.data.rule or "synthetic", run_dir)
    if why and pipe.on_weak_step == "stop":
        raise ConfigError(f"PPO stopped before its first update: {why}; {readiness.RUN_ANYWAY}")
    if why:
        judge.warnings.append(f"ran though it may not work (pipeline.on_weak_step=warn): {why}")
        if rank == 0:
            say(f"[ppo] WARNING {judge.warnings[-1]}")
    return figures


def train_step(roles: Roles, prompts: Prompts, batch: dict, cfg: Config, kl_ctl, moments, generator,
               gathering: int, epoch: int) -> dict[str, float]:
    """One PPO step: rollouts and their scores, the updates, and the step's figures (rollout
    statistics over all ranks, losses, phase times, throughput); the KL controller moves after it."""
    step_cfg, world = cfg.step, dist.get_world_size()
    t0 = time.perf_counter()
    exp = make_experience(roles.actor, roles.ref, roles.critic, roles.reward, roles.rule_fn, batch, roles.tokenizer,
                          step_cfg, kl_ctl, moments, gathering)
    t1 = time.perf_counter()
    train = ppo_update(roles.actor, roles.critic, exp, step_cfg, kl_ctl.value, generator, prompts.ptx)
    t2 = time.perf_counter()
    metrics = {**rollout_metrics(exp, roles.eval_rule), **train, "kl_coef": kl_ctl.value}
    kl_ctl.update(metrics["kl"], step_cfg.rollout_batch_size_per_device * world)
    t3 = time.perf_counter()
    n_seq, seq_len = exp.seq.shape
    # Forward FLOPs 2N per token: generation, the scoring passes (reference, critic, reward model, and
    # the actor's only with step.old_logprobs=recompute), then 3x (fwd+bwd) per update of the actor and
    # the critic (0 without one).
    scoring = roles.n_actor * (2 if step_cfg.old_logprobs == "recompute" else 1) + roles.n_critic + roles.n_reward
    flops = 2 * roles.n_actor * exp.mask.sum().item() + 2 * scoring * n_seq * seq_len \
        + step_cfg.ppo_epochs * 6 * (roles.n_actor + roles.n_critic) * n_seq * seq_len
    metrics.update({"generate_s": exp.generate_s, "experience_s": t1 - t0, "train_s": t2 - t1, "other_s": t3 - t2,
                    "step_s": t3 - t0, "samples_per_s": n_seq * world / (t3 - t0), "tflops": flops / (t3 - t0) / 1e12,
                    "lr": roles.actor.get_lr()[0], "epoch": epoch, "memory_gb": peak_memory_gb(cfg.hardware.accelerator)})
    return metrics


def run(cfg: Config) -> dict:
    # ------------------------------------------------------------------------------- setup
    rank, world, step_cfg = dist.get_rank(), dist.get_world_size(), cfg.step
    run_dir = Path(cfg.run_dir)
    tokenizer, *paths = checked_tokenizer(cfg)
    prompts = build_prompts(cfg, tokenizer, rank, world)
    roles = build_roles(cfg, tokenizer, tuple(paths), prompts.report_half, prompts.steps * ppo_updates_per_step(cfg))
    actor, ref, critic = roles.actor, roles.ref, roles.critic
    ema = _ema_init(actor, step_cfg.ema_decay, cfg.lora.rank)
    gathering = memory.generation_gathering(cfg)  # the pre-flight's choice, for ZeRO-3 generation
    kl_ctl = losses.AdaptiveKLController(step_cfg.kl_coef, step_cfg.kl_target, step_cfg.kl_horizon)
    moments, generator = losses.RunningMoments(), torch.Generator().manual_seed(cfg.seed)
    if rank == 0:
        (run_dir / "ds_config.json").write_text(json.dumps(roles.ds_configs, indent=2))
        say(f"[ppo] {prompts.count} prompts, {prompts.steps} PPO steps of {step_cfg.rollout_batch_size_per_device} "
            f"rollouts per device, {ppo_updates_per_step(cfg)} micro-batch updates each; "
            f"{step_cfg.advantage_estimator} advantages, KL ({step_cfg.kl_estimator}) in the {step_cfg.kl_in}, old "
            f"log-probs: {step_cfg.old_logprobs}; actor "
            f"{roles.n_actor / 1e6:.2f}M, critic {f'{roles.n_critic / 1e6:.2f}M' if critic else 'none'} parameters; "
            f"reward: {'reward model' if roles.reward else ''}{' + ' if roles.reward and roles.rule_fn else ''}"
            f"{step_cfg.reward_fn or ''}")
    ckpt = Checkpointer(run_dir, {"actor": actor, **({"critic": critic} if critic else {})}, cfg.checkpoint.every_steps,
                        cfg.checkpoint.keep_last)
    resumed = ckpt.load() if cfg.resume == "auto" else None
    logger = open_logger(cfg, rank, fresh=resumed is None)
    judge = Judge(cfg, roles, prompts, logger, gathering)
    stop = StopRequest()

    # -------------------------------------------------------------------------------- loop
    if resumed:
        step, start_epoch, skip = resumed["step"], resumed["epoch"], resumed["batch_index"]
        first, last, last_eval_step = resumed["first"], resumed["last"], resumed["last_eval_step"]
        fingerprints = {k: tuple(v) for k, v in resumed["fingerprints"].items()}
        judge.best, judge.warnings, judge.history = resumed["best"], resumed["warnings"], resumed.get("history", [])
        kl_ctl.load_state_dict(resumed["kl_ctl"])
        moments.load_state_dict(resumed["moments"])
        generator.set_state(resumed["generator"])
        ema = resumed["ema"] if ema is not None else None
        logger.truncate_after(step)
        if rank == 0:
            say(f"[ppo] resumed at PPO step {step} (epoch {start_epoch}, prompt batch {skip})")
    else:
        fingerprints = {"actor": param_fingerprint(actor), "reference": param_fingerprint(ref)}
        check = start_check(cfg, roles, prompts, judge, gathering)
        first = last = {**judge.evaluate(0, True, prompts.steps), **check}
        step, start_epoch, skip, last_eval_step = 0, 0, 0, 0

    def state(epoch: int, batch_index: int) -> dict:
        return {"step": step, "epoch": epoch, "batch_index": batch_index, "first": first, "last": last,
                "last_eval_step": last_eval_step, "fingerprints": fingerprints, "best": judge.best,
                "warnings": judge.warnings, "history": judge.history, "kl_ctl": kl_ctl.state_dict(),
                "moments": moments.state_dict(), "generator": generator.get_state(), "ema": ema}

    last_kl = float("nan")  # the latest rollout batch's KL to the reference
    bar = tqdm(total=prompts.steps, initial=step, desc="ppo", disable=rank != 0 or not cfg.logging.progress_bar)
    for epoch in range(start_epoch, step_cfg.epochs):
        for index, batch in _prompt_batches(prompts, epoch, start_epoch, skip, resumed):
            metrics = train_step(roles, prompts, batch, cfg, kl_ctl, moments, generator, gathering, epoch)
            _ema_update(ema, actor, step_cfg.ema_decay)
            step, last_kl = step + 1, metrics["kl"]
            ckpt.stop_if_nonfinite(step, state(epoch, index + 1), "PPO loss", metrics["loss"], unit="PPO step")
            logger.log(metrics, step=step)
            bar.update(1)
            bar.set_postfix(score=f"{metrics['reward/score_mean']:.3f}", kl=f"{metrics['kl']:.3f}")
            if rank == 0 and step % step_cfg.log_every_steps == 0:
                keys = ("reward/score_mean", "rollout/rule_accuracy", "kl", "policy_loss", "value_loss", "kl_loss", "step_s")
                say(f"[ppo] step {step}/{prompts.steps} " + " ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics))
            if step_cfg.eval_every_steps and step % step_cfg.eval_every_steps == 0:
                last, last_eval_step = judge.evaluate(step, step >= prompts.steps, prompts.steps), step
            if step >= prompts.steps:
                break
            ckpt.after_step(step, state(epoch, index + 1), stop, logger, "ppo")
        skip = 0
        if step >= prompts.steps:
            break
        ckpt.save(step, state(epoch + 1, 0))  # the epoch boundary: a resume trains the remaining epochs
    bar.close()
    if last_eval_step != step:
        last = judge.evaluate(step, True, prompts.steps)

    # -------------------------------------------------------------------------------- save
    return _finish(cfg, roles, judge, ema, step, first, last, last_kl, fingerprints, logger)


def _prompt_batches(prompts: Prompts, epoch: int, start_epoch: int, skip: int, resumed: dict | None):
    """The epoch's prompt batches with their index, after the first ``skip`` (consumed before the
    checkpoint a run resumed from), with the RNG restored where the checkpoint saved it: at the epoch
    boundary before the loader draws its seed, mid-epoch after it."""
    prompts.sampler.set_epoch(epoch)
    restore = resumed is not None and epoch == start_epoch
    if restore and skip == 0:
        set_rng_state(resumed["rng"])
    batches = iter(prompts.loader)
    if restore and skip:
        set_rng_state(resumed["rng"])
    for index, batch in enumerate(batches):
        if index >= skip:
            yield index, batch


def _finish(cfg: Config, roles: Roles, judge: Judge, ema, step: int, first: dict, last: dict, last_kl: float,
            fingerprints: dict, logger) -> dict:
    """Save the actor (the best-evaluated one as model/ where a rule judges), the critic and the EMA
    actor, and the final figures: how far the weights moved, every warning."""
    rank, run_dir = dist.get_rank(), Path(cfg.run_dir)
    # How far the weights moved, as |change| of (sum, sum of squares): 0 for the frozen reference.
    moved = {f"{role}_weight_change": max(abs(a - b) for a, b in zip(param_fingerprint(eng), fingerprints[role],
                                                                        strict=True))
             for role, eng in (("actor", roles.actor), ("reference", roles.ref))}
    for note in (unjudged_note(first, last, last_kl), still_rising(judge.history, len(judge.prompts.select))):
        if note:
            judge.warnings.append(note)
            if rank == 0:
                say(f"[ppo] NOTE {note}")

    def save_more(final: dict) -> None:
        if roles.critic is not None:
            save_hf_model(roles.critic, roles.tokenizer, run_dir / "critic")
        if ema is not None and rank == 0:
            _ema_save(ema, roles.actor, roles.tokenizer, run_dir / "model_ema")
            final["ema_dir"] = str(run_dir / "model_ema")
        if judge.keeps_best and judge.best and rank == 0:
            _keep_best(run_dir, judge.best, step, last, final, judge.warnings, roles.actor_path)

    # The list itself goes into the final figures: what _keep_best adds still lands there.
    return finish(cfg, roles.actor, roles.tokenizer, rank, step, first,
                  {**last, **moved, "old_logprobs": cfg.step.old_logprobs, "warnings": judge.warnings}, logger, save_more)


def _keep_best(run_dir: Path, best: dict, step: int, last: dict, final: dict, warnings: list[str],
               start: str = "") -> None:
    """Make the best-evaluated actor the output (model/), the last one model_last/, and say which;
    when the best was the start (step 0), the output is a copy of ``start``, the actor's folder."""
    shutil.rmtree(run_dir / "model_last", ignore_errors=True)
    final.update({f"{k}_last": v for k, v in last.items()}, best_step=best["step"])
    if best["step"] == step:
        shutil.rmtree(run_dir / "best_model", ignore_errors=True)  # an earlier best, now beaten
        say(f"[ppo] output: the last actor (step {step}) had the best held-out accuracy, "
              f"{last['eval/accuracy']:.3f}")
    elif best["step"] == 0:
        why = (f"PPO never beat its start on held-out accuracy ({best['metrics']['eval/accuracy']:.3f} at step 0, "
               f"{last['eval/accuracy']:.3f} at the end)")
        if (Path(start) / "config.json").exists():  # the start is a local model folder: it is the best actor
            os.replace(run_dir / "model", run_dir / "model_last")
            shutil.copytree(start, run_dir / "model")
            final.update(best["metrics"])
            warnings.append(f"{why}; the output model/ is a copy of the start ({start}), the last actor is in "
                            "model_last/")
        else:
            warnings.append(f"{why}; the output is the last actor")
        say(f"[ppo] WARNING {warnings[-1]}")
    else:
        os.replace(run_dir / "model", run_dir / "model_last")
        os.replace(run_dir / "best_model", run_dir / "model")
        final.update(best["metrics"])
        say(f"[ppo] output: model/ is the actor of step {best['step']} (held-out accuracy "
              f"{best['metrics']['eval/accuracy']:.3f}, the best evaluation); the last actor ({last['eval/accuracy']:.3f}) "
              f"is in model_last/")


def _forever(loader):
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


# ------------------------------------------------------------------------------------- EMA
def _ema_init(actor, decay: float, lora_rank: int) -> dict[str, torch.Tensor] | None:
    """A full-precision CPU copy of the actor's weights (rank 0), averaged after every PPO step."""
    if decay == 0:
        return None
    if lora_rank:
        raise ConfigError("step.ema_decay with lora.rank > 0 is not supported: average the merged model instead")
    state = gather_state_dict(actor)
    return {k: v.float() for k, v in state.items()} if state is not None else None


def _ema_update(ema, actor, decay: float) -> None:
    if ema is None and dist.get_rank() == 0 or decay == 0:
        return
    current = gather_state_dict(actor)  # every rank joins the gathers; rank 0 gets the tensors
    if current is not None:
        for name, value in current.items():
            if value.is_floating_point():
                ema[name].mul_(decay).add_(value.float(), alpha=1.0 - decay)


def _ema_save(ema, actor, tokenizer, out: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(actor.module.config)
    model.load_state_dict(ema, strict=False)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
