"""Metrics: one JSON object per logged step in ``metrics.jsonl`` (rank 0), optionally wandb too,
plus the throughput and memory figures DeepSpeed-Chat prints (samples/s, TFLOPs, latency, memory).

    python -c "from rlhf.logging import MetricsLogger; ..."   # used by the runners
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch


class MetricsLogger:
    def __init__(self, run_dir: str | Path, enabled: bool, wandb_cfg: dict | None = None, tensorboard: bool = False,
                 fresh: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "w" if fresh else "a") if enabled else None
        self._wandb = None
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
        if enabled and wandb_cfg:
            import wandb

            # Offline without a key, and never an interactive login prompt.
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self._wandb = wandb.init(dir=str(run_dir), mode=mode, **wandb_cfg)

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows logged after the checkpoint; the resumed run logs those steps again."""
        if not self.enabled:
            return
        self._file.close()
        rows = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= step]
        self.path.write_text("".join(r + "\n" for r in rows))
        self._file = open(self.path, "a")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        row = {"step": step, "time": round(time.time(), 3)}
        for k, v in metrics.items():
            v = v.item() if isinstance(v, torch.Tensor) else v
            row[k] = round(v, 6) if isinstance(v, float) and math.isfinite(v) else v
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, int | float):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def train_flops(n_params: int, num_layers: int, hidden: int, tokens: int, seq_len: int, checkpointing: bool) -> float:
    """Forward + backward FLOPs of a decoder for ``tokens`` tokens.

    2 FLOPs per parameter per token forward and 4 backward (Kaplan et al. 2020), one more forward
    under activation checkpointing, plus the attention score/value matmuls (4 * layers * seq * hidden
    per token forward), which the parameter count misses.
    """
    passes = 4 if checkpointing else 3
    return passes * tokens * (2 * n_params + 4 * num_layers * seq_len * hidden)


def peak_memory_gb(device: str) -> float:
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def format_line(metrics: dict[str, Any]) -> str:
    parts = []
    for k, v in metrics.items():
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts)
