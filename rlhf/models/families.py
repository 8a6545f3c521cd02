"""Tiny random models of every supported Hugging Face causal-LM family, for tests and benchmarks.

Each is built offline from its transformers config class (a few layers, grouped-query attention
where the family has it) with the random models' locally trained tokenizer, and saved with
``save_pretrained`` like any checkpoint, so that every step loads it through ``from_pretrained``.

    python -c "from rlhf.models.families import tiny_family_model; print(tiny_family_model('qwen2', '/tmp/q'))"
"""

from __future__ import annotations

from pathlib import Path

import torch

# The shape every tiny model shares: the sizes of conf/model/tiny-*.yaml scaled down so that a
# family's SFT + reward + PPO run stays a few seconds on one CPU core.
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, POSITIONS = 512, 64, 2, 4, 2, 128, 256


def _configs():
    import transformers as T

    llama = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 intermediate_size=FFN, max_position_embeddings=POSITIONS)
    gqa = dict(llama, num_key_value_heads=KV_HEADS)
    gpt = dict(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=POSITIONS, n_inner=FFN)
    # Each family's own config class and key names; what sets a family apart is its config's default
    # (GPT-J / CodeGen partial rotary, BLOOM's ALiBi, Gemma 2's soft-capping and alternating sliding
    # layers, Phi-3's fused projections), with a short sliding window where the family has one so that
    # rollouts longer than it are exercised.
    return {
        "opt": lambda: T.OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                   num_attention_heads=HEADS, ffn_dim=FFN, max_position_embeddings=POSITIONS,
                                   word_embed_proj_dim=HIDDEN),
        "bloom": lambda: T.BloomConfig(vocab_size=VOCAB, hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS),
        "gpt_neox": lambda: T.GPTNeoXConfig(**llama),
        "gptj": lambda: T.GPTJConfig(**gpt, rotary_dim=8),
        "gpt_neo": lambda: T.GPTNeoConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS,
                                          num_heads=HEADS, intermediate_size=FFN, max_position_embeddings=POSITIONS,
                                          attention_types=[[["global", "local"], LAYERS // 2]], window_size=16),
        "gpt2": lambda: T.GPT2Config(**gpt),
        "codegen": lambda: T.CodeGenConfig(**gpt, n_ctx=POSITIONS, rotary_dim=8),
        "llama": lambda: T.LlamaConfig(**llama),  # LLaMA 2: one key/value head per query head
        "llama3": lambda: T.LlamaConfig(**gqa, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
        "qwen2": lambda: T.Qwen2Config(**gqa, tie_word_embeddings=True),
        "qwen3": lambda: T.Qwen3Config(**gqa, head_dim=32, tie_word_embeddings=True),
        "mistral": lambda: T.MistralConfig(**gqa, sliding_window=16),
        "gemma2": lambda: T.Gemma2Config(**gqa, head_dim=32, sliding_window=16),
        "gemma3_text": lambda: T.Gemma3TextConfig(**gqa, head_dim=32, sliding_window=16),
        "phi3": lambda: T.Phi3Config(**gqa),
    }


FAMILIES = tuple(_configs())


def tiny_config(family: str, tokenizer):
    """The transformers config of ``family``'s tiny model, with ``tokenizer``'s special token ids and
    no dropout."""
    config = _configs()[family]()
    config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    from rlhf.models import _DROPOUT_KEYS

    for key in _DROPOUT_KEYS:
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    return config


_TOKENIZER = []


def tiny_tokenizer():
    """The random models' tokenizer (rlhf.models.train_tokenizer), trained once per process."""
    from rlhf.models import train_tokenizer

    if not _TOKENIZER:
        _TOKENIZER.append(train_tokenizer(VOCAB, POSITIONS))
    return _TOKENIZER[0]


def tiny_family_model(family: str, out, seed: int = 0) -> Path:
    """Write ``family``'s tiny random model and the local tokenizer into ``out`` (a checkpoint folder)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out)
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tokenizer))
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
