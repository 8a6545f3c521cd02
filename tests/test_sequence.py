"""Sequence parallelism (parallel.sequence): two CPU ranks that split every row's tokens give the
loss and every gradient of one rank that runs the rows whole, at every ZeRO stage, for the SFT,
reward and DPO losses and several model families; a run trains to the one-rank run's losses and
resumes exactly after losing a rank; what cannot be split is refused in one line that names the fix;
the pre-flight knows what the split saves.

    .venv/bin/python -m pytest -q tests/test_sequence.py
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rlhf import sequence
from rlhf.config import ConfigError, to_schema
from rlhf.preflight.plan import build_plan
from tests.conftest import ROOT, compose, compose_step, free_port, one_and_two_ranks, run_cli, start_cli
from tests.sequence_worker import CASES, WIDTH

WORKER = ROOT / "tests" / "sequence_worker.py"


def test_split_rows_give_the_whole_rows_loss_and_every_gradient_at_every_zero_stage(tmp_path):
    whole, split = one_and_two_ranks(WORKER, tmp_path)
    # The rows really ran whole on one rank and in halves on two (the width padded from 13 to 14).
    assert set(whole.pop("widths")) == {WIDTH} and set(split.pop("widths")) == {-(-WIDTH // 2)}
    assert set(whole) == set(split) == {f"{f}/{k}/{z}" + ("/checkpointing" if c else "") for f, k, z, c in CASES}
    for case, (loss, grads) in whole.items():
        split_loss, split_grads = split[case]
        assert abs(split_loss - loss) <= 1e-5, f"{case}: loss {split_loss} vs {loss}"
        assert grads.keys() == split_grads.keys()
        for name, g in grads.items():
            assert g.abs().max() > 0 or "bias" in name, f"{case} {name}: no gradient reached it"
            diff = (split_grads[name] - g).abs().max().item()
            assert diff <= 1e-5 * max(1.0, g.abs().max().item()), f"{case} {name}: max difference {diff:.2e}"


def _losses(run_dir: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in map(json.loads, open(run_dir / "metrics.jsonl")) if key in r}


QUIET = ["logging.progress_bar=false", "data.max_eval_samples=32", "step.log_every_steps=1"]


@pytest.mark.slow  # make test checks every loss's gradients through the worker above
@pytest.mark.parametrize("step, zero", [("sft", "2"), ("reward", "3"), ("dpo", "1"), ("kto", "0")])
def test_a_run_split_over_two_ranks_trains_to_the_one_rank_run_s_losses_and_weights(tmp_path, step, zero):
    """`python launch.py hardware=cpu-2rank step=sft parallel.sequence=2 zero=2 ...` against the same
    command on one rank (the same global batch: one data-parallel group reads what one rank reads)."""
    args = [f"step={step}", f"zero={zero}", "step.max_steps=6", "step.eval_every_steps=3", *QUIET]
    # KTO: its reference point is a mean over every rank's rows, the split group's copies counted alike.
    args += {"reward": ["step.rule_check_answers=0"], "dpo": ["actor.random_init=true"],
             "kto": ["actor.random_init=true"]}.get(step, [])
    one = run_cli(*args, "hardware=cpu", f"run_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cli(*args, "hardware=cpu-2rank", "parallel.sequence=2", f"launch.master_port={free_port()}",
                  f"run_dir={tmp_path / 'two'}")
    assert two.returncode == 0, (two.stdout + two.stderr)[-3000:]
    for key in ("loss", "eval/loss"):
        a, b = _losses(tmp_path / "one", key), _losses(tmp_path / "two", key)
        assert a.keys() == b.keys() and len(a) >= 2, (key, a, b)
        assert all(abs(a[s] - b[s]) <= 1e-5 for s in a), (key, a, b)
    wa, wb = (load_file(next((tmp_path / r / "model").glob("*.safetensors"))) for r in ("one", "two"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5


@pytest.mark.slow
def test_data_parallel_groups_beside_the_split_with_lora_and_checkpointing_train_as_data_parallelism(tmp_path):
    """4 ranks as 2 groups of 2 that split each row (world = dp x sp; two nodes of 2 ranks on this
    machine, as a cluster without ssh runs them) against 2 ranks that run whole rows: the same rows per
    data-parallel rank, so the same losses and weights; LoRA (merged on save) and gradient checkpointing on."""
    args = ["step=sft", "zero=2", "lora.rank=4", "step.gradient_checkpointing=true", "step.max_steps=4",
            "step.eval_every_steps=2", "step.micro_batch_size_per_device=8", "hardware=cpu-2rank", *QUIET]
    dp = run_cli(*args, f"launch.master_port={free_port()}", f"run_dir={tmp_path / 'dp'}")
    assert dp.returncode == 0, dp.stderr[-3000:]
    hostfile, port = tmp_path / "hostfile", free_port()
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n")
    nodes = [start_cli(*args, "hardware.nodes=2", "parallel.sequence=2", f"launch.hostfile={hostfile}",
                       "launch.master_addr=127.0.0.1", f"launch.master_port={port}", f"launch.node_rank={k}",
                       f"run_dir={tmp_path / 'both'}", stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for k in (0, 1)]
    outs = [p.communicate(timeout=900)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    for key in ("loss", "eval/loss"):
        a, b = _losses(tmp_path / "dp", key), _losses(tmp_path / "both", key)
        assert a.keys() == b.keys() and len(a) >= 2 and all(abs(a[s] - b[s]) <= 1e-5 for s in a), (key, a, b)
    wa, wb = (load_file(next((tmp_path / r / "model").glob("*.safetensors"))) for r in ("dp", "both"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) <= 1e-5


@pytest.mark.slow
def test_a_rank_lost_mid_run_under_sequence_parallelism_resumes_exactly(tmp_path):
    from tests.test_faults import _lose_a_rank_then_resume

    args = ["step=sft", "hardware=cpu-2rank", "parallel.sequence=2", "zero=3", "step.max_steps=40",
            "step.eval_every_steps=0", "checkpoint.every_steps=10", f"launch.master_port={free_port()}", *QUIET]
    out = run_cli(*args, f"run_dir={tmp_path / 'straight'}")
    assert out.returncode == 0, out.stderr[-3000:]
    _lose_a_rank_then_resume(args, tmp_path / "lost", tmp_path / "straight", rank=1, min_step=10, key="loss")


@pytest.mark.parametrize("overrides, says", [
    (["hardware=cpu-2rank", "parallel.sequence=3"], "parallel.sequence=3 does not divide the 2 ranks"),
    (["hardware=cpu-2rank", "parallel.sequence=2", "step=ppo"], "parallel.sequence=2 is not supported for PPO"),
    (["hardware=cpu-2rank", "parallel.sequence=2", "step.packing=true"], "set step.packing=false"),
    (["hardware=cpu-2rank", "parallel.sequence=2", "step.global_batch_size=24", "step.micro_batch_size_per_device=16"],
     "data-parallel ranks (1 = 2 ranks / parallel.sequence=2)"),
])
def test_what_cannot_be_split_is_refused_naming_the_key(overrides, says):
    with pytest.raises(ConfigError) as err:
        to_schema(compose(overrides))
    assert says in str(err.value)


def test_the_batch_arithmetic_counts_data_parallel_groups():
    cfg = to_schema(compose(["hardware=cpu-2rank", "parallel.sequence=2", "step.micro_batch_size_per_device=4",
                             "step.gradient_accumulation_steps=3"]))
    assert (cfg.data_parallel_size, cfg.step.global_batch_size) == (1, 12)


@pytest.mark.parametrize("model_type, heads, kv, n, says", [
    ("opt", 4, 4, 2, "not supported for M (model type 'opt')"),
    ("llama", 6, 6, 4, "does not divide M's 6 attention heads"),
    ("qwen2", 8, 3, 2, "M's 3 key/value heads: one must divide the other"),
])
def test_models_that_cannot_be_split_are_refused(model_type, heads, kv, n, says):
    assert says in sequence.problems(model_type, "M", heads, kv, n)
    assert sequence.problems("llama", "M", 8, 2, 4) is None and sequence.problems("mistral", "M", 8, 1, 4) is None


def test_the_pre_flight_refuses_a_family_it_cannot_split(tmp_path):
    plan = build_plan(to_schema(compose(["hardware=cpu-2rank", "parallel.sequence=2", "model=tiny-opt"])), tmp_path)
    assert any("model type 'opt'" in p and "parallel.sequence=1" in p for p in plan.problems), plan.problems


def test_the_long_context_preset_fits_only_with_sequence_parallelism_and_says_so(tmp_path):
    preset = ["experiment=llama3.1-8b-64k_8xa100-80g"]
    split = build_plan(to_schema(compose_step(preset, "sft")), tmp_path)
    assert split.fits and not split.problems, split.text()
    assert "8192 of 65536 tokens per rank" in split.text()
    whole = build_plan(to_schema(compose_step([*preset, "parallel.sequence=1"], "sft")), tmp_path)
    assert not whole.fits and whole.sequence_fit is not None
    assert f"it fits with parallel.sequence={whole.sequence_fit}" in whole.dry_run_result()["refused"][0]
    # The split takes the activations down, not the model states.
    a, b = split.memory[0], whole.memory[0]
    assert a.activations < b.activations / 6 and a.weights == b.weights
