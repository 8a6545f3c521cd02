"""The mistakes people make, each run both ways: the dry-run's verdict must be the real run's. Every
case is refused by both with exit code 2 and the same reason (the real run in one line, before
anything trains); what only this machine lacks (CUDA devices, a hub it cannot reach) the dry-run,
which plans for the target machine, says apart from its verdict. A sweep's dry-run gives each job the
real job's verdict.

    python -m pytest -q tests/test_mistakes.py            # the full corpus: make test-all
"""

from __future__ import annotations

import csv
import json

import pytest

from tests.conftest import run_cli

GRPO_RULE = ["step=ppo", "step.reward_fn=rule", "step.reward_model_weight=0", "step.advantage_estimator=grpo",
             "step.samples_per_prompt=4"]
QUICK = ["step.max_steps=2", "logging.progress_bar=false", "data.max_eval_samples=32"]


def _llama(folder, **sizes):
    from transformers import LlamaConfig

    LlamaConfig(**{"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, **sizes}).save_pretrained(folder)
    return folder


def _rows(folder, rows, lines=None):
    folder.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval"):
        (folder / f"{split}.jsonl").write_text(lines if lines is not None else "".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _setup(case: str, tmp) -> list[str]:
    """The overrides of one mistake, with whatever files it needs made under ``tmp``."""
    pairs = [{"prompt": f" Human: sort {c} a Assistant:", "chosen": f" a {c}", "rejected": f" {c} a"} for c in "bcdefghij"]
    long_answers = [{"prompt": f" Human: What is {i} + {i}? Assistant:",
                     "answer": f" We add {i} and {i} one step at a time: {i} plus {i} makes {2 * i}. #### {2 * i}"}
                    for i in range(40)]
    cases = {
        "empty model folder": lambda: [f"model.path={(tmp / 'empty').mkdir() or tmp / 'empty'}"],
        "config.json without weights": lambda: [f"model.path={_llama(tmp / 'cfg')}"],
        "a broken JSON line under on_bad_row=error": lambda: [
            f"data.sources=[{{path: {_rows(tmp / 'bad', [], json.dumps(pairs[0]) + chr(10) + '{broken' + chr(10))}}}]",
            "data.on_bad_row=error"],
        "no prompt column": lambda: [
            f"data.sources=[{{path: {_rows(tmp / 'q', [{'question': p['prompt'], 'chosen': p['chosen']} for p in pairs])}}}]"],
        "a data folder that is not there": lambda: [f"data.sources=[{{path: {tmp / 'nowhere'}}}]"],
        "a relative actor.path that does not exist": lambda: [*GRPO_RULE, "actor.path=runs/e2e/tiny/sft/model"],
        "PPO from a random model": lambda: GRPO_RULE,
        "DPO from a random model": lambda: ["step=dpo"],
        "KTO from a random model": lambda: ["step=kto"],
        "PPO without a reward model": lambda: ["step=ppo", "actor.random_init=true"],
        "an 8B actor on one A6000": lambda: [*GRPO_RULE, f"actor.path={_llama(tmp / 'big', vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)}",  # noqa: E501
                                             "hardware=a6000"],
        "a budget shorter than the reference answers": lambda: [
            *GRPO_RULE, "actor.random_init=true", f"data.sources=[{{path: {_rows(tmp / 'long', long_answers)}}}]",
            "data.rule=math"],
        "a misspelled key": lambda: ["optim.lrr=1e-3"],
        "a group option that does not exist": lambda: ["zero=5"],
        "a value of the wrong type": lambda: ["optim.lr=abc"],
        "a zero budget": lambda: ["step.max_new_tokens=0"],
        "GSPO with a length-weighted aggregation": lambda: [*GRPO_RULE, "step.policy_loss=gspo", "step.loss_agg=token_mean"],
        "a rollout correction without a trainer forward": lambda: [*GRPO_RULE, "step.rollout_correction=tis",
                                                                   "step.old_logprobs=rollout"],
        "dynamic sampling of one answer per prompt": lambda: ["step=ppo", "step.dynamic_sampling=true"],
        "a critic of another tokenizer": lambda: ["step=ppo", "actor.random_init=true", "critic.model=opt-350m",
                                                  f"critic.path={tmp / 'rm'}", "step.advantage_estimator=gae"],
        "a weird learning-rate schedule": lambda: ["optim.scheduler=cosin"],
    }
    return cases[case]()


CASES = ["empty model folder", "config.json without weights", "a broken JSON line under on_bad_row=error",
         "no prompt column", "a data folder that is not there", "a relative actor.path that does not exist",
         "PPO from a random model", "DPO from a random model", "KTO from a random model", "PPO without a reward model",
         "an 8B actor on one A6000", "a budget shorter than the reference answers", "a misspelled key",
         "a group option that does not exist", "a value of the wrong type", "a zero budget",
         "GSPO with a length-weighted aggregation", "a rollout correction without a trainer forward",
         "dynamic sampling of one answer per prompt", "a critic of another tokenizer", "a weird learning-rate schedule"]
# make test runs these; make test-all the whole corpus (each case is two launches of a few seconds).
FAST = {"config.json without weights", "a broken JSON line under on_bad_row=error", "PPO from a random model",
        "a budget shorter than the reference answers", "a misspelled key"}


def _error(proc) -> str:
    """The one line a refused real run prints, without its kind ('config error: ')."""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and " error: " in lines[0], proc.stderr[-3000:]
    return lines[0].split(" error: ", 1)[1]


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES])
def test_the_dry_run_refuses_what_the_real_run_refuses_with_the_same_reason(case, tmp_path):
    if case == "a critic of another tokenizer":  # a reward-model folder of another family (OPT's vocabulary)
        from transformers import OPTConfig

        OPTConfig(vocab_size=50272, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                  word_embed_proj_dim=64).save_pretrained(tmp_path / "rm")
    args = _setup(case, tmp_path)
    dry = run_cli(*args, "launch.dry_run=true", f"run_dir={tmp_path / 'dry'}", timeout=600)
    real = run_cli(*args, *QUICK, f"run_dir={tmp_path / 'real'}", timeout=600)
    assert real.returncode == 2, (case, real.stdout[-2000:], real.stderr[-2000:])
    reason = _error(real)
    assert dry.returncode == 2, (case, dry.stdout[-3000:], dry.stderr[-2000:])
    said = dry.stdout.strip().splitlines()[-1] if dry.stdout.strip() else ""
    # A mistake in the command line itself stops both before any plan: the same line.
    said = said if said.startswith("dry-run: ") else _error(dry)
    assert reason.removeprefix("data: ") in said, (case, reason, said)
    assert not (tmp_path / "real" / "model").exists(), "refused before anything trained"


@pytest.mark.slow
def test_a_finished_run_s_folder_with_other_settings_is_refused_both_ways(tmp_path):
    run_dir = tmp_path / "run"
    done = run_cli(*QUICK, f"run_dir={run_dir}", timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    dry = run_cli(*QUICK, "optim.lr=1e-2", "launch.dry_run=true", f"run_dir={run_dir}", timeout=600)
    real = run_cli(*QUICK, "optim.lr=1e-2", f"run_dir={run_dir}", timeout=600)
    assert real.returncode == dry.returncode == 2, (dry.stdout[-2000:], real.stderr[-2000:])
    reason = _error(real)
    assert "optim.lr" in reason and reason in dry.stdout.strip().splitlines()[-1], (reason, dry.stdout[-1500:])


@pytest.mark.slow
@pytest.mark.parametrize("args,lacks", [
    (["model=opt-125m", "HF_HUB_OFFLINE"], "is a hub id, but HF_HUB_OFFLINE is set"),
    (["hardware=a6000"], "hardware=a6000 needs 1 CUDA device(s) per node but this machine has 0: hardware=cpu runs it"),
])
def test_what_this_machine_lacks_is_said_apart_from_the_dry_run_s_verdict(args, lacks, tmp_path):
    """A dry-run plans for the target machine (a cluster's A6000, a hub the cluster reaches): its
    verdict stays 'would start', and the line that the real run here refuses with is printed beside it."""
    import torch

    if "hardware=a6000" in args and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    from tests.conftest import clean_env

    env = {**clean_env(), **({"HF_HUB_OFFLINE": "1"} if "HF_HUB_OFFLINE" in args else {})}
    args = [a for a in args if a != "HF_HUB_OFFLINE"]
    dry = run_cli(*args, "launch.dry_run=true", f"run_dir={tmp_path / 'dry'}", timeout=600, env=env)
    real = run_cli(*args, *QUICK, f"run_dir={tmp_path / 'real'}", timeout=600, env=env)
    assert real.returncode == 2 and lacks in _error(real), real.stderr[-2000:]
    assert dry.returncode == 0, dry.stdout[-2000:]
    lines = dry.stdout.strip().splitlines()
    assert any(x.startswith("on this machine: ") and _error(real) in x for x in lines), dry.stdout[-2000:]
    assert "on this machine it would be refused (1 reason(s) above" in lines[-1]


@pytest.mark.slow
def test_a_sweep_s_dry_run_gives_each_job_the_real_job_s_verdict(tmp_path):
    """Two jobs, one refused (DPO from a random model) and one that starts: the dry-run's results table
    says so per job, and the real sweep fails that job with the same reason, exit 2, one job counted."""
    args = ["-m", "step=sft,dpo", *QUICK]
    dry = run_cli(*args, "launch.dry_run=true", f"hydra.sweep.dir={tmp_path / 'dry'}", timeout=900)
    real = run_cli(*args, f"hydra.sweep.dir={tmp_path / 'real'}", timeout=900)
    assert dry.returncode == real.returncode == 2, (dry.stderr[-2000:], real.stderr[-2000:])
    planned = {r["overrides"].replace(" launch.dry_run=True", ""): r
               for r in csv.DictReader(open(tmp_path / "dry" / "results.csv"))}
    ran = {r["overrides"]: r for r in csv.DictReader(open(tmp_path / "real" / "results.csv"))}
    assert planned.keys() == ran.keys() and len(ran) == 2
    for job, row in ran.items():
        refused = planned[job]["error"].startswith("the real run would be refused")
        assert refused == (row["status"] == "failed"), (job, planned[job], row)
        if refused:
            assert "has no actor.path" in row["error"] and "has no actor.path" in planned[job]["error"]
    assert "sweep: 1 job(s) failed" in real.stderr
