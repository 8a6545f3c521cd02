"""Metrics: one JSON object per logged step in ``metrics.jsonl`` (rank 0), optionally wandb too,
plus the throughput and memory figures DeepSpeed-Chat prints (samples/s, TFLOPs, latency, memory).

    python -c "from rlhf.observe.logging import MetricsLogger; ..."   # used by the runners
"""

from __future__ import annotations

import json
import math
import os
import resource
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import torch


class MetricsLogger:
    def __init__(self, run_dir: str | Path, enabled: bool, wandb_cfg: dict | None = None, tensorboard: bool = False,
                 fresh: bool = True, wandb_mode: str = ""):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = open(self.path, "w" if fresh else "a") if enabled else None
        self._wandb = None
        self._tb = None
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))
            if wandb_cfg and wandb_cfg.get("config"):
                self._tb.add_text("config", "```\n" + json.dumps(wandb_cfg["config"], indent=2, default=str) + "\n```")
        if enabled and wandb_cfg:
            import wandb

            mode = resolve_wandb_mode(wandb_mode)
            # The run's W&B id lives in its folder: a resumed run continues its own W&B run, a fresh
            # start (or resume=never) opens a new one.
            id_file = Path(run_dir) / WANDB_ID_FILE
            run_id = id_file.read_text().strip() if not fresh and id_file.exists() else None
            if run_id is None:
                run_id = secrets.token_hex(4)  # W&B's form: 8 lowercase letters and digits
                id_file.write_text(run_id + "\n")
            self._wandb = wandb.init(dir=str(run_dir), id=run_id, resume="allow", **({"mode": mode} if mode else {}),
                                     **wandb_cfg)

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

    def summarize(self, final: dict[str, Any], step: int) -> None:
        """The step's final figures: W&B's run summary, TensorBoard scalars under final/."""
        if not self.enabled:
            return
        shown = {k: v for k, v in final.items() if isinstance(v, int | float | str) and not isinstance(v, bool)}
        if self._wandb is not None:
            self._wandb.summary.update({**shown, "warnings": "\n".join(final.get("warnings", []))})
        if self._tb is not None:
            for k, v in shown.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(f"final/{k}", v, step)
            if final.get("warnings"):
                self._tb.add_text("warnings", "\n\n".join(final["warnings"]), step)

    def close(self) -> None:
        if self._file:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


WANDB_ID_FILE = "wandb_id.txt"


def resolve_wandb_mode(asked: str) -> str | None:
    """The mode to pass to wandb.init: ``asked`` (logging.wandb_mode) when set; else None, leaving
    it to W&B's own settings (WANDB_MODE, `wandb offline`/`wandb online`) where a credential exists
    (WANDB_API_KEY or the netrc entry `wandb login` writes); "offline" where none does, since a
    run must never stop at a login prompt."""
    if asked:
        return asked
    if os.environ.get("WANDB_MODE") or _wandb_credential():
        return None
    return "offline"


def _wandb_credential() -> bool:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import netrc
    from urllib.parse import urlsplit

    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    path = os.environ.get("NETRC") or os.path.join(os.path.expanduser("~"), ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


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
