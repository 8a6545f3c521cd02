"""Rollout generation speed: the framework's decode loop (rlhf/decode.py) against Hugging Face
``generate``, same model, same left-padded batch, both sampling at temperature 0.7 with top-k 50,
eos suppressed so both make exactly --new tokens; alternating, median of --repeats each, one process.

Models: the PPO bench's random OPT (hidden 256, 4 layers, vocab 8192; bench/ppo_step.py) and the
default tiny LLaMA. Prints one JSON line per model with tokens/s of each and ``speedup`` (ours over
generate's time per token; the issue's target is >= 2), and the CPU's bf16 support.

    python bench/decode.py
    python bench/decode.py --batch 64 --new 32 --precision bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {
    "bench-opt-256": ["model=tiny-opt", "model.name=bench-opt-256", "model.hidden_size=256", "model.num_layers=4",
                      "model.num_heads=8", "model.ffn_size=1024", "model.vocab_size=8192", "model.max_positions=256"],
    "tiny-llama": ["model=tiny-llama"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="new tokens")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from rlhf.config import compose_config, to_schema

    torch.set_num_threads(args.threads)
    for name, overrides in MODELS.items():
        print(json.dumps(measure(name, to_schema(compose_config(overrides)), args)), flush=True)


def measure(name: str, cfg, args) -> dict:
    import torch

    from rlhf.decode import decode
    from rlhf.launch_step import cpu_bf16
    from rlhf.models import load_causal_lm, load_tokenizer, resolve_path

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    path = resolve_path(cfg.model)
    tok = load_tokenizer(path)
    model = load_causal_lm(path, tok, dtype).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, cfg.model.vocab_size, (args.batch, args.prompt), generator=gen)
    ids[:, 0] = tok.bos_token_id
    mask = torch.ones_like(ids)
    mask[0, : args.prompt // 4] = 0  # one left-padded row, as rollouts have
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 50, "min_new_tokens": args.new}

    def ours():
        return decode(model, ids, mask, args.new, tok.eos_token_id, tok.pad_token_id, **sampling)

    def theirs():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **sampling)

    times = {"ours": [], "generate": []}
    for fn in (ours, theirs):  # warm-up
        fn()
    for _ in range(args.repeats):
        for key, fn in (("ours", ours), ("generate", theirs)):
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.batch * args.new
    return {"model": name, "precision": args.precision, "cpu_bf16": cpu_bf16(), "threads": args.threads,
            "batch": args.batch, "prompt_tokens": args.prompt, "new_tokens": args.new,
            "ours_tokens_per_s": round(tokens / med["ours"], 1),
            "generate_tokens_per_s": round(tokens / med["generate"], 1),
            "speedup": round(med["generate"] / med["ours"], 3), "target": 2.0}

if __name__ == "__main__":
    main()
