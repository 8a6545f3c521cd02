"""A run's curves: ``curves.png`` in its folder, drawn from metrics.jsonl and final_metrics.json at
the end of the step and refreshed at each checkpoint, and the same panels for several runs laid
over each other (rlhf.observe.report).

Panels are chosen by the metrics a run logged, not by the step's name: a panel appears where one of
its keys was logged, so SFT gets loss / accuracy / lr, the reward model pairwise accuracy and
margin, PPO and the critic-free methods reward, KL, entropy, clip fraction, ... and a new method
that logs the same keys gets the same panels. Warnings that name a step ("step 6: reward hacking")
and a readiness stop are marked where they happened; every warning is written under the panels.

    python -m rlhf.observe.curves RUN_DIR          # (re)draw RUN_DIR/curves.png
"""

from __future__ import annotations

import json
import math
import re
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

FIGURE = "curves.png"
# A checkpoint refreshes the figure at most this often: runs that checkpoint every step (tests,
# tiny runs) would otherwise spend their time drawing; the end of the step always draws.
REFRESH_S = 30.0
_last_drawn: dict[str, float] = {}


@dataclass(frozen=True)
class Panel:
    title: str
    # (metrics key, legend label), drawn in this order.
    series: tuple[tuple[str, str], ...]
    # A figure between 0 and 1 (accuracies, fractions, AUC): a fixed 0..1 axis, so runs compare.
    fraction: bool = False
    # (key, label) on a second y axis (the KL coefficient beside the KL).
    twin: tuple[str, str] | None = None
    # (key, label) of a horizontal reference drawn from its latest value (a stop bar).
    bar: tuple[str, str] | None = None
    # A constant reference line (chance for an AUC).
    chance: float | None = None
    # Mark final_metrics' best_step (the output model's step) here.
    best: bool = False
    # A key whose value is the spread of the first series (drawn as a band of +- one std).
    spread: str | None = None
    # Said in a panel whose keys were logged but never finite.
    undefined: str = "logged, never finite"
    # A non-negative figure drawn from 0 (a learning rate): a schedule's last 0.03% is not a drop.
    from_zero: bool = False


PANELS: tuple[Panel, ...] = (
    Panel("loss", (("loss", "train"), ("eval/loss", "held-out"), ("select/loss", "held-out (select half)"))),
    Panel("accuracy by the rule", (("eval/accuracy", "held-out greedy (reported half)"),
                                   ("select/accuracy", "held-out greedy (select half)"),
                                   ("rollout/rule_accuracy", "sampled rollouts")),
          fraction=True, bar=("select/accuracy_bar", "stop bar"), best=True),
    Panel("pairwise accuracy (chosen > rejected)", (("acc", "train"), ("eval/acc", "held-out"),
                                                    ("select/acc", "held-out (select half)")), fraction=True, best=True),
    Panel("preference accuracy", (("pref_acc", "train"), ("eval/pref_acc", "held-out")), fraction=True),
    Panel("margin (chosen - rejected)", (("margin", "train"), ("eval/margin", "held-out"),
                                         ("select/margin", "held-out (select half)"))),
    Panel("implicit rewards", (("chosen_reward", "chosen (train)"), ("rejected_reward", "rejected (train)"),
                               ("eval/chosen_reward", "chosen (held-out)"),
                               ("eval/rejected_reward", "rejected (held-out)"))),
    Panel("reward", (("reward/score_mean", "rollouts: total (+-1 std)"), ("reward/rm_score", "rollouts: reward model"),
                     ("eval/rm_score", "held-out greedy: reward model"),
                     ("select/rm_score", "held-out greedy (select half): reward model")), spread="reward/score_std"),
    Panel("reward model vs rule on rollouts (AUC)", (("rollout/rm_rule_auc", "rollouts"),
                                                     ("select/policy_rm_auc", "start policy's samples")),
          fraction=True, chance=0.5,
          undefined="not defined: the rule judged every\nsampled answer alike (all right or all wrong)"),
    Panel("KL to the reference", (("kl", "KL"),), twin=("kl_coef", "KL coefficient")),
    Panel("entropy (nats/token)", (("entropy", "policy"),)),
    Panel("clip fraction", (("clip_frac", "policy ratio clipped"),)),
    Panel("answer length (tokens)", (("answer_len", "sampled rollouts"), ("eval/answer_len", "held-out greedy"),
                                     ("select/answer_len", "held-out greedy (select half)"))),
    Panel("truncated fraction", (("rollout/truncated_frac", "rollouts at max_new_tokens"),
                                 ("eval/truncated_frac", "held-out greedy answers at max_new_tokens"),
                                 ("select/truncated_frac", "held-out (select half) at max_new_tokens")),
          fraction=True),
    Panel("prompts without a signal", (("rollout/zero_std_frac", "groups whose answers all scored alike"),
                                       ("rollout/dynamic_fill_frac", "batch filled with them (dynamic sampling)")),
          fraction=True),
    Panel("sampler vs trainer", (("rollout/sampler_logprob_diff", "|log-prob gap| per token"),),
          twin=("rollout/correction_changed_frac", "tokens capped or masked")),
    Panel("policy and value loss", (("policy_loss", "policy"), ("value_loss", "value (critic)"),
                                    ("kl_loss", "KL in the loss"))),
    Panel("time per step (s)", (("step_s", "step"), ("generate_s", "generation"), ("experience_s", "experience"),
                                ("train_s", "updates"))),
    Panel("learning rate", (("lr", "lr"),), from_zero=True),
)


@dataclass
class Run:
    """What one run folder holds for the figures: its name, step, logged rows and final figures."""

    label: str
    step: str
    rows: list[dict]
    final: dict
    path: Path

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of ``key``, finite values only, in logged order."""
        xs, ys = [], []
        for row in self.rows:
            v = row.get(key)
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(row["step"])
                ys.append(float(v))
        return xs, ys

    def logged(self, key: str) -> bool:
        return any(key in row for row in self.rows)


def load_run(run_dir: str | Path, label: str | None = None) -> Run:
    run_dir = Path(run_dir)
    rows = []
    if (path := run_dir / "metrics.jsonl").exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # the line being written while a checkpoint draws
                continue
    for row in rows:  # the reward model logs its chosen and rejected scores; the margin is their difference
        if "margin" not in row and isinstance(row.get("chosen"), float) and isinstance(row.get("rejected"), float):
            row["margin"] = row["chosen"] - row["rejected"]
    final = json.loads((run_dir / "final_metrics.json").read_text()) if (run_dir / "final_metrics.json").exists() else {}
    return Run(label or run_dir.name, step_name(run_dir), rows, final, run_dir)


def step_name(run_dir: Path) -> str:
    """The step a run folder holds, from its config.yaml (``step.name``)."""
    path = run_dir / "config.yaml"
    if path.exists():
        match = re.search(r"^step:\n(?:  .*\n)*?  name: (\S+)", path.read_text(), re.M)
        if match:
            return match.group(1)
    return "run"


def panels_for(runs: list[Run]) -> list[Panel]:
    """The panels whose keys one of the runs logged, in PANELS' order."""
    keys = [k for p in PANELS for k, _ in p.series]
    present = {k for k in keys if any(r.logged(k) for r in runs)}
    return [p for p in PANELS if any(k in present for k, _ in p.series)]


def marks(run: Run) -> tuple[list[tuple[int, str]], list[str]]:
    """(step, short label) of each warning that names its step and of a readiness stop, and every
    warning's full text for the note under the panels."""
    at, notes = [], []
    for w in run.final.get("warnings", []):
        notes.append(w)
        if m := re.match(r"step (\d+): (.*)", w):
            at.append((int(m.group(1)), "warning"))  # the full text is under the panels
    stopped = run.final.get("stopped_by", "")
    if stopped and not stopped.startswith("the cap "):  # a readiness rule ended the step early
        at.append((int(run.final.get("step", 0)), "stopped"))
        notes.append(f"stopped at step {run.final.get('step')}: {stopped}")
    return at, notes


STYLES = ("-", "--", ":", "-.")
# Series of one panel often coincide (the reward model's score is the total reward without a rule):
# each later series is drawn with a smaller, different marker, so every one stays visible.
MARKERS = (("o", 6.0), ("s", 4.2), ("^", 3.2), ("D", 2.4))


def draw_panels(fig, runs: list[Run], panels: list[Panel], ncols: int = 4, colours: list[str] | None = None) -> list:
    """Draw ``panels`` for ``runs`` into ``fig`` (a Figure or SubFigure); returns the axes. One run:
    a colour per series. Several: a colour per run (``colours``, default Ci for run i) and a line style
    per series."""
    import matplotlib.ticker as ticker

    nrows = math.ceil(len(panels) / ncols)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    colours = colours or [f"C{i % 10}" for i in range(len(runs))]
    several = len(runs) > 1
    for ax, panel in zip(axes, panels, strict=False):
        ax.set_title(panel.title, fontsize=10)
        # Values as they are: an offset ("1e-6 + 2.999e-3") made a constant learning rate read as 0 to 1.
        ax.yaxis.set_major_formatter(ticker.ScalarFormatter(useOffset=False))
        drawn = False
        styled: dict[str, int] = {}  # several runs: series label -> index, for a legend of line styles
        twins: list = []  # second y axes, whose lines join this panel's one legend
        for r, run in enumerate(runs):
            drawn |= _draw_series(ax, panel, run, colours[r], several, styled)
            _draw_references(ax, panel, run, r, colours[r], several, annotate=panel is panels[0], twins=twins)
        _finish_panel(ax, panel, runs, drawn)
        _panel_legend(ax, styled if several else {}, twins)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    return list(axes[:len(panels)])


def _draw_series(ax, panel: Panel, run: Run, colour: str, several: bool, styled: dict[str, int]) -> bool:
    """One run's series of ``panel`` (in ``colour`` when runs are several, else a colour per series);
    records each series' index in ``styled``. Whether any series had points."""
    drawn = False
    for s, (key, label) in enumerate(panel.series):
        xs, ys = run.series(key)
        if not xs:
            continue
        colour_s = colour if several else f"C{s}"
        style = STYLES[s % len(STYLES)] if several else "-"
        # Evaluations are a few points: markers, so a single one still shows.
        marker, size = MARKERS[s % len(MARKERS)] if len(xs) <= 25 else (None, 0)
        ax.plot(xs, ys, style, color=colour_s, marker=marker, markersize=size, linewidth=1.3,
                label=None if several else label)
        styled.setdefault(label, s)
        drawn = True
        if panel.spread and s == 0:
            _, sd = run.series(panel.spread)
            if len(sd) == len(ys):
                ax.fill_between(xs, [y - d for y, d in zip(ys, sd, strict=True)],
                                [y + d for y, d in zip(ys, sd, strict=True)], color=colour_s, alpha=0.15)
    return drawn


def _draw_references(ax, panel: Panel, run: Run, r: int, colour: str, several: bool, annotate: bool,
                     twins: list) -> None:
    """One run's lines beside its series: the bar to beat, the best step, its warnings and stop
    (labelled on the first panel, ``annotate``), and the panel's right-axis series (appended to ``twins``)."""
    if panel.bar and (vals := run.series(panel.bar[0])[1]):
        ax.axhline(vals[-1], color=colour if several else "grey", linestyle="--", linewidth=1,
                   label=panel.bar[1] if r == 0 else None)
    if panel.best and "best_step" in run.final:
        ax.axvline(run.final["best_step"], color=colour if several else "green", linestyle="-.",
                   linewidth=1, label="best step (model/)" if r == 0 else None)
    for step, short in marks(run)[0]:
        ax.axvline(step, color="red", linestyle=":", linewidth=1.2)
        if annotate:
            ax.annotate(short, (step, 1.0), xycoords=("data", "axes fraction"), fontsize=7, color="red",
                        va="bottom", ha="center")
    if panel.twin and (xs := run.series(panel.twin[0])[0]):
        twin = ax.twinx()
        twin.plot(xs, run.series(panel.twin[0])[1], STYLES[1], color=colour if several else "grey",
                  linewidth=1, label=f"{panel.twin[1]} (right axis)")
        twin.tick_params(labelsize=7, colors="grey")
        twins.append(twin)


def _finish_panel(ax, panel: Panel, runs: list[Run], drawn: bool) -> None:
    """The panel's chance line, y range, axis ticks and, where nothing was drawn, why."""
    import matplotlib.ticker as ticker

    if panel.chance is not None:
        ax.axhline(panel.chance, color="grey", linewidth=0.8, linestyle=":", label="chance")
    if panel.fraction:
        ax.set_ylim(-0.03, 1.03)
    elif panel.from_zero and drawn:
        ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-12) * 1.05)
    if not drawn:  # logged, never finite (an AUC when every rollout was scored the same by the rule)
        ax.text(0.5, 0.5, panel.undefined, ha="center", va="center", transform=ax.transAxes, fontsize=8,
                color="dimgrey", bbox={"facecolor": "white", "edgecolor": "none"})
        steps = [row["step"] for run in runs for row in run.rows]
        if steps and max(steps) > min(steps):
            ax.set_xlim(min(steps), max(steps))
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True, nbins=6))
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4))
    ax.tick_params(labelsize=7)
    ax.set_xlabel("step", fontsize=8)
    ax.grid(alpha=0.3)


def _panel_legend(ax, styled: dict[str, int], twins: list) -> None:
    """The panel's one legend: its lines, the first second axis's, and with several runs
    (``styled`` non-empty) the series by line style in black, since colours are runs there (the
    figure's legend)."""
    handles, labels = ax.get_legend_handles_labels()
    for twin in twins[:1]:
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if styled:
        from matplotlib.lines import Line2D

        handles = [Line2D([], [], color="black", linestyle=STYLES[s % len(STYLES)],
                          marker=MARKERS[s % len(MARKERS)][0], markersize=4) for s in styled.values()] + handles
        labels = list(styled) + labels
    if handles:
        # Above a second axis's lines, which are drawn over this axis's own.
        (twins[-1] if twins else ax).legend(handles, labels, fontsize=7, frameon=False, loc="best")


def figure(runs: list[Run], title: str):
    """A figure of ``runs`` on their panels, with the warnings written under them; None when no run
    logged a figure a panel shows."""
    from matplotlib.figure import Figure

    panels = panels_for(runs)
    if not panels:
        return None
    ncols = min(4, len(panels))
    notes = [f"{r.label}: {n}" if len(runs) > 1 else n for r in runs for n in marks(r)[1]]
    lines = [line for n in notes[:6] for line in textwrap.wrap("! " + n, 170)]
    top_in, bottom_in = 0.75, 0.5 + 0.15 * len(lines)
    height = 2.9 * math.ceil(len(panels) / ncols) + top_in + bottom_in
    # Margins set by hand: a constrained layout doubles the time to draw, and this runs inside training.
    fig = Figure(figsize=(4.3 * ncols, height))
    fig.subplots_adjust(left=0.45 / (4.3 * ncols), right=1 - 0.5 / (4.3 * ncols), top=1 - top_in / height,
                        bottom=bottom_in / height, hspace=0.5, wspace=0.32)
    fig.suptitle(title, fontsize=11)
    draw_panels(fig, runs, panels, ncols)
    if lines:
        fig.text(0.01, 0.005, "\n".join(lines), fontsize=7.5, color="darkred", ha="left", va="bottom")
    return fig


def title_of(run: Run) -> str:
    from rlhf.config import STEPS

    spec = STEPS.get(run.step)
    f = run.final
    what = f"{spec.title if spec else run.step}, {run.path}"
    if f:
        state = f"finished at step {f.get('step')}" + (f", stopped by {f['stopped_by']}" if f.get("stopped_by") else "")
    else:
        last = max((row["step"] for row in run.rows), default=0)
        state = f"running: step {last} (refreshed at checkpoints)"
    return f"{what}\n{state}"


def draw(run_dir: str | Path):
    """Draw RUN_DIR/curves.png from its metrics; returns the Figure (its axes carry the panel
    titles), or None when nothing was logged yet."""
    run = load_run(run_dir)
    fig = figure([run], title_of(run))
    if fig is not None:
        out = Path(run_dir) / FIGURE
        tmp = out.with_name(".curves.tmp.png")
        fig.savefig(tmp, dpi=90)
        tmp.replace(out)  # a reader never sees half a file
        _last_drawn[str(Path(run_dir).resolve())] = time.monotonic()
    return fig


def refresh(run_dir: str | Path, at_checkpoint: bool = False) -> None:
    """Draw curves.png for a training run, which a figure must never stop: a failure is one line.
    At a checkpoint, at most every REFRESH_S seconds."""
    key = str(Path(run_dir).resolve())
    if at_checkpoint and time.monotonic() - _last_drawn.get(key, -math.inf) < REFRESH_S:
        return
    try:
        draw(run_dir)
    except Exception as err:  # noqa: BLE001 -- a figure is never worth a failed run
        print(f"[curves] {Path(run_dir) / FIGURE} not drawn: {type(err).__name__}: {err}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[-1].strip())
        return 0 if args else 2
    missing = [a for a in args if not (Path(a) / "metrics.jsonl").exists() and not Path(a).is_dir()]
    if missing:  # a typo in a folder name is the user's error: one line, exit 2, nothing drawn
        print(f"[curves] no such run folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    for run_dir in args:
        if draw(run_dir) is None:
            print(f"[curves] {run_dir}: no metrics logged yet")
        else:
            print(f"[curves] {Path(run_dir) / FIGURE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
