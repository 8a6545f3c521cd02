"""Shared test fixtures: hermetic caches, offline hubs, Hydra composition of the real conf/, and
the one way tests start `launch.py` (or any module) in a subprocess.

The caches are set when this module is imported -- before any test module copies os.environ --
so nothing a test starts, in-process or in a subprocess, writes to the user's caches.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_CACHE = Path(tempfile.mkdtemp(prefix="rlhf-test-cache-"))
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["RLHF_CACHE"] = str(_CACHE / "rlhf")
os.environ["HF_HOME"] = str(_CACHE / "hf")
os.environ["HF_DATASETS_CACHE"] = str(_CACHE / "datasets")
os.environ["WANDB_DIR"] = str(_CACHE / "wandb")
os.environ["MPLCONFIGDIR"] = str(_CACHE / "matplotlib")
# DeepSpeed compiles its CPU ops (CPU Adam, the shared-memory collective) on first use into
# ~/.cache/torch_extensions; tests keep them in a folder of their own that outlives one session,
# since a compile costs about a minute.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(tempfile.gettempdir()) / "rlhf-tests-torch-extensions"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Set by in-process runs (a single process tells DeepSpeed its world); a subprocess that starts
# ranks must not inherit them.
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="session", autouse=True)
def rlhf_cache():
    """The test session's random-model cache (a fresh temporary folder, never a user's)."""
    return Path(os.environ["RLHF_CACHE"])


def trajectory_overrides() -> list[str]:
    """Overrides for a test whose figures come from one training trajectory: the run's seed and torch
    threads from RLHF_TEST_SEED and RLHF_TEST_THREADS (bench/test_matrix.py sets them), none when
    unset, so the suite runs as configured (seed 42, hardware.torch_threads=1). OMP_NUM_THREADS
    alone changes nothing: each run sets its own thread count from hardware.torch_threads."""
    names = (("RLHF_TEST_SEED", "seed"), ("RLHF_TEST_THREADS", "hardware.torch_threads"))
    return [f"{key}={int(os.environ[var])}" for var, key in names if os.environ.get(var)]


def check_margin(record_property, name: str, value: float, bound: float, higher: bool = True,
                 strict: bool = False) -> None:
    """Assert ``value`` >= ``bound`` (<= where not ``higher``; > or < where ``strict``) and record
    (name, value, bound) as a junit property, so a run with --junitxml shows how far each learning
    threshold held (bench/test_matrix.py tabulates them). Recorded before the assert: a failing
    figure lands in the XML too."""
    import json

    value = float(value)
    record_property(f"margin:{name}", json.dumps({"value": value, "bound": bound, "higher": higher,
                                                  "strict": strict}))
    op = (">" if strict else ">=") if higher else ("<" if strict else "<=")
    ok = {">": value > bound, ">=": value >= bound, "<": value < bound, "<=": value <= bound}[op]
    assert ok, f"{name} = {value:.4g}, not {op} its bound {bound:.4g}"


def compose(overrides: list[str] | None = None):
    """The composed DictConfig that `python launch.py <overrides>` would get."""
    from rlhf.config import compose_config

    return compose_config(overrides or [])


def compose_step(overrides: list[str], name: str, run_dir: Path = Path("/tmp/never-written")):
    """The composed DictConfig of step ``name`` of the chain that ``overrides`` compose (an experiment
    file or pipeline=...), exactly as the chain composes it."""
    from rlhf.chain.pipeline import step_config

    return step_config(compose(overrides), name, overrides, {}, run_dir)[0]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without the rank variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env.update(extra)
    return env


def _cli(args: tuple[str, ...], module: str | None, env: dict[str, str] | None) -> dict:
    # From a scratch folder, with the checkout on PYTHONPATH: a default Hydra run folder (runs/...)
    # lands there, never in the working tree.
    cmd = [sys.executable, *(["-m", module] if module else [str(ROOT / "launch.py")]), *args]
    cwd = _CACHE / "cwd"
    cwd.mkdir(exist_ok=True)
    env = dict(env or clean_env())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return {"args": cmd, "cwd": cwd, "env": env, "text": True}


def run_cli(*args: str, module: str | None = None, timeout: float = 600, input: str | None = None,
            env: dict[str, str] | None = None, **popen) -> subprocess.CompletedProcess:
    """`python launch.py ARGS` (or `python -m MODULE ARGS`), output captured."""
    return subprocess.run(**_cli(args, module, env), capture_output=True, timeout=timeout, input=input, **popen)


def start_cli(*args: str, env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
    """`python launch.py ARGS` started in the background (for a test that kills or watches it)."""
    return subprocess.Popen(**_cli(args, None, env), **popen)


def one_and_two_ranks(worker: Path, tmp_path: Path) -> tuple[dict, dict]:
    """What ``worker`` saves to its OUT argument run as one process and as two ranks through the
    DeepSpeed launcher, both at once (each rank single-threaded)."""
    import torch

    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    env = clean_env(PYTHONPATH=str(ROOT))
    single = subprocess.Popen([sys.executable, str(worker), str(one)], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**env, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    ranks = subprocess.run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank",
                            "--master_port", str(free_port()), str(worker), str(two)], cwd=tmp_path,
                           capture_output=True, text=True, env=env, timeout=600)
    out = single.communicate(timeout=600)[0]
    assert single.returncode == 0, out[-3000:]
    assert ranks.returncode == 0, (ranks.stdout + ranks.stderr)[-3000:]
    return torch.load(one), torch.load(two)


def same_run(a: Path, b: Path, key: str) -> None:
    """Runs ``a`` and ``b`` ended with the same weights (1e-6) and logged the same ``key`` at every
    step, each step once and in order (a resumed run appends to its metrics)."""
    import json

    from safetensors.torch import load_file

    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-6
    la = {json.loads(x)["step"]: json.loads(x)[key] for x in open(a / "metrics.jsonl") if f'"{key}"' in x}
    lb = [(json.loads(x)["step"], json.loads(x)[key]) for x in open(b / "metrics.jsonl") if f'"{key}"' in x]
    assert [s for s, _ in lb] == sorted(la), "each step logged once, in order"
    assert all(abs(la[s] - v) <= 1e-6 for s, v in lb)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory():
    """Ranks that tests start or kill leave DeepSpeed's shared-memory all-reduce buffers in /dev/shm
    (69 MB per rank); remove the ones made during this session, never older ones."""
    import time

    start = time.time()
    yield
    for buf in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"):
        try:
            if buf.stat().st_mtime >= start:
                buf.unlink()
        except FileNotFoundError:
            pass
