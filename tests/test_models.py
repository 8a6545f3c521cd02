"""Random CPU models: built once into the cache, deterministic, loaded through from_pretrained."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from rlhf.config import ModelConfig
from rlhf.models import build_random_model, load_causal_lm, load_tokenizer, random_model_dir, resolve_path


def _tiny(family: str, **kw) -> ModelConfig:
    return ModelConfig(name=f"tiny-{family}", family=family, random_init=True, dropout=0.0, **kw)


def test_random_models_are_deterministic_from_the_seed(tmp_path):
    cfg = _tiny("llama")
    a = build_random_model(cfg, tmp_path / "a")
    b = build_random_model(cfg, tmp_path / "b")
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()
    c = build_random_model(_tiny("llama", init_seed=1), tmp_path / "c")
    assert not torch.equal(wa["model.embed_tokens.weight"], load_file(c / "model.safetensors")["model.embed_tokens.weight"])


def test_cache_key_changes_with_the_architecture():
    assert random_model_dir(_tiny("opt")) != random_model_dir(_tiny("opt", hidden_size=64))
    assert random_model_dir(_tiny("opt")) == random_model_dir(_tiny("opt"))


def test_tokenizer_conventions_and_generation():
    for family in ("opt", "llama"):
        path = resolve_path(_tiny(family))
        tok = load_tokenizer(path)
        assert tok.pad_token_id != tok.eos_token_id and tok.pad_token_id is not None
        ids = tok(" Human: sort d b a c Assistant:").input_ids
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == " Human: sort d b a c Assistant:"
        # One token per ' x' letter: answers are short and the sort task is learnable by tiny models.
        assert len(tok(" a b c d", add_special_tokens=False).input_ids) == 4
        model = load_causal_lm(path, tok)
        out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
        assert out.shape == (1, len(ids) + 4)


def test_an_incomplete_cache_entry_is_rebuilt_not_handed_back(tmp_path, monkeypatch):
    """Seen on a fresh machine: two ranks built the entry at once and the folder that won held only
    tokenizer files; every later run failed with "Unrecognized model". Such a folder is rebuilt."""
    monkeypatch.setenv("RLHF_CACHE", str(tmp_path))
    cfg = _tiny("opt")
    good = build_random_model(cfg, tmp_path / "reference")
    entry = random_model_dir(cfg)
    entry.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (entry / name).write_bytes((good / name).read_bytes())
    path = resolve_path(cfg)
    assert path == str(entry)
    tok = load_tokenizer(path)
    model = load_causal_lm(path, tok)  # "Unrecognized model ... model_type" before the fix
    assert model.config.model_type == "opt"
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".")], "no temporary folder left behind"


def test_tokenizer_mismatch_names_what_differs():
    from rlhf.models import tokenizer_mismatch

    a = load_tokenizer(resolve_path(_tiny("llama")))
    assert tokenizer_mismatch(a, load_tokenizer(resolve_path(_tiny("opt")))) is None  # same corpus, same vocab
    other = load_tokenizer(resolve_path(_tiny("opt", vocab_size=640)))
    assert "tokens" in tokenizer_mismatch(a, other)


def test_a_half_precision_model_attends_in_fp32_on_cpu_as_close_as_its_own_sdpa_and_saves_no_trace(tmp_path):
    """On CPU a bf16 model loaded by load_causal_lm / load_reward_model attends through
    SDPA_FP32_ON_CPU: its logits (valid positions of a left-padded batch) stay as close to the fp32
    model's as transformers' own bf16 SDPA does, gradients reach every weight, an fp32 model keeps
    transformers' SDPA, and a saved config.json names no attention implementation of ours."""
    import json

    from transformers import PreTrainedModel

    from rlhf.models import SDPA_FP32_ON_CPU, load_reward_model

    for family in ("opt", "llama"):
        path = resolve_path(_tiny(family))
        tok = load_tokenizer(path)
        exact = load_causal_lm(path, tok)
        half = load_causal_lm(path, tok, dtype=torch.bfloat16)
        theirs = load_causal_lm(path, tok, dtype=torch.bfloat16)
        theirs.set_attn_implementation("sdpa")
        assert exact.config._attn_implementation == "sdpa" and half.config._attn_implementation == SDPA_FP32_ON_CPU
        ids = torch.randint(4, len(tok), (3, 12))
        mask = torch.ones_like(ids)
        mask[0, :4] = 0
        valid = mask.bool()
        want = exact(input_ids=ids, attention_mask=mask).logits[valid]
        ours = half(input_ids=ids, attention_mask=mask).logits[valid].float()
        with torch.no_grad():
            ref = theirs(input_ids=ids, attention_mask=mask).logits[valid].float()
        assert (ours - want).abs().max() <= 1.5 * (ref - want).abs().max() + 1e-3
        ours.logsumexp(-1).mean().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in half.parameters() if p.requires_grad)
        half.save_pretrained(tmp_path / family)
        assert SDPA_FP32_ON_CPU not in (tmp_path / family / "config.json").read_text()
        assert json.loads((tmp_path / family / "config.json").read_text()).get("_attn_implementation") != SDPA_FP32_ON_CPU
        critic = load_reward_model(path, tok, dtype=torch.bfloat16)
        assert all(m.config._attn_implementation == SDPA_FP32_ON_CPU for m in critic.modules()
                   if isinstance(m, PreTrainedModel))
