"""Pure RL math: no modules, no engines, no config -- tensors in, tensors out.

Each function is tested against hand-worked numbers in tests/test_losses.py.

    python -m pytest tests/test_losses.py
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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


# ----------------------------------------------------------------------------------------- DPO
def sequence_logprob(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Sum of log p(token | prefix) over the tokens where ``loss_mask`` is 1 (the answer), per row.
    ``logits[t]`` predicts ``input_ids[t + 1]``; ``loss_mask`` is aligned with ``input_ids``."""
    logp = token_logprobs(logits[:, :-1], input_ids[:, 1:])
    return (logp * loss_mask[:, 1:].to(logp.dtype)).sum(-1)


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


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (ties count half); nan if one class."""
    pos, neg = scores[labels.bool()], scores[~labels.bool()]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    diff = pos.unsqueeze(1) - neg.unsqueeze(0)
    return ((diff > 0).float() + 0.5 * (diff == 0).float()).mean().item()


# ----------------------------------------------------------------------------------------- PPO
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool | None = True, reduce=None) -> torch.Tensor:
    """(x - mean) / std over the masked entries; masked-out entries come back as 0. ``shift_mean``
    False adds the mean back after scaling (TRL's convention); None only divides by the std.

    ``reduce`` sums a float64 tensor of statistics over the data-parallel ranks (the runner passes
    an all-reduce), so that every rank whitens with the global batch's mean and std, not its own.
    """
    m = mask.to(torch.float64)
    xd = x.to(torch.float64)
    stats = torch.stack([(xd * m).sum(), (xd * xd * m).sum(), m.sum()])
    if reduce is not None:
        stats = reduce(stats)
    count = stats[2].clamp(min=1)
    mean = stats[0] / count
    var = (stats[1] / count - mean * mean).clamp(min=0)
    if shift_mean is None:
        out = xd * torch.rsqrt(var + 1e-8)
    else:
        out = (xd - mean) * torch.rsqrt(var + 1e-8)
        if not shift_mean:
            out = out + mean
    return (out * m).to(x.dtype)


# On CPU the vocabulary-wide passes of the log-prob functions (cast, temperature, log-softmax,
# entropy, and their backward) run over this many bytes of fp32 logits at a time: over a few rows
# every pass reads what the last one wrote from cache, and no temporary is large enough to be a fresh
# mapping whose pages fault in; over a whole [batch, answer, vocabulary] tensor each pass streams it
# from memory (measured: docs/design-notes.md, "Half precision on CPU"). Chunking changes no value:
# each row's log-softmax and entropy is computed on its own. GPUs take the whole tensor at once: there
# each chunk would be kernel launches, not cache.
LOGPROB_CHUNK_BYTES = 1 << 19


def _row_chunks(logits: torch.Tensor, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(logits [..., vocabulary], their tokens [..., 1]) chunks of ``logits`` and ``tokens`` [...], in
    row-major order: ``LOGPROB_CHUNK_BYTES`` of fp32 logits each on CPU, one chunk elsewhere. Chunks
    are views: logits sliced along time (``logits[:, :-1]``) are taken sequence by sequence, not
    flattened, which would copy them whole."""
    if logits.device.type != "cpu":
        return [(logits, tokens.unsqueeze(-1))]
    if logits.dim() > 2 and not logits.is_contiguous():
        # unbind, not logits[b]: each indexing's backward writes a zero tensor of the whole logits, so B
        # of them made the backward grow with B squared; unbind's backward stacks the pieces once.
        return [c for rows, toks in zip(logits.unbind(0), tokens.unbind(0), strict=True)
                for c in _row_chunks(rows, toks)]
    n = max(1, LOGPROB_CHUNK_BYTES // (4 * logits.shape[-1]))
    rows, toks = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1, 1)
    return list(zip(rows.split(n), toks.split(n), strict=True))


def _scaled_logp(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(tokens[t] | ...) from logits aligned with tokens (logits[t] predicts tokens[t]).

    Divided by the sampling temperature: PPO's ratio must use the distribution that sampled.
    """
    picked = [_scaled_logp(rows, temperature).gather(-1, toks) for rows, toks in _row_chunks(logits, tokens)]
    return torch.cat(picked).view(tokens.shape)


def token_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                              entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logprobs`` and each position's entropy over the vocabulary, from one log-softmax.

    The vocabulary-wide passes (cast, scale, log-softmax) cost as much as the rest of the loss
    together; a second log-softmax for the entropy doubled them. The entropy carries a graph only
    with ``entropy_grad`` (an entropy bonus in the loss); otherwise it is measured for the log.
    """
    picked, entropy = [], []
    for rows, toks in _row_chunks(logits, tokens):
        logp = _scaled_logp(rows, temperature)
        picked.append(logp.gather(-1, toks))
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            lp = logp if entropy_grad else logp.detach()
            # A token at -inf (forbid_early_eos's eos) has p = 0 and adds 0; p * log p there is 0 * -inf =
            # NaN, in the value and in the gradient, so its log-prob is clamped to the lowest finite
            # value first (0 times it is 0, and the clamp passes it no gradient).
            entropy.append(-(lp.exp() * lp.clamp(min=torch.finfo(lp.dtype).min)).sum(-1))
    return torch.cat(picked).view(tokens.shape), torch.cat(entropy).view(tokens.shape)


def forbid_early_eos(logits: torch.Tensor, eos_id: int, min_new_tokens: int) -> torch.Tensor:
    """Answer logits [B, T, V] with eos at -inf on the first ``min_new_tokens`` answer positions: the
    distribution the sampler really draws from there (it never ends an answer that early), so that
    the old, new and reference log-probs and the KL are all of that one distribution."""
    if min_new_tokens <= 0:
        return logits
    early = torch.zeros(logits.shape[-2:], dtype=torch.bool, device=logits.device)
    early[:min_new_tokens, eos_id] = True
    return logits.masked_fill(early, float("-inf"))


def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.pow(2)


def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.expm1(-log_ratio) + log_ratio


# Per-token KL estimators of KL(policy || reference) from the sampled token's log ratio log r,
# r = p / p_ref (Schulman, "Approximating KL divergence", 2020): k1 = log r is unbiased but can be
# negative; k2 = (log r)^2 / 2 is biased, low variance, and its gradient is the KL's; k3 =
# (1/r - 1) + log r is unbiased and never negative. step.kl_estimator chooses by name.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) by the estimator named in KL_ESTIMATORS."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[estimator](logprobs - ref_logprobs)


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
