"""One step, as the user or the chain asks for it: memory pre-flight and checks, the run directory,
then the runner in-process (one rank) or through the DeepSpeed launcher (several ranks or nodes).

    python launch.py step=sft model=tiny-llama zero=3         # rlhf.launch.run -> run_step
    python launch.py step=ppo launch.dry_run=true              # the pre-flight only
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from rlhf import ranks
from rlhf.config import (
    PROJECT_ROOT,
    STEPS,
    Config,
    ConfigError,
    DataError,
    load_model_file,
    looks_local,
    missing_paths,
    ppo_updates_per_step,
    step_roles,
)
from rlhf.errors import DiskFullError
from rlhf.files import write_whole
from rlhf.probes import hub_unreachable

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
    write_whole(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    write_whole(run_dir / "command.txt", shlex.join(command) + "\n")
    env = {k: v for k, v in os.environ.items()
           if k.startswith(("RLHF_", "DS_", "OMP_", "CUDA_VISIBLE")) and not any(h in k for h in _SECRET_HINTS)}
    write_whole(run_dir / "run.json", json.dumps({"overrides": overrides, "git": git_state(), "versions": versions(),
                                                   "env": env}, indent=2))


# Keys that change how a run is watched, launched or checkpointed, not what it computes: a resume
# (or a rerun of a finished chain) may change them; any other key must match the run in the folder.
_NOT_RESULTS = ("logging", "resume", "launch", "checkpoint", "run_dir", "step.log_every_steps")


def flat_keys(node, prefix: str = "") -> dict:
    """A nested config container as {dotted key: leaf}."""
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in flat_keys(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: node}


def changed_settings(run_dir: Path, cfg: DictConfig) -> list[str]:
    """'key: old -> new' for each setting that differs from the run already in ``run_dir`` (its
    config.yaml), where that run left something to continue or reuse (a checkpoint or its final
    metrics); empty otherwise. Continuing under other settings would silently mix two runs."""
    old_file = run_dir / "config.yaml"
    if not old_file.exists() or not ((run_dir / "final_metrics.json").exists() or (run_dir / "checkpoints").exists()):
        return []
    old = flat_keys(OmegaConf.to_container(OmegaConf.load(old_file), resolve=False))
    new = flat_keys(OmegaConf.to_container(cfg, resolve=True))
    return [f"{k}: {old.get(k, '(absent)')} -> {new.get(k, '(absent)')}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and not any(k == p or k.startswith(p + ".") for p in _NOT_RESULTS)]


def refuse_changed_settings(run_dir: Path, cfg: DictConfig, what: str) -> None:
    if changes := changed_settings(run_dir, cfg):
        shown = "; ".join(changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
        raise ConfigError(f"{run_dir} holds {what} made with other settings ({shown}): continuing it would mix "
                          "two runs. Give another run_dir, or resume=never to start over in this folder")


def start_over(run_dir: Path) -> None:
    """resume=never: the folder's checkpoints and final metrics go, so nothing of the old run is
    resumed or reused later by mistake (its config.yaml and logs are rewritten by the new run)."""
    import shutil

    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    (run_dir / "final_metrics.json").unlink(missing_ok=True)


def preflight(schema: Config, run_dir: Path, will_exist: tuple[str, ...] = ()) -> tuple[bool, str, list[str]]:
    """Batch arithmetic, DeepSpeed JSON per role, launch command and the memory table, as text;
    whether the memory fits; and the problems that would make the real run refuse to start."""
    from rlhf import memory
    from rlhf.engine import ds_config

    step = schema.step
    lines = [f"== {step.name}: {schema.model.name} on {schema.hardware.name} "
             f"({schema.hardware.nodes} node(s) x {schema.hardware.devices_per_node}), zero {schema.zero.stage}"
             + (" + offload" if schema.zero.offload_optimizer.device != "none" else "")]
    lines.append(f"batch: {step.micro_batch_size_per_device} micro x {step.gradient_accumulation_steps} "
                 f"accumulation x {schema.world_size} ranks = {step.global_batch_size} "
                 f"{STEPS[step.name].rows} per optimizer step")
    if STEPS[step.name].generates:
        lines.append(f"rollouts: {step.rollout_batch_size_per_device} per device x {schema.world_size} ranks = "
                     f"{step.rollout_batch_size_per_device * schema.world_size} per PPO step, "
                     f"{ppo_updates_per_step(schema)} optimizer steps each ({step.ppo_epochs} PPO epoch(s) x "
                     f"{step.rollout_batch_size_per_device} rollouts / {step.micro_batch_size_per_device} micro x "
                     f"{step.gradient_accumulation_steps} accumulation)")
    offloaded = {"reference": getattr(step, "offload_reference", False), "reward": getattr(step, "offload_reward", False)}
    for role in step_roles(schema):
        ds = ds_config(schema, trainable=role.trainable, offload=not role.trainable and offloaded.get(role.name, False))
        lines.append(f"deepspeed config [{role.name}]: {json.dumps(ds)}")
    cmd = launch_command(schema, [run_dir]) if schema.world_size > 1 else ["python", "launch.py", "(in-process, 1 rank)"]
    lines.append("launch: " + shlex.join(cmd))
    if schema.hardware.nodes > 1:
        lines.append(per_node_text(schema))
        lines.append(f"hostfile: {schema.launch.hostfile} " if schema.launch.hostfile else
                     f"hostfile: needed -- launch.hostfile=FILE with {schema.hardware.nodes} lines 'HOST "
                     f"slots={schema.hardware.devices_per_node}', or submit with hydra/launcher=slurm (written from "
                     "the allocation)")
    critic = load_model_file(schema.critic.model) if schema.critic.model else None
    # Where the sizes below come from: the model's config.json, or its conf/model numbers offline.
    sized = [schema.model] + ([critic] if critic and any(not r.lm_head for r in step_roles(schema)) else [])
    lines += [f"sizes [{m.name}]: {memory.sizes(m).describe()}" for m in sized]
    from rlhf.models import ppo_role_problems  # torch and transformers: loaded where a model is sized

    problems = missing_paths(schema, will_exist) + ppo_role_problems(schema)
    if not schema.launch.dry_run:  # conf/model numbers size dry-runs only; a run loads config.json
        # (an earlier step of the same chain writes the folders in will_exist: sized by its numbers until then)
        problems += [f"model.path={m.path!r}: {memory.sizes(m).source}; from_pretrained needs its config.json"
                     for m in sized if memory.sizes(m).fallback and looks_local(m.path) and m.path not in will_exist]
    lines += [f"refused: {p}" for p in problems]
    estimate = memory.estimate(schema, critic)
    fits, _ = memory.verdict(estimate, schema.hardware.memory_per_device_gb)
    lines.append(memory.table(estimate, schema.hardware.memory_per_device_gb))
    lines.append(forecast_text(schema))
    return fits, "\n".join(lines), problems


def per_node_text(schema: Config) -> str:
    """The other way to start several nodes, for clusters without ssh between them: one command per
    node, each starting its own ranks (the DeepSpeed launcher's --no_ssh --node_rank)."""
    addr = schema.launch.master_addr or "NODE0_ADDRESS"
    return (f"launch without ssh between nodes: on node K (K = 0 .. {schema.hardware.nodes - 1}) run this command "
            f"with launch.node_rank=K launch.master_addr={addr} (the same hostfile and run_dir on a filesystem "
            f"every node sees); node K starts ranks {schema.hardware.devices_per_node}K .. "
            f"{schema.hardware.devices_per_node}K+{schema.hardware.devices_per_node - 1}")


def write_forecast(schema: Config, run_dir: Path) -> None:
    """Say the step's forecast in one line and keep it in RUN_DIR/forecast.json with the time it
    started, so the final figures can put forecast and actual side by side."""
    from rlhf import forecast

    try:
        f = forecast.step_forecast(schema)
    except (ValueError, OSError) as e:
        print(f"[{schema.step.name}] no forecast: {e}", flush=True)
        return
    per_step = f.seconds / max(f.steps, 1)
    money = f", ${f.cost:,.2f}" if f.cost is not None else ""
    print(f"[{schema.step.name}] forecast: {forecast.duration(f.seconds)} for {f.steps:,} steps "
          f"({per_step:.3g} s each) on {f.devices} device(s){money}", flush=True)
    (run_dir / "forecast.json").write_text(json.dumps({"started_at": time.time(), "seconds_per_step": per_step,
                                                       **f.as_dict()}, indent=2))


def forecast_text(schema: Config) -> str:
    """The forecast table, or the one line that says why there is none (no peak, unreadable data)."""
    from rlhf import forecast

    try:
        return forecast.table(forecast.step_forecast(schema))
    except (ValueError, OSError) as e:
        return f"forecast [{schema.step.name}]: none ({e})"


def slurm_hostfile(schema: Config, run_dir: Path) -> list[str]:
    """Inside a SLURM allocation, its nodes (empty outside one), written as the DeepSpeed hostfile
    RUN_DIR/hostfile (through a rename: every node's task writes it, and reads it)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return []
    hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                           check=True).stdout.split()
    write_whole(run_dir / "hostfile", "".join(f"{h} slots={schema.hardware.devices_per_node}\n" for h in hosts))
    schema.launch.hostfile = str(run_dir / "hostfile")
    return hosts


def slurm_node(schema: Config, hosts: list[str]) -> None:
    """In a SLURM job step that runs launch.py once per node (hydra/launcher=slurm: srun with one task
    per node), each task starts its own node's ranks (--no_ssh --node_rank SLURM_NODEID) with rank 0
    on the allocation's first node, instead of every task starting every node over ssh. Another
    count of tasks per node would start the ranks several times over: refused."""
    tasks, nodes = os.environ.get("SLURM_STEP_NUM_TASKS"), os.environ.get("SLURM_STEP_NUM_NODES")
    if not hosts or tasks is None or nodes is None or schema.launch.node_rank >= 0:
        return  # not in an srun step (salloc, or a batch script itself): one launcher over ssh
    if int(tasks) != int(nodes) or int(nodes) != schema.hardware.nodes:
        raise ConfigError(f"this SLURM job step runs {tasks} task(s) on {nodes} node(s), but launch.py must run once "
                          f"on each of hardware.nodes={schema.hardware.nodes} nodes (it starts that node's "
                          f"{schema.hardware.devices_per_node} ranks itself): hydra.launcher.tasks_per_node=1 and "
                          f"hydra.launcher.nodes={schema.hardware.nodes}")
    schema.launch.node_rank = int(os.environ["SLURM_NODEID"])
    schema.launch.master_addr = schema.launch.master_addr or hosts[0]
    print(f"[slurm] node {schema.launch.node_rank} of {nodes}: starting its {schema.hardware.devices_per_node} "
          f"rank(s); rank 0 on {schema.launch.master_addr}", flush=True)


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
    models reachable. Warns of bf16 on a CPU that emulates it."""
    if schema.hardware.accelerator == "cpu" and schema.hardware.precision == "bf16" and cpu_bf16() == "emulated":
        # Measured: bench/ppo_step.py took 17.7 s per step on an AVX2-only CPU, 0.84 s with avx512_bf16.
        print("WARNING hardware.precision=bf16 on a CPU without native bf16 (no avx512_bf16/amx_bf16 in "
              "/proc/cpuinfo): bf16 matmuls are emulated there, about 20x slower than with native support "
              "(bench/ppo_step.py: 17.7 s vs 0.84 s per step); hardware.precision=fp32 is faster on this CPU",
              flush=True)
    if schema.hardware.nodes > 1 and not schema.launch.hostfile and not os.environ.get("SLURM_JOB_NODELIST"):
        raise ConfigError(f"hardware.nodes={schema.hardware.nodes} needs launch.hostfile (one 'host slots=N' line per node)")
    if schema.hardware.accelerator == "cuda":
        import torch

        have = torch.cuda.device_count()
        if have < schema.hardware.devices_per_node:
            raise ConfigError(f"hardware.devices_per_node={schema.hardware.devices_per_node} but this machine has "
                              f"{have} CUDA device(s); pick a smaller hardware preset")
    elif schema.hardware.devices_per_node > (os.cpu_count() or 1):
        raise ConfigError(f"hardware.devices_per_node={schema.hardware.devices_per_node} CPU ranks but this machine "
                          f"has {os.cpu_count()} cores")
    for key, path in (("model.path", schema.model.path if not schema.model.random_init else ""),
                      ("actor.path", schema.actor.path), ("critic.path", schema.critic.path),
                      ("reward.path", schema.reward.path)):
        if path and not looks_local(path) and (why := hub_unreachable(path)):
            raise ConfigError(f"{key}={path!r} is a hub id, but {why}: download it where the hub is reachable "
                              "and pass the folder, or run where the hub is reachable")


def refuse_unrunnable(schema: Config, fits: bool, report: str, problems: list[str]) -> None:
    """Raise ConfigError when the pre-flight says the step cannot run (before anything is written)."""
    if problems:
        raise ConfigError("; ".join(problems))
    if not fits and not schema.launch.force:
        raise ConfigError(f"the run does not fit on {schema.hardware.name}:\n{report}\n"
                          "Lower the micro batch, raise the zero stage, offload, use LoRA or checkpointing, or set "
                          "launch.force=true to run anyway.")


def dry_run_result(schema: Config, fits: bool, problems: list[str]) -> dict:
    """What a dry-run found: whether the real run would start, and if not, why (the same reasons the
    real run refuses with; launch.force=true lets a run that does not fit start)."""
    why = list(problems)
    if not fits and not schema.launch.force:
        why.append(f"{schema.step.name} does not fit in {schema.hardware.name}'s memory (the table above; "
                   "launch.force=true runs it anyway)")
    return {"dry_run": True, "fits": fits and not problems, "refused": why}


def prepare_step(cfg: DictConfig, schema: Config, overrides: list[str], command: list[str],
                 will_exist: tuple[str, ...] = ()) -> dict | None:
    """Everything before the ranks start: checks, the run directory, shared files. Returns the final
    metrics of a step that finished before (resume=auto), else None. ``will_exist``: model folders
    that earlier steps of the same launch write."""
    run_dir = Path(schema.run_dir)
    refuse_unrunnable(schema, *preflight(schema, run_dir, will_exist))
    check_launchable(schema)
    done = run_dir / "final_metrics.json"
    if schema.resume == "never":
        start_over(run_dir)
    refuse_changed_settings(run_dir, cfg, "a run")
    if schema.resume == "auto" and done.exists():
        print(f"[{schema.step.name}] {run_dir} finished before ({done.name}); nothing to do "
              "(resume=never starts it over)", flush=True)
        return json.loads(done.read_text())
    write_run_dir(cfg, run_dir, overrides, command)
    write_forecast(schema, run_dir)
    if schema.world_size > 1 and "LOCAL_RANK" not in os.environ:
        if schema.hardware.nodes > 1 and not schema.launch.hostfile:
            slurm_node(schema, slurm_hostfile(schema, run_dir))
        from rlhf.models import resolve_path

        resolve_path(schema.model)  # once here, not once per rank (a hub id or folder costs nothing)
    return None


def run_step(cfg: DictConfig, schema: Config, overrides: list[str], command: list[str]) -> dict:
    """Pre-flight -> run directory -> the step on every rank. ``cfg.run_dir`` is already resolved."""
    run_dir = Path(schema.run_dir)
    if schema.launch.dry_run:
        fits, report, problems = preflight(schema, run_dir)
        print(report, flush=True)
        return dry_run_result(schema, fits, problems)
    if (done := prepare_step(cfg, schema, overrides, command)) is not None:
        return done
    if schema.world_size > 1 and "LOCAL_RANK" not in os.environ:
        return launch_ranks(schema, [run_dir])[0]
    from rlhf.worker import main

    return main(schema)


def launch_command(cfg: Config, run_dirs: list[Path]) -> list[str]:
    """The DeepSpeed launcher command that starts every rank on the resolved config(s): the ranks of
    a chain run its steps one after the other in one launch."""
    cmd = ["deepspeed", "--num_nodes", str(cfg.hardware.nodes), "--num_gpus", str(cfg.hardware.devices_per_node)]
    if cfg.launch.hostfile:
        cmd += ["--hostfile", cfg.launch.hostfile]
    if cfg.launch.master_addr:
        cmd += ["--master_addr", cfg.launch.master_addr]
    if cfg.launch.node_rank >= 0:  # this node's ranks only; the other nodes run the same command
        cmd += ["--no_ssh", "--node_rank", str(cfg.launch.node_rank)]
    cmd += ["--master_port", str(cfg.launch.master_port), "--no_local_rank", "--module", "rlhf.worker",
            *(str(d / "config.yaml") for d in run_dirs)]
    return cmd


def launch_ranks(cfg: Config, run_dirs: list[Path]) -> list[dict]:
    cmd = launch_command(cfg, run_dirs)
    print("launching:", shlex.join(cmd), flush=True)
    # Ranks must not inherit a single-process rendezvous (tests run steps in-process first).
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    # Ranks run from the project root; a user's module named in the config (data.rule=my_task:score)
    # is imported from the folder the run was started in, as in a one-rank run.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH", "")) if p)
    env["RLHF_LAUNCHER"] = "1"  # a rank's user error is left in error.json for this process to say once
    # The launcher next to this interpreter: a venv's bin/ need not be on PATH.
    runner = Path(sys.executable).parent / "deepspeed"
    exe = [str(runner)] if runner.exists() else [sys.executable, "-m", "deepspeed.launcher.runner"]
    # Each rank says where it ran and how it ended (rlhf.ranks), so a failed launch names the lost rank.
    ranks_dir = Path(os.path.commonpath(run_dirs)) / "ranks"
    node = max(cfg.launch.node_rank, 0)
    per_node = cfg.hardware.devices_per_node
    ranks.clear(ranks_dir, range(node * per_node, (node + 1) * per_node) if cfg.launch.node_rank >= 0
                else range(cfg.world_size))
    env[ranks.ENV] = str(ranks_dir)
    for d in run_dirs:
        (d / "error.json").unlink(missing_ok=True)
    started = time.monotonic()
    code = subprocess.run([*exe, *cmd[1:]], cwd=PROJECT_ROOT, env=env).returncode
    # DeepSpeed's CPU all-reduce keeps a shared-memory buffer per rank in /dev/shm, named by the
    # rendezvous port; ranks the launcher killed never unlink theirs (17 GB piled up here, and the
    # machine swapped). The ranks are gone now: remove this launch's buffers.
    for buf in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{cfg.launch.master_port}_*"):
        buf.unlink(missing_ok=True)
    if code:
        # A rank that stopped on a user's error left it in error.json: the same one line and exit code
        # 2 as a one-rank run. Anything else is a crash, whose traceback the ranks printed above.
        for d in run_dirs:
            if (f := d / "error.json").exists():
                err = json.loads(f.read_text())
                raise {"data": DataError, "disk": DiskFullError}.get(err["kind"], ConfigError)(err["message"])
        how = ranks.lost_ranks_report(ranks_dir, cfg.world_size)
        raise RuntimeError(f"the ranks stopped with exit code {code} after {time.monotonic() - started:.0f} s"
                           + (f": {how}" if how else "") + f" (their output is above; the run's files are in "
                           f"{', '.join(map(str, run_dirs))}; the same command resumes from the last checkpoint)")
    return [json.loads(f.read_text()) if (f := d / "final_metrics.json").exists() else {} for d in run_dirs]
