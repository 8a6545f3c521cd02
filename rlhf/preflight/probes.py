"""Probes of the machine a run starts on, asked once, in seconds, before anything waits on them:
whether a hub model can be loaded here, how the CPU does bf16, and whether the devices, cores and
hostfile the hardware preset asks for are there.

    python -c "from rlhf.preflight.probes import hub_unreachable; print(hub_unreachable('facebook/opt-125m'))"
    python -c "from rlhf.preflight.probes import cpu_bf16; print(cpu_bf16())"
"""

from __future__ import annotations

import os
from pathlib import Path

from rlhf.config import Config, ConfigError, looks_local


def extensions_root() -> Path:
    """Where torch keeps the ops DeepSpeed compiles on first use (CPU Adam, the CPU shared-memory collective)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")


def hub_unreachable(repo_id: str) -> str | None:
    """Why a hub model id cannot be loaded here, or None: it is in the Hugging Face cache, or the hub
    answers. Asked once, in seconds, instead of from_pretrained's minutes of retries on every rank."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set and it is not in the Hugging Face cache (HF_HOME)"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as err:
        return f"{host} cannot be reached ({err}) and it is not in the Hugging Face cache (HF_HOME)"
    return None


def cpu_bf16() -> str:
    """How this CPU does bf16 matrix math: 'native (avx512_bf16)' / 'native (amx_bf16)', or 'emulated'
    (AVX2 only). Linux /proc/cpuinfo flags; 'unknown' elsewhere."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    native = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    return f"native ({native[0]})" if native else "emulated"


def check_launchable(schema: Config) -> None:
    """What only matters when ranks really start: hostfile for several nodes, enough devices, hub
    models reachable (``machine_problems``, refused in one line). Warns of bf16 on a CPU that emulates
    it (an order of magnitude slower than fp32 there; docs/design-notes.md)."""
    if schema.hardware.accelerator == "cpu" and schema.hardware.precision == "bf16" and cpu_bf16() == "emulated":
        print("WARNING hardware.precision=bf16 on a CPU without native bf16 (no avx512_bf16/amx_bf16 in "
              "/proc/cpuinfo): bf16 matmuls are emulated there, about 20x slower than with native support "
              "(bench/ppo_step.py: 17.7 s vs 0.84 s per step); hardware.precision=fp32 is faster on this CPU",
              flush=True)
    if problems := machine_problems(schema):
        raise ConfigError("; ".join(problems))


def machine_problems(schema: Config) -> list[str]:
    """What this machine lacks for the run: a hostfile for several nodes, the devices, a hub model it
    can neither reach nor find cached. The run refuses on them; a dry-run, which plans for the target
    machine, prints them apart from its verdict."""
    problems = []
    if schema.hardware.nodes > 1 and not schema.launch.hostfile and not os.environ.get("SLURM_JOB_NODELIST"):
        problems.append(f"hardware.nodes={schema.hardware.nodes} needs launch.hostfile (one 'host slots=N' line per "
                        "node), or a SLURM allocation")
    if schema.hardware.accelerator == "cuda":
        import torch

        have = torch.cuda.device_count()
        if have < schema.hardware.devices_per_node:
            fix = ("hardware=cpu runs it on this machine's CPU" if have == 0 else
                   f"pick a hardware preset of at most {have} device(s) per node")
            problems.append(f"hardware={schema.hardware.name} needs {schema.hardware.devices_per_node} CUDA device(s) "
                            f"per node but this machine has {have}: {fix}")
    elif schema.hardware.devices_per_node > (os.cpu_count() or 1):
        problems.append(f"hardware.devices_per_node={schema.hardware.devices_per_node} CPU ranks but this machine "
                        f"has {os.cpu_count()} cores")
    for key, path in (("model.path", schema.model.path if not schema.model.random_init else ""),
                      ("actor.path", schema.actor.path), ("critic.path", schema.critic.path),
                      ("reward.path", schema.reward.path)):
        if path and not looks_local(path) and (why := hub_unreachable(path)):
            problems.append(f"{key}={path!r} is a hub id, but {why}: download it where the hub is reachable "
                            "and pass the folder, or run where the hub is reachable")
    return problems
