"""The preference methods' schemas: DPO, SimPO, ORPO, KTO (a new method adds its schema here)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.checks import _choice, _positive
from rlhf.config.steps.base import GreedyEvalStepConfig
from rlhf.errors import ConfigError


@dataclass
class PreferenceStepConfig(GreedyEvalStepConfig):
    """A preference method's step (rlhf.runners.preference): the policy learns from the reward part's pairs."""

    # Train the policy without dropout, as the reference is scored: with dropout on, the policy's
    # log-ratios are noisy and biased and the margin is not 0 at the start. false keeps model.dropout
    # (the checkpoint's own where that is null) in the policy.
    disable_dropout: bool = True


@dataclass
class ReferenceStepConfig(PreferenceStepConfig):
    """A preference method with a frozen reference model (the SFT start)."""

    # The reference's log-probs: precompute (one pass before training, then the reference model is
    # freed: no second model during training) or online (the reference scores every batch).
    reference_logprobs: str = "precompute"
    # Keep the frozen reference's parameters in host memory (ZeRO-3 offload).
    offload_reference: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("step.reference_logprobs", self.reference_logprobs, ("precompute", "online"))


@dataclass
class DPOStepConfig(ReferenceStepConfig):
    name: str = "dpo"
    # Loss from rlhf.losses.DPO_LOSSES: sigmoid (DPO; the conservative variant with label_smoothing > 0),
    # ipo, or robust (needs label_smoothing > 0).
    loss: str = "sigmoid"
    # Strength of the pull toward the reference: DPO's beta (IPO's tau). Higher stays closer.
    beta: float = 0.1
    # The probability that a pair's label is wrong (conservative and robust DPO); 0: plain DPO.
    label_smoothing: float = 0.0
    # Weight of the chosen answers' NLL added to the loss (RPO); 0: off. DPO alone lowers the chosen
    # answers' likelihood too (only the margin is pushed) and greedy answers can get worse.
    nll_coef: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        from rlhf.losses import DPO_LOSSES

        _choice("step.loss", self.loss, tuple(DPO_LOSSES))
        _positive("step.beta", self.beta)
        _positive("step.nll_coef", self.nll_coef, allow_zero=True)
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"step.label_smoothing={self.label_smoothing} must be in [0, 0.5): it is the "
                              "probability that a pair's label is flipped")
        if self.loss == "robust" and self.label_smoothing == 0:
            raise ConfigError("step.loss=robust needs step.label_smoothing > 0 (at 0 it is plain DPO: step.loss=sigmoid)")


@dataclass
class SimPOStepConfig(PreferenceStepConfig):
    name: str = "simpo"
    # Scale of the implicit reward beta / |y| * log pi(y|x) (Meng et al. 2024 use 2.0-2.5).
    beta: float = 2.0
    # Target margin between the chosen and rejected rewards (the paper's gamma, 0.5-1.5).
    gamma: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("step.beta", self.beta)
        _positive("step.gamma", self.gamma, allow_zero=True)


@dataclass
class ORPOStepConfig(PreferenceStepConfig):
    name: str = "orpo"
    # Weight of the odds-ratio term beside the chosen answers' NLL (the paper's lambda, 0.1-0.25).
    lam: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("step.lam", self.lam, allow_zero=True)


@dataclass
class KTOStepConfig(ReferenceStepConfig):
    name: str = "kto"
    # Scale of the reward beta * log(pi / ref) in the loss (the paper's beta). Higher stays closer.
    beta: float = 0.1
    # Weight of the desirable rows' loss (lambda_D).
    desirable_weight: float = 1.0
    # Weight of the undesirable rows' loss (lambda_U); the paper keeps lambda_D x desirable rows /
    # (lambda_U x undesirable rows) in [1, 4/3].
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("beta", "desirable_weight", "undesirable_weight"):
            _positive(f"step.{key}", getattr(self, key))
