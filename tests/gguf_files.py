"""Tiny GGUF files written with the `gguf` package (llama.cpp's writer), for the tests of reading GGUF
models: a random llama-architecture model with the random models' tokenizer, some tensors quantized.

    python -c "from tests.gguf_files import write_tiny_gguf; write_tiny_gguf('/tmp/tiny.gguf')"
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# A ChatML template whose turns end with <|im_end|>, a token other than the tokenizer's eos (</s>).
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SIZES = dict(layers=2, hidden=64, heads=4, kv_heads=2, ffn=128, positions=256)


def answer_characters(prompt: str, answer: str) -> float:
    """A reward in [0, 1] (within step.reward_clip) from the answer's length in characters, modulo 5:
    four random answers of 8 random tokens all score the same with probability 1/125 per group, so
    GRPO's advantages, and with them its updates, are not zero."""
    return (len(answer) % 5) / 4


def write_tiny_gguf(path, arch: str = "llama", quant: str = "Q8_0", seed: int = 0) -> Path:
    """A GGUF of a random 2-layer llama (grouped-query attention, tied head) whose linear weights are
    stored in ``quant`` (the rest in F32), with a byte-level BPE tokenizer and CHATML. ``arch`` other
    than llama writes the same file under another architecture name (a file transformers cannot read)."""
    import gguf

    from rlhf.models.families import tiny_tokenizer

    path = Path(path)
    tok = tiny_tokenizer()
    backend = json.loads(tok.backend_tokenizer.to_str())
    vocab = backend["model"]["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    specials = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}
    types = [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(len(tokens))]
    tokens += ["<|im_start|>", "<|im_end|>"]
    types += [gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    vocab_size = len(tokens)

    s = SIZES
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-gguf-test")
    w.add_block_count(s["layers"])
    w.add_context_length(s["positions"])
    w.add_embedding_length(s["hidden"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(True)
    w.add_chat_template(CHATML)

    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[quant]

    def add(name, shape, quantized):
        data = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if quantized and kind != gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, data)

    head = s["hidden"] // s["heads"]
    add("token_embd.weight", (vocab_size, s["hidden"]), False)
    add("output_norm.weight", (s["hidden"],), False)
    for i in range(s["layers"]):
        add(f"blk.{i}.attn_norm.weight", (s["hidden"],), False)
        add(f"blk.{i}.attn_q.weight", (s["hidden"], s["hidden"]), True)
        add(f"blk.{i}.attn_k.weight", (s["kv_heads"] * head, s["hidden"]), True)
        add(f"blk.{i}.attn_v.weight", (s["kv_heads"] * head, s["hidden"]), True)
        add(f"blk.{i}.attn_output.weight", (s["hidden"], s["hidden"]), True)
        add(f"blk.{i}.ffn_norm.weight", (s["hidden"],), False)
        add(f"blk.{i}.ffn_gate.weight", (s["ffn"], s["hidden"]), True)
        add(f"blk.{i}.ffn_up.weight", (s["ffn"], s["hidden"]), True)
        add(f"blk.{i}.ffn_down.weight", (s["hidden"], s["ffn"]), True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
