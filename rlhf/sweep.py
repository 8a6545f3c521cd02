"""Sweep bookkeeping: each job's objective and status, skipping finished jobs on a rerun, and the
results table (CSV + Markdown) and plot written when a multirun ends.

    python launch.py -m sweep=sft_lr_zero        # writes multirun/sft_lr_zero/results.{csv,md,png}
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

# The number each step's sweeps optimize, and in which direction.
OBJECTIVES: dict[str, tuple[str, str]] = {
    "sft": ("eval/ppl", "min"),
    "reward": ("eval/acc", "max"),
    "ppo": ("eval/accuracy", "max"),
    "dpo": ("eval/pref_acc", "max"),
    "simpo": ("eval/pref_acc", "max"),
}
RESULT_FILE = "metrics.json"


def objective(step: str, final: dict) -> float:
    key, _ = OBJECTIVES[step]
    value = final.get(key)
    return float(value) if isinstance(value, int | float) else math.nan


def write_result(run_dir: Path, status: str, step: str, overrides: list[str], final: dict | None, wall_s: float,
                 error: str | None = None) -> dict:
    key, mode = OBJECTIVES.get(step, ("", "max"))
    result = {"status": status, "step": step, "overrides": overrides, "objective": key, "mode": mode,
              "value": objective(step, final or {}) if status == "ok" else None,
              "wall_s": round(wall_s, 1), "metrics": final or {}, "error": error}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2))
    return result


def finished(run_dir: Path) -> dict | None:
    """The recorded result of a job that finished; None if it failed or never ran."""
    path = run_dir / RESULT_FILE
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    return result if result.get("status") == "ok" else None


def collect(sweep_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(sweep_dir.glob(f"*/{RESULT_FILE}")):
        result = json.loads(path.read_text())
        result["job"] = path.parent.name
        rows.append(result)
    return rows


def _swept(rows: list[dict]) -> dict[str, list[str]]:
    """Override keys whose values differ between jobs."""
    values: dict[str, list[str]] = {}
    for row in rows:
        for o in row["overrides"]:
            key, _, value = o.partition("=")
            values.setdefault(key, []).append(value)
    return {k: v for k, v in values.items() if len(set(v)) > 1}


def write_tables(rows: list[dict], out: Path) -> dict[str, Path]:
    """results.csv and results.md sorted by the objective (failed jobs last), results.png plot."""
    if not rows:
        return {}
    mode = rows[0]["mode"]
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["value"], reverse=mode == "max")
    ordered = ok + [r for r in rows if r["status"] != "ok"]
    metric_keys = sorted({k for r in ok for k, v in r["metrics"].items() if isinstance(v, int | float)})
    header = ["rank", "job", "status", "overrides", f"objective ({rows[0]['objective']}, {mode})", "wall_s",
              *metric_keys, "error"]
    table = []
    for i, r in enumerate(ordered, 1):
        table.append([i if r["status"] == "ok" else "", r["job"], r["status"], " ".join(r["overrides"]),
                      "" if r["value"] is None else f"{r['value']:.6g}", r["wall_s"],
                      *[_fmt(r["metrics"].get(k)) for k in metric_keys], (r.get("error") or "")[:200]])
    paths = {"csv": out / "results.csv", "md": out / "results.md", "png": out / "results.png"}
    with open(paths["csv"], "w", newline="") as f:
        csv.writer(f).writerows([header, *table])
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in table]
    paths["md"].write_text(f"Sweep results, sorted by {rows[0]['objective']} ({mode}imize)\n\n" + "\n".join(lines) + "\n")
    _plot(ok, paths["png"])
    return paths


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else ("" if v is None else str(v))


def _plot(ok: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    swept = _swept(ok) or {"job": [r["job"] for r in ok]}
    fig, axes = plt.subplots(1, len(swept), figsize=(4.5 * len(swept), 3.5), squeeze=False)
    objective_name = ok[0]["objective"] if ok else "objective"
    for ax, key in zip(axes[0], swept, strict=True):
        xs = [dict(o.partition("=")[::2] for o in r["overrides"]).get(key, r["job"]) for r in ok]
        try:
            x = [float(v) for v in xs]
            ax.set_xscale("log" if min(x) > 0 and max(x) / min(x) > 50 else "linear")
        except ValueError:
            x = xs
        ax.scatter(x, [r["value"] for r in ok])
        ax.set_xlabel(key)
        ax.set_ylabel(objective_name)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{objective_name} over the sweep ({len(ok)} finished jobs)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class SweepTable(Callback):
    """Hydra callback: when a multirun ends, write its results table and plot into the sweep folder."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        paths = write_tables(collect(sweep_dir), sweep_dir)
        if paths:
            print(f"[sweep] results: {paths['md']} {paths['csv']} {paths['png']}", flush=True)
