"""Rollout generation speed: the framework's decode loop (rlhf/generation/decode.py) against Hugging Face
``generate``, same model, same left-padded batch, both sampling the full distribution at temperature
0.7 (PPO's rollouts: no top-k, no top-p), eos suppressed so both make exactly --new tokens;
alternating, median of --repeats each, one process. ``full_over_top50`` is our loop's time sampling
the full distribution over its time drawing among the 50 most likely tokens only (the rollouts'
former default): the price of sampling the distribution PPO's log-probs describe. ``sampler_share``
is the part of our loop's time that sampling costs over greedy argmax (DeepSpeed-Chat's rollouts
are greedy), so that a comparison with a greedy peer can be read like for like.
``static_over_default`` is the static step's time (``step.decode_graph``, which on a GPU is
recorded as a CUDA graph; here it runs eagerly, each token attending over the cache up to the end of
its span, rlhf.generation.decode.STATIC_SPAN) over the default loop's; ``static_spans_over_whole`` is its time
over the same step attending over the whole cache from the first token (STATIC_SPAN = 0).

Models: the PPO bench's random OPT (hidden 256, 4 layers, vocab 8192; bench/ppo_step.py) and the
default tiny LLaMA. Prints one JSON line per model with tokens/s of each and ``speedup`` (ours over
generate's time per token, medians; the issue's target is >= 2), ``speedup_fastest`` (the fastest
call of each: every call does the same work, so the fastest is the least disturbed by a busy VM),
and the CPU's bf16 support.

Beside them, the time of the model's matrix products alone (every nn.Linear in forward order on the
same weights and shapes, nothing else): ``speedup_ceiling`` is generate's time over it, the speedup
of a loop with no cost but those products, which no decode loop can pass; ``ours_over_matmuls``
is what ours spends on top of them (attention, norms, sampling, Python). Where the ceiling is
under 2 the products stream the weights from memory every token and generate's overhead is too
small a share for any loop to halve its time.

``--families``: instead, one line per Hugging Face family (rlhf.models.families' tiny random models, hidden
64, 2 layers, grouped-query attention where the family has it): our loop against ``generate``, and
``path`` says whether ours ran our family forward (rlhf.generation.forwards.FORWARDS) or the model's own forward
with transformers' cache.

    python bench/decode.py
    python bench/decode.py --batch 64 --new 32 --precision bf16 --models tiny-llama
    python bench/decode.py --models smollm2-135m-instruct --batch 16 --prompt 48 --new 32 --threads 2 --repeats 3
    python bench/decode.py --families                  # every family; or --families qwen2 phi3
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
    # A real pretrained model (`make real-model`): 30 layers, 576 wide, grouped-query attention, 49k vocabulary.
    "smollm2-135m-instruct": ["model=smollm2-135m-instruct"],
}
DEFAULT_MODELS = ["bench-opt-256", "tiny-llama"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="new tokens")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    ap.add_argument("--families", nargs="*", default=None,
                    help="tiny random models of these families (rlhf.models.families.FAMILIES; none named: all)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    from rlhf.config import compose_config, to_schema

    torch.set_num_threads(args.threads)
    if args.families is not None:
        from rlhf.models.families import FAMILIES

        for family in args.families or FAMILIES:
            print(json.dumps(measure_family(family, args)), flush=True)
        return
    for name in args.models:
        overrides = MODELS[name]
        print(json.dumps(measure(name, to_schema(compose_config(overrides)), args)), flush=True)


def measure(name: str, cfg, args) -> dict:
    import torch
    import torch.nn.functional as F

    from rlhf.generation import decode as decode_module
    from rlhf.generation.decode import decode
    from rlhf.models import load_causal_lm, load_tokenizer, resolve_path
    from rlhf.preflight.probes import cpu_bf16

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    path = resolve_path(cfg.model)
    tok = load_tokenizer(path)
    model = load_causal_lm(path, tok, dtype).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (args.batch, args.prompt), generator=gen)
    ids[:, 0] = tok.bos_token_id
    mask = torch.ones_like(ids)
    mask[0, : args.prompt // 4] = 0  # one left-padded row, as rollouts have
    # top_k=0 explicitly: generate's own default is 50.
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 0, "min_new_tokens": args.new}

    def ours():
        return decode(model, ids, mask, args.new, tok.eos_token_id, tok.pad_token_id, **sampling)

    def ours_top50():
        return decode(model, ids, mask, args.new, tok.eos_token_id, tok.pad_token_id, **{**sampling, "top_k": 50})

    def ours_greedy():  # argmax, as DeepSpeed-Chat's rollouts: what our sampler adds is the difference
        return decode(model, ids, mask, args.new, tok.eos_token_id, tok.pad_token_id, min_new_tokens=args.new)

    def ours_static():
        return decode(model, ids, mask, args.new, tok.eos_token_id, tok.pad_token_id, static=True, **sampling)

    def ours_static_whole():  # every token over the whole cache, as before the spans
        spans, decode_module.STATIC_SPAN = decode_module.STATIC_SPAN, 0
        try:
            return ours_static()
        finally:
            decode_module.STATIC_SPAN = spans

    def theirs():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **sampling)

    def theirs_greedy():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                                  min_new_tokens=args.new, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]  # forward order; lm_head last

    @torch.no_grad()
    def matmuls():
        # Only the model's matrix products, in its order, on the same weights: the prompt through every
        # layer (the lm head at its last position), then one row per sequence per new token. Any decode
        # loop does at least these; attention, norms, embedding and sampling come on top.
        x = {m.in_features: torch.randn(args.batch, args.prompt, m.in_features, dtype=dtype) for m in linears}
        for m in linears[:-1]:
            F.linear(x[m.in_features], m.weight, m.bias)
        x = {k: v[:, -1] for k, v in x.items()}
        for _ in range(args.new):
            for m in linears:
                F.linear(x[m.in_features], m.weight, m.bias)

    calls = (("ours", ours), ("generate", theirs), ("matmuls", matmuls), ("ours_top50", ours_top50),
             ("ours_static", ours_static), ("ours_static_whole", ours_static_whole), ("ours_greedy", ours_greedy),
             ("generate_greedy", theirs_greedy))
    times = {key: [] for key, _ in calls}
    for _, fn in calls:  # warm-up
        fn()
    for _ in range(args.repeats):
        for key, fn in calls:
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.batch * args.new
    return {"model": name, "precision": args.precision, "cpu_bf16": cpu_bf16(), "threads": args.threads,
            "batch": args.batch, "prompt_tokens": args.prompt, "new_tokens": args.new,
            "ours_tokens_per_s": round(tokens / med["ours"], 1),
            "generate_tokens_per_s": round(tokens / med["generate"], 1),
            "speedup": round(med["generate"] / med["ours"], 3), "target": 2.0,
            "ours_greedy_tokens_per_s": round(tokens / med["ours_greedy"], 1),
            "generate_greedy_tokens_per_s": round(tokens / med["generate_greedy"], 1),
            "speedup_greedy": round(med["generate_greedy"] / med["ours_greedy"], 3),
            # Each call does the same work: the fastest of each is the one a busy VM disturbed least.
            "speedup_fastest": round(min(times["generate"]) / min(times["ours"]), 3),
            # The speedup of a loop that did nothing but the matrix products: no loop can beat it.
            "matmuls_tokens_per_s": round(tokens / med["matmuls"], 1),
            "speedup_ceiling": round(med["generate"] / med["matmuls"], 3),
            "ours_over_matmuls": round(med["ours"] / med["matmuls"], 3),
            "full_over_top50": round(med["ours"] / med["ours_top50"], 3),
            # The share of our generation time that sampling the full distribution costs over argmax.
            "sampler_share": round(1 - med["ours_greedy"] / med["ours"], 3),
            # The static step (step.decode_graph) without a graph, as it runs on CPU: its price here.
            "static_over_default": round(med["ours_static"] / med["ours"], 3),
            "static_spans_over_whole": round(med["ours_static"] / med["ours_static_whole"], 3)}

def measure_family(family: str, args) -> dict:
    """Our loop against generate on ``family``'s tiny random model: same batch and sampling as ``measure``."""
    import tempfile

    import torch

    from rlhf.generation.decode import _own_forward, decode
    from rlhf.models import load_causal_lm, load_tokenizer
    from rlhf.models.families import tiny_family_model

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.precision]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(tiny_family_model(family, tmp))
        tok = load_tokenizer(path)
        model = load_causal_lm(path, tok, dtype).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, len(tok), (args.batch, args.prompt), generator=gen)
    ids[:, 0] = tok.bos_token_id
    mask = torch.ones_like(ids)
    mask[0, : args.prompt // 4] = 0
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 0, "min_new_tokens": args.new}

    def ours():
        return decode(model, ids, mask, args.new, tok.eos_token_id, tok.pad_token_id, **sampling)

    def theirs():
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **sampling)

    times = {"ours": [], "generate": []}
    ours(), theirs()  # warm-up
    for _ in range(args.repeats):
        for key, fn in (("ours", ours), ("generate", theirs)):
            start = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.batch * args.new
    return {"family": family, "architecture": type(model).__name__, "precision": args.precision,
            "threads": args.threads, "batch": args.batch, "prompt_tokens": args.prompt, "new_tokens": args.new,
            "path": "ours" if _own_forward(model, args.prompt + args.new) else "model forward",
            "ours_tokens_per_s": round(tokens / med["ours"], 1),
            "generate_tokens_per_s": round(tokens / med["generate"], 1),
            "speedup": round(med["generate"] / med["ours"], 3),
            "speedup_fastest": round(min(times["generate"]) / min(times["ours"]), 3)}


if __name__ == "__main__":
    main()
