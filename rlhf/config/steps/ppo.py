"""PPO's schema and those of the RL methods it runs (GRPO, RLOO, REINFORCE++ are its advantage estimators)."""

from __future__ import annotations

from dataclasses import dataclass

from rlhf.config.checks import _choice, _positive
from rlhf.config.steps.base import StepConfig
from rlhf.errors import ConfigError


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
        estimator = self._derive_objective()
        self._check_sampling()
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

    def _derive_objective(self):
        """The estimator's, policy loss's and rollout correction's settings, each unset one derived from
        its paper's default; returns the estimator."""
        from rlhf.losses import ESTIMATORS, LOSS_AGGS, POLICY_LOSSES, ROLLOUT_CORRECTIONS

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
        return estimator

    def _check_sampling(self) -> None:
        """Rollouts drawn from the full distribution, and a KL whose gradient pulls toward the reference."""
        from rlhf.losses import KL_ESTIMATORS, KL_PLACES

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
