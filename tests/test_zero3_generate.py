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

from rlhf import models
from rlhf.config import to_schema
from rlhf.preflight import memory
from tests.conftest import ROOT, clean_env, compose, free_port
from tests.zero3_generate_worker import PROMPTS

WORKER = ROOT / "tests" / "zero3_generate_worker.py"
TINY = ["step=ppo", "model=tiny-llama", "hardware=cpu-2rank", "step.micro_batch_size_per_device=2",
        "step.rollout_batch_size_per_device=2", "optim.lr=1e-2"]


# DeepSpeed-Chat's step-3 settings (LoRA 128 actor, OPT-350M critic, 256 + 256 tokens), written
# out here so that the test does not depend on how experiment files store per-step settings.
DSCHAT_PPO = ["critic.model=opt-350m", "lora.rank=128", "step.max_prompt_len=256", "step.max_new_tokens=256",
              "step.gradient_checkpointing=true"]
PPO_SIZES = {"opt-1.3b_a6000": ["step.rollout_batch_size_per_device=32", "step.generation_batch_size_per_device=16",
                                "step.micro_batch_size_per_device=16", "step.gradient_accumulation_steps=2"],
             "opt-66b_64xa100-80g": ["step.offload_reference=true", "step.rollout_batch_size_per_device=4",
                                     "step.micro_batch_size_per_device=4"]}


def _step_config(name: str, *extra: str):
    """The PPO step of an experiment (its model, hardware and ZeRO stage), plus ``extra`` overrides."""
    return to_schema(compose([f"experiment={name}", "step=ppo", "pipeline.steps=[]", *DSCHAT_PPO, *PPO_SIZES[name],
                              *extra]))


def test_generation_gathering_takes_the_first_way_that_fits():
    small = _step_config("opt-1.3b_a6000", "zero=3")
    assert small.zero.stage == 3 and memory.generation_gathering(small) == 1
    big = _step_config("opt-66b_64xa100-80g")
    # 66B's 16-bit weights (134 GB) cannot be whole on an 80 GB device; an eighth of its layers can,
    # split over a node's 8 devices (DeepSpeed-Chat's --inference_tp_size 8 for this setting).
    assert big.zero.stage == 3 and memory.generation_gathering(big) == 8
    forced = _step_config("opt-66b_64xa100-80g", "step.zero3_generation=gather")
    assert memory.generation_gathering(forced) == 1
    fits, line = memory.verdict(memory.estimate(forced), forced.hardware.memory_per_device_gb)
    assert not fits, line
    # Halves (67 GB each beside the shard and the cache) do not fit either: auto falls back to layerwise.
    assert memory.generation_gathering(_step_config("opt-66b_64xa100-80g", "step.generation_tp_size=2")) == 0
    assert memory.generation_gathering(_step_config("opt-66b_64xa100-80g", "step.zero3_generation=tp",
                                                    "step.generation_tp_size=4")) == 4
    assert memory.generation_gathering(_step_config("opt-1.3b_a6000", "zero=3", "step.zero3_generation=layerwise")) == 0
    assert memory.generation_gathering(_step_config("opt-1.3b_a6000")) == 0  # zero 0: nothing to gather


def test_estimate_counts_the_gathered_actor_and_the_table_names_the_mode():
    cfg = _step_config("opt-1.3b_a6000", "zero=3")
    whole, layered = memory.estimate(cfg, gathering=1), memory.estimate(cfg, gathering=0)
    total, _, lora = memory.param_counts(cfg.model, cfg.lora.rank)
    full = 2 * (total + lora)  # fp16 actor
    assert whole[0].weights == full / cfg.world_size + full > layered[0].weights  # gathered beside its shard
    assert memory.estimate(cfg)[0].weights == whole[0].weights  # auto: what was decided
    assert "whole model gathered once per call (step.zero3_generation=auto)" in memory.table(
        memory.estimate(cfg), cfg.hardware.memory_per_device_gb)
    big = _step_config("opt-66b_64xa100-80g")
    total, _, lora = memory.param_counts(big.model, big.lora.rank)
    full, tables = 2 * (total + lora), 2 * big.model.vocab_size * big.model.hidden_size  # OPT ties its head
    # An eighth of every layer beside the shard; the embedding whole on every rank of the group.
    assert memory.estimate(big)[0].weights == pytest.approx(full / 64 + (full - tables) / 8 + tables)
    assert "tensor-parallel slices over 8 ranks (step.zero3_generation=auto)" in memory.table(
        memory.estimate(big), big.hardware.memory_per_device_gb)
    layerwise = _step_config("opt-66b_64xa100-80g", "step.zero3_generation=layerwise")
    assert "layer by layer (step.zero3_generation=layerwise)" in memory.table(
        memory.estimate(layerwise), big.hardware.memory_per_device_gb)


def test_bad_mode_is_named():
    from rlhf.config import ConfigError

    with pytest.raises(ConfigError, match="step.zero3_generation='all' is not allowed"):
        to_schema(compose([*TINY, "step.zero3_generation=all"]))
    with pytest.raises(ConfigError, match="step.generation_tp_size=-2 must be >= 0"):
        to_schema(compose([*TINY, "step.generation_tp_size=-2"]))
    # Slices that cannot be made are refused by the pre-flight, before any model loads.
    for extra, why in ((["step.generation_tp_size=3"], "its 4 attention heads do not split over 3 ranks"),
                       (["step.generation_tp_size=4"], "4 ranks per group do not divide the 2 ranks")):
        cfg = to_schema(compose([*TINY, "zero=3", "step.zero3_generation=tp", *extra]))
        with pytest.raises(ConfigError, match=f"step.zero3_generation=tp with .*: {why}"):
            memory.generation_gathering(cfg)


# The tiny LLaMA as it is, and with grouped-query attention (2 key/value heads for 4 query heads: each
# rank's tensor-parallel slice holds one).
@pytest.fixture(scope="module", params=["mha", pytest.param("gqa", marks=pytest.mark.slow)])
def two_rank_run(tmp_path_factory, request):
    """Both engine kinds, ZeRO-3 and ZeRO-0, on 2 CPU ranks: what each rank saw."""
    tmp = tmp_path_factory.mktemp("zero3_generate")
    files = []
    model = ["model.num_kv_heads=2"] if request.param == "gqa" else []
    for name, extra in (("zero3", ["zero=3"]), ("zero0", ["zero=0"]), ("lora", ["zero=3", "lora.rank=4"])):
        cfg = compose([*TINY, *model, *extra])
        schema = to_schema(cfg)
        files.append(tmp / f"{name}.yaml")
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
        # Tensor-parallel slices over both ranks, each rank's prompts decoded in one batch with the
        # other's: this rank's rows, the whole model's tokens and log-probs.
        assert seen["tokens_tp"] == seen["tokens_zero0"], rank
        assert len(seen["tokens_tp"]) == len(PROMPTS[rank])
        for ours, whole in zip(seen["logprobs_tp"], seen["logprobs_zero0"], strict=True):
            assert ours == pytest.approx(whole, abs=1e-4), rank
    if kind == "trainable":  # the step after generate really trained, identically under both stages
        before, after = two_rank_run[0]["trainable"]["losses"]["zero3"]
        assert after < before


def test_tensor_parallel_slices_merge_lora_adapters(two_rank_run):
    """A LoRA actor after one update: its slices, adapters merged into the weights, give the tokens and
    log-probs of the whole model gathered, whose PEFT layers add the adapters at run time."""
    for rank, seen in enumerate(two_rank_run):
        lora = seen["lora"]
        assert lora["b_norm"] > 0, "the adapters must be non-zero for the merge to be tested"
        (tokens, logprobs), (tp_tokens, tp_logprobs) = lora["whole"], lora["tp"]
        assert tp_tokens == tokens, rank
        for ours, whole in zip(tp_logprobs, logprobs, strict=True):
            assert ours == pytest.approx(whole, abs=1e-4), rank
