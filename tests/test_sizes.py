"""Model sizes from the checkpoint's own config.json (rlhf.models.model_sizes): exact parameter counts
from a meta-device build for every family, DeepSpeed's estimators on a grouped-query-attention model,
the KV cache by key/value heads, the YAML fallback offline and the one-line refusal without one.

    .venv/bin/python -m pytest -q tests/test_sizes.py
"""

from __future__ import annotations

import re

import pytest
import torch
import transformers as T
from transformers import AutoModelForCausalLM

from rlhf.config import ConfigError, LoraConfig, ModelConfig, to_schema
from rlhf.launch import run
from rlhf.models import apply_lora, model_sizes
from rlhf.preflight import memory
from tests.conftest import compose, run_cli

# Tiny random configs of several families, each with what sets it apart: grouped-query attention
# (fewer key/value heads than query heads), a head size not hidden / heads (gemma2), fused
# projections (phi3, gpt_neox, bloom), GPT-2's Conv1D linears, tied and untied heads.
SHAPE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
FAMILIES = {
    "llama-gqa": lambda: T.LlamaConfig(**SHAPE, num_key_value_heads=2, intermediate_size=64),
    "qwen2": lambda: T.Qwen2Config(**SHAPE, num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True),
    "mistral": lambda: T.MistralConfig(**SHAPE, num_key_value_heads=1, intermediate_size=64),
    "gemma2": lambda: T.Gemma2Config(**SHAPE, num_key_value_heads=2, head_dim=16, intermediate_size=64),
    "phi3": lambda: T.Phi3Config(**SHAPE, num_key_value_heads=2, intermediate_size=64, pad_token_id=0),
    "opt": lambda: T.OPTConfig(**SHAPE, ffn_dim=64, word_embed_proj_dim=32),
    "gpt2": lambda: T.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                                 eos_token_id=0),
    "gpt_neox": lambda: T.GPTNeoXConfig(**SHAPE, intermediate_size=64),
    "bloom": lambda: T.BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4),
}
# A Qwen2.5-0.5B-shaped config.json (the numbers of the hub checkpoint's config.json).
QWEN_05B = dict(vocab_size=151936, hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, intermediate_size=4864, max_position_embeddings=32768,
                tie_word_embeddings=True, rope_theta=1000000.0, bos_token_id=151643, eos_token_id=151643)


def _folder(tmp_path, config) -> str:
    """A folder holding only the config.json of ``config``: sizes read from it, no weights anywhere."""
    config.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    return str(tmp_path)


def _model_at(path: str, **kw) -> ModelConfig:
    return ModelConfig(name="m", path=path, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_parameter_counts_equal_the_real_model_s_for_every_family(family, tmp_path):
    from deepspeed.runtime.zero.stage3 import model_to_params

    config = FAMILIES[family]()
    sizes = model_sizes(_model_at(_folder(tmp_path, config)))
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(config)
    assert sizes.params == sum(p.numel() for p in real.parameters())
    assert (sizes.params, sizes.largest_module) == model_to_params(real), "DeepSpeed's own (total, largest layer)"
    assert sizes.family == config.model_type and sizes.source == f"config.json of {tmp_path}"
    assert sizes.tied_embeddings == (real.get_output_embeddings().weight is real.get_input_embeddings().weight)
    assert sizes.num_kv_heads == (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    assert sizes.head_dim == (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    assert sizes.gated_mlp == (family in ("llama-gqa", "qwen2", "mistral", "gemma2", "phi3"))
    assert sizes.ffn_size == (64 if family not in ("gpt2", "bloom") else 4 * 32)  # their MLP is 4 x hidden
    # LoRA on every linear of the layers (lora.target_modules=all-linear), as PEFT builds it.
    lora = apply_lora(real, LoraConfig(rank=4))
    assert sizes.lora_params(4) == sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)


def test_the_kv_cache_is_key_value_heads_times_head_size(tmp_path):
    """Grouped-query attention keeps num_key_value_heads x head_dim numbers per token and layer for each
    of key and value, not hidden_size: for the Qwen2.5-0.5B shape 2 x 64 = 128 against 896 (7x)."""
    qwen = _model_at(_folder(tmp_path / "q", T.Qwen2Config(**QWEN_05B)))
    assert memory.kv_cache_bytes(qwen, 8, 100, "bf16") == 2 * 24 * 8 * 100 * (2 * 64) * 2
    # Where config.json gives head_dim it is used (gemma2: 16, not 32 / 4 = 8).
    gemma = _model_at(_folder(tmp_path / "g", FAMILIES["gemma2"]()))
    assert memory.kv_width(gemma) == 2 * 16


@pytest.mark.parametrize("stage,offload", [(2, False), (2, True), (3, False), (3, True)])
def test_model_states_agree_with_deepspeed_s_estimators_for_a_gqa_model(stage, offload, tmp_path, capsys):
    """DeepSpeed's estimators for mixed precision, fed with our meta-device counts of a 0.5B Qwen2
    (grouped-query attention): the exact bytes, and the per-GPU figure its all_cold table prints."""
    from deepspeed.runtime.zero.stage3 import (
        estimate_zero3_model_states_mem_needs,
        estimate_zero3_model_states_mem_needs_all_cold,
    )
    from deepspeed.runtime.zero.stage_1_and_2 import (
        estimate_zero2_model_states_mem_needs,
        estimate_zero2_model_states_mem_needs_all_cold,
    )

    total, largest, _ = memory.param_counts(_model_at(_folder(tmp_path, T.Qwen2Config(**QWEN_05B))))
    ours = sum(memory.model_states(total, largest, total, stage, 8, "bf16", offload, offload))
    if stage == 2:
        _, theirs = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=8, cpu_offload=offload)
        estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node=8)
        option = f"offload_optimizer={'cpu' if offload else 'none'}"
    else:
        _, theirs, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=8, cpu_offload=offload,
                                                             cpu_offload_params=offload)
        estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=8)
        option = (f"offload_param={'cpu' if offload else 'none'}, offload_optimizer={'cpu' if offload else 'none'}, "
                  "zero_init=1")
    assert ours == pytest.approx(theirs, abs=1)  # DeepSpeed rounds down to whole bytes
    table = capsys.readouterr().out.replace("OffloadDeviceEnum.cpu", "cpu")
    printed = next(float(m.group(1)) for line in table.splitlines() if line.rstrip().endswith(option)
                   and (m := re.search(r"\|\s*([\d.]+)GB \|", line)))
    assert ours / 2**30 == pytest.approx(printed, abs=0.005)  # its table has two decimals


def test_a_dry_run_of_a_folder_holding_only_a_qwen2_0_5b_config_sizes_it_from_there(tmp_path, capsys):
    path = _folder(tmp_path / "qwen", T.Qwen2Config(**QWEN_05B))
    overrides = [f"model.path={path}", "hardware=a100-80g", "launch.dry_run=true", f"run_dir={tmp_path / 'run'}"]
    run(compose(overrides), overrides=overrides)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("sizes ["))
    assert line.endswith(f"sizes from config.json of {path}")
    assert "(Qwen2ForCausalLM): 24 layers, hidden 896, 14 heads (2 KV, head size 64)" in line
    params = float(re.search(r"([\d.]+)M parameters", line).group(1))
    assert params == pytest.approx(494.0, abs=1)
    assert re.search(r"^model\s+0\.49B", out, re.M), "the memory table counts the folder's model"


def test_a_hub_id_without_a_local_config_falls_back_to_its_yaml_numbers_and_says_so(tmp_path, capsys):
    overrides = ["model=opt-125m", "launch.dry_run=true", f"run_dir={tmp_path}"]
    run(compose(overrides), overrides=overrides)
    out = capsys.readouterr().out
    assert "sizes from conf/model/opt-125m.yaml (no config.json readable for facebook/opt-125m)" in out
    assert re.search(r"^model\s+0\.13B", out, re.M)


def test_a_path_with_no_readable_config_and_no_numbers_is_refused_in_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    # A model file with no numbers (family and sizes null), pointing at a folder without config.json.
    overrides = [f"model.path={empty}", "model.random_init=false", "model.family=null", "launch.dry_run=true",
                 f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError) as err:
        run(compose(overrides), overrides=overrides)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"model.path='{empty}': no config.json readable")
    assert "give a folder holding the checkpoint's config.json" in message


def test_a_real_run_of_a_folder_without_config_json_is_refused_before_anything_loads(tmp_path):
    """The conf/model numbers size dry-runs only: a run would load config.json, so it does not start."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"model.path='.*empty': conf/model/tiny-llama.yaml \(no config.json "
                                          r"readable for .*\); from_pretrained needs its config.json"):
        run(compose([f"model.path={empty}", f"run_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_any_family_autoconfig_knows_is_a_valid_model_family():
    assert ModelConfig(name="q", path="Qwen/Qwen2.5-0.5B", family="qwen2").family == "qwen2"
    assert ModelConfig(name="p", path="microsoft/Phi-3-mini-4k-instruct", family="phi3").family == "phi3"
    with pytest.raises(ConfigError, match="model.family='qwen9' is not a model_type transformers' AutoConfig knows"):
        ModelConfig(name="x", path="org/x", family="qwen9")
    # Random models are built for the families we have builders for.
    with pytest.raises(ConfigError, match="model.family='phi3' is not allowed; choose one of opt, llama, qwen2"):
        to_schema(compose(["model.family=phi3"]))


def test_the_forecast_counts_flops_from_the_folder_s_sizes(tmp_path):
    """Per token a forward costs 2 FLOPs per parameter of the layers and the head (the tied embedding
    is a lookup) plus attention over the context at the query width (heads x head size)."""
    from rlhf.preflight import forecast

    config = FAMILIES["llama-gqa"]()
    m = _model_at(_folder(tmp_path, config))
    real = AutoModelForCausalLM.from_config(config)
    layers = sum(p.numel() for p in real.model.layers.parameters())
    assert forecast.matmul_params(m, lm_head=True) == layers + 96 * 32
    assert forecast.forward_flops(m, 10, 4, True) == 10 * (2 * (layers + 96 * 32) + 2 * 2 * 4 * (4 * 8))


@pytest.mark.parametrize("name,params", [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-7b", 7_615_616_512),
                                         ("llama3.1-8b", 8_030_261_248), ("mistral-7b", 7_248_023_552)])
def test_the_presets_offline_numbers_size_the_published_checkpoints(name, params):
    """Where config.json cannot be read, a preset's numbers give its checkpoint's parameter count (the
    count of its published weights): GQA key/value heads, and Qwen2.5-0.5B's tied head counted once."""
    from rlhf.config import load_model_file

    sizes = model_sizes(load_model_file(name))
    assert sizes.params == params and "no config.json readable" in sizes.source
    assert sizes.tied_embeddings == (name == "qwen2.5-0.5b")


def test_the_preflight_sizes_each_role_from_the_checkpoint_it_will_load(tmp_path):
    """A PPO step whose actor.path and critic.path hold an 8B Llama's config.json is sized as 8B (it
    does not fit one A6000: the dry-run's exit code is 2), not as the model group's tiny default."""
    from transformers import LlamaConfig

    big = tmp_path / "llama-8b"
    LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8).save_pretrained(big)
    proc = run_cli("step=ppo", f"actor.path={big}", f"critic.path={big}", "hardware=a6000", "launch.dry_run=true",
                   f"run_dir={tmp_path / 'run'}", timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert any(x.startswith("sizes [actor.path]: 8.030B parameters (LlamaForCausalLM)") for x in lines)
    assert any(x.startswith("sizes [critic.path]: 8.030B parameters") for x in lines)
    assert any(x.startswith("memory: ") and "does not fit" in x for x in lines)
    # The same step on the model group alone fits: the sizes above came from the paths.
    small = run_cli("step=ppo", "actor.random_init=true", "step.reward_fn=rule", "step.reward_model_weight=0", "step.advantage_estimator=grpo",
                    "step.samples_per_prompt=4", "hardware=a6000", "launch.dry_run=true",
                    f"run_dir={tmp_path / 'small'}", timeout=300)
    assert small.returncode == 0 and "sizes [tiny-llama]" in small.stdout, small.stdout[-2000:]
