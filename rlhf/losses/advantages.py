"""Rewards placed on tokens and the advantage estimators (GAE, GRPO, Dr. GRPO, RLOO, REINFORCE++),
each with its paper's defaults (ESTIMATORS). A new estimator is a function here and one entry.

    python -m pytest tests/test_losses.py
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf.losses.tokens import masked_whiten


def last_token_index(response_mask: torch.Tensor) -> torch.Tensor:
    """Index of each response's last real token (its eos, or the token at the length limit).

    An empty response still has one action -- the eos it emitted first -- so the index is at least 0.
    """
    return (response_mask.long().sum(-1) - 1).clamp(min=0)


def place_rewards(scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float,
                  clip: float | None) -> torch.Tensor:
    """Per-token rewards: -kl_coef * KL on every response token, plus the (clipped) sequence score on
    its last real token. DeepSpeed-Chat put the score one past the end, on a padding position."""
    rewards = -kl_coef * kl * response_mask
    if clip is not None and clip > 0:
        scores = scores.clamp(-clip, clip)
    index = last_token_index(response_mask)
    return rewards.scatter_add(-1, index.unsqueeze(-1), scores.unsqueeze(-1).to(rewards.dtype))


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the response tokens (Schulman et al. 2016).

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}; the value after the
    last real token is 0 (the episode ended). Returns (advantages, returns = advantages + values).
    """
    mask = mask.to(values.dtype)
    values = values * mask
    rewards = rewards * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
        next_value = values[:, t]
    return advantages, advantages + values


def group_advantages(scores: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """GRPO (Shao et al. 2024): each response's score minus its prompt group's mean, over the group's
    std, given to every token of the response. Rows are grouped consecutively. A group whose answers
    all scored the same gets 0 (nothing to learn from it), whatever the answers' lengths."""
    grouped = scores.view(-1, group_size).to(torch.float32)
    centered = grouped - grouped.mean(-1, keepdim=True)
    normalized = centered / (grouped.std(-1, keepdim=True) + 1e-6)
    return normalized.view(-1, 1) * mask.to(torch.float32)


def leave_one_out_advantages(scores: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each response's score minus the mean score of the other responses
    to the same prompt, s_i - (sum_j s_j - s_i) / (k - 1) = k / (k - 1) * (s_i - mean), on every token."""
    grouped = scores.view(-1, group_size).to(torch.float32)
    baseline = (grouped.sum(-1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).view(-1, 1) * mask.to(torch.float32)


def group_centered(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each score minus its prompt group's mean (REINFORCE++ with a baseline)."""
    grouped = scores.view(-1, group_size).to(torch.float32)
    return (grouped - grouped.mean(-1, keepdim=True)).view(-1)


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over the response tokens, 0 after the last real token (REINFORCE)."""
    mask = mask.to(rewards.dtype)
    rewards = rewards * mask
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        out[:, t] = running
    return out


# ------------------------------------------------------------------------ advantage estimators
@dataclass(frozen=True)
class AdvantageInputs:
    """What every estimator may read, from one rollout batch (B rollouts, T answer tokens)."""

    score: torch.Tensor  # [B] sequence scores, already normalized and clipped
    kl: torch.Tensor  # [B, T] per-token KL estimate to the reference, 0 off the answer
    kl_coef: float  # the KL's weight in the reward; 0 when the KL is in the loss (step.kl_in=loss)
    mask: torch.Tensor  # [B, T] 1 on answer tokens
    values: torch.Tensor | None  # [B, T] the critic's values (estimators that need a critic)
    group_size: int  # answers per prompt, consecutive rows
    gamma: float
    lam: float
    whiten: bool  # GAE only: whiten its advantages over the batch
    reduce: Callable | None = None  # sums statistics over data-parallel ranks


def gae_estimator(x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's: token rewards (KL on every token, score on the last), GAE against the critic."""
    rewards = place_rewards(x.score, x.kl, x.mask, x.kl_coef, None)
    advantages, returns = gae(rewards, x.values, x.mask, x.gamma, x.lam)
    if x.whiten:
        advantages = masked_whiten(advantages, x.mask, reduce=x.reduce)
    return advantages, returns


def _sequence_reward(x: AdvantageInputs) -> torch.Tensor:
    # Outcome methods put the KL into the sequence's reward: score - coef * sum_t KL_t.
    return x.score - x.kl_coef * (x.kl * x.mask).sum(-1)


def grpo_estimator(x: AdvantageInputs) -> tuple[torch.Tensor, None]:
    # No whitening after: re-centering over the batch would give all-same groups a non-zero advantage.
    return group_advantages(_sequence_reward(x), x.mask, x.group_size), None


def dr_grpo_estimator(x: AdvantageInputs) -> tuple[torch.Tensor, None]:
    """Dr. GRPO (Liu et al. 2025): GRPO without the division by the group's std. Measured here with a
    learned reward model: dividing by a small std turns the reward model's slight preferences among
    answers that are all wrong into full-size advantages, and the policy learns its mistakes."""
    return group_centered(_sequence_reward(x), x.group_size).view(-1, 1) * x.mask.to(torch.float32), None


def rloo_estimator(x: AdvantageInputs) -> tuple[torch.Tensor, None]:
    return leave_one_out_advantages(_sequence_reward(x), x.mask, x.group_size), None


def reinforce_pp_estimator(x: AdvantageInputs) -> tuple[torch.Tensor, None]:
    """REINFORCE++ (Hu 2025): token rewards with the KL per token, returns to go, normalized over the
    global batch (every rank's rollouts) instead of against a critic or a group."""
    returns = discounted_returns(place_rewards(x.score, x.kl, x.mask, x.kl_coef, None), x.mask, x.gamma)
    return masked_whiten(returns, x.mask, reduce=x.reduce), None


def reinforce_pp_baseline_estimator(x: AdvantageInputs) -> tuple[torch.Tensor, None]:
    """REINFORCE++-baseline (Hu 2025; OpenRLHF's reinforce_baseline): scores centered within their
    prompt group, returns to go, then normalized over the global batch's answer tokens (every rank's),
    mean and std, as REINFORCE++ is. The batch step re-centres: the advantages of the batch's tokens
    sum to 0, so a group whose answers all scored the same gets minus the batch's token mean over its
    std, not 0."""
    score = group_centered(x.score, x.group_size)
    returns = discounted_returns(place_rewards(score, x.kl, x.mask, x.kl_coef, None), x.mask, x.gamma)
    return masked_whiten(returns, x.mask, reduce=x.reduce), None


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and the defaults of the paper that introduced it."""

    fn: Callable[[AdvantageInputs], tuple[torch.Tensor, torch.Tensor | None]]
    needs_critic: bool
    min_group: int  # least step.samples_per_prompt it works with
    kl_in: str  # where the KL to the reference goes by default: reward or loss
    kl_estimator: str  # and which estimator, by default
    loss_agg: str  # how its paper aggregates the per-token losses (LOSS_AGGS), by default
    source: str


# step.advantage_estimator chooses by name; config validation lists these keys, so an entry here
# is a valid choice everywhere.
ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(gae_estimator, True, 1, "reward", "k1", "token_mean",
                     "Schulman et al. 2016; Ouyang et al. 2022"),
    "grpo": Estimator(grpo_estimator, False, 2, "loss", "k3", "seq_mean_token_mean", "Shao et al. 2024 (DeepSeekMath)"),
    "dr_grpo": Estimator(dr_grpo_estimator, False, 2, "loss", "k3", "seq_mean_token_sum_norm",
                         "Liu et al. 2025 (Dr. GRPO)"),
    # RLOO treats the whole answer as one action: its log-probability is the sum over its tokens.
    "rloo": Estimator(rloo_estimator, False, 2, "reward", "k1", "seq_mean_token_sum", "Ahmadian et al. 2024"),
    "reinforce_pp": Estimator(reinforce_pp_estimator, False, 1, "reward", "k1", "token_mean", "Hu 2025 (REINFORCE++)"),
    "reinforce_pp_baseline": Estimator(reinforce_pp_baseline_estimator, False, 2, "loss", "k2", "token_mean",
                                       "Hu 2025 (REINFORCE++-baseline)"),
}
