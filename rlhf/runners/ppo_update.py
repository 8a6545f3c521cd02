"""PPO's update: step.ppo_epochs passes of clipped policy (and value) updates over one step's rollout
batch, in shuffled micro-batches, with the per-token losses aggregated over the whole optimizer
step. The RL math is in rlhf.losses; rlhf.runners.ppo calls ppo_update once per PPO step.

    python launch.py step=ppo actor.path=<sft out>/model critic.path=<reward out>/model
"""

from __future__ import annotations

import torch

from rlhf import losses
from rlhf.distributed import sum_over_ranks, world_size
from rlhf.generation.rollout import Experience, answer_logits


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

    The per-token loss (step.policy_loss's objective, weighted by step.rollout_correction's importance
    weights, plus the KL where step.kl_in=loss, minus the entropy bonus) is aggregated by step.loss_agg (rlhf.losses.LOSS_AGGS) over the whole optimizer step:
    every micro-batch divides by the step's count over all its micro-batches and ranks, and is
    scaled by accumulation x ranks because DeepSpeed divides each micro-batch's loss by the
    accumulation and averages gradients over ranks. The value loss is a mean over the step's tokens;
    ``loss`` is the sum of every term that reached backward, actor's and critic's."""
    n = exp.seq.shape[0]
    micro, accumulation = step_cfg.micro_batch_size_per_device, step_cfg.gradient_accumulation_steps
    scale = accumulation * world_size()
    agg, budget = step_cfg.loss_agg, exp.sampling.max_new_tokens
    token_col = 0 if losses.LOSS_AGGS[agg].unit == "token" else 1  # the column of step_counts agg divides by
    # The logged sums stay on the device until the update ends: a read-back per figure and micro
    # batch would make the host wait for the device each time, and the device then idles while the
    # host queues the next micro batch's kernels.
    sums = {}

    def add(key: str, value: torch.Tensor, factor: float = 1.0) -> None:
        value = value.detach().double() * factor
        sums[key] = sums[key] + value if key in sums else value

    count = steps = 0
    start = exp.start
    for epoch in range(step_cfg.ppo_epochs):
        order = torch.randperm(n, generator=generator)
        counts = step_counts(exp, order, micro, accumulation).tolist()  # on the host already: no wait
        for j, i in enumerate(range(0, n, micro)):
            idx = order[i:i + micro].to(exp.seq.device)
            mask = exp.loss_mask[idx]
            denom, tokens = counts[j // accumulation][token_col], counts[j // accumulation][0]
            logits = losses.forbid_early_eos(answer_logits(actor, exp.seq[idx], exp.attn[idx], exp.pos[idx], start),
                                             exp.eos_id, exp.sampling.min_new_tokens)
            logprobs, token_entropy = losses.token_logprobs_and_entropy(
                logits, exp.response[idx], exp.sampling.temperature, entropy_grad=step_cfg.entropy_coef > 0)
            pg_tokens, clipped = losses.POLICY_LOSSES[step_cfg.policy_loss].fn(
                logprobs, exp.old_logprobs[idx], exp.advantages[idx], mask, step_cfg.clip_eps_low, step_cfg.clip_eps_high)
            if exp.is_weights is not None:  # step.rollout_correction: the sampler's distribution against the trainer's
                pg_tokens = pg_tokens * exp.is_weights[idx]
            per_token = pg_tokens
            if step_cfg.kl_in == "loss":  # GRPO's place for the KL: its gradient pulls toward the reference
                kl_tokens = losses.kl_penalty(logprobs, exp.ref_logprobs[idx], step_cfg.kl_estimator)
                per_token = per_token + kl_coef * kl_tokens
                add("kl_loss", losses.aggregate(kl_tokens.detach(), mask, agg, denom, budget), world_size())
            if step_cfg.entropy_coef > 0:
                per_token = per_token - step_cfg.entropy_coef * token_entropy
            loss = scale * losses.aggregate(per_token, mask, agg, denom, budget)
            if ptx_iter is not None:  # a plain mean per micro-batch: DeepSpeed's scaling averages it over the step
                ptx = next(ptx_iter)
                ptx_loss = actor(**{k: v.to(actor.device) for k, v in ptx.items()}).loss
                loss = loss + step_cfg.ptx_coef * ptx_loss
                add("ptx_loss", ptx_loss, 1 / accumulation)
            # Every term that reaches backward, on the scale of the other logged losses: the non-finite
            # stop reads this sum, so no term (entropy bonus, ptx) can poison the weights unseen.
            add("loss", loss, 1 / accumulation)
            if epoch == 0 and i == 0:  # how far the sampler's log-probs are from a training forward's
                add("logprob_diff", losses.masked_mean((logprobs.detach() - exp.old_logprobs[idx]).abs(), mask))
            actor.backward(loss)
            actor.step()

            if critic is not None:
                v_loss = _value_update(critic, exp, idx, step_cfg, scale, tokens)
                add("value_loss", v_loss, world_size())
                add("loss", v_loss, world_size() * step_cfg.vf_coef)

            # Logged per optimizer step: this rank's share x ranks, the step's loss where ranks agree.
            add("policy_loss", losses.aggregate(pg_tokens.detach(), mask, agg, denom, budget), world_size())
            add("entropy", losses.masked_mean(token_entropy.detach(), mask))
            add("clip_frac", losses.masked_mean(clipped.float(), mask))
            count += 1
            steps += (j + 1) % accumulation == 0
    return _figures(sums, count, steps, critic is not None, step_cfg.kl_in == "loss")


def _value_update(critic, exp: Experience, idx: torch.Tensor, step_cfg, scale: float, tokens: int) -> torch.Tensor:
    """The critic's clipped value update on one micro batch: a mean over the optimizer step's
    ``tokens``, scaled as the policy's loss is; returns the value loss."""
    values = critic(input_ids=exp.seq[idx], attention_mask=exp.attn[idx])[:, exp.start:-1]
    v_err = losses.clipped_value_error(values, exp.old_values[idx], exp.returns[idx], step_cfg.value_clip_range)
    v_loss = losses.aggregate(v_err, exp.loss_mask[idx], "token_mean", tokens, exp.sampling.max_new_tokens)
    critic.backward(scale * step_cfg.vf_coef * v_loss)
    critic.step()
    return v_loss


def _figures(sums: dict[str, torch.Tensor], count: int, steps: int, has_critic: bool, kl_in_loss: bool) -> dict:
    """The update's logged figures from its device-side sums, read back at once: per optimizer step,
    entropy and clip fraction per micro batch."""
    keys = list(sums)
    host = dict.fromkeys(("loss", "policy_loss", "value_loss", "kl_loss", "entropy", "clip_frac", "ptx_loss"), 0.0)
    host.update(zip(keys, torch.stack([sums[k] for k in keys]).tolist(), strict=True))  # one read-back
    out = {k: v / (count if k in ("entropy", "clip_frac") else steps) for k, v in host.items() if k != "logprob_diff"}
    out["rollout/logprob_diff"] = host["logprob_diff"]
    if not has_critic:
        del out["value_loss"]
    if not kl_in_loss:
        del out["kl_loss"]
    return out
