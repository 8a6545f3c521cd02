"""The steps' schemas and the step registry STEPS: one StepSpec per step owns everything keyed by a
step's name (schema and chain delta, runner kind, rows, roles, sweep objective, summary figures,
chain inputs, readiness checks, preference loss). Nothing outside this module branches on a step's
name: adding a preference method is its loss in rlhf.losses.PREFERENCE_LOSSES, one schema and
STEPS entry here (its schema in rlhf/config/steps/preference.py), and one conf/step/<name>.yaml.

    python -c "from rlhf.config import STEPS"   # used through rlhf.config; no command of its own
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

from rlhf.config.groups import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RoleConfig,
    ZeroConfig,
)
from rlhf.config.steps.base import GreedyEvalStepConfig, StepConfig
from rlhf.config.steps.ppo import PPOStepConfig
from rlhf.config.steps.preference import (
    DPOStepConfig,
    KTOStepConfig,
    ORPOStepConfig,
    PreferenceStepConfig,
    ReferenceStepConfig,
    SimPOStepConfig,
)
from rlhf.config.steps.supervised import RewardStepConfig, SFTStepConfig

__all__ = ["STEPS", "STEP_SCHEMAS", "Role", "StepSpec", "step_delta", "StepConfig", "GreedyEvalStepConfig",
           "SFTStepConfig", "RewardStepConfig", "PreferenceStepConfig", "ReferenceStepConfig", "DPOStepConfig",
           "SimPOStepConfig", "ORPOStepConfig", "KTOStepConfig", "PPOStepConfig"]


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
                "reward": RoleConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
                "parallel": ParallelConfig}
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
    def slices_sequences(self) -> bool:
        """Whether parallel.sequence can split its rows' tokens over ranks: every forward it trains
        through is over whole rows it was given, not over answers it generates as it trains."""
        return not self.generates

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
