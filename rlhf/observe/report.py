"""Runs side by side: any run folders, chains (their steps in order) and sweeps (their jobs) laid
over each other on the panels of curves.png, one block per step, with each chain step's forecast
against its actual time; report.png, and report.html (the figure embedded, the final figures table
and the config keys that differ between the runs) in --out.

    python -m rlhf.observe.report RUN [RUN ...] [--out DIR]     # default DIR: RUN/report for one run, else beside the runs
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import os
import sys
from pathlib import Path

from rlhf.observe.curves import Run, draw_panels, load_run, panels_for

# Keys that differ between any two runs and say nothing about them.
_SAME_IN_SPIRIT = ("run_dir",)


def expand(path: Path) -> list[tuple[str, Path]]:
    """(label, run folder) of each run ``path`` holds: itself, a chain's steps in order (its
    manifest.json), or a sweep's jobs (folders holding metrics.jsonl, or chains)."""
    if (path / "manifest.json").exists():
        steps = json.loads((path / "manifest.json").read_text()).get("steps", {})
        return [(f"{path.name}/{name}", Path(entry.get("run_dir", path / name))) for name, entry in steps.items()]
    if (path / "metrics.jsonl").exists():
        return [(path.name, path)]
    runs = []
    for job in sorted(p for p in path.iterdir() if p.is_dir()) if path.is_dir() else []:
        runs += [(f"{path.name}/{label}", where) for label, where in expand(job)]
    return runs


def flat_config(run_dir: Path) -> dict[str, object]:
    from omegaconf import OmegaConf

    from rlhf.launch.provenance import flat_keys

    path = run_dir / "config.yaml"
    return flat_keys(OmegaConf.to_container(OmegaConf.load(path), resolve=False)) if path.exists() else {}


def config_differences(runs: list[Run]) -> dict[str, list[object]]:
    """key -> each run's value, for the keys whose values differ between runs of the same step, and
    for the keys every run has (the step's name, the model, the learning rate) that differ between any."""
    diffs: dict[str, list[object]] = {}
    configs = [flat_config(r.path) for r in runs]
    shared = set.intersection(*(set(c) for c in configs)) if configs else set()
    for k in sorted(shared):
        if k in _SAME_IN_SPIRIT or k.startswith("hydra."):
            continue
        if len({json.dumps(c[k], default=str) for c in configs}) > 1:
            diffs[k] = [c[k] for c in configs]
    for step in dict.fromkeys(r.step for r in runs):
        same = [i for i, r in enumerate(runs) if r.step == step]
        if len(same) < 2:
            continue
        keys = sorted({k for i in same for k in configs[i]})
        for k in keys:
            if k in _SAME_IN_SPIRIT or k.startswith("hydra."):
                continue
            values = [configs[i].get(k, "(absent)") for i in same]
            if k not in diffs and len({json.dumps(v, default=str) for v in values}) > 1:
                diffs[k] = [configs[i].get(k, "(absent)") if r.step == step else ""
                            for i, r in enumerate(runs)]
    return diffs


def final_figures(runs: list[Run]) -> dict[str, list[object]]:
    """key -> each run's final figure (numbers, stopped_by, warnings), in a stable order."""
    keys = sorted({k for r in runs for k, v in r.final.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and not k.endswith("_last")})
    table = {k: [r.final.get(k, "") for r in runs] for k in keys}
    for key in ("stopped_by", "warnings"):
        if any(r.final.get(key) for r in runs):
            table[key] = ["; ".join(v) if isinstance(v := r.final.get(key, ""), list) else v for r in runs]
    return table


def figure(runs: list[Run]):
    """One block of panels per step (in the order the runs name them), every run of that step laid
    over the others; below, forecast against actual seconds per run where a forecast was made."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    from rlhf.config import STEPS

    steps = list(dict.fromkeys(r.step for r in runs))
    blocks = [(step, [r for r in runs if r.step == step]) for step in steps]
    blocks = [(s, rs, panels_for(rs)) for s, rs in blocks if panels_for(rs)]
    timed = [r for r in runs if "forecast_s" in r.final and "actual_s" in r.final]
    heights = [3.0 * math.ceil(len(p) / 4) + 0.9 for _, _, p in blocks] + ([3.0] if timed else [])
    if not heights:
        return None
    fig = Figure(figsize=(4.4 * 4, sum(heights)), layout="constrained")
    subs = fig.subfigures(len(heights), 1, height_ratios=heights, squeeze=False).ravel()
    colour = {id(r): f"C{i % 10}" for i, r in enumerate(runs)}
    for sub, (step, rs, panels) in zip(subs, blocks, strict=False):
        spec = STEPS.get(step)
        sub.suptitle(f"{spec.title if spec else step}: {len(rs)} run(s)", fontsize=11, ha="left", x=0.01)
        draw_panels(sub, rs, panels, ncols=4, colours=[colour[id(r)] for r in rs])  # a run's colour report-wide
        handles = [Line2D([], [], color=colour[id(r)] if len(rs) > 1 else "black") for r in rs]
        sub.legend(handles, [r.label for r in rs], loc="upper right", fontsize=8, ncols=min(len(rs), 4),
                   frameon=False)
    if timed:
        sub = subs[len(blocks)]
        ax = sub.add_subplot(sub.add_gridspec(1, 4)[0, :min(4, math.ceil(len(timed) / 3))])
        x = range(len(timed))
        ax.bar([i - 0.2 for i in x], [r.final["forecast_s"] for r in timed], 0.4, label="forecast", color="grey")
        ax.bar([i + 0.2 for i in x], [r.final["actual_s"] for r in timed], 0.4, label="actual (the run's colour)",
               color=[colour[id(r)] for r in timed])
        ax.set_xticks(list(x), [r.label.split(" (")[0] for r in timed], fontsize=8, rotation=20, ha="right")
        ax.set_ylabel("seconds")
        ax.set_title("time: forecast against actual (a chain's steps in order)", fontsize=10)
        ax.legend(fontsize=8, frameon=False)
        ax.grid(alpha=0.3, axis="y")
    return fig


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return html.escape(str(v))


def _table(title: str, rows: dict[str, list[object]], runs: list[Run]) -> str:
    if not rows:
        return f"<h2>{title}</h2><p>none</p>"
    head = "".join(f"<th>{html.escape(r.label)}</th>" for r in runs)
    body = "".join(f"<tr><td><code>{html.escape(k)}</code></td>{''.join(f'<td>{_cell(v)}</td>' for v in vs)}</tr>"
                   for k, vs in rows.items())
    return f"<h2>{title}</h2><table><tr><th>key</th>{head}</tr>{body}</table>"


def write(paths: list[Path], out: Path) -> dict[str, Path]:
    found = [item for p in paths for item in expand(p)]
    if not found:
        raise SystemExit(f"no run found in {' '.join(map(str, paths))} (a run folder holds metrics.jsonl)")
    runs = [load_run(where, label) for label, where in found]
    diffs = config_differences(runs)
    for i, run in enumerate(runs):  # a run's legend entry says how it differs, not only its folder's name
        shown = [f"{k}={v[i]}" for k, v in diffs.items() if v[i] != ""][:3]
        run.label += f" ({', '.join(shown)})" if shown else ""
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    fig = figure(runs)
    image = ""
    if fig is not None:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90)
        (out / "report.png").write_bytes(buf.getvalue())
        written["png"] = out / "report.png"
        image = f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}" style="max-width:100%">'
    listing = "".join(f"<li>{html.escape(r.label)}: <code>{html.escape(str(r.path))}</code> ({r.step})</li>"
                      for r in runs)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>RLHF report</title><style>"
            "body{font-family:sans-serif;margin:1.5em} table{border-collapse:collapse;font-size:13px}"
            "td,th{border:1px solid #ccc;padding:3px 7px;text-align:right} td:first-child{text-align:left}"
            f"</style></head><body><h1>RLHF report: {len(runs)} run(s)</h1><ul>{listing}</ul>{image}"
            + _table("config differences", diffs, runs) + _table("final figures", final_figures(runs), runs)
            + "</body></html>")
    (out / "report.html").write_text(page)
    written["html"] = out / "report.html"
    print(f"[report] {len(runs)} run(s): " + ", ".join(r.label for r in runs))
    print("[report] differing keys: " + (", ".join(f"{k} ({' / '.join(map(str, v))})" for k, v in diffs.items())
                                        or "none"))
    print(f"[report] {' '.join(map(str, written.values()))}")
    return written


def _beside(runs: list[Path]) -> Path:
    """report/ in the folder that holds every run (never the working directory, which may be a checkout)."""
    common = Path(os.path.commonpath([p.resolve() for p in runs]))
    return (common if common != Path(common.anchor) else runs[0].resolve().parent) / "report"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlhf.observe.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, chain folders or sweep folders")
    parser.add_argument("--out", type=Path, default=None, help="where report.png and report.html go "
                        "(default: RUN/report for one run, else report/ in the folder that holds them all)")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.runs if not p.exists()]
    if missing:
        print(f"[report] no such run folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    out = args.out or (args.runs[0] / "report" if len(args.runs) == 1 else _beside(args.runs))
    write(args.runs, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
