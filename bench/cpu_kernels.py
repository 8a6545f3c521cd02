"""The CPU kernel timings behind three choices of the framework, measured in one process.

- AdamW: the engine steps torch's fused AdamW (rlhf/engine.py). Times one step over the PPO bench
  model's parameter shapes (5.3M fp32 parameters) for the for-loop, foreach and fused
  implementations, and the largest difference of fused's weights from foreach's after the steps.
- One-query attention: on CPU the decode loop keeps a bf16 model's KV cache and attention in fp32
  (rlhf/generation/decode.py). Times ``scaled_dot_product_attention`` of one new token over 65 and 128 cached
  keys (4 rows x 8 heads x 32 dims, the PPO bench's shapes) over slices of a preallocated cache, in
  bf16 and in fp32 (the query cast included).
- Grouped-query attention of one new token: the decode loop folds the query heads that share a
  key/value head into that head's query rows (rlhf/generation/forwards.py ``_Cache.attend``). Times
  ``scaled_dot_product_attention`` of one token over 320 cached keys, 16 rows x 32 query heads over 8
  key/value heads x 64 dims (Llama 3's grouping), fp32, with a padding mask: ``enable_gqa=True``
  against the fold, and the largest difference of their outputs.

- Chunked log-prob backward: the log-prob functions (rlhf/losses/tokens.py) walk time-sliced logits
  (``logits[:, :-1]``, [32, 32, 50272] fp32, OPT's vocabulary) sequence by sequence on CPU. Times
  forward and backward of ``token_logprobs`` chunked against one pass over the whole tensor, and the
  largest difference of their gradients.

Prints one JSON line of microseconds (best of 5 repeats of N calls) and the CPU's bf16 support.

    python bench/cpu_kernels.py
    python bench/cpu_kernels.py --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The PPO bench's OPT (h256, 4 layers, ffn 1024, vocab 8192): embedding, 4 x (4 attention
# projections + 2 feed-forward matrices), and the biases and norms.
SHAPES = [(8192, 256)] + [(256, 256)] * 16 + [(1024, 256), (256, 1024)] * 4 + [(256,)] * 60


def best_us(fn, calls: int) -> float:
    for _ in range(max(3, calls // 10)):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return round(best * 1e6, 1)


def adamw(kind: str) -> tuple[float, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    flags = {"forloop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[kind]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **flags)
    return best_us(opt.step, 10), params


def attention(dtype: torch.dtype, keys: int) -> float:
    cache_k, cache_v = (torch.randn(4, 8, 128, 32, dtype=dtype) for _ in range(2))
    q = torch.randn(4, 8, 1, 32, dtype=torch.bfloat16)
    mask = torch.ones(4, 1, 1, keys, dtype=torch.bool)
    k, v = cache_k[:, :, :keys], cache_v[:, :, :keys]
    return best_us(lambda: F.scaled_dot_product_attention(q.to(dtype), k, v, attn_mask=mask), 200)


def grouped_query(fold: bool) -> tuple[float, torch.Tensor]:
    rows, heads, kv_heads, width, keys = 16, 32, 8, 64, 320
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, 1, width, generator=gen)
    k, v = (torch.randn(rows, kv_heads, keys, width, generator=gen) for _ in range(2))
    mask = torch.zeros(rows, 1, 1, keys).index_fill(-1, torch.arange(20), float("-inf"))
    mask[1:] = 0  # one left-padded row

    def call():
        if fold:
            return F.scaled_dot_product_attention(q.reshape(rows, kv_heads, heads // kv_heads, width), k, v,
                                                  attn_mask=mask).reshape(rows, heads, 1, width)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return best_us(call, 200), call()


def logprob_backward(chunked: bool) -> tuple[float, torch.Tensor]:
    from rlhf import losses

    gen = torch.Generator().manual_seed(0)
    full = torch.randn(32, 33, 50272, generator=gen).requires_grad_()
    tokens = torch.randint(0, 50272, (32, 32), generator=gen)
    saved = losses.tokens.LOGPROB_CHUNK_BYTES

    def call():
        full.grad = None
        losses.tokens.LOGPROB_CHUNK_BYTES = saved if chunked else 1 << 40
        try:
            losses.token_logprobs(full[:, :-1], tokens).sum().backward()
        finally:
            losses.tokens.LOGPROB_CHUNK_BYTES = saved
    return best_us(call, 1), (call(), full.grad.clone())[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from rlhf.preflight.probes import cpu_bf16

    out = {"cpu_bf16": cpu_bf16(), "threads": args.threads, "adamw_params": sum(
        torch.Size(s).numel() for s in SHAPES)}
    weights = {}
    for kind in ("forloop", "foreach", "fused"):
        out[f"adamw_{kind}_us"], weights[kind] = adamw(kind)
    out["adamw_fused_max_diff_from_foreach"] = max(
        (a - b).abs().max().item() for a, b in zip(weights["fused"], weights["foreach"], strict=True))
    for keys in (65, 128):
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            out[f"attention_1x{keys}_{name}_us"] = attention(dtype, keys)
    (out["gqa_enable_gqa_us"], plain), (out["gqa_fold_us"], folded) = grouped_query(False), grouped_query(True)
    out["gqa_fold_over_enable_gqa"] = round(out["gqa_fold_us"] / out["gqa_enable_gqa_us"], 3)
    out["gqa_fold_max_diff"] = (plain - folded).abs().max().item()
    (out["logprob_bwd_chunked_us"], g_chunked), (out["logprob_bwd_one_pass_us"], g_one) = (
        logprob_backward(True), logprob_backward(False))
    out["logprob_bwd_chunked_over_one_pass"] = round(out["logprob_bwd_chunked_us"] / out["logprob_bwd_one_pass_us"], 3)
    out["logprob_bwd_max_grad_diff"] = (g_chunked - g_one).abs().max().item()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
