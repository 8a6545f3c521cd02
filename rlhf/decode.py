"""A lean decode loop for rollouts: one forward per token over a KV cache, sampling in a few tensor
ops, no logits-processor or stopping-criteria machinery.

At the sizes PPO rolls out on CPU, Hugging Face ``generate``'s per-token bookkeeping costs about as
much as the model's forward; this loop keeps only the forward. It serves any HF causal LM that takes
``past_key_values`` (OPT, LLaMA, GPT-2, GPT-NeoX, ...): left-padded prompts, position ids from the
attention mask where the model takes them, eos stopping, temperature / top-k / top-p in
``generate``'s order and with its sampling call, so that the same logits give the same greedy tokens
and, with the same RNG state, the same samples (tests/test_decode.py). ``synced`` keeps every rank
stepping until all are done: ZeRO-3's layer-by-layer gathers are collectives.

    python bench/decode.py          # tokens/s of this loop against HF generate, same model and batch
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist


def _filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), as ``generate``'s warpers apply them."""
    if temperature != 1.0:
        logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        # Drop the tokens after the cumulative mass passes top_p; the most likely token always stays.
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_tokens(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(-1)
    probs = _filter(logits.float(), temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, num_samples=1).squeeze(1)


def accepts(model, name: str) -> bool:
    """Whether the model's forward takes ``name``, looking through a DeepSpeed engine and a PEFT
    wrapper (whose forward takes ``**kwargs`` and hands them on to the model it wraps)."""
    model = getattr(model, "module", model)
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return name in inspect.signature(model.forward).parameters


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, eos_id: int,
           pad_id: int, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           min_new_tokens: int = 0, synced: bool = False) -> torch.Tensor:
    """New tokens [batch, <= max_new_tokens] for left-padded prompts; after a row's eos, pad."""
    from transformers import DynamicCache

    batch = input_ids.shape[0]
    attn = attention_mask.long()
    kwargs = {}
    # The prompt's forward needs the lm head at its last position only, where the model allows it.
    first = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
    positions = accepts(model, "position_ids")
    if positions:
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        kwargs["position_ids"] = pos
        next_pos = pos[:, -1:] + 1
    # Transformers 5 names the cache argument `cache`; earlier versions and some families `past_key_values`.
    cache_arg = "cache" if accepts(model, "cache") else "past_key_values"
    kwargs[cache_arg] = DynamicCache()  # filled in place by every forward
    out = model(input_ids=input_ids, attention_mask=attn, use_cache=True, **kwargs, **first)
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    tokens = []
    ones = torch.ones(batch, 1, dtype=attn.dtype, device=attn.device)
    for t in range(max_new_tokens):
        logits = out.logits[:, -1]
        if t < min_new_tokens:
            logits = logits.clone()
            logits[:, eos_id] = float("-inf")
        tok = next_tokens(logits, do_sample, temperature, top_k, top_p)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        tokens.append(tok)
        done = done | (tok == eos_id)
        finished = done.all()
        if synced:  # every rank runs as many forwards as the slowest (ZeRO-3 gathers are collectives)
            flag = (~finished).float().reshape(1)
            dist.all_reduce(flag)
            finished = flag.item() == 0
        if finished or t == max_new_tokens - 1:
            break
        attn = torch.cat([attn, ones], dim=1)
        if positions:
            kwargs["position_ids"] = next_pos
            next_pos = next_pos + 1
        out = model(input_ids=tok.unsqueeze(1), attention_mask=attn, use_cache=True, **kwargs)
    return torch.stack(tokens, dim=1)
