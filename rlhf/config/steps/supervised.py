"""The schemas of DeepSpeed-Chat's first two steps: SFT and the reward model."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.checks import _choice, _positive
from rlhf.config.steps.base import GreedyEvalStepConfig, StepConfig
from rlhf.errors import ConfigError


@dataclass
class SFTStepConfig(GreedyEvalStepConfig):
    name: str = "sft"
    # Tokens that carry the loss: the answer only (DeepSpeed-Chat masks nothing), or all tokens.
    loss_on: str = "answer"
    # Stop training once that held-out accuracy reaches this (seeds vary a lot at a fixed step count,
    # so an SFT start for PPO is better chosen by accuracy); null: never.
    stop_at_accuracy: float | None = None
    # Stop once the held-out loss has not improved on its best for this many evaluations in a row
    # (it has stopped learning); 0: never.
    early_stop_patience: int = 0
    # On that plateau while held-out accuracy by the rule is short of step.stop_at_accuracy's bar (a
    # rate too high for the task, on every untuned task measured), divide the learning rate by
    # step.plateau_lr_factor and go on, at most this many times, before the plateau ends the step;
    # 0: the plateau ends it at once.
    plateau_lr_drops: int = 2
    # What each such drop divides the learning rate by.
    plateau_lr_factor: float = 3.0
    # Train on each micro batch's rows packed end to end into one row without padding (position ids
    # restart per row, attention stays within each row): the same rows, loss and gradients, no compute
    # on padding. It pays only where padding is a large share of the tokens: with sdpa / eager attention
    # (the default, and CPU's) the per-row mask spans the whole packed row (bench/packing.py). LLaMA-type
    # models only: OPT builds its attention mask without the position ids.
    packing: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("step.loss_on", self.loss_on, ("answer", "all"))
        _positive("step.early_stop_patience", self.early_stop_patience, allow_zero=True)
        _positive("step.plateau_lr_drops", self.plateau_lr_drops, allow_zero=True)
        if self.plateau_lr_factor <= 1:
            raise ConfigError(f"step.plateau_lr_factor={self.plateau_lr_factor} must be above 1 (it divides the "
                              "learning rate); step.plateau_lr_drops=0 turns the drops off")
        if self.early_stop_patience and self.eval_every_steps == 0 and self.epochs == 1:
            raise ConfigError("step.early_stop_patience needs evaluations to compare: step.eval_every_steps > 0 "
                              "or step.epochs > 1 (every epoch ends with one)")
        if self.stop_at_accuracy is not None and (self.eval_accuracy_prompts == 0 or self.eval_every_steps == 0):
            raise ConfigError("step.stop_at_accuracy needs step.eval_accuracy_prompts > 0 and step.eval_every_steps > 0")

    def stops_when_ready(self) -> bool:
        return self.stop_at_accuracy is not None or bool(self.early_stop_patience)

    def check_run(self, cfg) -> None:
        if self.packing and cfg.parallel.sequence > 1:
            raise ConfigError(f"step.packing=true with parallel.sequence={cfg.parallel.sequence}: the attention over "
                              "a sliced sequence takes its causal order from the positions alone and would reach "
                              "across packed rows; set step.packing=false")


@dataclass
class RewardStepConfig(StepConfig):
    name: str = "reward"
    # Where a sequence's score is read: the last real token (eos; default), or DeepSpeed-Chat's
    # mean over the tokens from where chosen and rejected first differ.
    score_at: str = "last"
    # Coefficient of mean(chosen^2 + rejected^2): keeps scores near zero (unregularized they drift to
    # about +10/-5, and PPO's reward clipping at +-5 then erases the signal); 0 turns it off.
    score_regularizer: float = 0.0
    # Rule check: on the shipped synthetic task, answers scored per eval prompt (the right one and
    # near misses); with a user's data.rule, the eval pairs as that rule ranks them; 0 turns it off.
    rule_check_answers: int = 6
    # Stop once the held-out pairwise accuracy has not improved on its best for this many evaluations
    # in a row; 0: never.
    early_stop_patience: int = 0
    # Output the reward model of the evaluation with the best held-out pairwise accuracy (the last one
    # is kept in model_last/), not simply the last one.
    keep_best: bool = True
    # Pairs from the policy's own answers (InstructGPT's comparisons are of SFT samples): on this many
    # train prompts the policy samples step.policy_pairs_answers answers, the data's rule labels them,
    # and each distinct wrong one is added as rejected against a right one. 0: off; needs a rule.
    policy_pairs_prompts: int = 0
    # Answers sampled per prompt for those pairs.
    policy_pairs_answers: int = 4
    # The policy that samples them (a causal-LM checkpoint); unset: the model the reward model starts
    # from. A chain sets it to its SFT output.
    policy_path: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("step.score_at", self.score_at, ("last", "divergence"))
        _positive("step.policy_pairs_prompts", self.policy_pairs_prompts, allow_zero=True)
        _positive("step.policy_pairs_answers", self.policy_pairs_answers)
        _positive("step.early_stop_patience", self.early_stop_patience, allow_zero=True)
        _positive("step.score_regularizer", self.score_regularizer, allow_zero=True)
        _positive("step.rule_check_answers", self.rule_check_answers, allow_zero=True)

    def policy_pairs(self) -> tuple[int, int]:
        return self.policy_pairs_prompts, self.policy_pairs_answers
