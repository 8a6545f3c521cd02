"""A kernel-level profile of one training step (``logging.profile_step=N``): optimizer step N of the
supervised steps, PPO step N of PPO (rollouts, scoring and updates), through torch.profiler on rank
0. Writes RUN_DIR/profile/summary.json (the step's wall time, the device's busy time and the rest,
which the host's dispatch and its waits leave idle; device time by kind of kernel; the costliest
kernels) and RUN_DIR/profile/trace.json.gz (open in Perfetto or chrome://tracing). On CPU the
"device" is the CPU's operators.

    python launch.py step=ppo logging.profile_step=3      # RUN_DIR/profile/summary.json

Profile a step after the first (cuBLAS and the allocator warm up in step 1); the profiled step runs
slower than the others, so throughput figures of its logging window include the profiler's cost.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

# Kernel (GPU) or operator (CPU) names by what they do, first match wins: attention before matmul
# (flash kernels name their GEMM tiles), optimizer before elementwise.
KERNEL_KINDS = (
    ("attention", ("fmha", "flash", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cublas", "cutlass", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear",
                "aten::matmul", "splitk", "gemv")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("communication", ("nccl", "gloo", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                       "broadcast")),
    ("cache_write", ("index_copy", "indexcopy", "index_put", "scatter")),
    ("softmax_loss", ("softmax", "cross_entropy", "nll_loss", "log_softmax")),
    ("norm", ("layer_norm", "layernorm", "rms", "norm")),
    ("copy_cast", ("copy", "cast", "to_copy", "memcpy", "memset", "fill")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def device_times(prof, per: int = 1, top: int = 12) -> dict:
    """From a finished ``torch.profiler.profile``: the device's busy time (GPU kernels; on CPU the
    operators' own time) in ms, by kernel kind, the ``top`` costliest kernels, and how many kernels
    (operators) ran, each divided by ``per`` (the number of repeats profiled). Many short kernels
    point at launch latency, which no kernel's speed fixes: fewer, larger ones do."""
    events = prof.key_averages()  # one row per name (and device): costly over a long step, made once
    cuda = any(evt.device_type.name == "CUDA" for evt in events)
    kinds, names, launched = {}, {}, 0
    for evt in events:
        if cuda and evt.device_type.name != "CUDA":
            continue
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if us <= 0:
            continue
        kind = kernel_kind(evt.key)
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e3 / per
        names[evt.key] = us / 1e3 / per
        launched += evt.count
    return {"device": "cuda" if cuda else "cpu", "busy_ms": round(sum(kinds.values()), 3),
            "kernels": round(launched / per, 1),
            "by_kind_ms": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top_ms": [[name[:120], round(ms, 3)] for name, ms in sorted(names.items(), key=lambda kv: -kv[1])[:top]]}


class StepProfiler:
    """Starts torch.profiler before step ``logging.profile_step``'s work and stops it after that step
    (rank 0 only; 0: never). The loops call ``before(step about to run)`` and ``after(step done)``."""

    def __init__(self, cfg, rank: int):
        self.step = cfg.logging.profile_step if rank == 0 else 0
        self.out = Path(cfg.run_dir) / "profile"
        self.cuda = cfg.hardware.accelerator == "cuda"
        self.prof, self.t0 = None, 0.0

    def before(self, step: int) -> None:
        if self.step and step == self.step and self.prof is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=activities)
            self._sync()
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def after(self, step: int) -> None:
        if self.prof is None or step != self.step:
            return
        self._sync()
        wall_ms = 1e3 * (time.perf_counter() - self.t0)
        self.prof.__exit__(None, None, None)
        self.out.mkdir(parents=True, exist_ok=True)
        times = device_times(self.prof)
        summary = {"step": self.step, "wall_ms": round(wall_ms, 3), **times,
                   # What the device did not spend on kernels: the host's dispatch, its waits for
                   # read-backs, data loading (with the profiler's own cost on top).
                   "idle_ms": round(max(wall_ms - times["busy_ms"], 0.0), 3)}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        self.prof.export_chrome_trace(str(self.out / "trace.json.gz"))  # torch gzips a .gz path
        self.prof = None
        print(f"[profile] step {self.step}: {wall_ms:.1f} ms, device busy {times['busy_ms']:.1f} ms "
              f"({', '.join(f'{k} {v:.1f}' for k, v in list(times['by_kind_ms'].items())[:5])}); "
              f"{self.out / 'summary.json'}", flush=True)

    def _sync(self) -> None:
        if self.cuda and torch.cuda.is_available():
            torch.cuda.synchronize()
