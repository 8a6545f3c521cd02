"""Per-token math on logits and masks: masked means, whitening, log-probabilities and entropy in
memory-bounded chunks, the KL estimators.

    python -m pytest tests/test_losses.py
"""

from __future__ import annotations

from collections.abc import Callable

import torch


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
