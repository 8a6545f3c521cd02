"""Multi-turn chat with any output folder (SFT, PPO, EMA), hub id or GGUF file, like DeepSpeed-Chat's
chatbot.py.

Type a message; `clear` starts a new conversation, `quit` (or end of input) leaves. The
conversation is written as training wrote it (rlhf.data.adapters.ChatFormat, with the tokenizer the
steps load, rlhf.models.load_tokenizer): through the tokenizer's chat template where it has one
(``--chat-template none``: never), else in DeepSpeed-Chat's " Human: ... Assistant: ..." form; it is
cut from the left when it outgrows the model's context. The answer streams as it is decoded and
stops at the end of the turn (the template's end-of-turn token) or the model's own eos.

    python -m rlhf.chat --path runs/e2e/tiny-llama_synthetic-sort_seed42/ppo/model
    python -m rlhf.chat --path runs/rlvr/smollm2-135m-instruct_arithmetic_seed42/ppo/model --max-new-tokens 128
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


def respond(model, tokenizer, history: str, max_new_tokens: int, sample: bool, temperature: float,
            stream: bool = False) -> str:
    """The model's answer to ``history``, the conversation's text up to the answer (ChatFormat.prompt);
    with ``stream``, printed token by token as it is decoded."""
    from transformers import TextStreamer

    ids = tokenizer(history).input_ids
    limit = getattr(model.config, "max_position_embeddings", 2048) - max_new_tokens
    ids = ids[-limit:]  # keep the most recent turns
    own = model.generation_config.eos_token_id
    stops = list(dict.fromkeys([tokenizer.eos_token_id, *([] if own is None else [own] if isinstance(own, int) else own)]))
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=sample,
                             temperature=temperature if sample else None, eos_token_id=stops,
                             pad_token_id=tokenizer.pad_token_id, streamer=streamer)
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

    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # A hub id is "name" or "org/name"; anything else (a path with more parts, ./, /, ~) is a folder,
    # and a missing one is named as such rather than passed to the hub as a malformed id.
    if not Path(args.path).expanduser().exists() and (looks_local(args.path) or args.path.count("/") > 1):
        sys.exit(f"no such folder: {args.path} (a step's output is RUN_DIR/model, e.g. "
                 "runs/e2e/<chain>/ppo/model; or give a hub id such as facebook/opt-1.3b)")
    from rlhf import models
    from rlhf.errors import ConfigError

    try:
        path = models.checkpoint_path(args.path)  # a GGUF file is converted once, as the steps do
        config = AutoConfig.from_pretrained(path)
        if any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
            sys.exit(f"{args.path} is a reward model ({config.architectures[0]}: it scores answers, it does not "
                     "write them); chat with a policy: an SFT, PPO or DPO step's model/")
        tokenizer = models.load_tokenizer(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
    except (OSError, ValueError, ConfigError) as err:
        sys.exit(f"cannot load a causal LM from {args.path!r}: {err}")
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
        print("Assistant: ", end="", flush=True)
        answer = respond(model, tokenizer, fmt.prompt(history), args.max_new_tokens, args.sample, args.temperature,
                         stream=True)
        history.append({"role": "assistant", "content": answer.strip()})


if __name__ == "__main__":
    main()
