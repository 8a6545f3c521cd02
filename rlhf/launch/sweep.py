"""Sweep bookkeeping: each job's objective and status, skipping finished jobs on a rerun, and the
results table (CSV + Markdown) and plot written when a multirun ends -- also when it stops early
(a job's process killed takes Hydra's multirun down with it), naming every job of the sweep.

    python launch.py -m sweep=sft_lr_zero        # writes multirun/sft_lr_zero/results.{csv,md,png}
"""

from __future__ import annotations

import atexit
import csv
import json
import math
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from rlhf.config import NUMERIC_GROUPS, STEPS
from rlhf.files import write_whole

RESULT_FILE = "metrics.json"


def objective(step: str, final: dict) -> float:
    key, _ = STEPS[step].objective
    value = final.get(key)
    return float(value) if isinstance(value, int | float) else math.nan


def write_result(run_dir: Path, status: str, step: str, overrides: list[str], final: dict | None, wall_s: float,
                 error: str | None = None) -> dict:
    key, mode = STEPS[step].objective if step in STEPS else ("", "max")
    result = {"status": status, "step": step, "overrides": overrides, "objective": key, "mode": mode,
              "value": objective(step, final or {}) if status == "ok" else None,
              "wall_s": round(wall_s, 1), "metrics": final or {}, "error": error}
    run_dir.mkdir(parents=True, exist_ok=True)
    write_whole(run_dir / RESULT_FILE, json.dumps(result, indent=2))  # on several nodes each node records the job
    return result


def finished(run_dir: Path) -> dict | None:
    """The recorded result of a job that finished; None if it failed or never ran."""
    path = run_dir / RESULT_FILE
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    return result if result.get("status") == "ok" else None


def _job_overrides(job_dir: Path) -> list[str] | None:
    """The overrides a started job ran with: Hydra's .hydra/overrides.yaml (written before the job
    starts), else run.json (written once the step started); None for a folder that is no job."""
    from omegaconf import OmegaConf

    if (path := job_dir / ".hydra" / "overrides.yaml").exists():
        return [str(o) for o in OmegaConf.load(path)]
    if (path := job_dir / "run.json").exists():
        return list(json.loads(path.read_text()).get("overrides", []))
    return None


def _checkpoints(job_dir: Path) -> list[str]:
    """A job's latest checkpoints (a chain's: each step's), which a rerun resumes from."""
    pointers = [job_dir / "checkpoints" / "latest", *sorted(job_dir.glob("*/checkpoints/latest"))]
    return [(p.parent / p.read_text().strip()).relative_to(job_dir).as_posix() for p in pointers if p.exists()]


def collect(sweep_dir: Path, planned: list[list[str]] | None = None) -> list[dict]:
    """A row per job: its recorded result (ok or failed); a job folder without one (the job's
    process was killed, or is still running): "incomplete"; a job of ``planned`` (each job's
    overrides) with no folder: "not started"."""
    rows, seen = [], []
    for job_dir in sorted(p for p in sweep_dir.iterdir() if p.is_dir()) if sweep_dir.is_dir() else []:
        if (path := job_dir / RESULT_FILE).exists():
            result = json.loads(path.read_text())
        elif (overrides := _job_overrides(job_dir)) is not None:
            saved = _checkpoints(job_dir)
            where = (f"last checkpoint {', '.join(saved)}; a rerun of the sweep resumes it from there" if saved
                     else "no checkpoint yet; a rerun of the sweep starts it again")
            result = {"status": "incomplete", "overrides": overrides, "value": None, "wall_s": None, "metrics": {},
                      "error": f"no result: the job's process stopped before the end (killed?) or is still running; "
                               f"{where}"}
        else:
            continue
        result["job"] = job_dir.name
        rows.append(result)
        seen.append(result["overrides"])
    for overrides in planned or []:
        if overrides not in seen:
            rows.append({"job": "", "status": "not started", "overrides": overrides, "value": None, "wall_s": None,
                         "metrics": {}, "error": "the sweep stopped before this job started; rerun the sweep"})
    return rows


def planned_jobs(config: DictConfig) -> list[list[str]] | None:
    """Every job's overrides, as Hydra's basic sweeper expands the sweep (its params, then the
    command line); None for other sweepers (Optuna's trials are not known in advance)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweeper = config.hydra.sweeper
    if sweeper.get("_target_") != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
        return None
    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
    return [job for batch in BasicSweeper.split_arguments(overrides, None) for job in batch]


def _shown(override: str) -> str:
    """An override as the user typed it: `zero='3'` reaches Hydra quoted (rlhf.config.NUMERIC_GROUPS)."""
    key, sep, value = override.partition("=")
    return key + sep + (value.replace("'", "") if key in NUMERIC_GROUPS else value)


def _swept(rows: list[dict]) -> dict[str, list[str]]:
    """Override keys whose values differ between jobs."""
    values: dict[str, list[str]] = {}
    for row in rows:
        for o in map(_shown, row["overrides"]):
            key, _, value = o.partition("=")
            values.setdefault(key, []).append(value)
    return {k: v for k, v in values.items() if len(set(v)) > 1}


def write_tables(rows: list[dict], out: Path, trials: bool = False) -> dict[str, Path]:
    """results.csv and results.md sorted by the objective (failed jobs last), results.png plot
    (``trials``: an Optuna search, whose trials are also drawn in order)."""
    if not rows:
        return {}
    # Rows without a result (incomplete, not started) carry no objective: take it from one that does.
    named = next((r for r in rows if r.get("objective")), {"objective": "objective", "mode": "max"})
    objective_name, mode = named["objective"], named["mode"]
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["value"], reverse=mode == "max")
    ordered = ok + [r for r in rows if r["status"] != "ok"]
    metric_keys = sorted({k for r in ok for k, v in r["metrics"].items() if isinstance(v, int | float)})
    header = ["rank", "job", "status", "overrides", f"objective ({objective_name}, {mode})", "wall_s",
              *metric_keys, "error"]
    table = []
    for i, r in enumerate(ordered, 1):
        table.append([i if r["status"] == "ok" else "", r["job"], r["status"], " ".join(map(_shown, r["overrides"])),
                      "" if r["value"] is None else f"{r['value']:.6g}", _fmt(r["wall_s"]),
                      *[_fmt(r["metrics"].get(k)) for k in metric_keys], (r.get("error") or "")[:200]])
    paths = {"csv": out / "results.csv", "md": out / "results.md", "png": out / "results.png"}
    with open(paths["csv"], "w", newline="") as f:
        csv.writer(f).writerows([header, *table])
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in table]
    unlike = [k for k in _swept(ok) if k in getattr(STEPS.get(ok[0].get("step", "")), "measured_with", ())] if ok else []
    caveat = (f"WARNING: the jobs differ in {', '.join(unlike)}, which changes how {objective_name} is measured: "
              "the ranking compares unlike figures\n\n" if unlike else "")
    if unlike:
        print(f"[sweep] {caveat.strip()}", flush=True)
    paths["md"].write_text(f"Sweep results, sorted by {objective_name} ({mode}imize)\n\n{caveat}" + "\n".join(lines)
                           + "\n")
    if ok:
        plot(ok, paths["png"], out, trials)
    else:  # a dry-run sweep, or every job failed: no figure rather than empty axes
        paths.pop("png").unlink(missing_ok=True)
    return paths


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else ("" if v is None else str(v))


def _value(v: str) -> str:
    """A value as a label: Hydra's quotes stripped ('0' reads 0)."""
    return v.strip("'\"")


def _label(setting: dict, keys) -> str:
    """A job's settings of ``keys`` as a plot label: key=value, ..."""
    return ", ".join(f"{k}={_value(setting.get(k, ''))}" for k in keys)


def _numbers(values: list[str]) -> list[float] | None:
    try:
        return [float(_value(v)) for v in values]
    except ValueError:
        return None


def _log_axis(key: str, x: list[float]) -> bool:
    """Learning rates, and any positive key whose values span a decade or more, on a log axis."""
    if not x or min(x) <= 0 or len(set(x)) < 2:
        return False
    return max(x) / min(x) >= 10 or key.rsplit(".", 1)[-1] in ("lr", "learning_rate")


def _job_curve(sweep_dir: Path, row: dict, key: str) -> tuple[list[float], list[float]]:
    """A job's logged ``key`` by step: its metrics.jsonl, or a chain's last step's."""
    from rlhf.observe.curves import load_run

    job = sweep_dir / row["job"]
    if not (job / "metrics.jsonl").exists() and (job / "manifest.json").exists():
        steps = json.loads((job / "manifest.json").read_text()).get("steps", {})
        job = Path(list(steps.values())[-1]["run_dir"]) if steps else job
    return load_run(job).series(key)


def plot(ok: list[dict], path: Path, sweep_dir: Path, trials: bool = False):
    """results.png: the objective against each swept key (log axes for learning rates and keys that
    span decades; the other swept keys as colour), every job's held-out curve of the objective, and
    with ``trials`` (an Optuna search) the objective by trial in launch order with the best so far.
    Returns the Figure."""
    from matplotlib.figure import Figure

    objective_name, mode = ok[0]["objective"], ok[0]["mode"]
    settings = [dict(_shown(o).partition("=")[::2] for o in r["overrides"]) for r in ok]
    swept = list(_swept(ok))
    if not swept:  # one finished job, or jobs alike: the objective per job
        swept = ["job"]
        for s, r in zip(settings, ok, strict=True):
            s["job"] = r["job"]
    values = [r["value"] for r in ok]
    curves = [_job_curve(sweep_dir, r, objective_name) for r in ok]
    n = len(swept) + any(xs for xs, _ in curves) + trials
    fig = Figure(figsize=(4.6 * max(n, 1), 3.8), layout="constrained")
    axes = fig.subplots(1, max(n, 1), squeeze=False)[0]
    ylabel = f"{objective_name} ({mode})"
    colour_of: dict[str, str] = {}
    for ax, key in zip(axes, swept, strict=False):
        _swept_panel(fig, ax, key, swept, settings, values, colour_of, ylabel)
    rest = list(axes[len(swept):])
    if any(xs for xs, _ in curves):
        labels = [_label(s, swept) or r["job"] for s, r in zip(settings, ok, strict=True)]
        _curves_panel(rest.pop(0), curves, labels, objective_name)
    if trials:
        _trials_panel(rest.pop(0), ok, values, mode, ylabel)
    fig.suptitle(f"{objective_name} over the sweep ({len(ok)} finished jobs; {'lower' if mode == 'min' else 'higher'} "
                 "is better)")
    fig.savefig(path, dpi=100)
    return fig


def _swept_panel(fig, ax, key: str, swept: list[str], settings: list[dict], values: list[float],
                 colour_of: dict[str, str], ylabel: str) -> None:
    """The objective against one swept key, one line per combination of the other swept keys (a
    colour scale when the one other key is continuous). ``colour_of`` keeps a combination's colour
    the same in every panel."""
    raw = [s.get(key, "") for s in settings]
    x = _numbers(raw)
    # Lines only along a grid's few values: nothing lies between categories, and an Optuna
    # search's scattered trials joined by lines read as a curve.
    line = "o-" if x is not None and len(set(x)) <= 8 else "o"
    if x is None:  # categories, in the order the sweep ran them
        order = list(dict.fromkeys(map(_value, raw)))
        x = [float(order.index(_value(v))) for v in raw]
        ax.set_xticks(range(len(order)), order)
    else:
        if _log_axis(key, x):
            ax.set_xscale("log")
        if len(set(x)) <= 8:  # a grid's few values: ticks at them, labelled as typed
            typed = dict(zip(x, map(_value, raw), strict=True))
            ax.set_xticks(sorted(typed), [typed[v] for v in sorted(typed)])
            ax.minorticks_off()
    labels = [_label(s, [k for k in swept if k != key]) for s in settings]
    others = [k for k in swept if k != key]
    shade = _numbers([s.get(others[0], "") for s in settings]) if len(others) == 1 else None
    if shade is not None and len(set(shade)) > 8:  # a continuous other key (Optuna): a colour scale
        from matplotlib.colors import LogNorm, Normalize

        norm = LogNorm() if _log_axis(others[0], shade) else Normalize()
        points = ax.scatter(x, values, c=shade, norm=norm, cmap="viridis", s=30)
        fig.colorbar(points, ax=ax, label=others[0])
        labels = [""] * len(labels)
    for i, label in enumerate(dict.fromkeys(labels) if any(labels) or shade is None else []):
        points = sorted((xi, yi) for xi, yi, g in zip(x, values, labels, strict=True) if g == label)
        colour = colour_of.setdefault(label, f"C{len(colour_of) % 10}") if label else "C0"
        ax.plot([p[0] for p in points], [p[1] for p in points], line, color=colour, label=label or None,
                markersize=6 - min(i, 3))
    if any(labels):
        ax.legend(fontsize=8, frameon=False, title=None)
    # Perplexities spanning decades on a log axis; accuracies and other fractions stay linear.
    if min(values) > 0 and max(values) > 1 and max(values) / min(values) >= 10:
        ax.set_yscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, which="both")


def _curves_panel(ax, curves: list[tuple[list, list]], labels: list[str], objective_name: str) -> None:
    """Every job's held-out curve of the objective, labelled by its swept settings."""
    from matplotlib.ticker import FormatStrFormatter, MaxNLocator

    for i, ((xs, ys), label) in enumerate(zip(curves, labels, strict=True)):
        # Jobs that coincide stay visible: each later one a smaller marker on top.
        ax.plot(xs, ys, "o-", markersize=max(7 - i, 2), color=f"C{i % 10}", label=label)
    ax.set_title(f"held-out {objective_name} per job", fontsize=10)
    ax.set_xlabel("step")
    logged = [y for _, ys in curves for y in ys]
    if min(logged) > 0 and max(logged) / min(logged) >= 10:  # perplexity falls by decades
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, which="both")
    if len(labels) <= 12:
        ax.legend(fontsize=7, frameon=False)


def _trials_panel(ax, ok: list[dict], values: list[float], mode: str, ylabel: str) -> None:
    """An Optuna search's objective by trial in launch order, with the best so far."""
    from matplotlib.lines import Line2D

    order = sorted(range(len(ok)), key=lambda i: int(ok[i]["job"]) if ok[i]["job"].isdigit() else i)
    ys = [values[i] for i in order]
    best = [min(ys[: j + 1]) if mode == "min" else max(ys[: j + 1]) for j in range(len(ys))]
    ax.plot(range(len(ys)), ys, "o", label="trial")
    ax.step(range(len(ys)), best, where="post", color="C3", label="best so far")
    ax.set_title("trials in order", fontsize=10)
    ax.set_xlabel("trial")
    ax.set_ylabel(ylabel)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(handles=[Line2D([], [], marker="o", linestyle="", color="C0"), Line2D([], [], color="C3")],
              labels=["trial", "best so far"], fontsize=8, frameon=False)
    ax.grid(alpha=0.3)


class SweepTable(Callback):
    """Hydra callback: when a multirun ends, write its results table and plot into the sweep folder.

    Hydra calls on_multirun_end only when every job returned. A job whose process dies (the OOM
    killer, a SIGKILL) stops the whole multirun instead: joblib's pool breaks (TerminatedWorkerError)
    and kills the job running beside it, submitit raises for the job without a result, and the jobs
    not yet started never start. The table is then written when the process exits, naming every job:
    the finished ones, the ones stopped mid-way (a rerun resumes them from their last checkpoint) and
    the ones that never started."""

    def __init__(self) -> None:
        self.sweep_dir: Path | None = None
        self.planned: list[list[str]] | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self.planned = planned_jobs(config)
        atexit.register(self._stopped_early)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self._stopped_early)
        sweep_dir = Path(config.hydra.sweep.dir)
        planned = planned_jobs(config)
        paths = write_tables(collect(sweep_dir, planned), sweep_dir, trials=planned is None)
        if paths:
            print(f"[sweep] results: {' '.join(map(str, paths.values()))}", flush=True)

    def _stopped_early(self) -> None:
        rows = collect(self.sweep_dir, self.planned)
        if not any(r["job"] for r in rows):
            return  # no job started: nothing to tell apart
        paths = write_tables(rows, self.sweep_dir, trials=self.planned is None)
        counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "dry-run", "failed", "incomplete", "not started")}
        print("[sweep] the sweep stopped before all its jobs returned: "
              + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
              + f" of {len(rows)}. Run the same command again: finished jobs are skipped, stopped ones resume "
              f"from their last checkpoint. results so far: {paths['md']} {paths['csv']}", flush=True)
