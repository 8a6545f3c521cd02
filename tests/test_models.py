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
