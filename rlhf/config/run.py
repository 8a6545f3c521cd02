"""The whole run's schema (Config), the chain's (PipelineConfig with its per-step deltas), and the
checks that need more than one group.

    python -c "from rlhf.config import Config"   # used through rlhf.config; no command of its own
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING, OmegaConf

from rlhf.config.checks import PROJECT_ROOT, _choice, _positive
from rlhf.config.groups import (
    CheckpointConfig,
    DataConfig,
    HardwareConfig,
    LaunchConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RoleConfig,
    ZeroConfig,
    looks_local,
)
from rlhf.config.steps import STEP_SCHEMAS, STEPS, Role
from rlhf.errors import ConfigError


# ------------------------------------------------------------------------------------ chains
@dataclass
class _PipelineSettings:
    # Steps run in order, each step's output feeding the next; empty: run the one step in `step`.
    steps: list[str] = field(default_factory=list)
    # Start the reward model from the SFT output (InstructGPT's choice) instead of the model group
    # (DeepSpeed-Chat's: a separate, smaller base model).
    reward_from_sft: bool = False
    # Refuse PPO when the reward model's held-out pairwise accuracy is below this (0: never): PPO
    # finds and exploits the mistakes of a weak reward model.
    reward_min_accuracy: float = 0.0
    # Stop PPO before its first update when the reward model separates the policy's own sampled
    # answers (right or wrong by the rule) with an AUC below this (0: never): PPO climbs its scores of
    # the mistakes this policy makes, which held-out pairs need not contain.
    reward_min_policy_auc: float = 0.0
    # Refuse PPO when the SFT policy's held-out accuracy by the rule is below this (0: never): PPO can
    # only reinforce right answers it samples.
    min_policy_accuracy: float = 0.0
    # Refuse the step after SFT when SFT ended with its held-out loss still falling by more than this
    # fraction over its last evaluation interval (0: never): it stopped before it was ready.
    sft_loss_still_falling: float = 0.0
    # Refuse the step after SFT when SFT's held-out accuracy is within noise of always giving the best
    # single training answer (where that answer is right for 5% or more): it did not learn the task.
    sft_beyond_constant: bool = False
    # What a step that cannot work gets: stop (the chain ends before it, exit code 2, one line naming
    # the figure, the reason and the override) or warn (say so and run it anyway).
    on_weak_step: str = "stop"
    # Per step, the files of conf/stage/ composed over that step's config, in order (each a
    # `# @package _global_` delta: shared constants first, then what depends on size and hardware).
    stages: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("pipeline.on_weak_step", self.on_weak_step, ("stop", "warn"))
        for key in ("reward_min_accuracy", "reward_min_policy_auc", "min_policy_accuracy", "sft_loss_still_falling"):
            _positive(f"pipeline.{key}", getattr(self, key), allow_zero=True)
        for name in self.steps:
            _choice("pipeline.steps[]", name, tuple(STEP_SCHEMAS))
        for name, files in self.stages.items():
            _choice("pipeline.stages key", name, tuple(STEP_SCHEMAS))
            for f in files:
                if not (PROJECT_ROOT / "conf" / "stage" / f"{f}.yaml").exists():
                    raise ConfigError(f"pipeline.stages.{name}: conf/stage/{f}.yaml does not exist")


# The chain's settings and, per step of STEPS, its delta applied last, for that step only:
# `pipeline.ppo.step.epochs=1` on the command line.
PipelineConfig = dataclasses.make_dataclass(
    "PipelineConfig", [(name, spec.delta, field(default_factory=spec.delta)) for name, spec in STEPS.items()],
    bases=(_PipelineSettings,))


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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
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

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read different rows: the world over the ranks that share each sequence."""
        return self.hardware.world_size // self.parallel.sequence

    def __post_init__(self) -> None:
        _choice("resume", self.resume, ("auto", "never"))
        if self.step.name not in STEP_SCHEMAS:
            raise ConfigError(f"step.name={self.step.name!r} is not allowed; choose one of "
                              f"{', '.join(STEP_SCHEMAS)}")
        if self.launch.node_rank >= self.hardware.nodes:
            raise ConfigError(f"launch.node_rank={self.launch.node_rank} but hardware.nodes={self.hardware.nodes}: "
                              f"node ranks are 0 .. {self.hardware.nodes - 1}")
        sp = self.parallel.sequence
        if self.world_size % sp:
            raise ConfigError(f"parallel.sequence={sp} does not divide the {self.world_size} ranks "
                              f"(hardware.nodes x hardware.devices_per_node); choose a divisor of {self.world_size}")
        if sp > 1 and not STEPS[self.step.name].slices_sequences:
            raise ConfigError(f"parallel.sequence={sp} is not supported for {STEPS[self.step.name].label}: its "
                              "rollouts are generated whole on every rank; set parallel.sequence=1")
        # The batch arithmetic, derived once here: every later reader sees one consistent pair.
        ranks = (f"data-parallel ranks ({self.data_parallel_size} = {self.world_size} ranks / parallel.sequence={sp})"
                 if sp > 1 else f"world size ({self.world_size} = hardware.nodes x hardware.devices_per_node)")
        per_step = self.step.micro_batch_size_per_device * self.data_parallel_size
        if self.step.global_batch_size is not None:
            if self.step.global_batch_size % per_step:
                raise ConfigError(
                    f"step.global_batch_size={self.step.global_batch_size} is not divisible by "
                    f"step.micro_batch_size_per_device ({self.step.micro_batch_size_per_device}) x {ranks}")
            self.step.gradient_accumulation_steps = self.step.global_batch_size // per_step
        self.step.global_batch_size = per_step * self.step.gradient_accumulation_steps
        random = self.model.random_init and self.model.max_positions is not None
        if random and self.step.max_seq_len > self.model.max_positions:
            raise ConfigError(f"step.max_seq_len={self.step.max_seq_len} exceeds model.max_positions="
                              f"{self.model.max_positions}")
        self.step.check_run(self)


def ppo_updates_per_step(cfg: Config) -> int:
    """Optimizer steps per PPO step on each rank: every rollout is used ppo_epochs times, micro x
    accumulation rollouts per optimizer step."""
    step = cfg.step
    return step.ppo_epochs * step.rollout_batch_size_per_device // (step.micro_batch_size_per_device *
                                                                    cfg.step.gradient_accumulation_steps)


def missing_paths(cfg: Config, will_exist: tuple[str, ...] = ()) -> list[str]:
    """Model folders the run would load that are not there (and that no earlier step of a chain
    will write): refused before anything loads, instead of a hub error about repo ids."""
    problems = []
    for key, path in (("model.path", cfg.model.path), ("actor.path", cfg.actor.path),
                      ("critic.path", cfg.critic.path), ("reward.path", cfg.reward.path)):
        if not path or not looks_local(path) or path in will_exist:
            continue
        where = os.path.expanduser(path)
        if not os.path.exists(where):
            problems.append(f"{key}={path!r} does not exist in {os.getcwd()} (a path starting with /, ./, ../ or ~, "
                            "or with two slashes, is a local folder; a hub id looks like org/name)")
        elif os.path.isdir(where) and os.path.exists(os.path.join(where, "config.json")) and not _has_weights(where):
            problems.append(f"{key}={path!r} holds config.json but no weights (model.safetensors, pytorch_model.bin "
                            "or their index; a LoRA output's adapter_model.safetensors): from_pretrained cannot load "
                            "it; point it at the folder a finished step saved (its model/)")
    return problems


def _has_weights(folder: str) -> bool:
    return any(name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".index.json"))
               for name in os.listdir(folder))


def load_model_file(name: str) -> ModelConfig:
    """A conf/model file as a ModelConfig (its path, and the numbers that stand in for its config.json offline)."""
    node = OmegaConf.load(PROJECT_ROOT / "conf" / "model" / f"{name}.yaml")
    node.pop("defaults", None)
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), node))


def _at(base: ModelConfig, path: str) -> ModelConfig:
    """``base`` (a role's architecture numbers: the offline fallback) at the checkpoint ``path``: sized
    from that checkpoint's own config.json (or GGUF metadata), as the role loads it."""
    return dataclasses.replace(base, path=path, gguf_file=None, random_init=False)


def role_models(cfg: Config, critic_model: ModelConfig | None = None) -> tuple[ModelConfig, ModelConfig]:
    """The models the step really loads, as the pre-flight and the forecast size them: (the policy
    and its reference, the critic and reward model). The policy is actor.path's checkpoint where the
    step starts from one (PPO, the preference methods), else the model group; the critic and reward
    model are critic.path's / reward.path's checkpoints in PPO, else ``critic_model``, critic.model's
    conf/model file, or the model group."""
    spec = STEPS[cfg.step.name]
    actor = _at(cfg.model, cfg.actor.path) if cfg.actor.path and spec.policy.name == "actor" else cfg.model
    base = critic_model or (load_model_file(cfg.critic.model) if cfg.critic.model else cfg.model)
    path = (cfg.critic.path or cfg.reward.path) if spec.generates else ""
    return actor, _at(base, path) if path else base


def step_roles(cfg: Config) -> list[Role]:
    """The models this run of the step really builds (its spec's, less those its settings leave out:
    PPO without a reward-model weight builds no reward model, with a critic-free estimator no critic)."""
    return [r for r in STEPS[cfg.step.name].roles if cfg.step.builds(r.name)]
