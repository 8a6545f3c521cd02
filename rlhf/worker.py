"""Per-rank entry: read the resolved config from the run directory, init distributed, run the step.

launch.py calls ``main`` in-process for one rank; for several ranks or nodes it starts
    deepspeed --no_local_rank ... -m rlhf.worker RUN_DIR/config.yaml [RUN_DIR2/config.yaml ...]
so that Hydra composes once and every rank reads the same resolved file. A chain passes every
step's file: the ranks run the steps one after the other in one launch (one rendezvous, one
import of the libraries), skipping a step that finished before.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import sys
from pathlib import Path

import numpy as np
import torch

from rlhf import sequence
from rlhf.config import Config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The rank variables this process set for its own single-process world: they stay set after an
# in-process run (the process group outlives it), and must not make a later launch from the same
# process (a sweep's next job, a notebook's next run) believe a launcher started it as one rank.
_SET_HERE: set[str] = set()


def launched_as_a_rank() -> bool:
    """Whether a launcher (deepspeed, torchrun, srun) started this process as one rank of a world."""
    return "LOCAL_RANK" in os.environ and "LOCAL_RANK" not in _SET_HERE


def init_distributed(cfg: Config) -> None:
    import deepspeed
    import torch.distributed as dist

    if cfg.hardware.torch_threads:
        torch.set_num_threads(cfg.hardware.torch_threads)
    # Outside the launcher DeepSpeed would reach for mpi4py to discover the world; a single
    # process tells it directly, and remembers it did (see launched_as_a_rank).
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", None)):
        if key not in os.environ:
            os.environ[key] = value or str(_free_port())
            _SET_HERE.add(key)
    if int(os.environ["WORLD_SIZE"]) == 1 and cfg.hardware.accelerator == "cpu":
        # DeepSpeed's CPU backend compiles its shared-memory all-reduce op on a machine's first run
        # (a C++ toolchain needed) even where one rank has nothing to reduce. Its op table is a
        # module-level dict meant to be edited; marked unavailable, the backend uses plain gloo.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if not dist.is_initialized():
        from datetime import timedelta

        from torch.distributed import distributed_c10d

        timeout = timedelta(minutes=cfg.launch.collective_timeout_min)
        # DeepSpeed clones the world group for ZeRO (dist.new_group without a timeout), and a new group
        # takes torch's module default, not the world group's: set as the default, the configured
        # timeout holds in ZeRO's collectives too.
        distributed_c10d.default_pg_timeout = timeout
        if isinstance(getattr(distributed_c10d, "default_pg_nccl_timeout", None), timedelta):
            distributed_c10d.default_pg_nccl_timeout = timeout
        deepspeed.init_distributed(dist_backend=cfg.hardware.dist_backend, verbose=False, timeout=timeout)
    if cfg.hardware.accelerator == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))


# Warnings of these kinds raised inside an installed library are about the library's own calls: the
# run's log file keeps them, the console does not.
LIBRARY_WARNINGS = (FutureWarning, DeprecationWarning)


def quiet_libraries(log_file: Path | None = None) -> None:
    """Keep the console for our own progress lines: no per-file load bars or info chatter, and none of
    the libraries' deprecation notices about their own internal calls (DeepSpeed's collectives,
    transformers' checkpointing names), which a user can do nothing about. Those notices go to
    ``log_file`` (a rank's; in-process runs: Hydra's launch.log of the run), not away: a warning
    raised from our own code stays on the console, where it gets fixed."""
    import logging
    import warnings

    import datasets
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

    library = logging.getLogger("rlhf.library_warnings")
    library.setLevel(logging.INFO)
    if log_file is not None:  # each step of a chain launched once on several ranks: its own folder's file
        for old in list(library.handlers):
            library.removeHandler(old)
            old.close()
        handler = logging.FileHandler(log_file, delay=True)
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        library.addHandler(handler)
        library.propagate = False  # a rank's console is the launcher's
    if getattr(warnings.showwarning, "routes_library_warnings", False):
        return
    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, LIBRARY_WARNINGS) and f"{os.sep}site-packages{os.sep}" in filename:
            # INFO: below Hydra's console handler's level, above its launch.log handler's.
            library.info(warnings.formatwarning(message, category, filename, lineno, line).rstrip())
        else:
            shown(message, category, filename, lineno, file, line)

    show.routes_library_warnings = True
    warnings.showwarning = show


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_shared_artifacts(cfg: Config) -> None:
    """The random model's cache entry, before torch.distributed starts: once it has, transformers
    writes weights on global rank 0 only, and a rank that built the entry then would leave a folder
    with tokenizer files alone. Ranks building at once are safe: each writes
    its own folder, checks it and renames it into place. launch.py has usually built it already."""
    from rlhf import models

    models.resolve_path(cfg.model)  # a hub id or folder comes back as it is, with no work


def clear_stale_build_locks(max_age_s: float = 900) -> None:
    """Remove torch-extension build locks left by a killed process. DeepSpeed compiles its CPU ops
    (CPU Adam, the shared-memory collective) under a lock file that a killed build never removes,
    and torch waits on such a lock forever, so every later run would hang. A build takes minutes at
    most, so a lock older than ``max_age_s`` is stale."""
    import time

    from rlhf.preflight.probes import extensions_root

    root = extensions_root()
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        try:
            age = time.time() - lock.stat().st_mtime
            if age > max_age_s:
                lock.unlink()
                print(f"removed a stale build lock {lock} ({age / 60:.0f} min old, left by a killed build)",
                      file=sys.stderr, flush=True)
        except FileNotFoundError:  # another rank removed it first
            pass


def main(cfg: Config) -> dict:
    from rlhf.runners import RUNNERS

    quiet_libraries(Path(cfg.run_dir) / f"warnings.rank{int(os.environ.get('RANK', 0))}.log"
                    if int(os.environ.get("WORLD_SIZE", 1)) > 1 else None)
    clear_stale_build_locks()
    build_shared_artifacts(cfg)
    init_distributed(cfg)
    sequence.setup(cfg.parallel.sequence)
    seed_everything(cfg.seed)
    return RUNNERS[cfg.step.name](cfg)


def judge_start(cfg: Config, steps: list[str]) -> None:
    """A chain's step started in a launch of several ranks is judged as the one-process chain judges
    it (rlhf.chain.readiness.weak_step), from the chain's settings in the folder above the step's."""
    from rlhf.chain.readiness import RUN_ANYWAY, chain_settings, weak_step
    from rlhf.config import ConfigError

    chain_dir = Path(cfg.run_dir).parent
    if (pipe := chain_settings(Path(cfg.run_dir))) is None:
        return
    if not (why := weak_step(pipe, cfg.step.name, cfg, chain_dir, steps)):
        return
    if pipe.on_weak_step == "stop":
        raise ConfigError(f"{cfg.step.name} not started: {why}; {RUN_ANYWAY}")
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[e2e] WARNING {cfg.step.name} may not work: {why}", flush=True)


def main_steps(paths: list[str]) -> None:
    import gc
    import json
    import time

    import torch.distributed as dist

    from rlhf.checkpoint import StopRequest
    from rlhf.config import ConfigError, load_run_config
    from rlhf.launch import ranks

    ranks.started()
    ranks.end_with_the_launch()
    for path in paths:
        # The launcher terminates the other ranks as soon as one fails; say so in this rank's record
        # before going (the runners' stop request replaces this handler once training starts). Set
        # again before each step of a chain's launch: a signal while the next step builds its models
        # ends the rank then, not at that step's end. One that came in the last step's final moments,
        # after its loop stopped reading its stop request, ends it before the next step.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _end_on_signal)
        if StopRequest.last_signal:
            _end_on_signal(StopRequest.last_signal, None)
        cfg = load_run_config(path)
        run_dir = Path(cfg.run_dir)
        if cfg.resume == "auto" and (run_dir / "final_metrics.json").exists():
            continue
        start = time.perf_counter()
        try:
            judge_start(cfg, [Path(p).parent.name for p in paths])
            main(cfg)
        except ConfigError as err:
            # A user's error (bad data, a rule that cannot score): one line for the launcher to show
            # (rlhf.launch.processes.launch_ranks), not a traceback from every rank; exit 2 like a one-rank run.
            ranks.ended("error", f"{err.kind} error: {err}")
            (run_dir / "error.json").write_text(json.dumps({"kind": err.kind, "message": str(err)}))
            if "RLHF_LAUNCHER" not in os.environ:  # ranks started by hand: nobody else will say it
                print(f"{err.kind} error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)
        except Exception as err:
            ranks.ended("error", f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}")
            if (run_dir / "error.json").exists():  # another rank's user error broke the collectives
                sys.exit(2)
            raise
        if dist.get_rank() == 0:  # the chain's manifest reads the step's wall time from here
            (run_dir / "wall_time.json").write_text(json.dumps({"seconds": round(time.perf_counter() - start, 1)}))
        gc.collect()  # drop the finished step's engines before the next step builds its own
        dist.barrier()
    ranks.ended("ok")


def _end_on_signal(signum, frame) -> None:
    from rlhf.launch import ranks

    ranks.ended("signal", f"signal {signum}")
    sys.exit(128 + signum)


if __name__ == "__main__":
    main_steps(sys.argv[1:])
