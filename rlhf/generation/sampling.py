"""The sampling settings of one generation, as one object: built once from a step's config
(``Sampling.of(cfg.step)``) and handed through ``rlhf.generation.rollout.generate`` to ``rlhf.generation.decode.decode``,
so that the rollouts, the start check and the log-probs that score them read the same values.

    python -c "from rlhf.generation.sampling import Sampling; print(Sampling(8))"
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sampling:
    """How answers are drawn. The default is greedy (argmax, no minimum length), what evaluations use."""

    # Longest answer in tokens: decoding stops at eos or here.
    max_new_tokens: int
    # Shortest answer in tokens: eos is out of the distribution before it (sampler and log-probs alike).
    min_new_tokens: int = 0
    # Draw from softmax(logits / temperature); False: argmax on the raw logits.
    do_sample: bool = False
    temperature: float = 1.0
    # 0: off. Applied after the temperature, in transformers' order (top-k, then top-p).
    top_k: int = 0
    # 1.0: off.
    top_p: float = 1.0

    @classmethod
    def of(cls, step_cfg) -> Sampling:
        """The rollout sampling of a step config that carries these six keys (step.max_new_tokens, ...)."""
        return cls(step_cfg.max_new_tokens, step_cfg.min_new_tokens, step_cfg.do_sample, step_cfg.temperature,
                   step_cfg.top_k, step_cfg.top_p)

    @classmethod
    def coerce(cls, sampling: Sampling | int, settings: dict) -> Sampling:
        """``sampling`` itself, or from the short form ``(max_new_tokens, **settings)`` that tests and
        benches write; a Sampling with extra settings is refused, as two sources for one value."""
        if isinstance(sampling, Sampling):
            if settings:
                raise TypeError(f"sampling settings given twice: a Sampling and {sorted(settings)}")
            return sampling
        return cls(sampling, **settings)
