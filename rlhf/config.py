"""Typed schema of a run, registered in Hydra's ConfigStore.

Hydra merges the YAML groups under conf/ onto these dataclasses, so an unknown key or a value of
the wrong type fails while composing. Invariants that involve values (allowed choices, ranges,
cross-group arithmetic) live in ``__post_init__`` and run when ``to_schema`` turns the composed
DictConfig into objects -- in launch.py, before any model or dataset is touched.

    python -c "from rlhf.config import to_schema; ..."   # used by launch.py; no command of its own
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from rlhf.errors import ConfigError, DataError  # noqa: F401  (raised by the schema; DataError re-exported)

PROJECT_ROOT = Path(__file__).resolve().parent.parent


def _choice(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def _positive(key: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{key}={value!r} must be {bound}")


# --------------------------------------------------------------------------------------- model
MODEL_FAMILIES = ("opt", "llama", "bloom", "gpt_neox", "gpt2")


@dataclass
class ModelConfig:
    # Short name used in run-directory names and tables.
    name: str = MISSING
    # Hub id or local folder handed to from_pretrained; empty for a random model (cache folder).
    path: str = ""
    # Architecture family; picks the transformers config class for random models.
    family: str = "llama"
    # Build a random model (and a tokenizer trained on the shipped data) instead of downloading.
    random_init: bool = False
    # Architecture numbers: they size random models and let memory be estimated offline.
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    ffn_size: int = 512
    vocab_size: int = 512
    max_positions: int = 256
    # Seed of the random weights and of nothing else (the run seed drives training).
    init_seed: int = 0
    # Execute model code shipped with a hub checkpoint; off unless you trust the repository.
    trust_remote_code: bool = False
    # Override every dropout probability in the model config; null keeps the checkpoint's own.
    dropout: float | None = None

    def __post_init__(self) -> None:
        _choice("model.family", self.family, MODEL_FAMILIES)
        if not self.random_init and not self.path:
            raise ConfigError(f"model.path is empty for model {self.name!r}: give a hub id or a "
                              "local folder, or set model.random_init=true")
        for key in ("num_layers", "hidden_size", "num_heads", "ffn_size", "vocab_size", "max_positions"):
            _positive(f"model.{key}", getattr(self, key))
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by "
                              f"model.num_heads={self.num_heads}")
        if self.dropout is not None and not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")


# ------------------------------------------------------------------------------------ hardware
@dataclass
class HardwareConfig:
    # Preset name, shown in dry-runs and tables.
    name: str = MISSING
    # Device kind of one rank.
    accelerator: str = "cpu"
    # Machines taking part in the run.
    nodes: int = 1
    # Ranks per machine (GPUs, or CPU processes on the cpu preset).
    devices_per_node: int = 1
    # Memory of one device in GiB, for the memory pre-flight.
    memory_per_device_gb: float = 16.0
    # Training precision; fp32 is the only one CPU kernels run everywhere.
    precision: str = "fp32"
    # torch intra-op threads per rank; 0 keeps torch's default. On a loaded 2-core machine
    # 2 threads ran 11x slower than 1, so the cpu preset pins 1.
    torch_threads: int = 1
    # Collective backend: gloo on CPU, nccl on NVIDIA GPUs.
    dist_backend: str = "gloo"
    # For the time and cost forecast (rlhf/forecast.py), datasheet figures of one device: dense
    # matrix-product peak at hardware.precision in TFLOP/s (0 on CPU: measured at start-up), memory
    # bandwidth in GB/s, collective bandwidth to the other devices of its node per direction in GB/s,
    # and the network bandwidth of a whole node in GB/s.
    peak_tflops: float = 0.0
    memory_bandwidth_gbs: float = 0.0
    intra_node_gbs: float = 0.0
    inter_node_gbs: float = 0.0
    # Price of one device-hour in USD; 0: the forecast gives time only.
    price_per_device_hour: float = 0.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def __post_init__(self) -> None:
        _choice("hardware.accelerator", self.accelerator, ("cpu", "cuda"))
        _choice("hardware.precision", self.precision, ("fp32", "fp16", "bf16"))
        _choice("hardware.dist_backend", self.dist_backend, ("gloo", "nccl"))
        _positive("hardware.nodes", self.nodes)
        _positive("hardware.devices_per_node", self.devices_per_node)
        _positive("hardware.memory_per_device_gb", self.memory_per_device_gb)
        _positive("hardware.torch_threads", self.torch_threads, allow_zero=True)
        for key in ("peak_tflops", "memory_bandwidth_gbs", "intra_node_gbs", "inter_node_gbs", "price_per_device_hour"):
            _positive(f"hardware.{key}", getattr(self, key), allow_zero=True)
        if self.accelerator == "cpu" and self.precision == "fp16":
            raise ConfigError("hardware.precision=fp16 is not supported on hardware.accelerator=cpu "
                              "(DeepSpeed's CPU accelerator has no fp16 kernels); use fp32 or bf16")


# ---------------------------------------------------------------------------------------- zero
@dataclass
class OffloadConfig:
    # Where the state lives between uses: none, cpu or nvme.
    device: str = "none"
    # Page-locked host memory: faster copies, but it is taken from the host for the whole run.
    pin_memory: bool = False


@dataclass
class ZeroConfig:
    # ZeRO stage: 0 off, 1 optimizer states, 2 + gradients, 3 + parameters partitioned.
    stage: int = 0
    # Optimizer-state offload (stage >= 1); moves the optimizer to DeepSpeedCPUAdam.
    offload_optimizer: OffloadConfig = field(default_factory=OffloadConfig)
    # Parameter offload (stage 3 only).
    offload_param: OffloadConfig = field(default_factory=OffloadConfig)
    # Overlap gradient reduction with the backward pass.
    overlap_comm: bool = False
    # Copy gradients into one contiguous buffer to avoid fragmentation.
    contiguous_gradients: bool = True
    # Elements per gradient-reduction bucket.
    reduce_bucket_size: int = 500_000_000
    # Stage 3: parameters below this many elements stay unpartitioned.
    stage3_param_persistence_threshold: int = 10_000
    # Stage 3: elements prefetched ahead of use.
    stage3_prefetch_bucket_size: int = 30_000_000
    # Stage 3: most parameters held gathered at once, per rank.
    stage3_max_live_parameters: int = 30_000_000
    # Stage 3: DeepSpeed's memory-efficient linear (its default, on). It replaces
    # torch.nn.functional.linear for the whole process with an autograd Function whose saved weight
    # does not keep the gathered copy alive, so each layer's weights are freed after its forward;
    # off, every linear holds its gathered weight until the backward (the whole model's weights at
    # once: small models only). Its per-call overhead cost ZeRO-3 rollouts ~25% per token on 2 CPU
    # ranks, so rollouts gathered whole use torch's own linear either way (rlhf.rollout).
    memory_efficient_linear: bool = True

    def __post_init__(self) -> None:
        _choice("zero.stage", self.stage, (0, 1, 2, 3))
        _choice("zero.offload_optimizer.device", self.offload_optimizer.device, ("none", "cpu", "nvme"))
        _choice("zero.offload_param.device", self.offload_param.device, ("none", "cpu", "nvme"))
        if self.offload_optimizer.device != "none" and self.stage == 0:
            raise ConfigError("zero.offload_optimizer needs zero.stage >= 1 (it offloads ZeRO-partitioned state)")
        if self.offload_param.device != "none" and self.stage != 3:
            raise ConfigError("zero.offload_param needs zero.stage=3 (only stage 3 partitions parameters)")


# --------------------------------------------------------------------------------------- optim
@dataclass
class OptimConfig:
    # Peak learning rate.
    lr: float = 1e-3
    # Decoupled weight decay (AdamW); biases and norm weights are never decayed.
    weight_decay: float = 0.0
    # Adam betas.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # Adam epsilon.
    eps: float = 1e-8
    # Learning-rate schedule after warmup: cosine, linear or constant.
    scheduler: str = "cosine"
    # Linear warmup, in optimizer steps.
    warmup_steps: int = 0
    # Clip the global gradient norm to this value; 0 turns clipping off.
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _choice("optim.scheduler", self.scheduler, ("cosine", "linear", "constant"))
        _positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("optim.grad_clip", self.grad_clip, allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1)")


# ---------------------------------------------------------------------------------------- lora
@dataclass
class LoraConfig:
    # LoRA rank; 0 trains the full model.
    rank: int = 0
    # LoRA scaling numerator (the update is scaled by alpha / rank).
    alpha: float = 16.0
    # Dropout on the LoRA branch input.
    dropout: float = 0.0
    # Modules that get adapters: names or suffixes, or ["all-linear"] (PEFT's every linear but the head).
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # Train only the adapters (DeepSpeed-Chat's --only_optimize_lora); false also trains the base.
    only_optimize_lora: bool = True
    # Learning rate of the adapters; null uses optim.lr. DeepSpeed-Chat uses a separate, higher one.
    lr: float | None = None
    # Merge adapters into the base weights when saving, so the output is a plain HF model.
    merge_on_save: bool = True

    def __post_init__(self) -> None:
        _positive("lora.rank", self.rank, allow_zero=True)
        _positive("lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if self.rank and not self.target_modules:
            raise ConfigError("lora.target_modules is empty while lora.rank > 0")
        if self.lr is not None:
            _positive("lora.lr", self.lr)


# ---------------------------------------------------------------------------------------- data
@dataclass
class SourceConfig:
    # Local folder or json/jsonl/parquet file (loaded with datasets.load_dataset), or a hub id.
    path: str = MISSING
    # Relative sampling weight of this source in the blend.
    weight: float = 1.0
    # Split of the source used for training, and the one used for evaluation.
    train_split: str = "train"
    eval_split: str = "eval"
    # Row adapter from rlhf.data.adapters.ADAPTERS (DeepSpeed-Chat's datasets by hub id); empty: chosen
    # by the path when it is a known hub id.
    adapter: str = ""
    # Column mapping for other tables: {prompt: <column>, chosen: <column>, rejected: <column>}.
    columns: dict[str, str] = field(default_factory=dict)


def looks_local(path: str) -> bool:
    """Paths we must find on disk; anything else ("org/name") is handed to the hub as an id."""
    return (path.startswith(("/", "./", "../", "~")) or os.path.exists(path)
            or bool(re.search(r"\.(json|jsonl|parquet|csv)$", path)))


@dataclass
class DataConfig:
    # Blend name, shown in run directories and tables.
    name: str = MISSING
    # Sources of the blend, each with a weight.
    sources: list[SourceConfig] = field(default_factory=list)
    # DeepSpeed-Chat's per-step split of each source's train rows: SFT, reward, PPO parts.
    split: str = "2,4,4"
    # Seed of the split and of blend sampling (kept apart from the run seed so that runs with
    # different training seeds see the same data).
    seed: int = 1234
    # Cap on training rows after blending; -1 keeps all.
    max_train_samples: int = -1
    # Cap on evaluation rows; -1 keeps all.
    max_eval_samples: int = 512
    # Rows that cannot be used (empty, too long, chosen == rejected): drop (or skip: the same) and count
    # them in data_report.json, or error naming the source, row and column.
    on_bad_row: str = "drop"
    # Unsupervised text for PPO's ptx loss (a "text" column, or columns: {text: <column>}); empty: the
    # blend's SFT part (prompt + chosen).
    ptx_sources: list[SourceConfig] = field(default_factory=list)
    # PPO prompts longer than step.max_prompt_len: drop and count (DeepSpeed-Chat's rule), or keep their
    # last tokens (truncate_left: the end of a conversation matters most).
    long_prompts: str = "drop"
    # The task's rule, scoring (prompt, answer) -> float: held-out accuracy of SFT and PPO, the truth
    # PPO's rollouts are checked against, and PPO's reward with step.reward_fn=rule. A name from
    # rlhf.rewards.REWARD_FNS or your own 'package.module:function'; null: the shipped tasks' rule
    # where it parses every prompt, else none.
    rule: str | None = None

    @property
    def split_fractions(self) -> list[float]:
        parts = [float(x) for x in self.split.split(",")]
        return [p / sum(parts) for p in parts]

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError(f"data.sources is empty in blend {self.name!r}")
        from rlhf.data.adapters import ADAPTERS

        for i, src in enumerate(self.sources):
            _positive(f"data.sources[{i}].weight", src.weight)
            if src.adapter:
                _choice(f"data.sources[{i}].adapter", src.adapter, tuple(ADAPTERS))
            if src.columns and not {"prompt", "chosen"} <= set(src.columns) <= {"prompt", "chosen", "rejected"}:
                raise ConfigError(f"data.sources[{i}].columns={dict(src.columns)} must map prompt and chosen "
                                  "(and optionally rejected) to the table's column names")
            path = os.path.expanduser(src.path)
            if looks_local(src.path) and not os.path.exists(path):
                raise ConfigError(f"data.sources[{i}].path={src.path!r} does not exist")
        if self.rule:
            from rlhf.rewards import resolve

            resolve(self.rule, "data.rule")  # a bad reference fails now, naming what could not be imported
        for i, src in enumerate(self.ptx_sources):
            if looks_local(src.path) and not os.path.exists(os.path.expanduser(src.path)):
                raise ConfigError(f"data.ptx_sources[{i}].path={src.path!r} does not exist")
        try:
            parts = [float(x) for x in self.split.split(",")]
        except ValueError:
            raise ConfigError(f"data.split={self.split!r} must be comma-separated numbers like '2,4,4'") from None
        if len(parts) != 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
            raise ConfigError(f"data.split={self.split!r} must be three non-negative numbers (SFT, reward, "
                              "PPO) with a positive sum")
        _choice("data.on_bad_row", self.on_bad_row, ("drop", "skip", "error"))
        _choice("data.long_prompts", self.long_prompts, ("drop", "truncate_left"))


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

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("step.loss_on", self.loss_on, ("answer", "all"))
        _positive("step.early_stop_patience", self.early_stop_patience, allow_zero=True)
        if self.early_stop_patience and self.eval_every_steps == 0 and self.epochs == 1:
            raise ConfigError("step.early_stop_patience needs evaluations to compare: step.eval_every_steps > 0 "
                              "or step.epochs > 1 (every epoch ends with one)")
        if self.stop_at_accuracy is not None and (self.eval_accuracy_prompts == 0 or self.eval_every_steps == 0):
            raise ConfigError("step.stop_at_accuracy needs step.eval_accuracy_prompts > 0 and step.eval_every_steps > 0")


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

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("step.score_at", self.score_at, ("last", "divergence"))
        _positive("step.early_stop_patience", self.early_stop_patience, allow_zero=True)
        _positive("step.score_regularizer", self.score_regularizer, allow_zero=True)
        _positive("step.rule_check_answers", self.rule_check_answers, allow_zero=True)


@dataclass
class DPOStepConfig(GreedyEvalStepConfig):
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
    # The reference's log-probs: precompute (one pass before training, then the reference model is
    # freed: no second model during training) or online (the reference scores every batch).
    reference_logprobs: str = "precompute"
    # Keep the frozen reference's parameters in host memory (ZeRO-3 offload).
    offload_reference: bool = False
    # Train the policy without dropout, as the reference is scored: with dropout on, the policy's
    # log-ratios are noisy and biased and the margin is not 0 at the start. false keeps model.dropout
    # (the checkpoint's own where that is null) in the policy.
    disable_dropout: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        from rlhf.losses import DPO_LOSSES

        _choice("step.loss", self.loss, tuple(DPO_LOSSES))
        _choice("step.reference_logprobs", self.reference_logprobs, ("precompute", "online"))
        _positive("step.beta", self.beta)
        _positive("step.nll_coef", self.nll_coef, allow_zero=True)
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"step.label_smoothing={self.label_smoothing} must be in [0, 0.5): it is the "
                              "probability that a pair's label is flipped")
        if self.loss == "robust" and self.label_smoothing == 0:
            raise ConfigError("step.loss=robust needs step.label_smoothing > 0 (at 0 it is plain DPO: step.loss=sigmoid)")


@dataclass
class SimPOStepConfig(GreedyEvalStepConfig):
    name: str = "simpo"
    # Scale of the implicit reward beta / |y| * log pi(y|x) (Meng et al. 2024 use 2.0-2.5).
    beta: float = 2.0
    # Target margin between the chosen and rejected rewards (the paper's gamma, 0.5-1.5).
    gamma: float = 1.0
    # Train without dropout (noisy log-probs bias the margin); false keeps model.dropout.
    disable_dropout: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("step.beta", self.beta)
        _positive("step.gamma", self.gamma, allow_zero=True)


@dataclass
class PPOStepConfig(StepConfig):
    name: str = "ppo"
    # Prompts each device generates answers for per PPO step (the rollout batch).
    rollout_batch_size_per_device: int = 64
    # Rollouts per generate call and per scoring forward (bounds the KV cache and the scoring logits); 0: the
    # whole rollout batch at once.
    generation_batch_size_per_device: int = 0
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
    # Sample (true) or decode greedily (false) during rollouts.
    do_sample: bool = True
    # Sampling temperature; log-probs are computed on logits / temperature to match the sampler.
    temperature: float = 0.7
    # Where PPO's old log-probs (the ratio's denominator) come from: rollout, the logits that sampled
    # each token; recompute, a forward of the actor over the finished sequences (DeepSpeed-Chat's way:
    # one more forward per step; equal up to rounding, which differs in bf16/fp16 between the
    # cached one-token forwards and the full one).
    old_logprobs: str = "rollout"
    # Nucleus sampling mass; 1.0 is off. PPO refuses other values when sampling (see __post_init__).
    top_p: float = 1.0
    # Top-k sampling; 0 is off. PPO refuses other values when sampling (see __post_init__).
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
    # PPO policy clip range.
    clip_range: float = 0.2
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
    # ZeRO-3 generation: gathering the whole actor once per generate call is far faster than ZeRO-3's
    # layer-by-layer gathers (repeated for every token), but needs the full actor on each device.
    # auto: gather when the memory pre-flight says it fits (rlhf.memory.generation_gathers_whole_model),
    # else layerwise; gather; layerwise.
    zero3_generation: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("step.zero3_generation", self.zero3_generation, ("auto", "gather", "layerwise"))
        _choice("step.old_logprobs", self.old_logprobs, ("rollout", "recompute"))
        _choice("step.truncated_answers", self.truncated_answers, ("keep", "penalty", "mask"))
        for key in ("rollout_batch_size_per_device", "samples_per_prompt", "ppo_epochs", "max_prompt_len",
                    "max_new_tokens", "temperature", "top_p", "kl_horizon", "critic_lr"):
            _positive(f"step.{key}", getattr(self, key))
        for key in ("kl_coef", "reward_clip", "reward_model_weight", "reward_fn_weight", "gamma", "lam",
                    "clip_range", "value_clip_range", "vf_coef", "entropy_coef", "ptx_coef", "ema_decay",
                    "top_k", "eval_prompts", "min_new_tokens", "generation_batch_size_per_device", "truncated_penalty"):
            _positive(f"step.{key}", getattr(self, key), allow_zero=True)
        from rlhf.losses import ESTIMATORS, KL_ESTIMATORS, KL_PLACES, LOSS_AGGS

        _choice("step.advantage_estimator", self.advantage_estimator, tuple(ESTIMATORS))
        estimator = ESTIMATORS[self.advantage_estimator]
        # Derived, not configured: unset, the KL goes where the estimator's paper put it.
        if self.kl_estimator is None:
            self.kl_estimator = estimator.kl_estimator
        if self.kl_in is None:
            self.kl_in = estimator.kl_in
        if self.loss_agg is None:
            self.loss_agg = estimator.loss_agg
        _choice("step.loss_agg", self.loss_agg, tuple(LOSS_AGGS))
        if self.do_sample and (self.top_k or self.top_p < 1.0):
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


@dataclass(frozen=True)
class Role:
    # A model the step builds: its name, whether it trains, whether it has a language-model head.
    name: str
    trainable: bool
    lm_head: bool


@dataclass(frozen=True)
class StepSpec:
    """Everything keyed by step name, in one place: the schema, the title in chain logs, the part of
    DeepSpeed-Chat's data split it trains on, what one row is, and the models it builds."""

    schema: type[StepConfig]
    title: str
    split_index: int
    rows: str
    roles: tuple[Role, ...]


STEPS: dict[str, StepSpec] = {
    "sft": StepSpec(SFTStepConfig, "Step 1 (SFT)", 0, "sequences", (Role("model", True, True),)),
    "reward": StepSpec(RewardStepConfig, "Step 2 (reward model)", 1, "pairs", (Role("reward", True, False),)),
    # DeepSpeed-Chat's DPO alternative to steps 2-3: the policy learns from the reward part's pairs.
    "dpo": StepSpec(DPOStepConfig, "Step 2-3 (DPO)", 1, "pairs",
                    (Role("actor", True, True), Role("reference", False, True))),
    # SimPO: reference-free, the policy alone learns from the reward part's pairs.
    "simpo": StepSpec(SimPOStepConfig, "Step 2-3 (SimPO)", 1, "pairs", (Role("actor", True, True),)),
    "ppo": StepSpec(PPOStepConfig, "Step 3 (PPO)", 2, "rollouts",
                    (Role("actor", True, True), Role("reference", False, True), Role("critic", True, False),
                     Role("reward", False, False))),
}
STEP_SCHEMAS: dict[str, type[StepConfig]] = {name: spec.schema for name, spec in STEPS.items()}


def step_roles(cfg: Config) -> list[Role]:
    """The models this run of the step really builds: PPO without a reward-model weight builds no reward
    model, and with a critic-free advantage estimator no critic."""
    roles = list(STEPS[cfg.step.name].roles)
    if cfg.step.name == "ppo":
        from rlhf.losses import ESTIMATORS

        if cfg.step.reward_model_weight == 0:
            roles = [r for r in roles if r.name != "reward"]
        if not ESTIMATORS[cfg.step.advantage_estimator].needs_critic:
            roles = [r for r in roles if r.name != "critic"]
    return roles


# ------------------------------------------------------------------------------------- roles
@dataclass
class RoleConfig:
    # Checkpoint folder or hub id this role starts from; empty: the chain's output, else the model group.
    path: str = ""
    # A conf/model file describing this role's architecture, for the memory pre-flight (e.g. opt-350m
    # for DeepSpeed-Chat's critic); empty: the same as the model group.
    model: str = ""

    def __post_init__(self) -> None:
        if self.model and not (PROJECT_ROOT / "conf" / "model" / f"{self.model}.yaml").exists():
            options = sorted(p.stem for p in (PROJECT_ROOT / "conf" / "model").glob("*.yaml"))
            raise ConfigError(f"<role>.model={self.model!r} (actor, critic or reward) is not a file in conf/model; choose one of "
                              f"{', '.join(options)}")


# --------------------------------------------------------------------------- launch & logging
@dataclass
class LaunchConfig:
    # Print the DeepSpeed config, batch arithmetic, launch command and memory table; train nothing.
    dry_run: bool = False
    # Run even when the memory pre-flight says the run does not fit.
    force: bool = False
    # DeepSpeed hostfile ("host slots=N" per line); needed for more than one node.
    hostfile: str = ""
    # Address and port of rank 0 for multi-node runs; empty address: the launcher's default.
    master_addr: str = ""
    master_port: int = 29500
    # Train rows of the data blend for the time forecast where the data is on a hub (local files are
    # counted); 0: unknown, the forecast is per step.
    forecast_rows: int = 0

    def __post_init__(self) -> None:
        _positive("launch.forecast_rows", self.forecast_rows, allow_zero=True)
        if self.hostfile and not os.path.exists(os.path.expanduser(self.hostfile)):
            raise ConfigError(f"launch.hostfile={self.hostfile!r} does not exist")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"launch.master_port={self.master_port} is not a port number")


@dataclass
class LoggingConfig:
    # Show progress bars on rank 0.
    progress_bar: bool = True
    # Log to Weights & Biases as well as metrics.jsonl (offline unless WANDB_API_KEY is set).
    wandb: bool = False
    # Weights & Biases project.
    wandb_project: str = "rlhf"
    # Weights & Biases group: one per sweep, so its runs compare side by side; empty: none.
    wandb_group: str = ""
    # Also write TensorBoard event files into RUN_DIR/tensorboard.
    tensorboard: bool = False


@dataclass
class CheckpointConfig:
    # Save every this many optimizer steps (PPO: PPO steps), and always at the end of each epoch; 0: epochs only.
    every_steps: int = 0
    # Checkpoints kept (the newest).
    keep_last: int = 2

    def __post_init__(self) -> None:
        _positive("checkpoint.every_steps", self.every_steps, allow_zero=True)
        _positive("checkpoint.keep_last", self.keep_last)


# ------------------------------------------------------------------------------------ chains
def _delta_of(cls: type, name: str) -> type:
    """A dataclass shaped like ``cls`` whose every leaf is optional and None: a typed delta.

    A chain's per-step deltas are of this type, so `pipeline.ppo.step.epochs=1` on the command line
    is checked (an unknown key or a wrong type fails while composing) and needs no `+`, and an
    unset key stays None and changes nothing."""
    import dataclasses
    import typing

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


def _step_delta(step_schema: type) -> type:
    """Delta of everything a step of a chain may set differently from the others."""
    import dataclasses

    sections = {"model": ModelConfig, "zero": ZeroConfig, "step": step_schema, "data": DataConfig,
                "optim": OptimConfig, "lora": LoraConfig, "actor": RoleConfig, "critic": RoleConfig,
                "reward": RoleConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig}
    name = f"{step_schema.__name__}Delta"
    deltas = {k: _delta_of(v, f"{name}_{k}") for k, v in sections.items()}
    fields_ = [(k, d, field(default_factory=d)) for k, d in deltas.items()]
    fields_.append(("seed", int | None, None))
    return dataclasses.make_dataclass(name, fields_)


SFTDelta = _step_delta(SFTStepConfig)
RewardDelta = _step_delta(RewardStepConfig)
PPODelta = _step_delta(PPOStepConfig)
DPODelta = _step_delta(DPOStepConfig)
SimPODelta = _step_delta(SimPOStepConfig)


@dataclass
class PipelineConfig:
    # Steps run in order, each step's output feeding the next; empty: run the one step in `step`.
    steps: list[str] = field(default_factory=list)
    # Start the reward model from the SFT output (InstructGPT's choice) instead of the model group
    # (DeepSpeed-Chat's: a separate, smaller base model).
    reward_from_sft: bool = False
    # Refuse PPO when the reward model's held-out pairwise accuracy is below this (0: never): PPO
    # finds and exploits the mistakes of a weak reward model.
    reward_min_accuracy: float = 0.0
    # Refuse PPO when the SFT policy's held-out accuracy by the rule is below this (0: never): PPO can
    # only reinforce right answers it samples.
    min_policy_accuracy: float = 0.0
    # Refuse the step after SFT when SFT ended with its held-out loss still falling by more than this
    # fraction over its last evaluation interval (0: never): it stopped before it was ready.
    sft_loss_still_falling: float = 0.0
    # What a step that cannot work gets: stop (the chain ends before it, exit code 2, one line naming
    # the figure, the reason and the override) or warn (say so and run it anyway).
    on_weak_step: str = "stop"
    # Per step, the files of conf/stage/ composed over that step's config, in order (each a
    # `# @package _global_` delta: shared constants first, then what depends on size and hardware).
    stages: dict[str, list[str]] = field(default_factory=dict)
    # Per-step deltas applied last, for one step only: `pipeline.ppo.step.epochs=1` on the command line.
    sft: SFTDelta = field(default_factory=SFTDelta)
    reward: RewardDelta = field(default_factory=RewardDelta)
    ppo: PPODelta = field(default_factory=PPODelta)
    dpo: DPODelta = field(default_factory=DPODelta)
    simpo: SimPODelta = field(default_factory=SimPODelta)

    def __post_init__(self) -> None:
        _choice("pipeline.on_weak_step", self.on_weak_step, ("stop", "warn"))
        for key in ("reward_min_accuracy", "min_policy_accuracy", "sft_loss_still_falling"):
            _positive(f"pipeline.{key}", getattr(self, key), allow_zero=True)
        for name in self.steps:
            _choice("pipeline.steps[]", name, tuple(STEP_SCHEMAS))
        for name, files in self.stages.items():
            _choice("pipeline.stages key", name, tuple(STEP_SCHEMAS))
            for f in files:
                if not (PROJECT_ROOT / "conf" / "stage" / f"{f}.yaml").exists():
                    raise ConfigError(f"pipeline.stages.{name}: conf/stage/{f}.yaml does not exist")


# ------------------------------------------------------------------------------------ the run
@dataclass
class Config:
    model: ModelConfig = MISSING
    hardware: HardwareConfig = MISSING
    zero: ZeroConfig = MISSING
    step: Any = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # PPO roles: actor (and its frozen reference) from SFT, critic (and frozen reward) from the reward model.
    actor: RoleConfig = field(default_factory=RoleConfig)
    critic: RoleConfig = field(default_factory=RoleConfig)
    # The reward model; empty: critic.path.
    reward: RoleConfig = field(default_factory=RoleConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # auto: continue from the run directory's latest checkpoint (a finished run does nothing); never: start over.
    resume: str = "auto"
    # Seed of model-independent randomness in training (sampling order, dropout).
    seed: int = 42
    # Where this run writes everything; launch.py fills in Hydra's output directory when empty.
    run_dir: str = ""

    @property
    def world_size(self) -> int:
        return self.hardware.world_size

    def __post_init__(self) -> None:
        _choice("resume", self.resume, ("auto", "never"))
        if self.step.name not in STEP_SCHEMAS:
            raise ConfigError(f"step.name={self.step.name!r} is not allowed; choose one of "
                              f"{', '.join(STEP_SCHEMAS)}")
        # The batch arithmetic, derived once here: every later reader sees one consistent pair.
        per_step = self.step.micro_batch_size_per_device * self.world_size
        if self.step.global_batch_size is not None:
            if self.step.global_batch_size % per_step:
                raise ConfigError(
                    f"step.global_batch_size={self.step.global_batch_size} is not divisible by "
                    f"step.micro_batch_size_per_device ({self.step.micro_batch_size_per_device}) x world size "
                    f"({self.world_size} = hardware.nodes x hardware.devices_per_node)")
            self.step.gradient_accumulation_steps = self.step.global_batch_size // per_step
        self.step.global_batch_size = per_step * self.step.gradient_accumulation_steps
        if self.model.random_init and self.step.max_seq_len > self.model.max_positions:
            raise ConfigError(f"step.max_seq_len={self.step.max_seq_len} exceeds model.max_positions="
                              f"{self.model.max_positions}")
        if self.step.name == "ppo" and self.model.random_init and \
                self.step.max_prompt_len + self.step.max_new_tokens > self.model.max_positions:
            raise ConfigError(f"step.max_prompt_len + step.max_new_tokens = "
                              f"{self.step.max_prompt_len + self.step.max_new_tokens} exceeds model.max_positions="
                              f"{self.model.max_positions}")


def ppo_updates_per_step(cfg: Config) -> int:
    """Optimizer steps per PPO step on each rank: every rollout is used ppo_epochs times, micro x
    accumulation rollouts per optimizer step."""
    step = cfg.step
    return step.ppo_epochs * step.rollout_batch_size_per_device // (step.micro_batch_size_per_device *
                                                                    cfg.step.gradient_accumulation_steps)


def ppo_role_problems(cfg: Config) -> list[str]:
    """What makes a PPO config unrunnable before any model loads: a missing reward model, or roles
    whose architecture files (the memory pre-flight's sizes) say they use another tokenizer than
    the actor. Used by the dry-run, the launcher and the runner alike."""
    if cfg.step.name != "ppo":
        return []
    problems = []
    if cfg.step.reward_model_weight > 0 and not (cfg.reward.path or cfg.critic.path):
        problems.append("PPO with step.reward_model_weight > 0 needs critic.path or reward.path (a reward-model "
                        "output), or use step.reward_fn=rule step.reward_model_weight=0")
    actor = cfg.model
    for role in ("critic", "reward"):
        name = getattr(cfg, role).model
        if not name or (role == "reward" and cfg.step.reward_model_weight == 0):
            continue
        other = load_model_file(name)
        if (other.family, other.vocab_size) != (actor.family, actor.vocab_size):
            problems.append(f"{role}.model={name} ({other.family}, vocabulary {other.vocab_size}) does not share the "
                            f"actor's tokenizer (model={actor.name}: {actor.family}, vocabulary {actor.vocab_size}); "
                            "PPO feeds the actor's token ids to the critic and reward model")
    return problems


def missing_paths(cfg: Config, will_exist: tuple[str, ...] = ()) -> list[str]:
    """Model folders the run would load that are not there (and that no earlier step of a chain
    will write): refused before anything loads, instead of a hub error about repo ids."""
    problems = []
    for key, path in (("model.path", cfg.model.path), ("actor.path", cfg.actor.path),
                      ("critic.path", cfg.critic.path), ("reward.path", cfg.reward.path)):
        if path and looks_local(path) and not os.path.exists(os.path.expanduser(path)) and path not in will_exist:
            problems.append(f"{key}={path!r} does not exist (a path starting with /, ./, ../ or ~ is a local "
                            "folder; a hub id looks like org/name)")
    return problems


def load_model_file(name: str) -> ModelConfig:
    """A conf/model file as a ModelConfig (architecture numbers for sizing or checking another role)."""
    node = OmegaConf.load(PROJECT_ROOT / "conf" / "model" / f"{name}.yaml")
    node.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))


def register_configs() -> None:
    """Put the schemas where the YAML files' defaults lists find them.

    Group files start with ``defaults: [schema, _self_]`` (step files: ``/step/schema_<name>@step``)
    so that Hydra merges them onto the dataclass and rejects unknown keys and wrong types.
    """
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="model", name="schema", node=ModelConfig)
    cs.store(group="hardware", name="schema", node=HardwareConfig)
    cs.store(group="zero", name="schema", node=ZeroConfig)
    cs.store(group="data", name="schema", node=DataConfig)
    for name, schema in STEP_SCHEMAS.items():
        cs.store(group="step", name=f"schema_{name}", node=schema)


# Config groups whose option names are numbers. Hydra parses `zero=3` as the integer 3 and then
# refuses it as a group choice ("must be a string"), so such overrides are quoted before Hydra
# sees them: `zero=3` -> `zero='3'`, `zero=2,3` (a sweep) -> `zero='2','3'`.
NUMERIC_GROUPS = ("zero",)
_NUMERIC_GROUP_OVERRIDE = re.compile(rf"^({'|'.join(NUMERIC_GROUPS)})=([0-9]+(?:,[0-9]+)*)$")


def quote_numeric_groups(args: list[str]) -> list[str]:
    out = []
    for arg in args:
        m = _NUMERIC_GROUP_OVERRIDE.match(arg)
        out.append(f"{m.group(1)}=" + ",".join(f"'{v}'" for v in m.group(2).split(",")) if m else arg)
    return out


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("project_root"):
        # Shipped data and caches are addressed from the checkout, whatever the working directory.
        OmegaConf.register_new_resolver("project_root", lambda: str(PROJECT_ROOT))
    if not OmegaConf.has_resolver("or_else"):
        # hydra.run.dir follows run_dir when the user sets it: Hydra's own files (.hydra/) then land
        # in the run directory instead of a second, timestamped folder under runs/.
        OmegaConf.register_new_resolver("or_else", lambda value, default: value or default)


_register_resolvers()


def _unknown_keys(node: DictConfig, prefix: str = ""):
    """Keys of typed nodes that their schema does not have: `+step.max_step=3` (Hydra's own hint for a
    misspelled key) adds one, and it would otherwise be ignored without a word."""
    import dataclasses

    kind = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(kind):
        return
    names = [f.name for f in dataclasses.fields(kind)]
    for key in node.keys():
        if key not in names:
            yield f"{prefix}{key}", [f"{prefix}{n}" for n in names]
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            yield from _unknown_keys(child, f"{prefix}{key}.")


def _not_a_key(key: str, known: list[str]) -> ConfigError:
    """The one-line refusal of a key the config lacks, naming the nearest known key."""
    import difflib

    near = difflib.get_close_matches(key, known, n=1)
    return ConfigError(f"{key} is not a key of the config" + (f"; did you mean {near[0]}?" if near else
                                                              "; `python launch.py --cfg job` shows them all"))


def to_schema(cfg: DictConfig) -> Config:
    """Resolve and instantiate the composed config, running every ``__post_init__`` check."""
    from omegaconf.errors import OmegaConfBaseException

    for key, known in _unknown_keys(cfg):
        raise _not_a_key(key, known)

    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        # OmegaConf wraps our ConfigError raised inside __post_init__; unwrap it for a clean message.
        cause = err.__cause__ or err.__context__
        if isinstance(cause, ConfigError):
            raise cause from None
        raise ConfigError(str(err).splitlines()[0]) from None
    return obj


def load_run_config(path: str | Path) -> Config:
    """Read a run directory's resolved config.yaml back into the schema (used by every rank)."""
    loaded = OmegaConf.load(path)
    name = loaded.get("step", {}).get("name")
    if name not in STEP_SCHEMAS:
        raise ConfigError(f"{path}: step.name={name!r} is not one of {', '.join(STEP_SCHEMAS)}")
    base = OmegaConf.structured(Config)
    base.step = OmegaConf.structured(STEP_SCHEMAS[name])
    return to_schema(OmegaConf.merge(base, loaded))


register_configs()  # importing the schemas makes them composable, by @hydra.main and compose alike


def check_override_keys(overrides: list[str]) -> None:
    """Refuse an override of a key the config lacks, naming the nearest known key (ConfigError).

    Hydra refuses ``optim.lrr=1e-4`` itself, with a multi-line message, exit code 1 and the advice
    to add the key with ``+`` (which to_schema then refuses); this composes first and says it in
    one line. Other composition errors are left to Hydra's own message."""
    from hydra.errors import ConfigCompositionException

    try:
        compose_config(overrides)
    except ConfigCompositionException as err:
        found = re.search(r"Could not override '([^']+)'", str(err))
        if not found:
            return
        key = found.group(1)
        parent, _, _ = key.rpartition(".")
        rest = [o for o in overrides if not o.split("=", 1)[0].lstrip("~+") == key]
        try:
            node = compose_config(rest)
            node = OmegaConf.select(node, parent) if parent else node
        except ConfigCompositionException:
            node = None
        known = [f"{parent}.{k}" if parent else str(k) for k in node.keys()] if isinstance(node, DictConfig) else []
        raise _not_a_key(key, known) from None


def compose_config(overrides: list[str]) -> DictConfig:
    """The config `python launch.py <overrides>` composes, inside a running Hydra app or outside.

    The one place overrides are composed besides @hydra.main (launch.py quotes the same way)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = quote_numeric_groups(overrides)
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=overrides)
    with initialize_config_dir(str(PROJECT_ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)
