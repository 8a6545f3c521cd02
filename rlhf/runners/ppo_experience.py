"""PPO's experience: one step's rollouts sampled from the actor, scored (old and reference log-probs,
the critic's values, the reward model and/or the reward function) and turned into advantages by
step.advantage_estimator (rlhf.losses.ESTIMATORS); and the rollout batch's statistics, reduced over
every rank. rlhf.runners.ppo calls make_experience once per PPO step.

    python launch.py step=ppo actor.path=<sft out>/model critic.path=<reward out>/model
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from rlhf import losses, rewards
from rlhf.distributed import cat_over_ranks, sum_over_ranks, world_size
from rlhf.rollout import Experience, Scores, answer_logits, answer_texts, generate, position_ids, response_mask
from rlhf.runners.ppo_setup import Roles
from rlhf.sampling import Sampling


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


def shaped_score(scores: Scores, truncated: torch.Tensor, step_cfg, moments, device) -> torch.Tensor:
    """The score the advantages start from: the truncated answers' penalty (step.truncated_answers=
    penalty), then normalized by the running moments of every rank's scores (ranks normalize alike)
    and clipped, as the step config asks."""
    score = scores.total.to(device)
    if step_cfg.truncated_answers == "penalty":
        score = score - step_cfg.truncated_penalty * truncated.to(score.dtype)
    if step_cfg.reward_normalize:
        moments.update(score, reduce=sum_over_ranks)
        score = moments.normalize(score)
    if step_cfg.reward_clip:
        score = score.clamp(-step_cfg.reward_clip, step_cfg.reward_clip)
    return score


@torch.no_grad()
def make_experience(roles: Roles, batch: dict, sampling: Sampling, step_cfg, kl_ctl, moments,
                    gathering: int = 0) -> Experience:
    """Generate the step's rollouts, score them (log-probs, reference, critic, reward) and turn the
    scores into advantages with step.advantage_estimator (rlhf.losses.ESTIMATORS)."""
    t0 = time.perf_counter()
    actor, ref, critic, tokenizer = roles.actor, roles.ref, roles.critic, roles.tokenizer
    chunk = step_cfg.generation_batch_size_per_device or batch["input_ids"].shape[0]
    from_rollout = step_cfg.old_logprobs == "rollout"
    response, sampler_logprobs = rollouts(roles, batch, sampling, chunk, gathering, from_rollout,
                                          step_cfg.decode_graph)
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
            answer_logits(model, seq[r], attn[r], pos[r], start), eos, sampling.min_new_tokens),
            response[r], sampling.temperature), rows, chunk)

    if from_rollout:
        old_logprobs = sampler_logprobs
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
    scores = sequence_scores(roles.reward, roles.rule_fn, seq, attn, batch["prompts"], answers, step_cfg, chunk)
    # Answers cut at max_new_tokens without an eos: the reward model never saw such answers.
    truncated = ~(response == eos).any(-1)
    score = shaped_score(scores, truncated, step_cfg, moments, device)
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
                      truncated=truncated, eos_id=eos, start=start, sampling=sampling,
                      old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, old_values=old_values,
                      advantages=advantages, returns=returns, kl=kl.sum(-1),
                      kl_k1=((old_logprobs - ref_logprobs) * rmask_f).sum(-1), prompts=batch["prompts"],
                      answers=answers, scores=scores, generate_s=t_generated - t0)


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

