"""What every step's schema has, and what the plan, the memory pre-flight and the forecast ask of it."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from rlhf.config.checks import _positive
from rlhf.errors import ConfigError


# ---------------------------------------------------------------------------------------- step
@dataclass
class StepConfig:
    """Fields every step has; each step's schema extends it."""

    # Which runner executes the step (registry key in rlhf.runners).
    name: str = MISSING
    # Passes over the step's training rows.
    epochs: int = 1
    # Stop after this many optimizer steps; -1 runs all epochs.
    max_steps: int = -1
    # Rows per forward pass on one device.
    micro_batch_size_per_device: int = 8
    # Micro batches accumulated per optimizer step (derived from global_batch_size when that is set).
    gradient_accumulation_steps: int = 1
    # Rows per optimizer step over all ranks; when set, accumulation is derived from it. Either way the
    # validated config holds both, consistent: micro x accumulation x world size = global batch.
    global_batch_size: int | None = None
    # Rows per forward pass on one device during evaluation.
    eval_micro_batch_size_per_device: int = 32
    # Longest prompt + answer in tokens; longer rows are handled by data.on_bad_row.
    max_seq_len: int = 128
    # Log a metrics line every this many optimizer steps.
    log_every_steps: int = 10
    # Evaluate every this many optimizer steps as well as before training and after each epoch; 0: only those.
    eval_every_steps: int = 0
    # Recompute activations in the backward pass: less memory, about a third more compute.
    gradient_checkpointing: bool = False
    # Write the final model into the run directory.
    save_model: bool = True

    def __post_init__(self) -> None:
        for key in ("epochs", "micro_batch_size_per_device", "gradient_accumulation_steps",
                    "eval_micro_batch_size_per_device", "max_seq_len", "log_every_steps"):
            _positive(f"step.{key}", getattr(self, key))
        _positive("step.eval_every_steps", self.eval_every_steps, allow_zero=True)
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"step.max_steps={self.max_steps} must be -1 (all epochs) or positive")
        if self.global_batch_size is not None:
            _positive("step.global_batch_size", self.global_batch_size)

    def check_run(self, cfg) -> None:
        """Checks and derived values that need the rest of the run (cfg: an rlhf.config.Config whose
        batch arithmetic is done); raises ConfigError."""

    def builds(self, role: str) -> bool:
        """Whether this run of the step builds ``role`` of its spec (a setting can leave one out)."""
        return True

    # What the plan, the memory pre-flight and the forecast ask a step, answered by its schema (a step
    # without the setting gives the default here), so that none of them probes for a key.
    def offloads(self, role: str) -> bool:
        """Whether the frozen ``role`` lives in host memory (step.offload_<role>)."""
        return bool(getattr(self, f"offload_{role}", False))

    def greedy_eval_prompts(self) -> int:
        """Held-out prompts answered greedily and judged by the rule at each evaluation (0: none)."""
        return 0

    def answer_budget(self) -> int | None:
        """The longest answer it generates for a rule to judge (step.max_new_tokens); None where it
        generates none."""
        return None

    def cut_answers_setting(self) -> str | None:
        """What answers cut at the budget get (step.truncated_answers); None where the step has no say."""
        return None

    def stops_when_ready(self) -> bool:
        """Whether a readiness rule (an accuracy bar, a plateau) can end it before its cap."""
        return bool(getattr(self, "early_stop_patience", 0))

    def policy_pairs(self) -> tuple[int, int]:
        """(prompts, answers per prompt) of the pairs drawn from the policy's own answers before training."""
        return 0, 0

    def zero3_mode(self) -> tuple[str, bool]:
        """How a ZeRO-3 generate call holds the model (step.zero3_generation), and whether the step has
        that key: a step without it (SFT's accuracy eval) lets the pre-flight choose (auto)."""
        return "auto", False

    def generation_tp(self) -> int:
        """Ranks per tensor-parallel generation group (step.generation_tp_size; 0: a node's devices)."""
        return 0


@dataclass
class GreedyEvalStepConfig(StepConfig):
    """A step whose policy is also judged by greedy answers to held-out prompts (SFT, DPO)."""

    # Held-out prompts answered greedily and scored by the data's rule (data.rule, or the shipped
    # tasks' rule on their prompts), per half: a stop rule reads the first half of the distinct eval
    # prompts at each eval (select/accuracy), the reported figure comes from the second, before
    # training and of the output (eval/accuracy); 0: off.
    eval_accuracy_prompts: int = 0
    # Longest greedy answer in that check, in tokens.
    max_new_tokens: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("step.eval_accuracy_prompts", self.eval_accuracy_prompts, allow_zero=True)
        _positive("step.max_new_tokens", self.max_new_tokens)

    def greedy_eval_prompts(self) -> int:
        return self.eval_accuracy_prompts

    def answer_budget(self) -> int | None:
        return self.max_new_tokens if self.eval_accuracy_prompts else None
