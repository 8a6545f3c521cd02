"""Preference losses on log-probabilities (DPO and its variants, SimPO, ORPO, KTO) and the registry a
step spec's `loss` names. A new preference method is a function here and one PREFERENCE_LOSSES entry.

    python -m pytest tests/test_losses.py
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


# ----------------------------------------------------------------------------------------- DPO
def sequence_logprob(next_logp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of log p(token | prefix) over the tokens where ``loss_mask`` is 1 (the answer), per row.
    ``next_logp[t]`` is the log-prob of the token at t + 1 (its last column predicts nothing);
    ``loss_mask`` is aligned with the tokens."""
    return (next_logp[:, :-1] * loss_mask[:, 1:].to(next_logp.dtype)).sum(-1)


def dpo_sigmoid(margin: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta * margin); with label smoothing eps > 0 the
    conservative variant (Mitchell 2023) that trusts each label with probability 1 - eps."""
    z = beta * margin
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def dpo_ipo(margin: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """IPO (Azar et al. 2023): (margin - 1 / (2 beta))^2, a bounded target instead of a push to infinity."""
    return (margin - 1 / (2 * beta)).pow(2)


def dpo_robust(margin: torch.Tensor, beta: float, label_smoothing: float) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024): unbiased under labels flipped with probability eps."""
    z = beta * margin
    return (-(1 - label_smoothing) * F.logsigmoid(z) + label_smoothing * F.logsigmoid(-z)) / (1 - 2 * label_smoothing)


# step.loss of the DPO step chooses by name. Each takes the per-pair margin (policy log-ratio of
# chosen over rejected minus the reference's) and returns the per-pair loss.
DPO_LOSSES: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "sigmoid": dpo_sigmoid, "ipo": dpo_ipo, "robust": dpo_robust}


def answer_nll(logprob_sum: torch.Tensor, answer_tokens: torch.Tensor) -> torch.Tensor:
    """Mean over pairs of the chosen answers' per-token negative log-likelihood: RPO's (Pang et al.
    2024) term beside DPO, which keeps the chosen answers likely while the margin grows."""
    return (-logprob_sum / answer_tokens.clamp(min=1)).mean()


def simpo(chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, chosen_len: torch.Tensor,
          rejected_len: torch.Tensor, beta: float, gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SimPO (Meng, Xia and Chen 2024, eq. 6): -log sigmoid(beta / |y_w| * log pi(y_w|x) - beta / |y_l| *
    log pi(y_l|x) - gamma), per pair, with the implicit rewards beta / |y| * log pi(y|x): the average
    log-likelihood of an answer (what generation ranks by) with no reference model, and gamma a target
    margin between the rewards. ``*_logp``: summed answer log-probs; ``*_len``: answer tokens."""
    chosen = beta * chosen_logp / chosen_len
    rejected = beta * rejected_logp / rejected_len
    return -F.logsigmoid(chosen - rejected - gamma), chosen, rejected


def dpo_margin(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor) -> torch.Tensor:
    """(log pi(y_w) - log pi(y_l)) - (log ref(y_w) - log ref(y_l)), per pair."""
    return (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)


# ------------------------------------------------------------------------- preference methods
@dataclass
class PreferenceBatch:
    """What a preference loss reads of a micro batch of n rows, two sequences each: first the n rows'
    answers (a pair's chosen one; an unpaired row's own), then their partners (a pair's rejected
    answer; an unpaired row's mismatched answer, another prompt's)."""

    # Summed answer log-probs under the policy, [2n].
    logp: torch.Tensor
    # Answer tokens (eos included), [2n].
    tokens: torch.Tensor
    # Summed answer log-probs under the frozen reference, [2n]; None for a reference-free method.
    ref_logp: torch.Tensor | None = None
    # Unpaired rows: 1.0 for a desirable answer, 0.0 for an undesirable one, [n]; None for pairs.
    desirable: torch.Tensor | None = None


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' answers' and their partners' figures of a preference batch's sequences."""
    return x[: len(x) // 2], x[len(x) // 2:]


@dataclass
class PreferenceResult:
    """A preference loss's output: the loss to backpropagate (mean over the rows), the implicit
    rewards of the chosen (desirable) and of the rejected (undesirable) answers, per row 1 where
    its reward sits on the right side (of its pair's other answer, or of the reference point), 0.5 on
    a tie (at the start of a method with a reference every reward is 0: accuracy starts at 0.5), and
    the policy's summed log-probs of the chosen (desirable) answers alone."""

    loss: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor
    right: torch.Tensor
    chosen_logp: torch.Tensor


def _right(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    return (chosen > rejected).float() + 0.5 * (chosen == rejected).float()


def dpo_step(b: PreferenceBatch, step) -> PreferenceResult:
    """DPO and its variants (step.loss of DPO_LOSSES), plus step.nll_coef x the chosen answers' NLL (RPO);
    implicit rewards beta * log(pi / ref)."""
    (pc, pr), (rc, rr) = halves(b.logp), halves(b.ref_logp)
    chosen, rejected = step.beta * (pc - rc), step.beta * (pr - rr)
    loss = DPO_LOSSES[step.loss](dpo_margin(pc, pr, rc, rr), step.beta, step.label_smoothing).mean()
    if step.nll_coef:
        loss = loss + step.nll_coef * answer_nll(pc, halves(b.tokens)[0])
    return PreferenceResult(loss, chosen.detach(), rejected.detach(), _right(chosen, rejected).detach(), pc.detach())


def _length_normalised_step(loss_fn, b: PreferenceBatch, *settings) -> PreferenceResult:
    """A reference-free loss over summed answer log-probs and answer lengths (SimPO, ORPO):
    ``loss_fn(chosen_logp, rejected_logp, chosen_len, rejected_len, *settings)`` gives the per-pair loss
    and the two rewards."""
    (pc, pr), (tc, tr) = halves(b.logp), halves(b.tokens.to(b.logp.dtype))
    loss, chosen, rejected = loss_fn(pc, pr, tc, tr, *settings)
    return PreferenceResult(loss.mean(), chosen.detach(), rejected.detach(), _right(chosen, rejected).detach(),
                            pc.detach())


def simpo_step(b: PreferenceBatch, step) -> PreferenceResult:
    """SimPO (simpo) with step.beta and step.gamma."""
    return _length_normalised_step(simpo, b, step.beta, step.gamma)


def log_odds(mean_logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of p = exp(mean_logp), stable near p = 1 (p is capped just below it)."""
    x = mean_logp.clamp(max=-1e-6)
    # log(1 - e^x): -expm1 is accurate where e^x is near 1, log1p where it is small.
    return x - torch.where(x > -0.6931, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo(chosen_logp: torch.Tensor, rejected_logp: torch.Tensor, chosen_len: torch.Tensor,
         rejected_len: torch.Tensor, lam: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ORPO (Hong, Lee and Thorne 2024, eq. 6-7), per pair: the chosen answer's NLL per token plus lam x
    -log sigmoid(log odds(y_w|x) - log odds(y_l|x)), odds = p / (1 - p) with p the length-normalised
    sequence probability exp(log pi(y|x) / |y|); no reference model. Also returns the rewards
    lam x log p of each answer (their order is the log odds' order). ``*_logp``: summed answer
    log-probs; ``*_len``: answer tokens."""
    chosen, rejected = chosen_logp / chosen_len, rejected_logp / rejected_len
    ratio = -F.logsigmoid(log_odds(chosen) - log_odds(rejected))
    return -chosen + lam * ratio, lam * chosen, lam * rejected


def orpo_step(b: PreferenceBatch, step) -> PreferenceResult:
    """ORPO (orpo) with step.lam."""
    return _length_normalised_step(orpo, b, step.lam)


def kto(logratio: torch.Tensor, desirable: torch.Tensor, z0: torch.Tensor, beta: float, desirable_weight: float,
        undesirable_weight: float) -> torch.Tensor:
    """KTO (Ethayarajh et al. 2024, eq. 8), per row: lambda_D (1 - sigmoid(beta (r - z0))) for a
    desirable answer, lambda_U (1 - sigmoid(beta (z0 - r))) for an undesirable one, r = log pi(y|x) -
    log ref(y|x) of the answer and z0 the reference point (kto_reference_point)."""
    d = desirable.to(logratio.dtype)
    good = desirable_weight * (1 - torch.sigmoid(beta * (logratio - z0)))
    bad = undesirable_weight * (1 - torch.sigmoid(beta * (z0 - logratio)))
    return d * good + (1 - d) * bad


def kto_reference_point(mismatched_logratio: torch.Tensor) -> torch.Tensor:
    """KTO's z0: the policy's KL to the reference estimated by the mean log-ratio of answers to other
    prompts (mismatched pairs), over all ranks where several train, clamped at 0 (a KL is not negative)
    and detached: it sets the point that rewards are judged against, it is not trained."""
    total = torch.stack([mismatched_logratio.detach().float().sum(),
                         torch.tensor(float(len(mismatched_logratio)), device=mismatched_logratio.device)])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).clamp(min=0).to(mismatched_logratio.dtype)


def kto_step(b: PreferenceBatch, step) -> PreferenceResult:
    """KTO (kto) with step.beta, step.desirable_weight and step.undesirable_weight on unpaired rows; the
    rewards beta * r of the desirable and of the undesirable answers, right where beta (r - z0) has the
    label's sign."""
    (own, partner) = halves(b.logp - b.ref_logp)
    z0 = kto_reference_point(partner)
    loss = kto(own, b.desirable, z0, step.beta, step.desirable_weight, step.undesirable_weight)
    reward, good = (step.beta * own).detach(), b.desirable.bool()
    side = reward - step.beta * z0
    right = _right(torch.where(good, side, -side), torch.zeros_like(side))
    # A row's own answer is desirable or undesirable: the chosen figures are the desirable rows'.
    return PreferenceResult(loss.mean(), reward[good], reward[~good], right, halves(b.logp)[0].detach()[good])


# A preference method's loss over a micro batch, given the step's settings; a step spec's `loss` names one.
PREFERENCE_LOSSES: dict[str, Callable[[PreferenceBatch, object], PreferenceResult]] = {
    "dpo": dpo_step, "simpo": simpo_step, "orpo": orpo_step, "kto": kto_step}
