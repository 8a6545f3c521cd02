"""ZeRO-3 generation: gathered once per generate call (hooks off) or layer by layer, and the memory
pre-flight's choice between them.

    .venv/bin/python -m pytest -q tests/test_zero3_generate.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from rlhf import memory, models
from rlhf.config import to_schema
from tests.conftest import ROOT, clean_env, compose, free_port

WORKER = ROOT / "tests" / "zero3_generate_worker.py"
TINY = ["step=ppo", "model=tiny-llama", "hardware=cpu-2rank", "step.micro_batch_size_per_device=2",
        "step.rollout_batch_size_per_device=2", "optim.lr=1e-2"]


# DeepSpeed-Chat's step-3 settings (LoRA 128 actor, OPT-350M critic, 256 + 256 tokens), written
# out here so that the test does not depend on how experiment files store per-step settings.
DSCHAT_PPO = ["critic.model=opt-350m", "lora.rank=128", "step.max_prompt_len=256", "step.max_new_tokens=256",
              "step.gradient_checkpointing=true", "step.do_sample=false"]
PPO_SIZES = {"opt-1.3b_a6000": ["step.rollout_batch_size_per_device=32", "step.generation_batch_size_per_device=16",
                                "step.micro_batch_size_per_device=16", "step.gradient_accumulation_steps=2"],
             "opt-66b_64xa100-80g": ["step.offload_reference=true", "step.rollout_batch_size_per_device=4",
                                     "step.micro_batch_size_per_device=4"]}


def _step_config(name: str, *extra: str):
    """The PPO step of an experiment (its model, hardware and ZeRO stage), plus ``extra`` overrides."""
    return to_schema(compose([f"experiment={name}", "step=ppo", "pipeline.steps=[]", *DSCHAT_PPO, *PPO_SIZES[name],
                              *extra]))


def test_gathers_whole_actor_only_where_it_fits():
    small = _step_config("opt-1.3b_a6000", "zero=3")
    assert small.zero.stage == 3 and memory.generation_gathers_whole_model(small)
    big = _step_config("opt-66b_64xa100-80g")
    assert big.zero.stage == 3 and not memory.generation_gathers_whole_model(big)
    # Forced gathering of 66B 16-bit weights (134 GB) cannot fit an 80 GB device; the pre-flight says so.
    forced = _step_config("opt-66b_64xa100-80g", "step.zero3_generation=gather")
    assert memory.generation_gathers_whole_model(forced)
    fits, line = memory.verdict(memory.estimate(forced), forced.hardware.memory_per_device_gb)
    assert not fits, line
    assert not memory.generation_gathers_whole_model(_step_config("opt-1.3b_a6000", "zero=3",
                                                                  "step.zero3_generation=layerwise"))
    assert not memory.generation_gathers_whole_model(_step_config("opt-1.3b_a6000"))  # zero 0: nothing to gather


def test_estimate_counts_the_gathered_actor_and_the_table_names_the_mode():
    cfg = _step_config("opt-1.3b_a6000", "zero=3")
    whole, layered = memory.estimate(cfg, gather_whole=True), memory.estimate(cfg, gather_whole=False)
    total, _, lora = memory.param_counts(cfg.model, cfg.lora.rank)
    full = 2 * (total + lora)  # fp16 actor
    assert whole[0].weights == full / cfg.world_size + full > layered[0].weights  # gathered beside its shard
    assert memory.estimate(cfg)[0].weights == whole[0].weights  # auto: what was decided
    assert "whole model gathered once per call (step.zero3_generation=auto)" in memory.table(
        memory.estimate(cfg), cfg.hardware.memory_per_device_gb)
    big = _step_config("opt-66b_64xa100-80g")
    assert "layer by layer (step.zero3_generation=auto)" in memory.table(memory.estimate(big),
                                                                         big.hardware.memory_per_device_gb)


def test_bad_mode_is_named():
    from rlhf.config import ConfigError

    with pytest.raises(ConfigError, match="step.zero3_generation='all' is not allowed"):
        to_schema(compose([*TINY, "step.zero3_generation=all"]))


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """Both engine kinds, ZeRO-3 and ZeRO-0, on 2 CPU ranks: what each rank saw."""
    tmp = tmp_path_factory.mktemp("zero3_generate")
    files = []
    for zero in ("3", "0"):
        cfg = compose([*TINY, f"zero={zero}"])
        schema = to_schema(cfg)
        files.append(tmp / f"zero{zero}.yaml")
        files[-1].write_text(OmegaConf.to_yaml(cfg, resolve=True))
    models.resolve_path(schema.model)  # built once here, into the test cache the ranks inherit
    out = tmp / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--no_local_rank",
           "--master_port", str(free_port()), str(WORKER), *map(str, files), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=clean_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("kind", ["trainable", pytest.param("frozen", marks=pytest.mark.slow)])
def test_zero3_generate_gathers_once_and_matches_zero0(two_rank_run, kind):
    for rank, seen in enumerate(two_rank_run):
        seen = seen[kind]
        partitioned = [n for n in seen["params"] if n not in seen["persistent"]]
        assert partitioned, "the tiny model must have partitioned parameters for this check to mean anything"
        for label in ("gather", "gather_again"):
            releases = seen[f"releases_{label}"]
            assert {n: releases.get(n, 0) for n in partitioned} == dict.fromkeys(partitioned, 1), (rank, label)
        # Persistent parameters, resident since the layerwise forwards, are left alone.
        assert not set(seen["releases_gather_again"]) & set(seen["persistent"]), rank
        before, after = seen["hooks_before_after_error"]
        assert before == after and before[0] > 0, rank
        # Layer by layer: released after every forward, 6 tokens = 6 forwards (also shows the hooks came back).
        layerwise = seen["releases_layerwise"]
        assert {n: layerwise.get(n, 0) for n in partitioned} == dict.fromkeys(partitioned, 6), rank
        assert seen["tokens_gather"] == seen["tokens_zero0"], rank
        assert seen["tokens_layerwise"] == seen["tokens_gather"] == seen["tokens_gather_again"], rank
        assert seen["losses"]["zero3"] == pytest.approx(seen["losses"]["zero0"], rel=1e-4), rank
    if kind == "trainable":  # the step after generate really trained, identically under both stages
        before, after = two_rank_run[0]["trainable"]["losses"]["zero3"]
        assert after < before
