"""One step's launch, worked out before anything runs: compose (the validated schema) -> checks ->
memory -> forecast -> the command that starts the ranks. Built once by ``build_plan``; the dry-run
prints it (``Plan.text``), the launch refuses on it (``Plan.refuse``) and executes it
(rlhf.launch.step).

    python launch.py step=ppo launch.dry_run=true              # prints the plan of the PPO step
    python launch.py pipeline=e2e launch.dry_run=true          # one plan per step of the chain
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from rlhf.config import (
    STEPS,
    Config,
    ConfigError,
    DataError,
    ModelConfig,
    load_model_file,
    looks_local,
    missing_paths,
    ppo_updates_per_step,
    role_models,
    step_roles,
)
from rlhf.launch.processes import launch_command, per_node_text
from rlhf.preflight import memory
from rlhf.preflight.forecast import StepForecast, step_forecast
from rlhf.preflight.forecast import table as forecast_table


@dataclass
class Plan:
    """Everything the launch of one step needs decided, and the reasons it would be refused.

    ``command`` is the DeepSpeed launcher command for several ranks, None for one rank (run in this
    process); inside a SLURM job step the node's own part (--node_rank, --master_addr) is read from
    the allocation when the step starts (rlhf.launch.processes.slurm_node). ``problems`` are refusals whatever the memory says; ``fits`` is the memory verdict
    alone (launch.force=true starts a step that does not fit, never one with problems)."""

    schema: Config
    run_dir: Path
    arithmetic: list[str]  # the header line and the batch arithmetic
    ds_configs: dict[str, dict]  # the DeepSpeed JSON of each role the step builds
    command: list[str] | None
    nodes: list[str]  # several nodes: the per-node commands and the hostfile
    sizes: list[str]  # each model's sizes and where they come from
    problems: list[str]
    memory: list  # rlhf.preflight.memory.estimate's per-role figures
    fits: bool
    forecast: StepForecast | None
    no_forecast: str = ""  # why there is none (no peak, unreadable data)
    # Where the step does not fit: the fewest ranks per sequence with which it would (None: none).
    sequence_fit: int | None = None
    # The data reader's refusal (also among the problems), raised as itself where it is the only one.
    data_error: DataError | None = None

    def text(self) -> str:
        """The dry-run's printout: batch math, DeepSpeed JSON per role, launch command, sizes,
        refusals, the memory table and the forecast."""
        shown = ["python", "launch.py", "(in-process, 1 rank)"] if self.command is None else self.command
        lines = [*self.arithmetic, *(f"deepspeed config [{role}]: {json.dumps(ds)}" for role, ds in self.ds_configs.items()),
                 "launch: " + shlex.join(shown), *self.nodes, *self.sizes, *(f"refused: {p}" for p in self.problems),
                 memory.table(self.memory, self.schema.hardware.memory_per_device_gb),
                 *([self._fits_with()] if self.sequence_fit else []),
                 forecast_table(self.forecast) if self.forecast is not None
                 else f"forecast [{self.schema.step.name}]: none ({self.no_forecast})"]
        return "\n".join(lines)

    def _fits_with(self) -> str:
        n = self.sequence_fit
        return (f"memory: it fits with parallel.sequence={n} (each of {n} ranks holds 1/{n} of every sequence's "
                f"activations; {self.schema.world_size // n} data-parallel groups)")

    def refuse(self) -> None:
        """Raise ConfigError when the step cannot run (before anything is written); the data reader's
        own DataError where it is the only reason (said as a data error, naming the file and row)."""
        if self.data_error is not None and self.problems == [str(self.data_error)]:
            raise self.data_error
        if self.problems:
            raise ConfigError("; ".join(self.problems))
        if not self.fits and not self.schema.launch.force:
            raise ConfigError(f"the run does not fit on {self.schema.hardware.name}:\n{self.text()}\n"
                              + (f"Set parallel.sequence={self.sequence_fit}, or lower" if self.sequence_fit else "Lower")
                              + " the micro batch, raise the zero stage, offload, use LoRA or checkpointing, or set "
                              "launch.force=true to run anyway.")

    def dry_run_result(self) -> dict:
        """What a dry-run found: whether the real run would start, and if not, why (the same reasons the
        real run refuses with; launch.force=true lets a run that does not fit start)."""
        why = list(self.problems)
        if not self.fits and not self.schema.launch.force:
            why.append(f"{self.schema.step.name} does not fit in {self.schema.hardware.name}'s memory (the table "
                       "above" + (f"; it fits with parallel.sequence={self.sequence_fit}" if self.sequence_fit else "")
                       + "; launch.force=true runs it anyway)")
        return {"dry_run": True, "fits": self.fits and not self.problems, "refused": why}


def build_plan(schema: Config, run_dir: Path, will_exist: dict[str, ModelConfig] | None = None,
               keys: str = "") -> Plan:
    """The plan of one step. ``will_exist``: model folders an earlier step of the same launch writes
    (not refused as missing), each with the model that step trains, whose architecture its output has
    (sized from that model until the folder exists); ``keys``: what a fix's key starts with
    (pipeline.<step>. in a chain)."""
    from rlhf.models import ppo_role_problems  # torch and transformers: loaded where a model is sized

    will_exist = will_exist or {}
    critic = load_model_file(schema.critic.model) if schema.critic.model else None
    # What the step loads, each sized from its own config.json (or GGUF metadata, or conf/model numbers
    # offline): the policy from actor.path where the step starts from one, the critic and reward model
    # from theirs; an earlier step's output not written yet, from the model that step trains.
    sizing = shaped_as_built(schema, will_exist)
    actor, judge = role_models(sizing, critic)
    sized = [("model.path" if actor is sizing.model else "actor.path", actor)]
    if any(not r.lm_head for r in step_roles(schema)) and judge is not sizing.model:
        key = next((k for k, v in (("critic.path", sizing.critic.path), ("reward.path", sizing.reward.path))
                    if v and v == judge.path), "critic.model")
        sized.append((key, judge))
    problems = missing_paths(schema, will_exist) + ppo_role_problems(sizing) + random_start(schema, keys) \
        + budget_problems(sizing, keys) + sequence_problems(sizing, [m for _, m in sized])
    # A hub id's conf/model numbers size an offline dry-run (it plans for a machine that can reach the
    # hub); a local folder without config.json fails from_pretrained wherever the run goes.
    problems += [f"{key}={m.path!r}: {memory.sizes(m).source}; from_pretrained needs its config.json"
                 for key, m in sized if memory.sizes(m).fallback and looks_local(m.path)
                 and m.path not in will_exist and not any(repr(m.path) in p for p in problems)]
    estimate = memory.estimate(sizing, critic)
    fits, _ = memory.verdict(estimate, schema.hardware.memory_per_device_gb)
    forecast, no_forecast = _forecast(sizing)
    data_error = no_forecast if isinstance(no_forecast, DataError) else None
    if data_error is not None:  # the data the run would read is refused by its reader
        problems.append(str(data_error))
    return Plan(schema=schema, run_dir=run_dir, arithmetic=_arithmetic(schema), ds_configs=_ds_configs(schema),
                command=launch_command(schema, [run_dir]) if schema.world_size > 1 else None,
                nodes=_nodes(schema), sizes=[f"sizes [{m.name if key.startswith('model') else key}]: "
                                                    f"{memory.sizes(m).describe()}{_not_yet(schema, key, will_exist)}"
                                                    for key, m in sized],
                problems=problems, memory=estimate, fits=fits, forecast=forecast, no_forecast=str(no_forecast),
                data_error=data_error, sequence_fit=None if fits else sequence_fit(sizing, critic))


def _not_yet(schema: Config, key: str, will_exist: dict) -> str:
    group, field = key.split(".")
    path = getattr(getattr(schema, group), field) if field == "path" else ""
    if _written_later(path, will_exist) is not None:
        return f" (as {key}={path}, which an earlier step of the chain writes with this architecture)"
    return ""


def _written_later(path: str, will_exist: dict[str, ModelConfig]) -> ModelConfig | None:
    """The model an earlier step trains into ``path``, where that step has not written it yet."""
    return will_exist.get(path) if path and not os.path.exists(os.path.expanduser(path)) else None


def shaped_as_built(schema: Config, will_exist: dict[str, ModelConfig]) -> Config:
    """``schema`` as the pre-flight sizes it before a chain has run: each model path that an earlier
    step writes and that is not there yet stands for the model that step trains (a step's output keeps
    its start's architecture), so a GGUF or hub model with no numbers in conf/model is sized from its
    own metadata at every step of the chain, not only the first."""
    def built(path: str) -> ModelConfig | None:
        # A random model's output is sized by its conf/model numbers, which the step's own config holds.
        m = _written_later(path, will_exist)
        return m if m is not None and m.path else None

    sizing = copy.copy(schema)
    if (m := built(schema.model.path)) is not None:
        sizing.model = dataclasses.replace(schema.model, path=m.path, gguf_file=m.gguf_file, random_init=m.random_init)
    for role in ("actor", "critic", "reward"):
        if (m := built(getattr(schema, role).path)) is not None:
            where = os.path.join(m.path, m.gguf_file) if m.gguf_file else m.path
            setattr(sizing, role, dataclasses.replace(getattr(schema, role), path=where))
    return sizing


def sequence_problems(schema: Config, models: list[ModelConfig]) -> list[str]:
    """parallel.sequence's refusals for each model the step trains or scores, from its own config.json
    (the run asks the loaded model the same)."""
    from rlhf.sequence import problems

    found = []
    for m in models:
        s = memory.sizes(m)
        if why := problems(s.family, s.architecture, s.num_heads, s.num_kv_heads, schema.parallel.sequence):
            found.append(why)
    return list(dict.fromkeys(found))


def sequence_fit(schema: Config, critic: ModelConfig | None) -> int | None:
    """The fewest ranks per sequence (parallel.sequence) with which a step that does not fit would fit,
    where its rows can be split and its models allow it; None where none does."""
    if schema.parallel.sequence > 1 or not STEPS[schema.step.name].slices_sequences:
        return None
    from rlhf.sequence import problems

    s = memory.sizes(schema.model)
    for n in range(2, schema.world_size + 1):
        if schema.world_size % n or problems(s.family, s.architecture, s.num_heads, s.num_kv_heads, n):
            continue
        trial = copy.copy(schema)
        trial.parallel = dataclasses.replace(schema.parallel, sequence=n)
        if memory.verdict(memory.estimate(trial, critic), schema.hardware.memory_per_device_gb)[0]:
            return n
    return None


def random_start(schema: Config, keys: str = "") -> list[str]:
    """A policy step (PPO, the preference methods) with no actor.path starts from the model group's
    weights; where those are random (a tiny random model) it would train a policy that knows nothing,
    which nobody means without saying so (actor.random_init=true)."""
    if STEPS[schema.step.name].policy.name != "actor" or schema.actor.path or not schema.model.random_init \
            or schema.actor.random_init:
        return []
    return [f"step={schema.step.name} has no {keys}actor.path and model={schema.model.name} is a random model: the "
            f"policy would start from random weights. Give {keys}actor.path=<an SFT output>/model (python launch.py "
            f"step=sft run_dir=DIR first, or a chain: pipeline=e2e), or {keys}actor.random_init=true to train from "
            "random weights on purpose"]


# A budget that holds fewer than this share of the data's reference answers whole is refused; the fix
# names the budget that holds BUDGET_SUGGESTS of them.
BUDGET_REFUSES, BUDGET_SUGGESTS = 0.5, 0.9


def budget_problems(schema: Config, keys: str = "") -> list[str]:
    """A generation budget too short for the data's answers: where the step generates answers a rule
    judges (PPO's rollouts and evaluations, SFT's and the preference steps' held-out accuracy), the
    reference answers of local data, tokenized as the run tokenizes them (their content: a rule reads
    an answer cut right after it as whole), must fit step.max_new_tokens for at least BUDGET_REFUSES
    of them; else most generated answers are cut before their final answer and judged wrong, and the
    accuracy reads near 0 whatever the model learned. PPO with step.truncated_answers=penalty or mask
    has said what cut answers get, and is not refused."""
    step = schema.step
    budget, cut = step.answer_budget(), step.cut_answers_setting()
    if budget is None or cut not in (None, "keep"):
        return []
    from rlhf.data.blend import references
    from rlhf.preflight.forecast import data_tokenizer

    try:
        tokenizer = data_tokenizer(schema)
        table = references(schema.data, tokenizer) if tokenizer is not None else {}
    except (ValueError, OSError):  # the data's own refusal comes from its reader, in the data's words
        return []
    answers = [a for a in list(table.values())[:2000] if a.strip()]
    if len(answers) < 8:
        return []
    lengths = sorted(len(tokenizer(a, add_special_tokens=False).input_ids) for a in answers)
    fits = sum(n <= budget for n in lengths) / len(lengths)
    if fits >= BUDGET_REFUSES:
        return []
    needed = lengths[min(len(lengths) - 1, int(BUDGET_SUGGESTS * len(lengths)))] + 1  # and the end of the answer
    suggest = -(-needed // 8) * 8
    return [f"{keys}step.max_new_tokens={budget} holds only {fits:.0%} of the data's {len(lengths)} reference answers "
            f"whole ({needed} tokens with the end of the answer hold {BUDGET_SUGGESTS:.0%} of them, the longest is "
            f"{lengths[-1] + 1}, counted with the run's tokenizer): most answers would be cut before their final answer "
            f"and judged wrong. Set {keys}step.max_new_tokens={suggest}"
            + (f", or say what cut answers get ({keys}step.truncated_answers=mask or penalty)"
               if cut is not None else "")]


def _arithmetic(schema: Config) -> list[str]:
    step = schema.step
    lines = [f"== {step.name}: {schema.model.name} on {schema.hardware.name} "
             f"({schema.hardware.nodes} node(s) x {schema.hardware.devices_per_node}), zero {schema.zero.stage}"
             + (" + offload" if schema.zero.offload_optimizer.device != "none" else "")]
    sp = schema.parallel.sequence
    readers = (f"{schema.data_parallel_size} data-parallel groups of {sp} ranks sharing each sequence" if sp > 1
               else f"{schema.world_size} ranks")
    lines.append(f"batch: {step.micro_batch_size_per_device} micro x {step.gradient_accumulation_steps} "
                 f"accumulation x {readers} = {step.global_batch_size} "
                 f"{STEPS[step.name].rows} per optimizer step")
    if sp > 1:
        lines.append(f"sequence parallel: each rank runs {-(-step.max_seq_len // sp)} of every sequence's up to "
                     f"{step.max_seq_len} tokens (DeepSpeed Ulysses: all-to-alls around each layer's attention); "
                     "answers the step generates (held-out accuracy, policy pairs) are generated whole on each rank. "
                     f"DeepSpeed's train_batch_size counts every rank ({step.global_batch_size * sp})")
    if STEPS[step.name].generates:
        lines.append(f"rollouts: {step.rollout_batch_size_per_device} per device x {schema.world_size} ranks = "
                     f"{step.rollout_batch_size_per_device * schema.world_size} per PPO step, "
                     f"{ppo_updates_per_step(schema)} optimizer steps each ({step.ppo_epochs} PPO epoch(s) x "
                     f"{step.rollout_batch_size_per_device} rollouts / {step.micro_batch_size_per_device} micro x "
                     f"{step.gradient_accumulation_steps} accumulation)")
    return lines


def _ds_configs(schema: Config) -> dict[str, dict]:
    from rlhf.engine import ds_config

    step = schema.step
    return {role.name: ds_config(schema, trainable=role.trainable,
                                 offload=not role.trainable and step.offloads(role.name))
            for role in step_roles(schema)}


def _nodes(schema: Config) -> list[str]:
    if schema.hardware.nodes <= 1:
        return []
    hostfile = (f"hostfile: {schema.launch.hostfile} " if schema.launch.hostfile else
                f"hostfile: needed -- launch.hostfile=FILE with {schema.hardware.nodes} lines 'HOST "
                f"slots={schema.hardware.devices_per_node}', or submit with hydra/launcher=slurm (written from "
                "the allocation)")
    return [per_node_text(schema), hostfile]


def _forecast(schema: Config) -> tuple[StepForecast | None, str | DataError]:
    """The step's forecast, or why there is none: the data's own refusal (a DataError, which the run
    would meet too), or a reason it cannot be forecast (hub data without a row count, say)."""
    try:
        return step_forecast(schema), ""
    except DataError as e:
        return None, e
    except (ValueError, OSError) as e:
        return None, str(e)
