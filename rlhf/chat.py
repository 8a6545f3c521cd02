"""Multi-turn chat with any output folder (SFT, PPO, EMA) or hub id, like DeepSpeed-Chat's chatbot.py.

Type a message; `clear` starts a new conversation, `quit` (or end of input) leaves. The
conversation is written as training wrote it (rlhf.data.adapters.ChatFormat): through the
tokenizer's chat template where it has one (``--chat-template none``: never), else in DeepSpeed-Chat's
" Human: ... Assistant: ..." form; it is cut from the left when it outgrows the model's context.

    python -m rlhf.chat --path runs/e2e/tiny-llama_synthetic-sort_seed42/ppo/model
    python -m rlhf.chat --path facebook/opt-1.3b --max-new-tokens 128 --sample --temperature 0.7
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from rlhf.config.groups import looks_local
from rlhf.data.adapters import ChatFormat, chat_tokenizer


def chat_format(tokenizer, mode: str = "auto") -> ChatFormat:
    """The rendering of the steps' data (data.chat_template=mode) for this tokenizer."""
    return ChatFormat(chat_tokenizer(tokenizer, mode))


def respond(model, tokenizer, history: str, max_new_tokens: int, sample: bool, temperature: float) -> str:
    """The model's answer to ``history``, the conversation's text up to the answer (ChatFormat.prompt)."""
    ids = tokenizer(history).input_ids
    limit = getattr(model.config, "max_position_embeddings", 2048) - max_new_tokens
    ids = ids[-limit:]  # keep the most recent turns
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=sample,
                             temperature=temperature if sample else None, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", required=True, help="model folder (any step's output) or hub id")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--chat-template", choices=("auto", "none"), default="auto",
                    help="the data.chat_template the model was trained with")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # A hub id is "name" or "org/name"; anything else (a path with more parts, ./, /, ~) is a folder,
    # and a missing one is named as such rather than passed to the hub as a malformed id.
    if not Path(args.path).expanduser().exists() and (looks_local(args.path) or args.path.count("/") > 1):
        sys.exit(f"no such folder: {args.path} (a step's output is RUN_DIR/model, e.g. "
                 "runs/e2e/<chain>/ppo/model; or give a hub id such as facebook/opt-1.3b)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.path)
        model = AutoModelForCausalLM.from_pretrained(args.path).eval()
    except (OSError, ValueError) as err:
        sys.exit(f"cannot load a causal LM from {args.path!r}: {err}")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # generation only: no masks are built from pad here
    fmt = chat_format(tokenizer, args.chat_template)
    history: list[dict] = []
    print("Type a message; 'clear' starts over, 'quit' leaves.", flush=True)
    while True:
        try:
            text = input("Human: ").strip()
        except EOFError:
            break
        if text == "quit":
            break
        if text == "clear":
            history = []
            print("(conversation cleared)", flush=True)
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        answer = respond(model, tokenizer, fmt.prompt(history), args.max_new_tokens, args.sample, args.temperature)
        history.append({"role": "assistant", "content": answer.strip()})
        print(f"Assistant: {answer.strip()}", flush=True)


if __name__ == "__main__":
    main()
