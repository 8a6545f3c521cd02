"""The policy and value losses (PPO's clipped surrogate, GSPO, CISPO), rollout correction, the
overlong penalty, loss aggregation and the adaptive KL controller. A new policy loss is a function
here and one POLICY_LOSSES entry.

    python -m pytest tests/test_losses.py
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlhf.losses.tokens import masked_mean

KL_PLACES = ("reward", "loss")


def clipped_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      clip_low: float, clip_high: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate objective per token, as a loss: max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)),
    r = exp(logprobs - old_logprobs), eps_high = eps_low unless given (DAPO's clip-higher raises it so that
    unlikely tokens with a positive advantage can grow); and where the clipped term won (the clip
    fraction). Aggregated over tokens by ``aggregate``."""
    high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def gspo_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                   clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, GSPO-token form) per token, as a loss: the clipped surrogate of
    s_t = sg[s] * pi(y_t) / sg[pi(y_t)], where s = exp(mean over the answer's tokens of log r) is the
    sequence's length-normalised ratio (pi(y) / pi_old(y))^(1/|y|). Each token's value is its answer's
    -min(s A, clip(s, 1 - eps_low, 1 + eps_high) A), and with an answer-constant advantage the token
    mean's gradient is the sequence objective's, so seq_mean_token_mean aggregation gives the paper's
    1/G sum over answers; the ratio is clipped (and the clip fraction counted) by answer."""
    log_seq = masked_mean(logprobs - old_logprobs, mask, dim=-1).unsqueeze(-1)
    ratio = torch.exp(log_seq.detach() + logprobs - logprobs.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def cispo_surrogate(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, Chen et al. 2025) per token, as a loss: -sg(clip(r, 1 - eps_low, 1 + eps_high)) A
    log pi. The importance weight is clipped and detached instead of the update: every token keeps a
    gradient (PPO's clip zeroes those beyond the range, often the rare tokens that reflect); and where
    the weight was clipped."""
    ratio = torch.exp(logprobs - old_logprobs).detach()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return -weight * advantages * logprobs, weight != ratio


@dataclass(frozen=True)
class PolicyLoss:
    """A policy objective (step.policy_loss): its per-token loss, the clip range it takes when
    step.clip_eps_low / step.clip_eps_high are unset (None: step.clip_range), the aggregation its paper
    defines (None: the advantage estimator's), and its source."""

    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    clip: tuple[float, float] | None
    loss_agg: str | None
    source: str


POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(lambda lp, old, adv, mask, lo, hi: clipped_surrogate(lp, old, adv, lo, hi), None, None,
                      "Schulman et al. 2017; clip-higher: DAPO (Yu et al. 2025)"),
    # The paper's ranges (section 5.1): the sequence ratio is a per-token geometric mean, near 1.
    "gspo": PolicyLoss(gspo_surrogate, (3e-4, 4e-4), "seq_mean_token_mean", "Zheng et al. 2025 (GSPO)"),
    # No lower bound on the weight (the paper tunes only the upper one); the cap 5 is TRL's
    # recommended epsilon_high for CISPO, after ScaleRL (Khatri et al. 2025).
    "cispo": PolicyLoss(lambda lp, old, adv, mask, lo, hi: cispo_surrogate(lp, old, adv, lo, hi), (1.0, 4.0),
                        "token_mean", "MiniMax-M1 (Chen et al. 2025, CISPO)"),
}


# ----------------------------------------------------------------------------- rollout correction
def rollout_correction(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor, method: str,
                       low: float, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights [B, T] for the gap between the distribution that sampled the answers (the
    sampler's log-probs) and the one the trainer computes for the same weights (``old_logprobs``,
    a training forward's), rho = pi_train / pi_sampler, detached; and the tokens whose weight was
    changed (capped or masked). Multiplied into the policy loss per token.

    tis:    min(rho_t, cap) per token (Yao et al. 2025, truncated importance sampling).
    mis:    rho(y) 1[rho(y) <= cap] per answer, rho(y) the product of its tokens' ratios (Liu et al.
            2025, masked importance sampling): an answer sampled too far from the trainer is dropped.
    icepop: rho_t 1[low <= rho_t <= cap] per token (Ling team 2025, IcePop): both tails masked."""
    mask = mask.to(old_logprobs.dtype)
    log_rho = ((old_logprobs - sampler_logprobs) * mask).detach()
    if method == "tis":
        rho = log_rho.exp()
        weight, changed = rho.clamp(max=cap), rho > cap
    elif method == "mis":
        seq = log_rho.sum(-1, keepdim=True)  # compared in logs: the product overflows on long answers
        keep = seq <= math.log(cap)
        weight = torch.where(keep, seq.clamp(max=math.log(cap)).exp(), torch.zeros_like(seq)).expand_as(log_rho)
        changed = (~keep).expand_as(log_rho)
    elif method == "icepop":
        keep = (log_rho >= math.log(low)) & (log_rho <= math.log(cap))
        weight, changed = torch.where(keep, log_rho.clamp(max=math.log(cap)).exp(), torch.zeros_like(log_rho)), ~keep
    else:
        raise ValueError(f"unknown rollout correction {method!r}")
    return weight * mask, changed & mask.bool()


# step.rollout_correction: the (low, cap) each method takes when step.rollout_correction_low / _cap are unset.
ROLLOUT_CORRECTIONS: dict[str, tuple[float, float]] = {
    "tis": (0.0, 2.0),     # C = 2, the TIS authors' setting
    "mis": (0.0, 2.0),     # C = 2, Liu et al.'s experiments
    "icepop": (0.5, 5.0),  # [0.5, 5]: OpenRLHF's default range for its IcePop correction
}


def overlong_penalty(lengths: torch.Tensor, budget: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) per answer: 0 up to budget - buffer tokens,
    then falling linearly to -factor at the budget; ``lengths`` count the answer's tokens, eos included."""
    return (-(lengths - (budget - buffer)) / buffer * factor).clamp(max=0.0)


def clipped_value_error(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                        clip_range: float) -> torch.Tensor:
    """0.5 * max((V - R)^2, (V_clipped - R)^2) per token, V_clipped kept within clip_range of the rollout's value."""
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)


# ----------------------------------------------------------------------------- loss aggregation
@dataclass(frozen=True)
class LossAgg:
    """How per-token losses become one loss: ``per_row`` turns [B, T] token losses into each answer's
    contribution [B], and the optimizer step's loss is the sum of every contribution over the
    step's micro-batches and ranks divided by the step's count of ``unit`` (answer tokens or
    answers) -- never by one micro-batch's, so a token's weight does not depend on how the step is
    split into micro-batches, accumulation steps and ranks."""

    per_row: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    unit: str  # "token" or "answer"
    source: str


def _row_sum(x: torch.Tensor, mask: torch.Tensor, budget: int) -> torch.Tensor:
    return (x * mask).sum(-1)


def _row_mean(x: torch.Tensor, mask: torch.Tensor, budget: int) -> torch.Tensor:
    return (x * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def _row_sum_over_budget(x: torch.Tensor, mask: torch.Tensor, budget: int) -> torch.Tensor:
    return (x * mask).sum(-1) / budget


# step.loss_agg chooses by name (null: the advantage estimator's paper's, ESTIMATORS[...].loss_agg).
LOSS_AGGS: dict[str, LossAgg] = {
    # Every answer token of the step weighs the same: long answers weigh more.
    "token_mean": LossAgg(_row_sum, "token", "InstructGPT / DeepSpeed-Chat PPO, DAPO"),
    # Each answer's token mean, then the mean over answers: every answer weighs the same.
    "seq_mean_token_mean": LossAgg(_row_mean, "answer", "GRPO (Shao et al. 2024)"),
    # Each answer's token sum (its whole log-probability), then the mean over answers.
    "seq_mean_token_sum": LossAgg(_row_sum, "answer", "RLOO (Ahmadian et al. 2024): the answer is one action"),
    # Each answer's token sum over a constant, the generation budget (max_new_tokens): no length bias.
    "seq_mean_token_sum_norm": LossAgg(_row_sum_over_budget, "answer", "Dr. GRPO (Liu et al. 2025)"),
}


def agg_count(mask: torch.Tensor, agg: str) -> torch.Tensor:
    """What this micro-batch adds to the step's denominator: its answer tokens, or its answers (rows
    with at least one token to train on)."""
    if LOSS_AGGS[agg].unit == "token":
        return mask.sum()
    return (mask.sum(-1) > 0).sum()


def aggregate(x: torch.Tensor, mask: torch.Tensor, agg: str, step_count: torch.Tensor | float,
              budget: int) -> torch.Tensor:
    """This micro-batch's share of the optimizer step's loss: its rows' contributions by ``agg``
    over ``step_count``, the step's whole count (``agg_count`` summed over all its micro-batches
    and ranks). Summed over the step's micro-batches and ranks, the shares are the step's loss."""
    mask = mask.to(x.dtype)
    return LOSS_AGGS[agg].per_row(x, mask, budget).sum() / step_count


class AdaptiveKLController:
    """Ziegler et al. (2019): move the KL coefficient so that the observed KL tracks a target.

    With ``target`` None the coefficient stays fixed.
    """

    def __init__(self, init_coef: float, target: float | None, horizon: int):
        self.value, self.target, self.horizon = init_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        if self.target is not None:
            error = max(-0.2, min(0.2, current_kl / self.target - 1.0))
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class RunningMoments:
    """Running mean and std of rewards (Chan et al.'s parallel update), for reward normalization."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 1e-8

    def update(self, x: torch.Tensor, reduce=None) -> None:
        """Fold in a batch; ``reduce`` (an all-reduce sum) makes the batch the global one over ranks."""
        xd = x.detach().to(torch.float64).flatten()
        # The count is made on the scores' device: stacking a host count with a GPU sum fails.
        stats = torch.stack([xd.new_tensor(float(xd.numel())), xd.sum(), (xd * xd).sum()])
        if reduce is not None:
            stats = reduce(stats)
        n, total_sum, total_sq = stats.tolist()
        if n == 0:
            return
        mean = total_sum / n
        var = max(total_sq / n - mean * mean, 0.0)
        delta = mean - self.mean
        total = self.count + n
        self.var = (self.var * self.count + var * n + delta**2 * self.count * n / total) / total
        self.mean += delta * n / total
        self.count = total

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.var**0.5 + 1e-8)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]
