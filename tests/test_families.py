"""Every Hugging Face family through every step: tiny random models of each (rlhf.models.families: their own
config classes, grouped-query attention where the family has it, the local tokenizer) train SFT, a
reward model and PPO with a critic, and save outputs that transformers' Auto classes load; rollouts
give generate's greedy tokens and a plain forward's log-probs; LoRA's targets come from PEFT's mapping.

    .venv/bin/python -m pytest -q tests/test_families.py            # one family per kind
    .venv/bin/python -m pytest -q tests/test_families.py -m slow    # the whole matrix (a few minutes)
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.config import ConfigError, LoraConfig
from rlhf.launch import run
from rlhf.models import apply_lora, load_causal_lm, load_reward_model, load_tokenizer, model_sizes
from rlhf.models.families import FAMILIES, tiny_family_model
from tests.conftest import compose

QUIET = ["logging.progress_bar=false", "data.max_eval_samples=32"]
# Kept in `make test`: Phi-3 trains (grouped-query attention, fused projections, decoded through
# transformers' own forward); Qwen3 (our family forward), Gemma 2 (sliding window, soft-capping,
# transformers' forward) and CodeGen (no sequence-classification class in transformers) decode.
FAST_TRAIN = {"phi3"}
FAST_DECODE = {"qwen3", "gemma2", "codegen"}


def _marked(families, fast):
    return [f if f in fast else pytest.param(f, marks=pytest.mark.slow) for f in families]


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    made = {}

    def build(family: str) -> str:
        if family not in made:
            made[family] = str(tiny_family_model(family, tmp_path_factory.mktemp(family) / "init"))
        return made[family]
    return build


@pytest.mark.parametrize("family", _marked(FAMILIES, FAST_TRAIN))
def test_every_family_trains_sft_a_reward_model_and_ppo_and_saves_what_auto_classes_load(family, family_dir, tmp_path):
    init = family_dir(family)
    sft, rm, ppo = tmp_path / "sft", tmp_path / "reward", tmp_path / "ppo"
    run(compose(["step=sft", f"model.path={init}", "model.random_init=false", "step.max_steps=2",
                 "step.eval_micro_batch_size_per_device=16", *QUIET, f"run_dir={sft}"]))
    run(compose(["step=reward", f"model.path={sft / 'model'}", "model.random_init=false", "step.max_steps=2",
                 "step.rule_check_answers=0", *QUIET, f"run_dir={rm}"]))
    final = run(compose(["step=ppo", f"model.path={sft / 'model'}", "model.random_init=false", f"actor.path={sft / 'model'}", f"critic.path={rm / 'model'}", "step.max_steps=2",
                         "step.rollout_batch_size_per_device=8", "step.micro_batch_size_per_device=4",
                         "step.eval_prompts=8", "step.eval_micro_batch_size_per_device=8", "step.max_new_tokens=8",
                         "step.eval_every_steps=0", *QUIET, f"run_dir={ppo}"]))
    assert final["actor_weight_change"] > 0
    for folder in (sft / "model", ppo / ("model_last" if final.get("best_step") == 0 else "model")):
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.config.model_type == AutoModelForCausalLM.from_pretrained(init).config.model_type
    ids = torch.tensor([[1, 40, 41, 42, 2]])
    for folder in (rm / "model", ppo / "critic"):
        scorer = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1).eval()
        ours = load_reward_model(str(folder), load_tokenizer(str(folder))).eval()
        with torch.no_grad():  # the saved head scores as the reward model that trained it
            assert torch.allclose(scorer(input_ids=ids).logits[0, 0], ours(ids, torch.ones_like(ids))[0, -1], atol=1e-5)


def _left_padded(tok):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, len(tok), (3, 10), generator=gen)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[2, :1] = 0, 0
    return ids.masked_fill(mask == 0, tok.pad_token_id), mask


@pytest.mark.parametrize("family", _marked(FAMILIES, FAST_DECODE))
def test_every_family_s_rollouts_give_generate_s_tokens_and_a_plain_forward_s_logprobs(family, family_dir):
    """24 new tokens after 10-token left-padded prompts (past the families' 16-token sliding windows):
    greedy tokens equal generate's; sampled tokens' log-probs (temperature 0.7) equal one forward over
    the finished sequences within 1e-4 in fp32; the families of rlhf.generation.forwards.FORWARDS run our forward."""
    from rlhf import losses
    from rlhf.generation.decode import FORWARDS, _own_forward, decode
    from rlhf.generation.rollout import answer_logits, position_ids, response_mask

    path = family_dir(family)
    tok = load_tokenizer(path)
    model = load_causal_lm(path, tok).eval()
    ids, mask = _left_padded(tok)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    ours = decode(model, ids, mask, 24, eos, pad)
    theirs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=eos,
                            pad_token_id=pad)[:, ids.shape[1]:]
    assert torch.equal(ours, theirs[:, :ours.shape[1]]) and (theirs[:, ours.shape[1]:] == pad).all()
    windowed = getattr(model.config, "sliding_window", None) is not None and model.config.model_type == "mistral"
    assert (_own_forward(model, 10) is not None) == (type(model).__name__ in FORWARDS)
    assert _own_forward(model, 34) is None or not windowed
    torch.manual_seed(3)
    tokens, logprobs = decode(model, ids, mask, 24, eos, pad, do_sample=True, temperature=0.7, with_logprobs=True)
    rmask = response_mask(tokens, eos)
    seq, attn = torch.cat([ids, tokens], 1), torch.cat([mask, rmask], 1)
    with torch.no_grad():
        full = losses.token_logprobs(answer_logits(model, seq, attn, position_ids(attn), ids.shape[1] - 1), tokens, 0.7)
    assert torch.allclose(logprobs * rmask, full * rmask, atol=1e-4), (logprobs - full).abs().max()


def test_a_codegen_reward_model_saves_what_auto_model_for_sequence_classification_loads(family_dir, tmp_path):
    """transformers has no CodeGenForSequenceClassification: the reward model is its generic one over
    CodeGen's backbone, which starts from the causal LM's weights and saves a folder that
    AutoModelForSequenceClassification loads (registered by rlhf.models) to the same score."""
    path = family_dir("codegen")
    tok = load_tokenizer(path)
    causal = load_causal_lm(path, tok)
    rm = load_reward_model(path, tok).eval()
    assert torch.equal(rm.transformer.h[0].attn.qkv_proj.weight, causal.transformer.h[0].attn.qkv_proj.weight)
    rm.save_pretrained(tmp_path)
    ids = torch.tensor([[1, 40, 41, 42, 43]])
    with torch.no_grad():
        back = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=1).eval()
        assert torch.allclose(back(input_ids=ids).logits[0, 0], rm(ids, torch.ones_like(ids))[0, -1], atol=1e-6)


@pytest.mark.parametrize("family,expected", [("qwen2", ["q_proj", "v_proj"]), ("gpt_neox", ["query_key_value"]),
                                             ("gpt2", ["c_attn"])])
def test_lora_peft_default_takes_each_family_s_targets_from_peft_s_mapping(family, expected, family_dir):
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    path = family_dir(family)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model.config.model_type] == expected
    lora = apply_lora(model, LoraConfig(rank=4, target_modules=["peft-default"]))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in lora.named_parameters() if "lora_A" in n}
    assert adapted == set(expected)
    # The pre-flight counts the same adapters from config.json alone.
    from rlhf.config import ModelConfig

    sizes = model_sizes(ModelConfig(name="m", path=path))
    assert sizes.lora_params(4, ["peft-default"]) == sum(p.numel() for n, p in lora.named_parameters() if "lora_" in n)


def test_lora_peft_default_for_a_family_peft_has_no_default_for_is_refused_in_one_line(family_dir):
    model = AutoModelForCausalLM.from_pretrained(family_dir("phi3"))
    with pytest.raises(ConfigError) as err:
        apply_lora(model, LoraConfig(rank=4, target_modules=["peft-default"]))
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("lora.target_modules=[peft-default]: PEFT has no default LoRA target modules "
                                     "for phi3")


def test_a_family_without_a_tensor_parallel_plan_is_refused_naming_it(family_dir):
    """Phi-3 fuses q, k and v (and gate and up) into one projection each: no slice plan of ours."""
    from rlhf.config import ModelConfig
    from rlhf.preflight import memory

    why = memory.tp_unsupported(ModelConfig(name="m", path=family_dir("phi3")), 2)
    assert why.startswith("model.family='phi3' has no tensor-parallel plan") and "\n" not in why
    assert memory.tp_unsupported(ModelConfig(name="m", path=family_dir("qwen3")), 2) is None  # GQA: 2 KV heads
