"""Where a composed config goes: one step (its plan, rlhf.preflight.plan, executed by rlhf.launch.step) or a
chain of steps (rlhf.chain.pipeline, one plan per step).
``launch.py`` at the top level is the Hydra entry that calls ``run``; tests call ``run`` directly
with a config from ``rlhf.config.compose_config``.

    python launch.py step=sft model=tiny-llama zero=3     # one step
    python launch.py pipeline=e2e                         # the chain
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from rlhf.config import Config, to_schema


def run(cfg: DictConfig, overrides: list[str] | None = None, command: list[str] | None = None) -> dict:
    """Validate (every schema check, before any model or data loads), fix the run directory, and
    run the step or the chain. Raises ConfigError for user errors, before anything is written."""
    schema: Config = to_schema(cfg)
    # Here, not at the top: the launch package's modules (rlhf.launch.processes, which the plan reads)
    # import without the chain, which imports them.
    from rlhf.chain import pipeline
    from rlhf.launch import step as launch_step
    from rlhf.worker import quiet_libraries

    quiet_libraries()  # a dry-run and a chain read data and build models here too: no library bars
    if not cfg.run_dir:
        from hydra.core.hydra_config import HydraConfig

        cfg.run_dir = HydraConfig.get().runtime.output_dir
    cfg.run_dir = schema.run_dir = str(Path(cfg.run_dir).resolve())
    overrides, command = overrides or [], command or [sys.executable, *sys.argv]
    if pipeline.is_chain(cfg):
        return pipeline.run_chain(cfg, schema, overrides, command)
    return launch_step.run_step(cfg, schema, overrides, command)


def usage() -> str:
    """`python launch.py --help`: the groups and their options as the files on disk have them, where
    each key is documented (the comment above it), instead of Hydra's dump of every resolved key."""
    from rlhf.config import PROJECT_ROOT

    conf = PROJECT_ROOT / "conf"

    def options(folder: Path) -> str:
        return ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))

    groups = [(d.name, options(d)) for d in sorted(conf.iterdir()) if d.is_dir() and d.name not in ("hydra", "stage")]
    groups.append(("sweep", options(PROJECT_ROOT / "sweeps" / "sweep") + "   (with -m; files in sweeps/sweep/)"))
    groups.append(("hydra/launcher", "basic (default: jobs one after the other), joblib (N at a time: "
                   "hydra.launcher.n_jobs=N), " + options(conf / "hydra" / "launcher") + "   (with -m)"))
    groups.append(("hydra/sweeper", "basic (default: the grid), optuna (a search; see sweeps/sweep/reward_optuna.yaml)"))
    groups.append(("stage", ", ".join(sorted(d.name for d in (conf / "stage").iterdir() if d.is_dir()))
                   + "   (a chain's per-step files, named by pipeline.stages.<step>)"))
    width = max(len(name) for name, _ in groups)
    lines = ["usage: python launch.py [group=option ...] [key=value ...]        one step, or a chain with pipeline=e2e",
             "       python launch.py -m [group=a,b ...] [key=x,y ...]           a sweep (or sweep=<name>)",
             "       python launch.py ... launch.dry_run=true                    DeepSpeed JSON, batch math, launch",
             "                                                                   command and memory verdict only",
             "",
             "Config groups (conf/<group>/<option>.yaml):"]
    lines += [f"  {name:<{width}}  {opts}" for name, opts in groups]
    lines += ["",
              "Every key is documented by the comment above it in its YAML file (conf/config.yaml, conf/step/<step>.yaml,",
              "conf/model/..., conf/data/...); a misspelled key is refused with the nearest known one. Main keys:",
              "  step.epochs  step.max_steps  step.micro_batch_size_per_device  optim.lr  seed  run_dir  resume",
              "  lora.rank  step.gradient_checkpointing  parallel.sequence  data.sources  data.rule  actor.path  critic.path",
              "  pipeline.<step>.<key>=value   one key of one step of a chain, e.g. pipeline.ppo.step.epochs=1",
              "",
              "The composed config of a command:  python launch.py [overrides] --cfg job",
              "Hydra's own help:                   python launch.py --hydra-help",
              "More: README.md"]
    return "\n".join(lines)
