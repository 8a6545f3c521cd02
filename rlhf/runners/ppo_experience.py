"""PPO's experience: one step's rollouts sampled from the actor, scored (old and reference log-probs,
the critic's values, the reward model and/or the reward function) and turned into advantages by
step.advantage_estimator (rlhf.losses.ESTIMATORS); and the rollout batch's statistics, reduced over
every rank. rlhf.runners.ppo calls make_experience once per PPO step.

    python launch.py step=ppo actor.path=<sft out>/model critic.path=<reward out>/model
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf import losses, rewards
from rlhf.distributed import any_rank, cat_over_ranks, min_over_ranks, sum_over_ranks, world_size
from rlhf.generation.rollout import (
    Experience,
    Scores,
    answer_logits,
    answer_texts,
    generate,
    position_ids,
    response_mask,
)
from rlhf.generation.sampling import Sampling
from rlhf.runners.ppo_setup import Roles


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
def rollouts(roles: Roles, batch: dict, sampling: Sampling, chunk: int, gathering: int, with_logprobs: bool,
             static: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The actor's answers to the left-padded prompt ``batch``, generated ``chunk`` rows at a time,
    padded after their eos to one width; with ``with_logprobs`` also the sampler's own log-probs
    (0 after eos, like every masked position), else None."""
    actor, tokenizer = roles.actor, roles.tokenizer
    pieces = [generate(actor, {k: v[i:i + chunk] for k, v in batch.items() if k != "prompts"}, tokenizer, sampling,
                       gathering=gathering, with_logprobs=with_logprobs, static=static)
              for i in range(0, batch["input_ids"].shape[0], chunk)]
    tokens = [p[0] if with_logprobs else p for p in pieces]
    width = max(p.shape[1] for p in tokens)  # chunks may stop at different lengths; pad after their eos
    response = torch.cat([F.pad(p, (0, width - p.shape[1]), value=tokenizer.pad_token_id) for p in tokens])
    if not with_logprobs:
        return response, None
    return response, torch.cat([F.pad(p[1], (0, width - p[1].shape[1])) for p in pieces]).to(actor.device)


def shaped_score(scores: Scores, truncated: torch.Tensor, lengths: torch.Tensor, step_cfg, moments,
                 device) -> torch.Tensor:
    """The score the advantages start from: the truncated answers' penalty (step.truncated_answers=
    penalty) and DAPO's soft overlong penalty (step.overlong_buffer), then normalized by the running
    moments of every rank's scores (ranks normalize alike) and clipped, as the step config asks."""
    score = scores.total.to(device)
    if step_cfg.truncated_answers == "penalty":
        score = score - step_cfg.truncated_penalty * truncated.to(score.dtype)
    if step_cfg.overlong_buffer:
        score = score + losses.overlong_penalty(lengths.to(device, score.dtype), step_cfg.max_new_tokens,
                                                step_cfg.overlong_buffer, step_cfg.overlong_penalty_factor)
    if step_cfg.reward_normalize:
        moments.update(score, reduce=sum_over_ranks)
        score = moments.normalize(score)
    if step_cfg.reward_clip:
        score = score.clamp(-step_cfg.reward_clip, step_cfg.reward_clip)
    return score


@dataclass
class Drawn:
    """One prompt batch's sampled and scored answers: what dynamic sampling keeps or drops by group."""

    prompt_ids: torch.Tensor  # [rows, prompt width], left-padded
    prompt_mask: torch.Tensor
    response: torch.Tensor  # [rows, answer width], padded after eos
    sampler_logprobs: torch.Tensor | None
    prompts: list[str]
    answers: list[str]
    scores: Scores

    def rows(self, index: torch.Tensor) -> Drawn:
        i = index.tolist()

        def pick(t):
            return None if t is None else t[index.to(t.device)]

        return Drawn(pick(self.prompt_ids), pick(self.prompt_mask), pick(self.response), pick(self.sampler_logprobs),
                     [self.prompts[j] for j in i], [self.answers[j] for j in i],
                     Scores(*(pick(t) for t in (self.scores.total, self.scores.rm, self.scores.fn))))


def _joined(parts: list[Drawn], pad_id: int) -> Drawn:
    """The draws as one batch: prompts left-padded and answers right-padded to the widest."""
    if len(parts) == 1:
        return parts[0]
    wp, wr = max(p.prompt_ids.shape[1] for p in parts), max(p.response.shape[1] for p in parts)

    def left(t, v):
        return F.pad(t, (wp - t.shape[1], 0), value=v)

    def right(t, v):
        return F.pad(t, (0, wr - t.shape[1]), value=v)

    def cat(ts):
        return None if ts[0] is None else torch.cat(ts)

    return Drawn(torch.cat([left(p.prompt_ids, pad_id) for p in parts]), torch.cat([left(p.prompt_mask, 0) for p in parts]),
                 torch.cat([right(p.response, pad_id) for p in parts]),
                 cat([None if p.sampler_logprobs is None else right(p.sampler_logprobs, 0.0) for p in parts]),
                 [x for p in parts for x in p.prompts], [x for p in parts for x in p.answers],
                 Scores(*(cat([getattr(p.scores, k) for p in parts]) for k in ("total", "rm", "fn"))))


def draw(roles: Roles, batch: dict, sampling: Sampling, step_cfg, chunk: int, gathering: int,
         with_logprobs: bool) -> Drawn:
    """The actor's answers to one prompt batch, with their scores (and the sampler's log-probs)."""
    tokenizer, device = roles.tokenizer, roles.actor.device
    response, sampler_logprobs = rollouts(roles, batch, sampling, chunk, gathering, with_logprobs,
                                          step_cfg.decode_graph)
    prompt_ids, prompt_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    seq = torch.cat([prompt_ids, response], dim=1)
    attn = torch.cat([prompt_mask, response_mask(response, tokenizer.eos_token_id)], dim=1)
    answers = answer_texts(tokenizer, response, attn[:, prompt_ids.shape[1]:])
    scores = sequence_scores(roles.reward, roles.rule_fn, seq, attn, batch["prompts"], answers, step_cfg, chunk)
    return Drawn(prompt_ids, prompt_mask, response, sampler_logprobs, batch["prompts"], answers, scores)


def signal_groups(total: torch.Tensor, group_size: int) -> torch.Tensor:
    """Per group of ``group_size`` consecutive answers to one prompt: whether their scores differ (a
    group whose answers all scored the same has every group advantage 0: no signal)."""
    groups = total.view(-1, group_size)
    return groups.amax(-1) > groups.amin(-1)


def pick_groups(signal: list[torch.Tensor], needed: int) -> tuple[list[list[int]], int]:
    """Dynamic sampling's choice from the draws' per-group ``signal`` flags: the first ``needed`` groups
    with a signal in the order drawn, then groups without one to fill the batch; per draw the chosen
    group indices (ascending), and how many of them are fills."""
    drawn = [(i, g, bool(f)) for i, flags in enumerate(signal) for g, f in enumerate(flags.tolist())]
    picked = ([x for x in drawn if x[2]] + [x for x in drawn if not x[2]])[:needed]
    return [sorted(g for i, g, _ in picked if i == d) for d in range(len(signal))], sum(not x[2] for x in picked)


def drawn_batch(roles: Roles, batch: dict, sampling: Sampling, step_cfg, chunk: int, gathering: int,
                with_logprobs: bool, draw_more) -> tuple[Drawn, dict[str, float]]:
    """The step's rollouts and their statistics: one prompt batch's, or under step.dynamic_sampling
    (DAPO) the groups with a signal from as many prompt batches as it takes to fill the rollout batch
    (``draw_more()`` gives the next one, None at the epoch's end), at most
    step.dynamic_sampling_max_draws; short of a full batch, the rest is dropped groups (advantage 0).
    Every rank draws as often as the others (a collective decision): ZeRO-3's gathers need it."""
    group = step_cfg.samples_per_prompt
    first = draw(roles, batch, sampling, step_cfg, chunk, gathering, with_logprobs)
    draws, groups = [first], first.scores.total.numel() // group
    signal = [signal_groups(first.scores.total, group)] if group > 1 else []
    if step_cfg.dynamic_sampling:
        while min_over_ranks(sum(int(s.sum()) for s in signal)) < groups \
                and len(draws) < step_cfg.dynamic_sampling_max_draws:
            more = draw_more() if draw_more is not None else None
            if any_rank(more is None):  # the epoch's prompts ran out (on every rank alike)
                break
            draws.append(draw(roles, more, sampling, step_cfg, chunk, gathering, with_logprobs))
            signal.append(signal_groups(draws[-1].scores.total, group))
    stats = {}
    if group > 1:
        flags = torch.cat(signal)
        counts = sum_over_ranks(torch.tensor([float((~flags).sum()), float(flags.numel())], dtype=torch.float64))
        stats["rollout/zero_std_frac"] = (counts[0] / counts[1]).item()
    if not step_cfg.dynamic_sampling:
        return first, stats
    chosen, filled = pick_groups(signal, groups)
    parts = [d.rows(torch.tensor([g * group + k for g in chosen[i] for k in range(group)]))
             for i, d in enumerate(draws) if chosen[i]]
    counts = sum_over_ranks(torch.tensor([float(filled), float(groups), float(len(draws))], dtype=torch.float64))
    stats.update({"rollout/dynamic_fill_frac": (counts[0] / counts[1]).item(),
                  "rollout/prompt_draws": (counts[2] / world_size()).item()})
    return _joined(parts, roles.tokenizer.pad_token_id), stats


@torch.no_grad()
def make_experience(roles: Roles, batch: dict, sampling: Sampling, step_cfg, kl_ctl, moments,
                    gathering: int = 0, draw_more=None) -> Experience:
    """Generate the step's rollouts (``drawn_batch``), score them (log-probs, reference, critic, reward)
    and turn the scores into advantages with step.advantage_estimator (rlhf.losses.ESTIMATORS); with
    step.rollout_correction, the importance weights of the sampler's distribution against a training
    forward's."""
    t0 = time.perf_counter()
    actor, ref, critic, tokenizer = roles.actor, roles.ref, roles.critic, roles.tokenizer
    chunk = step_cfg.generation_batch_size_per_device or batch["input_ids"].shape[0]
    from_rollout = step_cfg.old_logprobs == "rollout"
    correcting = step_cfg.rollout_correction != "none"
    drawn, stats = drawn_batch(roles, batch, sampling, step_cfg, chunk, gathering, from_rollout or correcting,
                               draw_more)
    t_generated = time.perf_counter()
    device = actor.device
    prompt_ids, prompt_mask, response = drawn.prompt_ids, drawn.prompt_mask, drawn.response
    rmask = response_mask(response, tokenizer.eos_token_id)
    seq = torch.cat([prompt_ids, response], dim=1)
    attn = torch.cat([prompt_mask, rmask], dim=1)
    pos = position_ids(attn)
    start = prompt_ids.shape[1] - 1  # logits at start predict the first answer token

    rows = seq.shape[0]

    eos = tokenizer.eos_token_id

    def logprobs(model):  # of the distribution the sampler drew from: no eos before min_new_tokens
        return by_chunks(lambda r: losses.token_logprobs(losses.forbid_early_eos(
            answer_logits(model, seq[r], attn[r], pos[r], start), eos, sampling.min_new_tokens),
            response[r], sampling.temperature), rows, chunk)

    if from_rollout:
        old_logprobs = drawn.sampler_logprobs
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

    rmask_f = rmask.float()
    is_weights = None
    if correcting:
        is_weights, changed = losses.rollout_correction(old_logprobs, drawn.sampler_logprobs, rmask_f,
                                                        step_cfg.rollout_correction, step_cfg.rollout_correction_low,
                                                        step_cfg.rollout_correction_cap)
        gap = sum_over_ranks(torch.stack([((old_logprobs - drawn.sampler_logprobs).abs() * rmask_f).sum(),
                                          changed.float().sum(), rmask_f.sum()]).double().cpu())
        stats.update({"rollout/sampler_logprob_diff": (gap[0] / gap[2].clamp(min=1)).item(),
                      "rollout/correction_changed_frac": (gap[1] / gap[2].clamp(min=1)).item()})
    scores = drawn.scores
    # Answers cut at max_new_tokens without an eos: the reward model never saw such answers.
    truncated = ~(response == eos).any(-1)
    score = shaped_score(scores, truncated, rmask_f.sum(-1), step_cfg, moments, device)
    kl = losses.kl_penalty(old_logprobs, ref_logprobs, step_cfg.kl_estimator) * rmask_f
    inputs = losses.AdvantageInputs(
        score=score, kl=kl, kl_coef=kl_ctl.value if step_cfg.kl_in == "reward" else 0.0, mask=rmask_f,
        values=old_values, group_size=step_cfg.samples_per_prompt, gamma=step_cfg.gamma, lam=step_cfg.lam,
        whiten=step_cfg.whiten_advantages, reduce=sum_over_ranks)
    advantages, returns = losses.ESTIMATORS[step_cfg.advantage_estimator].fn(inputs)
    # DAPO's overlong filtering: truncated answers keep their place in the advantages, not in the loss.
    loss_mask = rmask_f * (~truncated).unsqueeze(-1) if step_cfg.truncated_answers == "mask" else rmask_f
    return Experience(seq=seq, attn=attn, pos=pos, response=response, mask=rmask_f, loss_mask=loss_mask,
                      truncated=truncated, eos_id=eos, start=start, sampling=sampling,
                      old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, old_values=old_values,
                      advantages=advantages, returns=returns, kl=kl.sum(-1),
                      kl_k1=((old_logprobs - ref_logprobs) * rmask_f).sum(-1), prompts=drawn.prompts,
                      answers=drawn.answers, scores=scores, generate_s=t_generated - t0, is_weights=is_weights,
                      stats=stats)


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
           "rollout/truncated_frac": rows["truncated"].mean().item(), **exp.stats}
    if "rm_score" in rows:
        out["reward/rm_score"] = rows["rm_score"].mean().item()
    if "truth" in rows:
        out["rollout/rule_accuracy"] = rows["truth"].mean().item()
        if "rm_score" in rows and bool(((rows["truth"] == 0) | (rows["truth"] == 1)).all()):  # right/wrong rules
            out["rollout/rm_rule_auc"] = losses.auc(rows["rm_score"], rows["truth"])
    return out

