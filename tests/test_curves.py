"""Seeing a run: curves.png in every run folder (its panels read back from the Figure), the report
that lays runs side by side, sweep figures with log axes, and a resumed run's W&B id."""

from __future__ import annotations

import json

import pytest

from rlhf.launch import run
from rlhf.observe import curves
from tests.conftest import compose

QUIET = ["logging.progress_bar=false", "data.max_eval_samples=32", "step.save_model=false"]


def titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes if ax.get_title()]


@pytest.fixture(scope="module")
def two_sft_runs(tmp_path_factory):
    """Two 20-step SFT runs that differ in their learning rate; the first evaluates greedy accuracy."""
    base = tmp_path_factory.mktemp("sft")
    for name, extra in (("a", ["optim.lr=3e-3", "step.eval_accuracy_prompts=16", "step.eval_every_steps=10"]),
                        ("b", ["optim.lr=1e-3"])):
        run(compose(["step.max_steps=20", "step.log_every_steps=5", *QUIET, *extra, f"run_dir={base / name}"]))
    return base / "a", base / "b"


def test_a_20_step_sft_draws_its_loss_accuracy_and_lr_panels(two_sft_runs):
    a, _ = two_sft_runs
    assert (a / "curves.png").stat().st_size > 10_000
    fig = curves.draw(a)
    assert titles(fig) == ["loss", "accuracy by the rule", "answer length (tokens)", "truncated fraction", "learning rate"]
    loss = fig.axes[0]
    assert [line.get_label() for line in loss.get_lines()] == ["train", "held-out"]
    train = loss.get_lines()[0]
    assert list(train.get_xdata()) == [5, 10, 15, 20]  # every logged step, in order


def test_a_4_step_ppo_draws_the_rl_panels_and_marks_warnings_where_they_happened(tmp_path):
    sft = tmp_path / "sft"
    run(compose(["step.max_steps=20", *QUIET[:2], f"run_dir={sft}"]))
    ppo = tmp_path / "ppo"
    run(compose(["step=ppo", "step.rollout_batch_size_per_device=8", "step.micro_batch_size_per_device=8",
                 "step.max_steps=4", "step.eval_prompts=8", "step.eval_micro_batch_size_per_device=8",
                 "step.max_new_tokens=4", "step.eval_every_steps=2", "step.reward_fn=rule", "step.reward_model_weight=0",
                 *QUIET, f"actor.path={sft / 'model'}", f"run_dir={ppo}"]))
    assert (ppo / "curves.png").exists()
    fig = curves.draw(ppo)
    shown = titles(fig)
    for title in ("reward", "accuracy by the rule", "KL to the reference", "entropy (nats/token)", "clip fraction",
                  "answer length (tokens)", "truncated fraction", "time per step (s)", "learning rate"):
        assert title in shown
    kl = next(ax for ax in fig.axes if ax.get_title() == "KL to the reference")
    assert len(kl.get_lines()[0].get_xdata()) == 4

    # A warning that names its step is a vertical line at that step on every panel.
    final = json.loads((ppo / "final_metrics.json").read_text())
    final["warnings"] = ["step 2: the reward model's score rose while accuracy fell (reward hacking?)"]
    (ppo / "final_metrics.json").write_text(json.dumps(final))
    fig = curves.draw(ppo)
    for ax in fig.axes:
        if ax.get_title():
            assert any(list(line.get_xdata()) == [2, 2] and line.get_color() == "red" for line in ax.get_lines())
    assert any("reward hacking" in t.get_text() for t in fig.texts)


def test_the_report_overlays_two_runs_and_names_the_keys_that_differ(two_sft_runs, tmp_path, capsys):
    from rlhf.observe import report

    a, b = two_sft_runs
    assert report.main([str(a), str(b), "--out", str(tmp_path)]) == 0
    html = (tmp_path / "report.html").read_text()
    assert (tmp_path / "report.png").stat().st_size > 10_000
    assert "data:image/png;base64," in html
    assert "optim.lr" in html and "step.eval_accuracy_prompts" in html
    assert "run_dir" not in html.split("config differences")[1].split("</table>")[0]
    assert "eval/loss" in html  # the final figures table
    assert "optim.lr" in capsys.readouterr().out


def test_a_report_of_runs_of_different_steps_names_the_keys_they_differ_in_and_writes_beside_them(
        two_sft_runs, tmp_path, capsys):
    """Runs of different steps and models (here an SFT run's copy relabelled as a DPO run of another
    model) differ in keys they all have: the report names them, and without --out it writes into the
    folder that holds the runs, never the working directory."""
    import shutil

    from omegaconf import OmegaConf

    from rlhf.observe import report

    a, _ = two_sft_runs
    runs = tmp_path / "runs"
    shutil.copytree(a, runs / "sft", ignore=shutil.ignore_patterns("model", "checkpoints", "report"))
    shutil.copytree(a, runs / "dpo", ignore=shutil.ignore_patterns("model", "checkpoints", "report"))
    cfg = OmegaConf.load(runs / "dpo" / "config.yaml")
    cfg.step.name, cfg.model.name, cfg.optim.lr = "dpo", "tiny-qwen2", 1e-4
    OmegaConf.save(cfg, runs / "dpo" / "config.yaml")
    assert report.main([str(runs / "sft"), str(runs / "dpo")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("[report] differing keys: "))
    for key in ("step.name (sft / dpo)", "model.name (tiny-llama / tiny-qwen2)", "optim.lr (0.003 / 0.0001)"):
        assert key in line, line
    assert (runs / "report" / "report.html").exists()
    # A folder that is not there is the user's mistake: one line, exit 2, for both tools.
    assert report.main([str(runs / "sft"), str(tmp_path / "nope")]) == 2
    assert curves.main([str(tmp_path / "nope")]) == 2
    assert "no such run folder" in capsys.readouterr().err


def test_a_sweep_over_log_spaced_learning_rates_gets_a_log_axis_and_colours_by_the_other_key(tmp_path):
    from rlhf.launch import sweep

    rows = []
    grid = [(lr, zero) for lr in ("1e-5", "1e-4", "1e-3") for zero in ("'2'", "'3'")]
    for i, (lr, zero) in enumerate(grid):
        job = tmp_path / str(i)
        job.mkdir()
        (job / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval/ppl": 50 / (s + 1) + i}) + "\n"
                                                   for s in (0, 10, 20)))
        rows.append({"job": str(i), "status": "ok", "overrides": [f"optim.lr={lr}", f"zero={zero}"],
                     "objective": "eval/ppl", "mode": "min", "value": 3.0 + i, "wall_s": 1.0, "metrics": {}})
    fig = sweep.plot(rows, tmp_path / "results.png", tmp_path)
    assert (tmp_path / "results.png").exists()
    lr_ax = next(ax for ax in fig.axes if ax.get_xlabel() == "optim.lr")
    assert lr_ax.get_xscale() == "log"
    legend = [t.get_text() for t in lr_ax.get_legend().get_texts()]
    assert legend == ["zero=2", "zero=3"]  # the other key as colour, no quotes
    labels = [t.get_text() for ax in fig.axes for t in ax.get_xticklabels()]
    assert not any("'" in t for t in labels)
    curves_ax = next(ax for ax in fig.axes if ax.get_title().startswith("held-out"))
    assert len(curves_ax.get_lines()) == 6  # every job's held-out curve


def test_a_resumed_run_keeps_its_wandb_id_and_a_wandb_login_is_honoured(tmp_path, monkeypatch):
    from rlhf.observe.logging import WANDB_ID_FILE, MetricsLogger, resolve_wandb_mode

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert resolve_wandb_mode("") == "offline"  # no credential: never a login prompt
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "x" * 40 + "\n")
    assert resolve_wandb_mode("") is None  # `wandb login`'s key: W&B's own settings decide
    assert resolve_wandb_mode("offline") == "offline"

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = {"project": "rlhf-test", "name": "run", "config": {"optim": {"lr": 1e-3}}}
    first = MetricsLogger(tmp_path, True, cfg, fresh=True)
    first.log({"loss": 1.0}, step=1)
    first.close()
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    resumed = MetricsLogger(tmp_path, True, cfg, fresh=False)
    assert resumed._wandb.id == run_id
    resumed.log({"loss": 0.5}, step=2)
    resumed.summarize({"eval/loss": 0.4, "warnings": []}, step=2)
    resumed.close()
    started_over = MetricsLogger(tmp_path, True, cfg, fresh=True)  # resume=never, or no checkpoint to resume
    new_id = started_over._wandb.id
    started_over.close()
    assert new_id != run_id
    # W&B's offline folders (offline-run-<time>-<id>, with -<n> after when two start in the same
    # second): the resumed run wrote to its first one's id.
    assert {p.name.split("-")[3] for p in (tmp_path / "wandb").glob("offline-run-*")} == {run_id, new_id}
