"""A GGUF file is a model: sized from its metadata without converting, converted once into a cached
Hugging Face folder that gives transformers' own GGUF load's logits and tokens, refused in one line
where transformers cannot read it, and trained by every step. Its chat template's end of turn
(<|im_end|>, not the tokenizer's eos </s>) ends answers, and rules never see it.

    python -m pytest -q tests/test_gguf.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf import models
from rlhf.config import ConfigError, DataConfig, ModelConfig, SourceConfig
from rlhf.data.blend import data_rule, references
from rlhf.launch import run
from tests.conftest import compose
from tests.gguf_files import SIZES, write_tiny_gguf

QUIET = ["logging.progress_bar=false", "data.max_eval_samples=16"]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-Q8_0.gguf")


def test_sizes_come_from_the_metadata_without_converting(gguf_path, rlhf_cache):
    sizes = models.model_sizes(ModelConfig(name="tiny-gguf", path=str(gguf_path)))
    assert sizes.source == f"the GGUF metadata of {gguf_path}"
    assert (sizes.num_layers, sizes.hidden_size, sizes.num_heads, sizes.num_kv_heads, sizes.ffn_size) == \
        (SIZES["layers"], SIZES["hidden"], SIZES["heads"], SIZES["kv_heads"], SIZES["ffn"])
    assert sizes.tied_embeddings  # no output.weight in the file
    own = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert sizes.params == sum(p.numel() for p in own.parameters())
    assert not (rlhf_cache / "gguf").exists() or not any(gguf_path.stem in p.name for p in (rlhf_cache / "gguf").iterdir())


def test_the_converted_folder_gives_transformers_own_logits_and_tokens_and_is_made_once(gguf_path):
    cfg = ModelConfig(name="tiny-gguf", path=str(gguf_path))
    folder = models.resolve_path(cfg)
    assert json.loads((Path(folder) / "source.json").read_text())["gguf"] == str(gguf_path)
    made = (Path(folder) / "model.safetensors").stat().st_mtime_ns
    assert models.resolve_path(cfg) == folder  # cached by content: no second conversion
    assert (Path(folder) / "model.safetensors").stat().st_mtime_ns == made
    # The folder form (model.path=<folder> model.gguf_file=<name>) is the same model.
    assert models.resolve_path(ModelConfig(name="t", path=str(gguf_path.parent), gguf_file=gguf_path.name)) == folder

    own_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ours_tok = AutoTokenizer.from_pretrained(folder)
    text = "sort d b c a, then add 12 and 30"
    assert ours_tok(text).input_ids == own_tok(text).input_ids
    assert ours_tok.chat_template == own_tok.chat_template
    own = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).eval()
    ours = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([own_tok(text).input_ids])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, own(ids).logits)
    # Dequantized: the Q8_0 projections hold their quantized values, not the F32 values written.
    q = ours.model.layers[0].self_attn.o_proj.weight
    assert q.dtype == torch.float32 and q.abs().max() > 0


def test_a_gguf_transformers_cannot_read_is_refused_in_one_line_naming_architecture_and_quantization(tmp_path):
    bad = write_tiny_gguf(tmp_path / "odd.gguf", arch="notallama")
    with pytest.raises(ConfigError) as err:
        models.resolve_path(ModelConfig(name="odd", path=str(bad)))
    message = str(err.value)
    assert "'notallama'" in message and "Q8_0" in message and "\n" not in message
    with pytest.raises(ConfigError, match="no GGUF file at"):
        models.resolve_path(ModelConfig(name="gone", path=str(tmp_path), gguf_file="missing.gguf"))


def test_the_template_s_end_of_turn_ends_answers_and_never_reaches_a_rule(gguf_path, tmp_path):
    folder = models.resolve_path(ModelConfig(name="tiny-gguf", path=str(gguf_path)))
    plain = AutoTokenizer.from_pretrained(folder)
    assert plain.eos_token == "</s>"  # the file's eos is not the template's end of turn
    tok = models.load_tokenizer(folder)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id not in (tok.eos_token_id, None)
    rows = [{"prompt": f"What is {a} + 30?", "answer": f"{a} + 30 = {a + 30}\n#### {a + 30}"} for a in range(10, 20)]
    for split in ("train", "eval"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = DataConfig(name="sums", sources=[SourceConfig(path=str(tmp_path))], split="1,0,1", rule="math")
    table = references(data, tok)
    assert len(table) == len(rows) and not any("<|im_end|>" in ref for ref in table.values())
    prompts = list(table)
    assert all(p.startswith("<|im_start|>user\n") and p.endswith("<|im_start|>assistant\n") for p in prompts)
    for name in ("math", "exact"):
        rule = data_rule(DataConfig(**{**data.__dict__, "rule": name}), prompts, tok)
        # The reference itself, as the policy writes it (closing its turn with the marker and going
        # on), scores 1.0 under both verifiers.
        assert all(rule(p, ref + "<|im_end|>\n<|im_start|>user") == 1.0 for p, ref in table.items()), name
    math = data_rule(data, prompts, tok)
    assert math(prompts[0], "\\boxed{" + table[prompts[0]].rsplit(" ", 1)[-1] + "}") == 1.0


@pytest.mark.parametrize("lora", [0, 4])
def test_sft_and_grpo_train_a_gguf_model_and_save_safetensors_folders(gguf_path, tmp_path, lora):
    rows = [{"prompt": f"What is {a} + {b}?", "answer": f"#### {a + b}"} for a in range(10, 30) for b in (3, 7)]
    data = tmp_path / "data"
    data.mkdir()
    for split in ("train", "eval"):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [f"data.sources=[{{path: {data}}}]", "data.split='1,0,1'", "data.rule=math", f"lora.rank={lora}", *QUIET]
    sft = run(compose(["step=sft", f"model.path={gguf_path}", "step.max_steps=2", "step.max_seq_len=64",
                       "step.eval_micro_batch_size_per_device=16", "step.eval_accuracy_prompts=8",
                       "step.early_stop_patience=0", *common, f"run_dir={tmp_path / 'sft'}"]))
    assert sft["stopped_by"]
    out = tmp_path / "sft" / "model"
    assert (out / "model.safetensors").exists() or (out / "adapter_model.safetensors").exists()
    final = run(compose(["step=ppo", f"model.path={gguf_path}", f"actor.path={out}", "step.advantage_estimator=grpo",
                         "step.samples_per_prompt=4", "step.reward_fn=tests.gguf_files:answer_characters",
                         "step.reward_model_weight=0",
                         "step.max_steps=2", "step.rollout_batch_size_per_device=8", "step.micro_batch_size_per_device=4",
                         "step.eval_prompts=8", "step.eval_micro_batch_size_per_device=8", "step.max_new_tokens=8",
                         "step.eval_every_steps=0", *common, f"run_dir={tmp_path / 'ppo'}"]))
    assert final["actor_weight_change"] > 0
    saved = AutoTokenizer.from_pretrained(tmp_path / "ppo" / ("model_last" if final.get("best_step") == 0 else "model"))
    assert saved.eos_token == "<|im_end|>"  # the trained model's answers end where its template's turns do


def test_a_chain_on_a_model_without_conf_numbers_sizes_every_step_before_any_ran(gguf_path, tmp_path, capsys):
    # conf/model/smollm2-135m-instruct.yaml has no numbers: the reward model (from SFT's output) and PPO's
    # actor and critic are sized as the model the step before trains, not refused as unreadable folders.
    args = ["pipeline=e2e", "model=smollm2-135m-instruct", f"model.path={gguf_path}", "launch.dry_run=true",
            f"run_dir={tmp_path / 'chain'}", *QUIET]
    result = run(compose(args), args)
    out = capsys.readouterr().out
    assert result["fits"] and not result["refused"], result
    sizes = [line for line in out.splitlines() if line.startswith("sizes [")]
    assert len(sizes) == 4 and all(f"the GGUF metadata of {gguf_path}" in line for line in sizes), sizes
    assert [line.split("]")[0] for line in sizes] == ["sizes [smollm2-135m-instruct", "sizes [smollm2-135m-instruct",
                                                       "sizes [actor.path", "sizes [critic.path"]
    assert sum("which an earlier step of the chain writes" in line for line in sizes) == 3, sizes
