"""Where a composed config goes: one step (rlhf.launch_step) or a chain of steps (rlhf.pipeline).
``launch.py`` at the top level is the Hydra entry that calls ``run``; tests call ``run`` directly
with a config from ``rlhf.config.compose_config``.

    python launch.py step=sft model=tiny-llama zero=3     # one step
    python launch.py pipeline=e2e                         # the chain
"""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from rlhf import launch_step, pipeline
from rlhf.config import Config, to_schema


def run(cfg: DictConfig, overrides: list[str] | None = None, command: list[str] | None = None) -> dict:
    """Validate (every schema check, before any model or data loads), fix the run directory, and
    run the step or the chain. Raises ConfigError for user errors, before anything is written."""
    schema: Config = to_schema(cfg)
    if not cfg.run_dir:
        from hydra.core.hydra_config import HydraConfig

        cfg.run_dir = HydraConfig.get().runtime.output_dir
    cfg.run_dir = schema.run_dir = str(Path(cfg.run_dir).resolve())
    overrides, command = overrides or [], command or [sys.executable, *sys.argv]
    if pipeline.is_chain(cfg):
        return pipeline.run_chain(cfg, schema, overrides, command)
    return launch_step.run_step(cfg, schema, overrides, command)
