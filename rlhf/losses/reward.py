"""Reward-model losses: the pairwise loss at the answers' last tokens or where they diverge, its
regulariser, pairwise accuracy and AUC. Tested against hand-worked numbers in tests/test_losses.py.

    python -m pytest tests/test_losses.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def end_indices(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row, from the mask alone.

    Works for left and right padding and whatever the pad id is: DeepSpeed-Chat searched for the
    pad id, which finds the wrong end when pad == eos (OPT) or when there is no pad token (LLaMA).
    A row with no real token gets index 0.
    """
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


def gather_at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[b, index[b]] for each row b."""
    return values.gather(-1, index.unsqueeze(-1)).squeeze(-1)


def pairwise_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry loss -log sigmoid(chosen - rejected), mean over pairs.

    logsigmoid, not log(sigmoid()): DeepSpeed-Chat's first version overflowed for large margins.
    """
    return -F.logsigmoid(chosen - rejected).mean()


def divergence_mask(chosen_ids: torch.Tensor, rejected_ids: torch.Tensor, chosen_mask: torch.Tensor,
                    rejected_mask: torch.Tensor) -> torch.Tensor:
    """Positions from where chosen and rejected first differ to the later of their two ends.

    DeepSpeed-Chat's averaged variant compares the per-token scores over exactly these positions.
    Both rows must be right-padded to the same width so that their prompts line up.
    """
    differs = (chosen_ids != rejected_ids) | (chosen_mask != rejected_mask)
    width = chosen_ids.shape[-1]
    positions = torch.arange(width, device=chosen_ids.device).expand_as(chosen_ids)
    first = torch.where(differs, positions, width).min(-1).values
    last = torch.maximum(end_indices(chosen_mask), end_indices(rejected_mask))
    return (positions >= first.unsqueeze(-1)) & (positions <= last.unsqueeze(-1))


def pairwise_loss_divergence(chosen_values: torch.Tensor, rejected_values: torch.Tensor,
                             mask: torch.Tensor) -> torch.Tensor:
    """Per pair, the mean over ``mask`` positions of -log sigmoid(chosen_t - rejected_t); mean over pairs."""
    per_token = -F.logsigmoid(chosen_values - rejected_values) * mask
    return (per_token.sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def score_regularizer(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """mean(chosen^2 + rejected^2): keeps scores near zero so PPO's reward clipping does not erase them."""
    return (chosen.pow(2) + rejected.pow(2)).mean()


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    return (chosen > rejected).float().mean()


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (ties count half); nan if one class."""
    pos, neg = scores[labels.bool()], scores[~labels.bool()]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    diff = pos.unsqueeze(1) - neg.unsqueeze(0)
    return ((diff > 0).float() + 0.5 * (diff == 0).float()).mean().item()
