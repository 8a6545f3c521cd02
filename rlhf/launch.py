"""Validate the composed config, write the run directory, and run the step (in-process for one
rank, through the DeepSpeed launcher for several). ``launch.py`` at the top level is the Hydra
entry that calls ``run``; tests call ``run`` directly with a config from ``hydra.compose``.

    python launch.py step=sft model=tiny-llama zero=3
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlhf.config import PROJECT_ROOT, Config, to_schema

# Environment variables that could carry secrets are never written into the run directory.
_SECRET_HINTS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def git_state() -> dict:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=PROJECT_ROOT, capture_output=True, text=True,
                                  check=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"sha": sha, "dirty": bool(status) if status is not None else None}


def versions() -> dict:
    import deepspeed
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "transformers": transformers.__version__, "platform": platform.platform()}


def write_run_dir(cfg: DictConfig, run_dir: Path, overrides: list[str], command: list[str]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (run_dir / "command.txt").write_text(shlex.join(command) + "\n")
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("RLHF_", "DS_", "OMP_", "CUDA_VISIBLE")) and not any(h in k for h in _SECRET_HINTS)}
    (run_dir / "run.json").write_text(json.dumps({"overrides": overrides, "git": git_state(), "versions": versions(),
                                                  "env": env}, indent=2))


def run(cfg: DictConfig, overrides: list[str] | None = None, command: list[str] | None = None) -> dict:
    """Compose-time checks -> run directory -> the step. Raises ConfigError for user errors."""
    schema: Config = to_schema(cfg)  # every __post_init__ check, before any model or data loads
    if not cfg.run_dir:
        from hydra.core.hydra_config import HydraConfig

        cfg.run_dir = HydraConfig.get().runtime.output_dir
        schema.run_dir = cfg.run_dir
    run_dir = Path(schema.run_dir).resolve()
    cfg.run_dir = schema.run_dir = str(run_dir)
    if schema.launch.dry_run:
        from rlhf.engine import ds_config

        print(OmegaConf.to_yaml(cfg, resolve=True))
        print(f"batch: {schema.step.micro_batch_size_per_device} micro x {schema.gradient_accumulation_steps} "
              f"accumulation x {schema.world_size} ranks = {schema.global_batch_size} rows per optimizer step")
        print(json.dumps(ds_config(schema), indent=2))
        return {}
    write_run_dir(cfg, run_dir, overrides or [], command or [sys.executable, *sys.argv])
    from rlhf.pipeline import is_chain, run_chain

    if is_chain(cfg):
        return run_chain(schema, overrides or [])
    if schema.world_size > 1 and "LOCAL_RANK" not in os.environ:
        return launch_ranks(schema, run_dir)
    from rlhf.worker import main

    return main(schema)


def compose_config(overrides: list[str]) -> DictConfig:
    """The config `python launch.py <overrides>` composes (inside a running Hydra app or outside)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from rlhf.config import quote_numeric_groups, register_configs

    register_configs()
    overrides = quote_numeric_groups(overrides)
    if GlobalHydra.instance().is_initialized():
        return compose(config_name="config", overrides=overrides)
    with initialize_config_dir(str(PROJECT_ROOT / "conf"), version_base=None):
        return compose(config_name="config", overrides=overrides)


def launch_command(cfg: Config, run_dir: Path) -> list[str]:
    """The DeepSpeed launcher command that starts every rank on the resolved config."""
    return ["deepspeed", "--no_local_rank", "--num_nodes", str(cfg.hardware.nodes),
            "--num_gpus", str(cfg.hardware.devices_per_node), "--module", "rlhf.worker", str(run_dir / "config.yaml")]


def launch_ranks(cfg: Config, run_dir: Path) -> dict:
    cmd = launch_command(cfg, run_dir)
    print("launching:", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=PROJECT_ROOT)
    final = run_dir / "final_metrics.json"
    return json.loads(final.read_text()) if final.exists() else {}
