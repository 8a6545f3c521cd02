"""What a run directory records about the run in it, and whether a new run may continue it: the
resolved config, the command, git state, library versions and environment (config.yaml,
command.txt, run.json); and the settings diff against the run already there.

    python -c "from rlhf.launch.provenance import git_state; print(git_state())"
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlhf.config import PROJECT_ROOT, ConfigError
from rlhf.files import write_whole

# Environment variables that could carry secrets are never written into the run directory.
_SECRET_HINTS = ("KEY", "TOKEN", "SECRET", "PASSWORD")

# Keys that change how a run is watched, launched or checkpointed, not what it computes: a resume
# (or a rerun of a finished chain) may change them; any other key must match the run in the folder.
_NOT_RESULTS = ("logging", "resume", "launch", "checkpoint", "run_dir", "step.log_every_steps")


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
    write_whole(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    write_whole(run_dir / "command.txt", shlex.join(command) + "\n")
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("RLHF_", "DS_", "OMP_", "CUDA_VISIBLE")) and not any(h in k for h in _SECRET_HINTS)}
    write_whole(run_dir / "run.json", json.dumps({"overrides": overrides, "git": git_state(), "versions": versions(),
                                                   "env": env}, indent=2))


def flat_keys(node, prefix: str = "") -> dict:
    """A nested config container as {dotted key: leaf}."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in flat_keys(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def changed_settings(run_dir: Path, cfg: DictConfig) -> dict[str, str]:
    """{key: 'old -> new'} for each setting that differs from the run already in ``run_dir`` (its
    config.yaml), where that run left something to continue or reuse (a checkpoint or its final
    metrics); empty otherwise. Continuing under other settings would silently mix two runs."""
    old_file = run_dir / "config.yaml"
    if not old_file.exists() or not ((run_dir / "final_metrics.json").exists() or (run_dir / "checkpoints").exists()):
        return {}
    old = flat_keys(OmegaConf.to_container(OmegaConf.load(old_file), resolve=False))
    new = flat_keys(OmegaConf.to_container(cfg, resolve=True))
    # A key the schema gained after that run (absent there) at its default changes nothing the run did:
    # otherwise every new setting would make every earlier run "another experiment".
    defaults = schema_defaults(str(new.get("step.name", "")))
    return {k: f"{old.get(k, '(absent)')} -> {new.get(k, '(absent)')}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and not any(k == p or k.startswith(p + ".") for p in _NOT_RESULTS)
            and not (k not in old and k in defaults and new.get(k) == defaults[k])}


def schema_defaults(step: str) -> dict[str, object]:
    """Every key's default in the typed schema (the step's own schema under step.*), flattened."""
    from rlhf.config import STEP_SCHEMAS, Config

    out = {k: v for k, v in flat_keys(OmegaConf.to_container(OmegaConf.structured(Config))).items()
           if not k.startswith("step.")}
    if step in STEP_SCHEMAS:
        out.update({f"step.{k}": v for k, v in flat_keys(OmegaConf.to_container(
            OmegaConf.structured(STEP_SCHEMAS[step]))).items()})
    return out


def shown_changes(changes: dict[str, str], limit: int = 6) -> str:
    """The first ``limit`` changes as 'key: old -> new; ...' and how many more."""
    shown = "; ".join(f"{k}: {v}" for k, v in list(changes.items())[:limit])
    return shown + (f"; and {len(changes) - limit} more" if len(changes) > limit else "")


def refuse_changed_settings(run_dir: Path, cfg: DictConfig, what: str, changes: dict[str, str] | None = None) -> None:
    """Refuses to continue ``run_dir`` under other settings; ``changes``: changed_settings' result, when
    the caller has it already."""
    if changes := (changed_settings(run_dir, cfg) if changes is None else changes):
        raise ConfigError(f"{run_dir} holds {what} made with other settings ({shown_changes(changes)}): continuing "
                          "it would mix two runs. Give another run_dir, or resume=never to start over in this folder")


# What a run reads back when it continues in its folder, besides its checkpoints: the reward step's
# pairs of the policy's own answers and the evaluations' appended samples. A start over drops them.
_READ_BACK = ("policy_pairs.jsonl", "samples.jsonl")


def start_over(run_dir: Path) -> None:
    """resume=never, or a chain's step whose settings changed: the folder's checkpoints, final metrics
    and what a resumed run reads back go, so nothing of the old run is resumed or reused later by
    mistake (its config.yaml, logs and metrics are rewritten by the new run)."""
    import shutil

    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    for name in ("final_metrics.json", *_READ_BACK):
        (run_dir / name).unlink(missing_ok=True)
