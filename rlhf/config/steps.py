"""The steps' schemas and the step registry STEPS: one StepSpec per step owns everything keyed by a
step's name (schema and chain delta, runner kind, rows, roles, sweep objective, summary figures,
chain inputs, readiness checks, preference loss). Nothing outside this module branches on a step's
name: adding a preference method is its loss in rlhf.losses.PREFERENCE_LOSSES, one schema and
STEPS entry here, and one conf/step/<name>.yaml.

    python -c "from rlhf.config import STEPS"   # used through rlhf.config; no command of its own
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

from omegaconf import MISSING

from rlhf.config.checks import _choice, _positive
from rlhf.config.groups import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RoleConfig,
    ZeroConfig,
)
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


@dataclass
class PPOStepConfig(StepConfig):
    name: str = "ppo"
    # Prompts each device generates answers for per PPO step (the rollout batch).
    rollout_batch_size_per_device: int = 64
    # Rollouts per generate call and per scoring forward (bounds the KV cache and the scoring logits); 0: the
    # whole rollout batch at once.
    generation_batch_size_per_device: int = 0
    # Decode rollouts with the static-shape token step (rlhf.generation.decode._StaticSteps): on a GPU recorded
    # once per generate call as a CUDA graph and replayed per token, the all-ended check every 16
    # tokens; the default loop's distribution (its log-probs match a plain forward as closely). On one
    # H200 the PPO step ran 1.52x faster (docs/benchmarks.md). On CPU it runs without a graph (every
    # token attends over the whole cache: about the default loop's speed at short answers, more as
    # answers grow).
    decode_graph: bool = False
    # Answers sampled per prompt (> 1 for group-normalized advantages).
    samples_per_prompt: int = 1
    # Passes of PPO updates over each rollout batch.
    ppo_epochs: int = 1
    # Longest prompt in tokens; longer prompts are dropped and counted.
    max_prompt_len: int = 32
    # Longest answer in tokens (generation stops at eos or here).
    max_new_tokens: int = 8
    # Shortest answer in tokens (eos is suppressed before it); 0: none. Benchmarks use it for fixed lengths.
    min_new_tokens: int = 0
    # Sample during rollouts; PPO refuses false (see __post_init__): its log-probs, ratio and KL are of
    # softmax(logits / temperature), which argmax answers are not drawn from.
    do_sample: bool = True
    # Sampling temperature; log-probs are computed on logits / temperature to match the sampler.
    temperature: float = 0.7
    # Where PPO's old log-probs (the ratio's denominator and the KL's policy term) come from: rollout,
    # the logits that sampled each token (the cached one-token decode forwards); recompute, a forward of
    # the actor over the finished sequences, the kind of forward the new and reference log-probs come
    # from (DeepSpeed-Chat's, TRL's, OpenRLHF's and veRL's way: one more forward per step); auto:
    # recompute in bf16/fp16, where the two kinds of forward round differently and the ratio would start
    # away from 1, rollout in fp32, where they agree to rounding. The run's choice is in its final figures.
    old_logprobs: str = "auto"
    # Nucleus sampling mass; 1.0 is off. PPO refuses other values (see __post_init__).
    top_p: float = 1.0
    # Top-k sampling; 0 is off. PPO refuses other values (see __post_init__).
    top_k: int = 0
    # How per-token losses become the step's loss (rlhf.losses.LOSS_AGGS: token_mean,
    # seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm), over the whole optimizer step;
    # null: the advantage estimator's paper's (rlhf.losses.ESTIMATORS).
    loss_agg: str | None = None
    # Answers cut at max_new_tokens without an eos: keep (train on them like any other), penalty (subtract
    # truncated_penalty from their score) or mask (left out of the loss, DAPO's overlong filtering).
    truncated_answers: str = "keep"
    # What step.truncated_answers=penalty subtracts from a truncated answer's score.
    truncated_penalty: float = 1.0
    # KL penalty coefficient against the reference model (initial value when adaptive).
    kl_coef: float = 0.05
    # Per-token KL estimator from rlhf.losses.KL_ESTIMATORS (k1, k2, k3); null: the advantage
    # estimator's paper's choice (rlhf.losses.ESTIMATORS).
    kl_estimator: str | None = None
    # Where the KL to the reference enters: reward (a per-token penalty in the reward, InstructGPT) or
    # loss (a term of the policy loss, GRPO); null: the advantage estimator's paper's choice.
    kl_in: str | None = None
    # Target KL for the adaptive controller; null keeps kl_coef fixed.
    kl_target: float | None = None
    # Adaptive controller horizon, in rollouts.
    kl_horizon: int = 10000
    # Clip the sequence score to +-this before it becomes a reward; 0 turns clipping off.
    reward_clip: float = 5.0
    # Normalize scores by running mean and std before clipping.
    reward_normalize: bool = False
    # Weight of the reward model's score in the reward (0: no reward model is loaded).
    reward_model_weight: float = 1.0
    # A reward function added to the score (null: none): rule (the data's rule, data.rule), a name from
    # rlhf.rewards.REWARD_FNS, or your own 'package.module:function' taking (prompt, answer) -> float.
    reward_fn: str | None = None
    # Weight of reward_fn's value.
    reward_fn_weight: float = 1.0
    # Advantage estimator from rlhf.losses.ESTIMATORS: gae (with a critic), or the critic-free grpo,
    # dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline (no critic is built).
    advantage_estimator: str = "gae"
    # GAE discount.
    gamma: float = 1.0
    # GAE lambda.
    lam: float = 0.95
    # Whiten GAE's advantages over the rollout batch (the critic-free estimators normalize by their own
    # definition: per group, or over the batch for REINFORCE++).
    whiten_advantages: bool = True
    # PPO policy clip range (both sides, unless step.clip_eps_low / step.clip_eps_high say otherwise).
    clip_range: float = 0.2
    # The policy objective (rlhf.losses.POLICY_LOSSES): ppo (the clipped surrogate), gspo (its
    # sequence-level ratio and clip, Zheng et al. 2025) or cispo (a clipped, detached importance
    # weight on a REINFORCE term, MiniMax-M1); each works with every advantage estimator.
    policy_loss: str = "ppo"
    # The ratio's lower clip, 1 - this; null: step.clip_range for ppo, the objective's paper's otherwise
    # (gspo 3e-4; cispo 1.0, no lower bound on its weight).
    clip_eps_low: float | None = None
    # The ratio's upper clip, 1 + this; null: as clip_eps_low (gspo 4e-4, cispo 4.0). DAPO's clip-higher
    # sets it above the lower one (0.28 against 0.2).
    clip_eps_high: float | None = None
    # Correct the update for the gap between the sampler's log-probs and a training forward's of the same
    # weights (a rollout decoded in another precision or by another kernel): none, tis (weights capped at
    # the cap), mis (answers whose ratio exceeds the cap dropped), icepop (tokens outside [low, cap]
    # dropped); needs step.old_logprobs recompute (auto chooses it). The gap is logged as
    # rollout/sampler_logprob_diff.
    rollout_correction: str = "none"
    # IcePop's lower bound on a token's ratio; null: 0.5.
    rollout_correction_low: float | None = None
    # The ratio's cap (TIS's C, MIS's threshold, IcePop's upper bound); null: 2.0 for tis and mis, 5.0 for icepop.
    rollout_correction_cap: float | None = None
    # DAPO's dynamic sampling: drop the prompts whose answers all scored the same (no signal for a
    # group advantage) and draw more prompt batches until the rollout batch is full of prompts with a signal.
    dynamic_sampling: bool = False
    # Prompt batches one PPO step may draw under step.dynamic_sampling; short of a full batch after
    # them, the rest is filled with dropped prompts (advantage 0) and counted in rollout/dynamic_fill_frac.
    dynamic_sampling_max_draws: int = 10
    # DAPO's soft overlong punishment: the last this-many tokens before step.max_new_tokens take a penalty
    # in the score, rising linearly to step.overlong_penalty_factor at the budget; 0: off.
    overlong_buffer: int = 0
    # The soft overlong penalty at the budget (subtracted from the score).
    overlong_penalty_factor: float = 1.0
    # Value clip range.
    value_clip_range: float = 0.2
    # Weight of the value loss (the critic has its own optimizer; this scales its loss).
    vf_coef: float = 1.0
    # Entropy bonus coefficient; 0 is off.
    entropy_coef: float = 0.0
    # Weight of the pretraining (ptx) LM loss on the SFT part of the blend; 0 is off.
    ptx_coef: float = 0.0
    # Critic learning rate (the actor's is optim.lr).
    critic_lr: float = 5e-4
    # Decay of an exponential moving average of the actor, saved as model_ema; 0 is off.
    ema_decay: float = 0.0
    # Keep the frozen reference model's parameters in host memory (ZeRO-3 offload).
    offload_reference: bool = False
    # Keep the frozen reward model's parameters in host memory (ZeRO-3 offload).
    offload_reward: bool = False
    # Held-out prompts scored by greedy decoding (with the rule, where it applies), per half: keeping
    # the best actor and the hacking warning read the first half at each eval (select/*), the figures
    # reported (before, after, the output's) come from the second (eval/*); 0: off.
    eval_prompts: int = 256
    # Where a rule scores the held-out prompts: the output model is the actor of the evaluation with the
    # best held-out accuracy (the last actor is kept in model_last/), not simply the last one -- PPO
    # against a learned reward model can lose accuracy late while its reward still rises.
    keep_best: bool = True
    # Stop once this many evaluations in a row have not beaten the best held-out rule accuracy (the
    # select half, which keep_best picks by); 0: never. Needs a rule and step.eval_every_steps > 0.
    early_stop_patience: int = 0
    # ZeRO-3 generation: gathering the whole actor once per generate call is far faster than ZeRO-3's
    # layer-by-layer gathers (repeated for every token), but needs the full actor on each device; tp
    # gathers it into tensor-parallel slices over groups of step.generation_tp_size ranks, which decode
    # their prompts together (DeepSpeed-Chat's hybrid engine with --inference_tp_size; rlhf/generation/shards.py).
    # auto: gather when the memory pre-flight says it fits, else tp where the model splits and it fits,
    # else layerwise (rlhf.preflight.memory.generation_gathering); gather; tp; layerwise.
    zero3_generation: str = "auto"
    # Ranks per tensor-parallel generation group under zero3_generation tp (or auto choosing it):
    # consecutive ranks, so a node's devices when it divides them; 0: hardware.devices_per_node.
    generation_tp_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("step.zero3_generation", self.zero3_generation, ("auto", "gather", "tp", "layerwise"))
        if self.generation_tp_size < 0:
            raise ConfigError(f"step.generation_tp_size={self.generation_tp_size} must be >= 0 (0: the node's devices)")
        _choice("step.old_logprobs", self.old_logprobs, ("auto", "rollout", "recompute"))
        _choice("step.truncated_answers", self.truncated_answers, ("keep", "penalty", "mask"))
        for key in ("rollout_batch_size_per_device", "samples_per_prompt", "ppo_epochs", "max_prompt_len",
                    "max_new_tokens", "temperature", "top_p", "kl_horizon", "critic_lr"):
            _positive(f"step.{key}", getattr(self, key))
        for key in ("kl_coef", "reward_clip", "reward_model_weight", "reward_fn_weight", "gamma", "lam",
                    "clip_range", "value_clip_range", "vf_coef", "entropy_coef", "ptx_coef", "ema_decay",
                    "top_k", "eval_prompts", "min_new_tokens", "generation_batch_size_per_device", "truncated_penalty"):
            _positive(f"step.{key}", getattr(self, key), allow_zero=True)
        _positive("step.early_stop_patience", self.early_stop_patience, allow_zero=True)
        if self.early_stop_patience and not self.eval_every_steps:
            raise ConfigError("step.early_stop_patience needs evaluations to compare: set step.eval_every_steps > 0 "
                              "or step.early_stop_patience=0")
        from rlhf.losses import ESTIMATORS, KL_ESTIMATORS, KL_PLACES, LOSS_AGGS, POLICY_LOSSES, ROLLOUT_CORRECTIONS

        _choice("step.advantage_estimator", self.advantage_estimator, tuple(ESTIMATORS))
        estimator = ESTIMATORS[self.advantage_estimator]
        # Derived, not configured: unset, the KL goes where the estimator's paper put it.
        if self.kl_estimator is None:
            self.kl_estimator = estimator.kl_estimator
        if self.kl_in is None:
            self.kl_in = estimator.kl_in
        _choice("step.policy_loss", self.policy_loss, tuple(POLICY_LOSSES))
        objective = POLICY_LOSSES[self.policy_loss]
        if objective.loss_agg == "seq_mean_token_mean" and self.loss_agg not in (None, objective.loss_agg):
            raise ConfigError(f"step.policy_loss={self.policy_loss} clips one ratio per answer and averages over "
                              f"answers (seq_mean_token_mean); step.loss_agg={self.loss_agg} would weigh answers by "
                              "length: leave step.loss_agg unset")
        if self.loss_agg is None:
            self.loss_agg = objective.loss_agg or estimator.loss_agg
        _choice("step.loss_agg", self.loss_agg, tuple(LOSS_AGGS))
        low, high = objective.clip or (self.clip_range, self.clip_range)
        self.clip_eps_low = low if self.clip_eps_low is None else self.clip_eps_low
        self.clip_eps_high = (self.clip_eps_low if objective.clip is None else high) if self.clip_eps_high is None \
            else self.clip_eps_high
        _positive("step.clip_eps_low", self.clip_eps_low, allow_zero=True)
        _positive("step.clip_eps_high", self.clip_eps_high, allow_zero=True)
        if self.clip_eps_low > 1.0:
            raise ConfigError(f"step.clip_eps_low={self.clip_eps_low}: the lower clip 1 - clip_eps_low would be "
                              "negative; at most 1.0 (no lower bound)")
        _choice("step.rollout_correction", self.rollout_correction, ("none", *ROLLOUT_CORRECTIONS))
        if self.rollout_correction != "none":
            default_low, default_cap = ROLLOUT_CORRECTIONS[self.rollout_correction]
            self.rollout_correction_low = default_low if self.rollout_correction_low is None \
                else self.rollout_correction_low
            self.rollout_correction_cap = default_cap if self.rollout_correction_cap is None \
                else self.rollout_correction_cap
            if not 0 <= self.rollout_correction_low < 1 <= self.rollout_correction_cap:
                raise ConfigError(f"step.rollout_correction_low={self.rollout_correction_low} and "
                                  f"step.rollout_correction_cap={self.rollout_correction_cap} must bracket 1 "
                                  "(low in [0, 1), cap >= 1): a ratio of 1 is a token sampled as the trainer sees it")
            if self.old_logprobs == "rollout":
                raise ConfigError(f"step.rollout_correction={self.rollout_correction} with step.old_logprobs=rollout: "
                                  "the correction weighs the sampler's log-probs against a training forward's, and "
                                  "with old_logprobs=rollout there is none; set step.old_logprobs=recompute (or auto)")
        if self.dynamic_sampling and self.samples_per_prompt < 2:
            raise ConfigError("step.dynamic_sampling drops the prompts whose answers all scored the same: it needs "
                              f"step.samples_per_prompt >= 2 (got {self.samples_per_prompt})")
        _positive("step.dynamic_sampling_max_draws", self.dynamic_sampling_max_draws)
        if not 0 <= self.overlong_buffer <= self.max_new_tokens:
            raise ConfigError(f"step.overlong_buffer={self.overlong_buffer} must be in [0, step.max_new_tokens="
                              f"{self.max_new_tokens}]: it counts the tokens before the budget that take a penalty")
        _positive("step.overlong_penalty_factor", self.overlong_penalty_factor, allow_zero=True)
        if not self.do_sample:
            raise ConfigError(
                "step.do_sample=false: PPO scores each rollout as a draw of softmax(logits / step.temperature), which "
                "argmax answers are not, and with grpo, dr_grpo or rloo every answer to a prompt is the same (every "
                "advantage 0); set step.do_sample=true (a lower step.temperature gives more focused rollouts)")
        if self.top_k or self.top_p < 1.0:
            # Top-k / top-p sample from a truncated distribution whose support is each model's own: a
            # token the actor drew can lie outside the reference's top-k, where its probability is 0 and
            # the KL infinite; scoring with the full softmax instead biases the gradient and the KL.
            raise ConfigError(
                f"step.top_k={self.top_k} / step.top_p={self.top_p}: PPO samples the full distribution (top_k=0, "
                "top_p=1.0) so that the old, new and reference log-probs are of the distribution that drew the "
                "answers; a truncated one has a support of its own per model (a drawn token can have probability "
                "0 under the reference: an infinite KL). Lower step.temperature for more focused rollouts")
        _choice("step.kl_estimator", self.kl_estimator, tuple(KL_ESTIMATORS))
        _choice("step.kl_in", self.kl_in, KL_PLACES)
        if self.kl_in == "loss" and self.kl_estimator == "k1":
            # d/dtheta E_pi[log pi - log ref] = E_pi[grad log pi * (log pi - log ref)] + E_pi[grad log pi], and the
            # per-sample k1 term's gradient is only the second part: zero in expectation on-policy.
            raise ConfigError(
                "step.kl_in=loss with step.kl_estimator=k1: the k1 term's gradient is zero in expectation on-policy, "
                "so it would not pull the policy toward the reference; set step.kl_estimator=k3 (or k2), or "
                "step.kl_in=reward")
        if self.samples_per_prompt < estimator.min_group:
            raise ConfigError(f"step.advantage_estimator={self.advantage_estimator} compares the answers to one prompt: "
                              f"it needs step.samples_per_prompt >= {estimator.min_group} "
                              f"(got {self.samples_per_prompt})")
        if self.rollout_batch_size_per_device % self.samples_per_prompt:
            raise ConfigError(f"step.rollout_batch_size_per_device={self.rollout_batch_size_per_device} is not a "
                              f"multiple of step.samples_per_prompt={self.samples_per_prompt}: a prompt's answers "
                              "must land in one rollout batch")
        if self.reward_fn is not None and self.reward_fn != "rule":
            from rlhf.rewards import resolve

            resolve(self.reward_fn, "step.reward_fn")
        if self.reward_model_weight == 0 and self.reward_fn is None:
            raise ConfigError("step.reward_model_weight=0 and no step.reward_fn: PPO would have no reward")
        if self.rollout_batch_size_per_device % (self.micro_batch_size_per_device * self.gradient_accumulation_steps):
            raise ConfigError(
                f"step.rollout_batch_size_per_device={self.rollout_batch_size_per_device} is not divisible by "
                f"step.micro_batch_size_per_device ({self.micro_batch_size_per_device}) x "
                f"step.gradient_accumulation_steps ({self.gradient_accumulation_steps})")
        if self.global_batch_size is not None:
            raise ConfigError("step.global_batch_size is not used by PPO; set step.rollout_batch_size_per_device, "
                              "step.micro_batch_size_per_device and step.gradient_accumulation_steps")
        if self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(f"step.min_new_tokens={self.min_new_tokens} exceeds step.max_new_tokens={self.max_new_tokens}")
        if self.ema_decay >= 1.0:
            raise ConfigError(f"step.ema_decay={self.ema_decay} must be < 1")

    def check_run(self, cfg) -> None:
        if self.old_logprobs == "auto":
            # Derived from the precision: in 16 bits the decode's cached forwards and the full forwards that
            # score the new and reference log-probs round apart, so the old ones must come from a full one too;
            # a rollout correction weighs the two against each other, so it needs both.
            self.old_logprobs = "rollout" if cfg.hardware.precision == "fp32" and self.rollout_correction == "none" \
                else "recompute"
        if cfg.model.random_init and cfg.model.max_positions is not None and \
                self.max_prompt_len + self.max_new_tokens > cfg.model.max_positions:
            raise ConfigError(f"step.max_prompt_len + step.max_new_tokens = {self.max_prompt_len + self.max_new_tokens} "
                              f"exceeds model.max_positions={cfg.model.max_positions}")

    def answer_budget(self) -> int | None:
        return self.max_new_tokens

    def cut_answers_setting(self) -> str | None:
        return self.truncated_answers

    def zero3_mode(self) -> tuple[str, bool]:
        return self.zero3_generation, True

    def generation_tp(self) -> int:
        return self.generation_tp_size

    def builds(self, role: str) -> bool:
        """No reward model without a reward-model weight, no critic with a critic-free advantage estimator."""
        from rlhf.losses import ESTIMATORS

        if role == "reward":
            return self.reward_model_weight != 0
        if role == "critic":
            return ESTIMATORS[self.advantage_estimator].needs_critic
        return True


@dataclass(frozen=True)
class Role:
    # A model the step builds: its name, whether it trains, whether it has a language-model head.
    name: str
    trainable: bool
    lm_head: bool


# ------------------------------------------------------------------------------- chain deltas
def _delta_of(cls: type, name: str) -> type:
    """A dataclass shaped like ``cls`` whose every leaf is optional and None: a typed delta.

    A chain's per-step deltas are of this type, so `pipeline.ppo.step.epochs=1` on the command line
    is checked (an unknown key or a wrong type fails while composing) and needs no `+`, and an
    unset key stays None and changes nothing."""
    hints = typing.get_type_hints(cls)
    fields_ = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            sub = _delta_of(kind, f"{name}_{f.name}")
            fields_.append((f.name, sub, field(default_factory=sub)))
        else:
            fields_.append((f.name, typing.Optional[kind], None))  # noqa: UP045 - a runtime type, not an annotation
    return dataclasses.make_dataclass(name, fields_)


@functools.cache
def step_delta(step_schema: type) -> type:
    """Delta of everything a step of a chain may set differently from the others."""
    sections = {"model": ModelConfig, "zero": ZeroConfig, "step": step_schema, "data": DataConfig,
                "optim": OptimConfig, "lora": LoraConfig, "actor": RoleConfig, "critic": RoleConfig,
                "reward": RoleConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig}
    name = f"{step_schema.__name__}Delta"
    deltas = {k: _delta_of(v, f"{name}_{k}") for k, v in sections.items()}
    fields_ = [(k, d, field(default_factory=d)) for k, d in deltas.items()]
    fields_.append(("seed", int | None, None))
    return dataclasses.make_dataclass(name, fields_)


# ------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class StepSpec:
    """Everything keyed by a step's name, in one place."""

    # The step's typed schema (its chain delta, step_delta(schema), follows from it).
    schema: type[StepConfig]
    # The step's name in chain logs and the summary.
    title: str
    # The part of DeepSpeed-Chat's data split it trains on (0 SFT, 1 reward, 2 PPO).
    split_index: int
    # What one training row is: sequences, pairs, unpaired (each pair's two answers as labelled
    # rows) or rollouts (generated while training).
    rows: str
    # The models it builds (rlhf.config.step_roles narrows them by the run's settings).
    roles: tuple[Role, ...]
    # Which runner trains it: a key of rlhf.runners.KINDS.
    runner: str
    # The final figure its sweeps rank by, and whether higher or lower is better.
    objective: tuple[str, str]
    # The chain summary's figures: (final-metrics key, label, shown as a percentage).
    summary: tuple[tuple[str, str, bool], ...] = ()
    # Keys that change how the objective is measured: sweep jobs differing in one are not ranked together.
    measured_with: tuple[str, ...] = ()
    # In a chain, overrides taken from earlier steps' outputs: (key, step whose output folder it is,
    # the pipeline flag that must be true for it or None). A model.path so set is a trained model.
    chain_inputs: tuple[tuple[str, str, str | None], ...] = ()
    # In a chain, rlhf.chain.readiness.weak_step's floors that apply to it: reward_accuracy (the reward
    # model's held-out accuracy, pipeline.reward_min_accuracy), policy_accuracy (the SFT policy's,
    # pipeline.min_policy_accuracy, judged as soon as SFT's figures exist).
    checks: tuple[str, ...] = ()
    # Preference steps (runner "preference"): the loss, a key of rlhf.losses.PREFERENCE_LOSSES.
    loss: str | None = None

    @property
    def delta(self) -> type:
        return step_delta(self.schema)

    @property
    def seqs_per_row(self) -> int:
        """Sequences one training row puts in a micro batch: a pair's two answers; an unpaired row's
        answer and the mismatched answer its reference point is estimated from."""
        return 2 if self.rows in ("pairs", "unpaired") else 1

    @property
    def rows_per_source_row(self) -> int:
        """Training rows that one row of the data's part makes: an unpaired step's pair makes two."""
        return 2 if self.rows == "unpaired" else 1

    @property
    def generates(self) -> bool:
        """Whether it trains on answers it generates (rollouts): decode memory, rollout forecasts."""
        return self.rows == "rollouts"

    @property
    def supervised_policy(self) -> bool:
        """Whether it trains the policy on reference answers (SFT): the chain judges its held-out
        accuracy, its loss and the best constant answer before the steps after it start."""
        return self.rows == "sequences"

    def source_of(self, key: str) -> str | None:
        """The chain step whose output this step takes as ``key`` (actor.path, critic.path, ...)."""
        return next((source for k, source, _ in self.chain_inputs if k == key), None)

    def has_role(self, name: str) -> bool:
        return any(role.name == name for role in self.roles)

    @property
    def label(self) -> str:
        """What the step trains, as its title says it ("PPO" of "Step 3 (PPO)")."""
        return self.title.split("(", 1)[1].rstrip(")")

    @property
    def policy(self) -> Role:
        """The trainable model it outputs: the one with a language-model head, else the first trainable."""
        trainable = [r for r in self.roles if r.trainable]
        return next((r for r in trainable if r.lm_head), trainable[0])


_PREF_SUMMARY = (("eval/pref_acc", "held-out preference accuracy", True),
                 ("eval/accuracy", "held-out accuracy by the rule", True))
_POLICY = Role("actor", True, True)
_REFERENCE = Role("reference", False, True)
# A policy step starts from the chain's SFT output.
_FROM_SFT = (("actor.path", "sft", None),)


def _preference(schema: type, title: str, roles: tuple, rows: str = "pairs") -> StepSpec:
    """A preference method's spec: the preference runner with the loss named as the step, on the
    reward part of the data, from the SFT output, judged by held-out preference accuracy."""
    return StepSpec(schema, title, 1, rows, roles, "preference", ("eval/pref_acc", "max"), _PREF_SUMMARY,
                    chain_inputs=_FROM_SFT, loss=schema.name)


STEPS: dict[str, StepSpec] = {
    "sft": StepSpec(SFTStepConfig, "Step 1 (SFT)", 0, "sequences", (Role("model", True, True),), "sft",
                    ("eval/ppl", "min"),
                    (("eval/accuracy", "held-out accuracy by the rule", True), ("eval/loss", "held-out loss", False)),
                    # SFT's perplexity is over the answer tokens or over every token.
                    measured_with=("step.loss_on",)),
    "reward": StepSpec(RewardStepConfig, "Step 2 (reward model)", 1, "pairs", (Role("reward", True, False),),
                       "reward", ("eval/acc", "max"), (("eval/acc", "held-out pairwise accuracy", True),),
                       # From the SFT output with pipeline.reward_from_sft (InstructGPT's choice); the policy
                       # whose answers make step.policy_pairs_prompts' pairs is the SFT output.
                       chain_inputs=(("model.path", "sft", "reward_from_sft"), ("step.policy_path", "sft", None))),
    # DeepSpeed-Chat's DPO alternative to steps 2-3: the policy learns from the reward part's pairs.
    "dpo": _preference(DPOStepConfig, "Step 2-3 (DPO)", (_POLICY, _REFERENCE)),
    # SimPO: reference-free, the policy alone learns from the reward part's pairs.
    "simpo": _preference(SimPOStepConfig, "Step 2-3 (SimPO)", (_POLICY,)),
    # ORPO: SFT's loss on the chosen answers plus an odds-ratio term against the rejected ones; no reference.
    "orpo": _preference(ORPOStepConfig, "Step 2-3 (ORPO)", (_POLICY,)),
    # KTO: unpaired rows (each pair's chosen answer desirable, its rejected one undesirable) judged
    # against a reference point, the policy's KL to the frozen reference.
    "kto": _preference(KTOStepConfig, "Step 2-3 (KTO)", (_POLICY, _REFERENCE), rows="unpaired"),
    "ppo": StepSpec(PPOStepConfig, "Step 3 (PPO)", 2, "rollouts",
                    (_POLICY, _REFERENCE, Role("critic", True, False), Role("reward", False, False)), "ppo",
                    ("eval/accuracy", "max"),
                    (("eval/accuracy", "held-out accuracy by the rule", True),
                     ("eval/rm_score", "reward-model score", False),
                     ("select/policy_rm_auc_before", "reward model's AUC on the start policy's samples", False)),
                    chain_inputs=(*_FROM_SFT, ("critic.path", "reward", None)),
                    checks=("reward_accuracy", "policy_accuracy")),
}
STEP_SCHEMAS: dict[str, type[StepConfig]] = {name: spec.schema for name, spec in STEPS.items()}
