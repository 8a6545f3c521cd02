"""The command line tells the truth: a dry-run that says no exits 2, a wrong value, type or group option
is one line and exit code 2 naming the key, dry-run sweeps record verdicts (not killed jobs) and draw
nothing, --help names every group; and the Python API runs what the command line runs.

    python -m pytest -q tests/test_cli.py
"""

from __future__ import annotations

import csv
import json

import pytest
from conftest import compose, run_cli

import rlhf
from rlhf.config import ConfigError
from rlhf.launch import run


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_a_dry_run_the_real_run_would_refuse_exits_2_and_says_so_last(tmp_path):
    refused = run_cli("step=ppo", "--dry-run", f"run_dir={tmp_path}/ppo", timeout=300)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert _last_line(refused.stdout).startswith("dry-run: the real run would be refused: PPO with "
                                                 "step.reward_model_weight > 0 needs critic.path")
    # The verdict the command line prints is the run's own: in-process, the same reasons come back.
    missing = run(compose(["actor.path=/nonexistent/model", "launch.dry_run=true", f"run_dir={tmp_path}/sft"]))
    assert not missing["fits"] and "/nonexistent/model" in missing["refused"][0], missing
    # A 6.7B actor with Adam states in fp32 on one 48 GB A6000 with ZeRO-0 does not fit: refused unless
    # forced, as the real run is.
    big = ["model=opt-6.7b", "hardware=a6000", "zero=0", "launch.dry_run=true", f"run_dir={tmp_path}/big"]
    too_big = run(compose(big))
    assert too_big["refused"] == ["sft does not fit in a6000's memory (the table above; launch.force=true runs it "
                                  "anyway)"], too_big
    assert run(compose([*big, "launch.force=true"]))["refused"] == []
    assert not any(p.parent.name != ".hydra" for p in tmp_path.rglob("*.yaml")), "a dry-run writes no run folder"


@pytest.mark.parametrize(("override", "line"), [
    ("optim.lr=abc", "config error: optim.lr='abc': expected a number"),
    ("step.max_steps=1.5", "config error: step.max_steps='1.5': expected an integer"),
    ("launch.dry_run=maybe", "config error: launch.dry_run='maybe': expected true or false"),
    ("zero=5", "config error: zero=5: no such option; zero is one of 0, 1, 2, 2-offload, 3, 3-offload"),
    ("step=ppx", "config error: step=ppx: no such option; step is one of dpo, kto, orpo, ppo, reward, sft, simpo"),
])
def test_a_wrong_value_type_or_group_option_is_one_line_and_exit_2(override, line, tmp_path):
    proc = run_cli(override, f"run_dir={tmp_path}", timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[0]]  # one line
    assert proc.stderr.startswith(line) and "schema" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(("args", "line"), [
    (["-m", "optim.lrr=1e-3,3e-3"], "config error: optim.lrr is not a key of the config; did you mean optim.lr?"),
    (["-m", "zero=0,5"], "config error: zero=5: no such option; zero is one of 0, 1, 2, 2-offload, 3, 3-offload"),
    (["-m", "optim.lr=1e-3,abc"], "config error: optim.lr='abc': expected a number"),
    (["--cfg", "job", "optim.lrr=1e-3"], "config error: optim.lrr is not a key of the config; did you mean optim.lr?"),
])
def test_a_mistake_in_a_sweep_or_with_cfg_job_is_one_line_and_exit_2_before_any_job(args, line, tmp_path):
    proc = run_cli(*args, f"hydra.sweep.dir={tmp_path}", timeout=300)
    assert proc.returncode == 2 and proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert not any(tmp_path.iterdir()), "no job ran"


def test_a_dry_run_sweep_records_each_job_s_verdict_and_draws_nothing(tmp_path):
    # sft_lr_zero: 3 learning rates x zero 0 and 3, here for SFT and for PPO.
    proc = run_cli("-m", "sweep=sft_lr_zero", "step=sft,ppo", "launch.dry_run=true", f"hydra.sweep.dir={tmp_path}",
                   timeout=600)
    # PPO without a reward model would be refused: the sweep says so and exits 2.
    assert proc.returncode == 2 and "6 job(s) of the sweep would be refused" in proc.stderr, proc.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [r["status"] for r in rows] == ["dry-run"] * 12
    verdicts = {r["overrides"]: r["error"] for r in rows}
    assert all(v.startswith("the real run would be refused") == ("step=ppo" in k) for k, v in verdicts.items())
    assert not (tmp_path / "results.png").exists(), "no figure without a finished job"
    assert not any("'" in p.name for p in tmp_path.iterdir()), "job folders named as typed: zero=3, not zero='3'"


def test_an_optuna_sweep_dry_runs_its_base_config_once(tmp_path):
    proc = run_cli("-m", "sweep=reward_optuna", "launch.dry_run=true", f"run_dir={tmp_path}/base", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dry-run of an Optuna sweep" in proc.stdout and proc.stdout.count("== reward:") == 1
    assert _last_line(proc.stdout).startswith("dry-run: the real run would start")


def test_help_names_every_group_and_chat_names_a_missing_folder(tmp_path):
    out = run_cli("--help", timeout=120).stdout
    for group in ("data", "experiment", "hardware", "model", "pipeline", "step", "zero", "sweep", "hydra/launcher",
                  "hydra/sweeper"):
        assert f"\n  {group} " in out, group
    chat = run_cli("--path", str(tmp_path / "runs" / "ppo" / "model"), module="rlhf.chat", input="", timeout=120)
    assert chat.returncode != 0 and chat.stderr.startswith(f"no such folder: {tmp_path}/runs/ppo/model"), chat.stderr


def test_the_python_api_composes_and_trains_as_the_command_line_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default run folder (runs/...) lands here
    cfg = rlhf.compose(["step=sft", "optim.lr=1e-3"])
    assert cfg.optim.lr == 1e-3 and cfg.run_dir.startswith("runs/sft/") and "hydra" not in cfg
    with pytest.raises(ConfigError, match="optim.lrr is not a key of the config; did you mean optim.lr"):
        rlhf.compose(["optim.lrr=1e-3"])
    final = rlhf.train(["step=sft", "step.max_steps=4", "step.eval_every_steps=0", "data.max_eval_samples=16",
                        "logging.progress_bar=false"])
    run_dirs = list((tmp_path / "runs" / "sft").iterdir())
    assert len(run_dirs) == 1 and final["step"] == 4 and final["stopped_by"] == "the cap step.max_steps=4"
    assert json.loads((run_dirs[0] / "final_metrics.json").read_text())["step"] == 4
    assert (run_dirs[0] / "command.txt").read_text().split()[1:3] == ["launch.py", "step=sft"]


def test_cfg_job_prints_the_composed_config_without_the_chain_s_unset_step_blocks(tmp_path):
    plain = run_cli("--cfg", "job", "optim.lr=1e-3", timeout=300)
    assert plain.returncode == 0 and "lr: 0.001" in plain.stdout and len(plain.stdout.splitlines()) < 250
    assert "  sft:\n    model:" not in plain.stdout, "no block of nulls for each step of a chain"
    chain = run_cli("--cfg", "job", "pipeline=e2e", "pipeline.ppo.step.epochs=1", timeout=300)
    assert chain.returncode == 0 and "  ppo:\n    step:\n      epochs: 1" in chain.stdout, chain.stdout[-1500:]
