"""Tiny SFT runs through real DeepSpeed engines (no mocks): loss and perplexity fall, and the saved
model reloads with AutoModelForCausalLM, gives the perplexity the run reported, and generates."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.config import ConfigError, to_schema
from rlhf.data.blend import DataReport, load_step_data
from rlhf.data.tokenize import IGNORE_INDEX, PadCollator, sft_dataset
from rlhf.launch import run
from tests.conftest import check_margin, compose, trajectory_overrides

FAST = ["step.max_steps=30", "step.log_every_steps=5", "data.max_eval_samples=128", "logging.progress_bar=false"]


def _reloaded_ppl(model_dir: Path, cfg) -> float:
    """Perplexity of the saved model on the run's eval rows, computed without the framework's engine."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    _, eval_rows = load_step_data(cfg.data, "sft", DataReport())
    ds = sft_dataset(eval_rows, tok, cfg.step.max_seq_len, cfg.step.loss_on, DataReport(), "eval")
    batch = PadCollator(tok.pad_token_id)([ds[i] for i in range(len(ds))])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(),
                                             ignore_index=IGNORE_INDEX)
    return math.exp(loss.item())


# LoRA adapts a frozen base; on a random base it learns far slower than full fine-tuning (loss
# 6.1 -> 5.3 in 30 steps, ppl 513 -> 152 in 150), hence its looser bar.
@pytest.mark.parametrize("variant,loss_ratio,ppl_ratio", [
    pytest.param(["zero=0"], 0.7, 0.5, id="zero0"),
    pytest.param(["zero=3"], 0.7, 0.5, id="zero3"),
    pytest.param(["zero=2", "lora.rank=8", "lora.lr=1e-2", "model=tiny-opt"], 0.92, 0.7, id="lora-opt"),
])
@pytest.mark.trajectory
def test_sft_learns_saves_and_reloads(tmp_path, record_property, variant, loss_ratio, ppl_ratio):
    dict_cfg = compose([*FAST, *variant, *trajectory_overrides(), f"run_dir={tmp_path}"])
    final = run(dict_cfg)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    check_margin(record_property, "loss last/first", losses[-1] / losses[0], loss_ratio, higher=False, strict=True)
    check_margin(record_property, "eval/ppl after/before", final["eval/ppl"] / final["eval/ppl_before"], ppl_ratio,
                 higher=False, strict=True)
    for key in ("samples_per_s", "tokens_per_s", "tflops", "latency_s", "memory_gb", "lr"):
        assert rows[1][key] > 0

    model_dir = tmp_path / "model"
    assert (model_dir / "config.json").exists() and list(model_dir.glob("*.safetensors"))
    assert (model_dir / "tokenizer.json").exists() and (model_dir / "generation_config.json").exists()
    cfg = to_schema(dict_cfg)
    assert _reloaded_ppl(model_dir, cfg) == pytest.approx(final["eval/ppl"], rel=1e-3)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not any("lora" in k for k in model.state_dict())
    ids = torch.tensor([tok(" Human: sort d b a c Assistant:").input_ids])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape[1] > ids.shape[1]

    for name in ("config.yaml", "ds_config.json", "command.txt", "run.json", "data_report.json"):
        assert (tmp_path / name).exists(), name
    ds_cfg = json.loads((tmp_path / "ds_config.json").read_text())["model"]
    assert ds_cfg["zero_optimization"]["stage"] == cfg.zero.stage


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl") if '"loss"' in line]


@pytest.mark.slow  # 74 s; make test trains ZeRO 0 and 3 in test_sft_learns_saves_and_reloads
def test_zero_stages_offload_and_checkpointing_train_the_same(tmp_path):
    """ZeRO partitions state and checkpointing recomputes activations; neither may change the math."""
    base = ["step.max_steps=12", "step.log_every_steps=4", "data.max_eval_samples=32", "logging.progress_bar=false",
            "step.save_model=false"]
    runs = {"0": [], "2-offload": [], "3": ["step.gradient_checkpointing=true"]}
    losses = {}
    for zero, extra in runs.items():
        run(compose([*base, f"zero={zero}", *extra, f"run_dir={tmp_path / zero}"]))
        losses[zero] = _losses(tmp_path / zero)
    for zero in ("2-offload", "3"):
        assert losses[zero] == pytest.approx(losses["0"], rel=1e-4), (zero, losses)


def test_cli_default_command_writes_loss_metrics(tmp_path):
    """The documented command, through Hydra and launch.py as a user runs it."""
    from tests.conftest import run_cli

    proc = run_cli("step=sft", "model=tiny-llama", "zero=3", "step.max_steps=10", "data.max_eval_samples=32",
                   "logging.progress_bar=false", f"run_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert any("loss" in r for r in rows)
    assert "zero=3" in (tmp_path / "command.txt").read_text()
    assert json.loads((tmp_path / "run.json").read_text())["overrides"][:3] == ["step=sft", "model=tiny-llama", "zero='3'"]


@pytest.mark.trajectory
def test_sft_stops_once_its_held_out_loss_stops_improving(tmp_path, record_property):
    """A learning rate far too high makes the held-out loss rise: two evaluations without a new best
    (step.early_stop_patience=2) end the run at step 10 of 60, and the final figures say why."""
    final = run(compose(["step.max_steps=60", "step.eval_every_steps=5", "step.early_stop_patience=2", "optim.lr=0.1",
                         "optim.warmup_steps=0", "data.max_eval_samples=64", "logging.progress_bar=false",
                         *trajectory_overrides(), f"run_dir={tmp_path}"]))
    evals = [json.loads(x)["eval/loss"] for x in open(tmp_path / "metrics.jsonl") if '"eval/loss"' in x]
    # The stop at step 10 follows from both evaluations after step 0 being worse than step 0's.
    check_margin(record_property, "best eval/loss after 0 / at 0", min(evals[1:3]) / evals[0], 1.0, strict=True)
    assert final["step"] == 10 and final["eval/loss"] > final["eval/loss_before"]
    assert final["stopped_by"].startswith("eval/loss did not beat its best") and "step.early_stop_patience" in \
        final["stopped_by"]
    with pytest.raises(ConfigError, match="step.early_stop_patience needs evaluations"):
        to_schema(compose(["step.early_stop_patience=2"]))


@pytest.mark.trajectory
def test_a_plateau_short_of_the_accuracy_bar_lowers_the_learning_rate_before_it_ends_sft(tmp_path, record_property):
    """A rate far too high flattens the held-out loss at 0% accuracy by the rule, short of the bar:
    the first plateau divides the rate by step.plateau_lr_factor and SFT goes on (logged); once
    step.plateau_lr_drops are spent the plateau ends it, saying the rate is the likely cause and the
    override that starts over at a lower rate, and the final figures carry the rate it ended at."""
    final = run(compose(["step.max_steps=200", "step.eval_every_steps=5", "step.early_stop_patience=2", "optim.lr=0.1",
                         "optim.warmup_steps=0", "optim.scheduler=constant", "data.max_eval_samples=64",
                         "step.eval_accuracy_prompts=16", "step.stop_at_accuracy=0.3", "step.max_new_tokens=4",
                         "step.plateau_lr_drops=1", "step.plateau_lr_factor=4", "logging.progress_bar=false",
                         *trajectory_overrides(), f"run_dir={tmp_path}"]))
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    drops = [r for r in rows if set(r) == {"step", "time", "lr_drops", "lr_peak"}]
    assert [(r["step"], r["lr_drops"], r["lr_peak"]) for r in drops] == [(10, 1.0, 0.025)], drops
    # The optimizer runs at the lowered rate from the next step on.
    assert all(r["lr"] == pytest.approx(0.025) for r in rows if "lr" in r and r["step"] > 10)
    accuracy = [r["select/accuracy"] for r in rows if "select/accuracy" in r]
    check_margin(record_property, "best select accuracy (bar 0.3)", max(accuracy), 0.3, higher=False, strict=True)
    assert final["lr_drops"] == 1.0 and final["lr_peak"] == pytest.approx(0.025)
    assert final["step"] < 200, "the second plateau ends SFT before its cap"
    assert "short of its bar 30.0% after 1 drops of the rate to 0.025 (step.plateau_lr_drops=1): the likely cause is a " \
           "learning rate too high for the task: start over at a lower one, optim.lr=0.025 step.early_stop_patience=0" \
           in final["stopped_by"], final["stopped_by"]
    with pytest.raises(ConfigError, match="step.plateau_lr_factor=1.0 must be above 1"):
        to_schema(compose(["step.plateau_lr_factor=1"]))


def test_sft_stops_on_one_half_of_the_held_out_prompts_and_reports_the_other(tmp_path):
    """step.stop_at_accuracy reads select/accuracy (the select half); eval/accuracy comes from the other
    half of the prompts, measured before training and on the output only, never during the run: a
    figure the stop rule chose is optimistic. A bar of 0 stops at the first evaluation."""
    final = run(compose([*FAST, "step.eval_every_steps=5", "step.eval_accuracy_prompts=16",
                         "step.stop_at_accuracy=0.0", "step.max_new_tokens=8", f"run_dir={tmp_path}"]))
    assert final["step"] == 5 and final["stopped_by"] == "held-out accuracy 0.000 >= step.stop_at_accuracy=0.0"
    assert {"select/accuracy", "eval/accuracy", "eval/accuracy_before", "select/accuracy_before"} <= set(final)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "select/accuracy" in r] == [0, 5]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 5]
    assert "eval/accuracy" not in next(r for r in rows if r["step"] == 5 and "select/accuracy" in r)


@pytest.mark.trajectory
def test_a_task_where_one_answer_is_often_right_raises_the_accuracy_stop_above_it(tmp_path, monkeypatch,
                                                                                  record_property):
    """Is the first letter a vowel? Four answers in five are ' no'. A policy that learned only ' no'
    scores ~80% and passed the absolute 30% bar at its first evaluation; the bar is now 30% of the
    way from the best constant answer's accuracy to 100%, so SFT goes on training."""
    import random

    from rlhf.chain.readiness import accuracy_bar

    rng = random.Random(0)
    data = tmp_path / "vowel"
    data.mkdir()

    def row() -> dict:
        first = rng.choice("aeiou") if rng.random() < 0.2 else rng.choice("bcdfghjklmnp")
        w = [first] + [rng.choice("abcdefghijklmnop") for _ in range(3)]
        right = " yes" if first in "aeiou" else " no"
        return {"prompt": f" Human: vowel {' '.join(w)} Assistant:", "chosen": right,
                "rejected": " no" if right == " yes" else " yes"}

    for split, n in (("train", 800), ("eval", 128)):
        (data / f"{split}.json").write_text(json.dumps([row() for _ in range(n)]))
    (tmp_path / "vowel_rule.py").write_text(
        "def score(prompt, answer):\n"
        "    first = prompt.split('vowel', 1)[1].split()[0]\n"
        "    return float(answer.strip() == ('yes' if first in 'aeiou' else 'no'))\n")
    monkeypatch.chdir(tmp_path)
    final = run(compose(["step.max_steps=10", "step.eval_every_steps=5", "step.eval_accuracy_prompts=128",
                         "step.stop_at_accuracy=0.3", "step.max_new_tokens=4", "logging.progress_bar=false",
                         f"data.sources=[{{path: {data}}}]", "data.rule=vowel_rule:score", *trajectory_overrides(),
                         f"run_dir={tmp_path / 'run'}"]))
    constant = final["select/constant_accuracy"]
    assert 0.7 < constant < 0.95 and final["select/accuracy_bar"] == pytest.approx(accuracy_bar(0.3, constant))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl") if "select/accuracy" in line]
    at_5 = next(r for r in rows if r["step"] == 5)
    # The policy learned the frequent answer by step 5 (the old bar's stop).
    check_margin(record_property, "select/accuracy at step 5", at_5["select/accuracy"], 0.3)
    assert final["step"] == 10 or final["select/accuracy"] >= final["select/accuracy_bar"], final["stopped_by"]


def test_constant_answer_accuracy_and_the_bar_by_hand():
    from rlhf.chain.readiness import accuracy_bar, constant_answer_accuracy

    def rule(prompt, answer):
        return float(answer == prompt[-1])

    # Answers "a" x3, "b" x2, "c" x1; prompts end in a, a, b, c: "a" is right for 2 of 4.
    assert constant_answer_accuracy(rule, ["xa", "ya", "zb", "wc"], list("aaabbc")) == (0.5, "a")
    assert constant_answer_accuracy(rule, ["xa", "ya", "zb", "wc"], list("aaabbc"), top=1) == (0.5, "a")
    assert constant_answer_accuracy(rule, ["xb", "yb"], list("aaabbc"), top=1) == (0.0, "a")
    assert accuracy_bar(0.3, 0.0) == 0.3 and accuracy_bar(0.3, 0.5) == pytest.approx(0.65)


def test_profile_step_writes_the_step_s_kernel_times_and_a_trace(tmp_path):
    """logging.profile_step=3 profiles optimizer step 3 alone: its summary names the step, a wall time
    at least the device's busy time, the matrix products among the kinds, and a trace Perfetto opens."""
    import gzip

    run(compose(["step.max_steps=4", "step.log_every_steps=2", "data.max_eval_samples=16", "logging.progress_bar=false",
                 "step.eval_every_steps=0", "logging.profile_step=3", f"run_dir={tmp_path}"]))
    summary = json.loads((tmp_path / "profile" / "summary.json").read_text())
    assert summary["step"] == 3 and summary["device"] == "cpu"
    assert 0 < summary["busy_ms"] <= summary["wall_ms"] and summary["by_kind_ms"]["matmul"] > 0
    assert summary["busy_ms"] == pytest.approx(sum(summary["by_kind_ms"].values()), abs=0.01)
    trace = json.loads(gzip.open(tmp_path / "profile" / "trace.json.gz").read())
    assert any("aten::" in e.get("name", "") for e in trace["traceEvents"])


def test_profile_step_is_refused_below_zero():
    with pytest.raises(ConfigError, match="logging.profile_step"):
        to_schema(compose(["logging.profile_step=-1"]))
