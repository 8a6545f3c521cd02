"""A lean decode loop for rollouts: one forward per token over a KV cache, sampling in a few tensor
ops, no logits-processor or stopping-criteria machinery.

At the sizes PPO rolls out on CPU, Hugging Face ``generate``'s per-token bookkeeping costs about as
much as the model's forward; this loop keeps only the forward. It serves any HF causal LM that takes
``past_key_values`` (OPT, LLaMA, GPT-2, GPT-NeoX, ...): left-padded prompts, position ids from the
attention mask where the model takes them, eos stopping, temperature / top-k / top-p in
``generate``'s order, so that the same logits give the same greedy tokens and the same sampling
distribution (tests/test_decode.py; the draws themselves differ, see ``_draw``).
``synced`` keeps every rank stepping until all are done: ZeRO-3's layer-by-layer gathers are
collectives.

For the families in ``FORWARDS`` (LLaMA, OPT) the loop does not call the model's own forward at all
when every weight is present (not ZeRO-3, or ZeRO-3 gathered whole): a short forward over the
model's own submodules (so LoRA layers and any bias still apply) writes keys and values into a
cache preallocated for prompt + answer and attends with one ``scaled_dot_product_attention``. It
leaves out what transformers does per token for generality (mask building for every attention
backend, cache-class dispatch, output dataclasses, input checks), which at rollout sizes costs as
much as the arithmetic. Other families, and ZeRO-3 with layer-by-layer gathers, use the model's
forward; tests check both give the tokens ``generate`` gives.

    python bench/decode.py          # tokens/s of this loop against HF generate, same model and batch
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.generation.sampling import Sampling
from rlhf.losses import token_logprobs


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
    logits = logits.float()
    if top_k and top_k < logits.shape[-1]:
        # Draw among the k best only: the distribution of masking the rest to -inf, at k/vocab of the
        # cost. A tie at the k-th logit, which generate keeps, is dropped.
        best, index = torch.topk(logits, top_k, dim=-1)
        return index.gather(-1, _draw(_filter(best, temperature, 0, top_p))).squeeze(1)
    return _draw(_filter(logits, temperature, top_k, top_p)).squeeze(1)


def _draw(logits: torch.Tensor) -> torch.Tensor:
    """One index per row drawn from softmax(logits), by inverse transform: one uniform number per row
    against the cumulative distribution. ``torch.multinomial`` (and so ``generate``) races one
    exponential per vocabulary entry, which costs 5-7x more on CPU at vocabularies of 8k-50k
    (bench/decode.py's sampler rows); the draws differ from its draws, the distribution is the same
    (tests/test_decode.py). The running sums are float64 so that their rounding over 50k entries
    cannot move mass between tokens; ``right=True`` never lands on a token of zero probability."""
    weights = (logits - logits.amax(-1, keepdim=True)).exp().double().cumsum(-1)
    u = torch.rand(weights.shape[0], 1, dtype=torch.float64, device=weights.device) * weights[:, -1:]
    return torch.searchsorted(weights, u, right=True).clamp(max=logits.shape[-1] - 1)


def accepts(model, name: str) -> bool:
    """Whether the model's forward takes ``name``, looking through a DeepSpeed engine and a PEFT
    wrapper (whose forward takes ``**kwargs`` and hands them on to the model it wraps)."""
    return name in inspect.signature(_base(model).forward).parameters


def _base(model):
    """The transformers model inside a DeepSpeed engine and a PEFT wrapper (LoRA layers sit inside it)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _llama_forward(model, ids, cache, start, mask):
    inner = model.model
    h = cache.stream(inner.embed_tokens(ids))
    if "rope" not in cache.tables:  # every position's rotation at once, not ten small ops per token
        cos, sin = inner.rotary_emb(h, position_ids=cache.positions)
        half = sin.shape[-1] // 2
        # [batch, 1, length, head_dim], rotate-half's sign folded into sin (see _rotate).
        cache.tables["rope"] = cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
    cos, sin = (cache.window(c, 2, start, ids.shape[1]) for c in cache.tables["rope"])
    for i, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = cache.run(layer.input_layernorm, h)
        q, k, v = (_heads(y, attn.head_dim) for y in cache.linears((attn.q_proj, attn.k_proj, attn.v_proj), x))
        if hasattr(attn, "q_norm"):  # Qwen3: an RMSNorm over each head's query and key, before the rotation
            q, k = cache.run(attn.q_norm, q), cache.run(attn.k_norm, k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        h = h + cache.linear(attn.o_proj, cache.attend(i, q, k, v, start, mask, attn.scaling))
        h = h + _gated_mlp(cache, layer.mlp, cache.run(layer.post_attention_layernorm, h))
    return cache.linear(model.lm_head, cache.run(inner.norm, h[:, -1]))


def _gated_mlp(cache, mlp, x):
    """LLaMA's MLP, down(act(gate(x)) * up(x)), with its projections through ``cache.linear``; another
    MLP (a mixture of experts, ...) through its own forward."""
    if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return cache.run(mlp, x)
    return cache.linear(mlp.down_proj, mlp.act_fn(cache.linear(mlp.gate_proj, x)) * cache.linear(mlp.up_proj, x))


def _opt_forward(model, ids, cache, start, mask):
    dec = model.model.decoder
    h = cache.stream(dec.embed_tokens(ids))
    if dec.project_in is not None:
        h = cache.linear(dec.project_in, h)
    # The embedding's row index of every position once (not the vectors: batch x length x hidden).
    if "rows" not in cache.tables:
        cache.tables["rows"] = cache.positions + dec.embed_positions.offset
    h = h + dec.embed_positions.weight[cache.window(cache.tables["rows"], 1, start, ids.shape[1])]
    for i, layer in enumerate(dec.layers):
        attn, pre = layer.self_attn, layer.do_layer_norm_before
        x = cache.run(layer.self_attn_layer_norm, h) if pre else h
        # OPT scales the query before the product, not the scores (its own order, kept for equality).
        q, k, v = cache.linears((attn.q_proj, attn.k_proj, attn.v_proj), x)
        q, k, v = _heads(q * attn.scaling, attn.head_dim), _heads(k, attn.head_dim), _heads(v, attn.head_dim)
        h = h + cache.linear(attn.out_proj, cache.attend(i, q, k, v, start, mask, 1.0))
        if not pre:
            h = cache.run(layer.self_attn_layer_norm, h)
        x = cache.run(layer.final_layer_norm, h) if pre else h
        h = h + cache.linear(layer.fc2, layer.activation_fn(cache.linear(layer.fc1, x)))
        if not pre:
            h = cache.run(layer.final_layer_norm, h)
    h = h[:, -1]
    if dec.final_layer_norm is not None:
        h = cache.run(dec.final_layer_norm, h)
    if dec.project_out is not None:
        h = cache.linear(dec.project_out, h)
    return cache.linear(model.lm_head, h)


# Family forwards by transformers class name; a family not here decodes through its own forward.
# Qwen2, Qwen3 and Mistral are LLaMA's layers (Qwen2 with biases on q/k/v, which the module calls
# apply; Qwen3 with a norm over each head's query and key) plus a sliding attention window, which
# our forward does not apply: ``_own_forward`` takes them only where the window cannot bind (see
# ``_window``).
FORWARDS = {"LlamaForCausalLM": _llama_forward, "OPTForCausalLM": _opt_forward,
            "Qwen2ForCausalLM": _llama_forward, "Qwen3ForCausalLM": _llama_forward,
            "MistralForCausalLM": _llama_forward}


def _window(base) -> int | None:
    """The sliding attention window a Qwen2 / Qwen3 / Mistral model applies, None where it applies none."""
    config = base.config
    if type(base).__name__ in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not getattr(base.model, "has_sliding_layers",
                                                                                       False):
        return None
    return getattr(config, "sliding_window", None)


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[batch, time, heads * head_dim] -> [batch, heads, time, head_dim]."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """LLaMA's rotary embedding x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1): with
    the minus moved onto sin's first half (``signed_sin``), the swap is one roll, and -x2 * s equals
    x2 * -s bit for bit. 8 us instead of 19 per call (4 rows x 4 heads, one token); cos and
    signed_sin [batch, 1, time, head_dim]."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class _Cache:
    """Keys and values for prompt + answer, allocated once: [batch, kv_heads, length, head_dim] per
    layer, in ``dtype`` (None: the model's), where the attention also runs; every position id of
    prompt + answer [batch, length], and the family forward's per-position tables computed from them
    once (rotations, position embeddings).

    ``start`` (where a forward's tokens go) is a Python int on the eager path and a one-element
    device tensor on the static one (``_StaticSteps``): there every shape is fixed and the position
    lives on the device, so the step records once as a CUDA graph and replays."""

    def __init__(self, positions: torch.Tensor, dtype: torch.dtype | None = None):
        self.positions, self.length, self.dtype = positions, positions.shape[1], dtype
        self.keys, self.values, self.tables = {}, {}, {}
        self.fp32 = {}  # a module, or a tuple of them, -> (weight, bias) in fp32, for ``linear(s)`` and ``run``
        self.half = None  # the model's half-precision dtype where ``stream`` made the residual stream fp32
        self.span = self.length  # the static path's attention reads cache positions [0, span) (``_StaticSteps``)

    def stream(self, h: torch.Tensor) -> torch.Tensor:
        """The embeddings ``h`` in the residual stream's dtype: fp32 for a half-precision model where
        the cache is fp32 (CPU), else unchanged. On CPU a small model's decode step is a few hundred
        small ops, and a stream in the weights' half precision pays a cast before and after every
        fp32 product (``linear``) and attention (``_cache_dtype``); in fp32 the stream needs one cast
        in (here) and one before the LM head's half-precision product. The weights stay as they are,
        only the sums round less (tests/test_decode.py: as close to fp32 as the model's own forward)."""
        if self.dtype == torch.float32 and h.dtype in (torch.bfloat16, torch.float16):
            self.half = h.dtype
            return h.float()
        return h

    def _fp32_weights(self, module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 copies of ``module``'s weight and bias, made once per decode (the weights change between rollouts)."""
        weights = self.fp32.get(module)
        if weights is None:
            weights = self.fp32[module] = (module.weight.float(), None if module.bias is None else module.bias.float())
        return weights

    def run(self, module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)`` for a norm or another module of the layer, in the stream's dtype. Over an fp32
        stream of a half-precision model: a LayerNorm with fp32 copies of its weights; LLaMA's family
        of RMSNorms as they are (they normalize in fp32 and return fp32 for an fp32 input); any other
        module in the model's dtype, its output back in fp32."""
        if self.half is None or x.dtype != torch.float32:
            return module(x)
        if type(module) is torch.nn.LayerNorm:
            return F.layer_norm(x, module.normalized_shape, *self._fp32_weights(module), module.eps)
        if type(module).__name__ in FP32_INPUT_NORMS:
            return module(x)
        return module(x.to(self.half)).float()

    def linear(self, module, x: torch.Tensor) -> torch.Tensor:
        """``module(x)``, in ``x``'s dtype; for a plain half-precision ``nn.Linear`` on CPU whose
        product is small (``SMALL_MATMUL``), the same product through an fp32 copy of its weights
        (rounded back where ``x`` is half precision); over an fp32 stream any other module runs in the
        model's dtype (the LM head, a large model's projections, a LoRA layer) and its output comes
        back in fp32."""
        if _fp32_is_faster(module, x):
            return _as(F.linear(_as(x, torch.float32), *self._fp32_weights(module)), x.dtype)
        if self.half is not None and x.dtype == torch.float32:
            return module(x.to(self.half)).float()
        return module(x)

    def linears(self, modules: tuple, x: torch.Tensor) -> list[torch.Tensor]:
        """``[m(x) for m in modules]`` (a layer's query, key and value projections); on CPU, where
        their products together are small (``SMALL_MATMUL``), as one product over their weights
        concatenated once per decode (fp32 copies for a half-precision model, as ``linear``): one
        call's fixed cost instead of three, every token and layer."""
        if x.device.type != "cpu":
            return [m(x) for m in modules]
        rows = x.numel() // x.shape[-1]
        if (any(type(m) is not torch.nn.Linear for m in modules) or len({m.bias is None for m in modules}) > 1
                or rows * sum(m.weight.numel() for m in modules) > SMALL_MATMUL):
            return [self.linear(m, x) for m in modules]
        weights = self.fp32.get(modules)
        if weights is None:
            bias = None if modules[0].bias is None else torch.cat([m.bias.float() for m in modules])
            weights = self.fp32[modules] = (torch.cat([m.weight.float() for m in modules]), bias)
        out = _as(F.linear(_as(x, torch.float32), *weights), x.dtype)
        # Sizes from the weights: a tensor-parallel slice (rlhf.generation.shards) keeps the module's out_features.
        return list(out.split([m.weight.shape[0] for m in modules], dim=-1))

    @staticmethod
    def window(table: torch.Tensor, dim: int, start, n: int) -> torch.Tensor:
        """``n`` entries of ``table`` along ``dim`` from ``start`` (the static path's n is 1)."""
        return table.narrow(dim, start, n) if isinstance(start, int) else table.index_select(dim, start)

    def attend(self, layer: int, q, k, v, start, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Store this chunk's keys/values at ``start`` and attend over the cache up to its end under
        ``mask`` [batch, 1, time, end] (static path: over the cache's first ``span`` positions, ``mask``
        as long); the output as [batch, time, heads * head_dim]."""
        if layer not in self.keys:
            shape = (k.shape[0], k.shape[1], self.length, k.shape[3])
            dtype = self.dtype or k.dtype
            # Zeros, not empty: the static path attends over positions not written yet (masked out),
            # and a NaN of uninitialized memory would survive the mask (NaN * 0 weight is NaN).
            self.keys[layer], self.values[layer] = k.new_zeros(shape, dtype=dtype), v.new_zeros(shape, dtype=dtype)
        keys, values = self.keys[layer], self.values[layer]
        if isinstance(start, int):
            end = start + k.shape[2]
            keys[:, :, start:end], values[:, :, start:end] = k, v
            keys, values = keys[:, :, :end], values[:, :, :end]
        else:
            keys.index_copy_(2, start, k.to(keys.dtype))
            values.index_copy_(2, start, v.to(values.dtype))
            keys, values = keys[:, :, :self.span], values[:, :, :self.span]
        batch, heads, time, width = q.shape
        groups = heads // keys.shape[1]
        if groups > 1 and time == 1:
            # Grouped-query attention, one new token: the query heads that share a key/value head become
            # that head's query rows (the mask is the same for each), so the kernel reads each cached key
            # once. enable_gqa under a mask has no fused kernel on a GPU: the fallback copies the keys
            # and values once per group, every layer and token.
            out = F.scaled_dot_product_attention(_as(q, keys.dtype).reshape(batch, -1, groups, width), keys, values,
                                                 attn_mask=mask, scale=scale).reshape(batch, heads, 1, width)
        else:
            out = F.scaled_dot_product_attention(_as(q, keys.dtype), keys, values, attn_mask=mask, scale=scale,
                                                 enable_gqa=groups > 1)
        return _as(out, q.dtype).transpose(1, 2).reshape(batch, time, -1)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` without the call where it is one already: a decode step makes dozens of such
    casts per token, and even a no-op ``to`` is a dispatch."""
    return x if x.dtype == dtype else x.to(dtype)


# On CPU a half-precision matrix product pays a fixed cost per call before any arithmetic (the
# oneDNN bf16 path); fp32 has no such floor but a lower peak. Below this many multiply-adds
# (rows x in x out) the fp32 product of the same bf16 weights is faster: every decode token's
# projections of a small model (one row per sequence), never a prompt's forward or a large model's
# matrices, which stay in half precision. For a half-precision input the products are exact in fp32
# (bf16 x bf16 fits) and the sums are fp32 in both paths, so the result rounded back differs from the
# half-precision one only in summation order; over the fp32 residual stream (``_Cache.stream``) the
# input keeps its fp32 bits, and the result is nearer the fp32 model's (tests/test_decode.py).
# Measured crossover: docs/design-notes.md.
SMALL_MATMUL = 1 << 20


def _fp32_is_faster(module, x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and type(module) is torch.nn.Linear  # a LoRA or quantized layer runs its own forward
            and module.weight.dtype in (torch.bfloat16, torch.float16)
            and x.numel() // x.shape[-1] * module.weight.numel() <= SMALL_MATMUL)


# Norms whose forward normalizes in fp32 and multiplies by its weight in the input's dtype: given an
# fp32 input they return fp32 with no cast (transformers' LlamaRMSNorm and its copies).
FP32_INPUT_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def _own_forward(model, length: int = 0):
    """The family forward for ``model`` when every weight of it is present (and, for a family with a
    sliding window, when ``length`` tokens fit in it), else None."""
    base = _base(model)
    forward = FORWARDS.get(type(base).__name__)
    window = _window(base) if forward is _llama_forward else None
    if forward is None or (window is not None and length > window):
        return None
    # ZeRO-3 partitions (ds_status NOT_AVAILABLE) are gathered by hooks on the model's own forward only.
    if any(getattr(p, "ds_status", None) is not None and p.ds_status.name != "AVAILABLE" for p in base.parameters()):
        return None
    return lambda *args: forward(base, *args)


# The static path looks at "has every row ended?" once per this many tokens: each look waits for the
# device (a host synchronization), which a replayed CUDA graph otherwise never does. Tokens decoded
# past the end are padding and are trimmed, so the output is the same as looking every token.
STATIC_CHECK_EVERY = 16


@torch.no_grad()
def decode(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: Sampling | int, eos_id: int,
           pad_id: int, *, synced: bool = False, with_logprobs: bool = False, static: bool = False, tp_group=None,
           **settings):
    """New tokens [batch, <= max_new_tokens] for left-padded prompts; after a row's eos, pad.

    ``sampling``: how tokens are drawn (rlhf.generation.sampling.Sampling), or its short form, max_new_tokens
    with the other settings as keywords (``decode(model, ids, mask, 8, eos, pad, do_sample=True)``).

    ``with_logprobs``: (tokens, logprobs), each new token's log-probability under the softmax of
    the logits / temperature over the whole vocabulary, eos left out before ``min_new_tokens``
    (0 after eos) -- what PPO's ratio divides by, taken from the logits that sampled instead of a
    second forward over the finished sequences. Top-k / top-p are not in these log-probs: PPO
    refuses them (rlhf.config.PPOStepConfig).

    ``static``: the one-token step with every shape fixed (``_StaticSteps``), recorded once as a
    CUDA graph and replayed per token on a GPU, and the all-rows-ended check every
    ``STATIC_CHECK_EVERY`` tokens; the default loop's tokens and log-probs in exact arithmetic (in
    fp32 the same tokens; in bf16 both loops round differently, and their log-probs match one forward
    over their own tokens equally closely: bench/gpu.sh's decode phase). Families
    without a forward of ours decode the default way (a one-line notice says so).

    ``tp_group``: ``model`` is this rank's tensor-parallel slice (rlhf.generation.shards) and the group decodes
    the same rows; every token is the group's first rank's draw, so the group never parts.
    """
    sampling = Sampling.coerce(sampling, settings)
    max_new_tokens = sampling.max_new_tokens
    own = _own_forward(model, input_ids.shape[1] + max_new_tokens)
    if static and own is None:
        _notice(f"[decode] {type(_base(model)).__name__}: no static decode step for this family (rlhf.generation.decode.FORWARDS)"
                " or its weights are partitioned (ZeRO-3 without gathering whole); decoding through its own forward")
        static = False
    if static:
        step = _StaticSteps(own, input_ids, attention_mask, max_new_tokens)
    elif own:
        step = _own_steps(own, input_ids, attention_mask, max_new_tokens)
    else:
        step = _model_steps(model, input_ids, attention_mask)
    check_every = STATIC_CHECK_EVERY if static else 1
    batch = input_ids.shape[0]
    done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    pad = torch.full_like(done, pad_id, dtype=input_ids.dtype)
    tokens, logprobs, ended = [], [], []
    eos = torch.tensor([eos_id], device=input_ids.device)
    logits = step(None)
    for t in range(max_new_tokens):
        tok, scaled = sample_token(logits, t, sampling, eos, with_logprobs)
        if tp_group is not None:  # each rank's RNG differs; a rank that parted would hang the group
            dist.broadcast(tok, src=dist.get_global_rank(tp_group, 0), group=tp_group)
        tok = torch.where(done, pad, tok)
        tokens.append(tok)
        if with_logprobs:  # of the distribution that drew (eos excluded before min_new_tokens)
            logprobs.append(token_logprobs(scaled, tok).masked_fill(done, 0.0))
        done = done | (tok == eos_id)
        ended.append(done)
        if t == max_new_tokens - 1:
            break
        if (t + 1) % check_every == 0:
            finished = done.all()
            # Every rank runs as many forwards as the slowest where the model's forward gathers ZeRO-3
            # weights (collectives); our own forward runs none.
            if synced and own is None:
                flag = (~finished).float().reshape(1)
                dist.all_reduce(flag)
                finished = flag.item() == 0
            if finished:
                break
        logits = step(tok)
    # Cut what was decoded after every row had ended (the static path looks only every few tokens):
    # the length the every-token check stops at, so both paths return the same tensor.
    length = min(int((~torch.stack(ended, dim=1)).sum(1).max()) + 1, len(tokens)) if check_every > 1 else len(tokens)
    out = torch.stack(tokens[:length], dim=1)
    return (out, torch.stack(logprobs[:length], dim=1)) if with_logprobs else out


def sample_token(logits: torch.Tensor, t: int, sampling: Sampling, eos: torch.Tensor,
                 with_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The token [batch] drawn from one decoding step's ``logits`` [batch, vocab] for answer position
    ``t``, and the logits the sampler scaled (by the temperature, eos forbidden before
    min_new_tokens), which the token's log-prob is read from."""
    if t < sampling.min_new_tokens:  # the answer may not end yet: eos is out of the distribution here
        logits = logits.index_fill(-1, eos, float("-inf"))
    do_sample, temperature = sampling.do_sample, sampling.temperature
    # Scaled once for the sampler and the log-probs (greedy picks on the raw logits, as generate).
    scaled = logits.float() / temperature if temperature != 1.0 and (do_sample or with_logprobs) else logits
    return next_tokens(scaled if do_sample else logits, do_sample, 1.0, sampling.top_k, sampling.top_p), scaled


_told: set[str] = set()


def _notice(line: str) -> None:
    """Say ``line`` once per process (decode runs per rollout batch)."""
    if line not in _told:
        _told.add(line)
        print(line, flush=True)


def _positions(attention_mask: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Position ids of prompt + answer [batch, prompt + max_new_tokens], counted over valid tokens."""
    pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return torch.cat([pos, pos[:, -1:] + torch.arange(1, max_new_tokens + 1, device=pos.device)], dim=1)


def _cache_dtype(device: torch.device) -> torch.dtype | None:
    # On CPU a half-precision model's one-query attention is slower than the same attention in fp32
    # (docs/design-notes.md, "Half precision on CPU"): there the cache and the attention stay fp32 (the
    # projections follow ``_Cache.linear``). GPUs have fast half-precision attention and keep the model's dtype.
    return torch.float32 if device.type == "cpu" else None


def _prompt_mask(valid: torch.Tensor, prompt: int) -> torch.Tensor:
    """The prompt attends causally over its own valid tokens; a padding position attends to itself
    too, so that no row of the softmax is empty (its output is never read)."""
    at = torch.arange(prompt, device=valid.device)
    return (valid[..., :prompt] & (at[None, :] <= at[:, None])) | torch.eye(prompt, dtype=torch.bool,
                                                                               device=valid.device)


def _own_steps(own, input_ids, attention_mask, max_new_tokens):
    """step(None) runs the prompt, step(tok) one new token; each returns the last position's logits."""
    batch, prompt = input_ids.shape
    device = input_ids.device
    valid = torch.ones(batch, 1, 1, prompt + max_new_tokens, dtype=torch.bool, device=device)
    valid[..., :prompt] = attention_mask.bool()[:, None, None]
    cache = _Cache(_positions(attention_mask, max_new_tokens), _cache_dtype(device))
    state = {"at": prompt}
    # Where the attention's dtype is known (the fp32 cache on CPU), the tokens' mask is additive
    # (0 / -inf) in that dtype, made once: attention converts a boolean mask to that form in every
    # layer, every token.
    tokens_mask = valid if cache.dtype is None else torch.zeros(valid.shape, dtype=cache.dtype, device=device).masked_fill(
        ~valid, float("-inf"))

    def step(tok):
        if tok is None:
            return own(input_ids, cache, 0, _prompt_mask(valid, prompt))
        # Sliced once per token, contiguous: attention over a strided mask costs twice as much, per layer.
        mask = tokens_mask[..., :state["at"] + 1].contiguous()
        logits = own(tok.unsqueeze(1), cache, state["at"], mask)
        state["at"] += 1
        return logits
    return step


# The static path's attention reads the cache up to the next multiple of this many positions past
# the token's own (not the whole prompt + max_new_tokens), one CUDA graph per such span: the KV
# cache is most of what a decoding step reads at rollout batch sizes, and attending over the whole
# cache from the first answer token reads on average max_new_tokens / 2 positions more per row than
# the tokens need. A span's graph is recorded when the first token reaches it (a capture only; the
# warm-up runs before the first). 0: every token attends over the whole cache, one graph.
STATIC_SPAN = 64


def static_span(needed: int, length: int) -> int:
    """The cache positions a static step attends over when its token needs the first ``needed``: that
    many rounded up to a multiple of ``STATIC_SPAN``, at most the whole cache of ``length``."""
    return min(length, -(-needed // STATIC_SPAN) * STATIC_SPAN) if STATIC_SPAN else length


class _StaticSteps:
    """The steps of ``_own_steps`` with every per-token shape fixed: each token's forward attends over
    the cache up to the end of its span (``STATIC_SPAN``) under a mask that opens one position per
    token in place, and the position is a device tensor advanced in place. Nothing in a token's step
    (``token``) reads a value back to the host or changes shape within a span, so on a GPU each
    span's step is recorded once as a CUDA graph (the first after the prompt's forward has built the
    cache and its tables) and replayed for every token in it: one launch instead of a few hundred
    kernel launches from Python. The host knows which span a token is in from the count of tokens
    fed, never from the device. On CPU the same step runs eagerly (bench/decode.py's
    ``static_over_default``: its price there)."""

    def __init__(self, own, input_ids, attention_mask, max_new_tokens):
        batch, self.prompt = input_ids.shape
        device = input_ids.device
        self.own, self.input_ids, self.max_new_tokens = own, input_ids, max_new_tokens
        self.valid = torch.zeros(batch, 1, 1, self.prompt + max_new_tokens, dtype=torch.bool, device=device)
        self.valid[..., :self.prompt] = attention_mask.bool()[:, None, None]
        self.cache = _Cache(_positions(attention_mask, max_new_tokens), _cache_dtype(device))
        self.at = torch.full((1,), self.prompt, dtype=torch.long, device=device)
        self.tok = torch.zeros(batch, 1, dtype=input_ids.dtype, device=device)
        self.fed = 0  # tokens fed so far: the next one's key goes to position prompt + fed
        self.graphs = {}  # span -> (graph, its output buffer, rewritten by every replay)

    def feed(self, tok: torch.Tensor) -> int:
        """Take ``tok`` as the next token to run and set its span (the positions up to its own,
        ``static_span``); returns the span."""
        self.tok.copy_(tok.unsqueeze(1))
        self.cache.span = static_span(self.prompt + self.fed + 1, self.cache.length)
        self.fed += 1
        return self.cache.span

    def token(self) -> torch.Tensor:
        """One token's forward from ``self.tok`` at ``self.at`` over ``self.cache.span`` positions; the
        logits [batch, vocab]."""
        self.valid.index_fill_(-1, self.at, True)
        logits = self.own(self.tok, self.cache, self.at, self.valid[..., :self.cache.span])
        self.at.add_(1)
        return logits

    def __call__(self, tok):
        if tok is None:
            return self.own(self.input_ids, self.cache, 0, _prompt_mask(self.valid, self.prompt))
        span = self.feed(tok)
        if self.input_ids.device.type != "cuda":
            return self.token()
        if span not in self.graphs:
            self.graphs[span] = self._record(warm_up=not self.graphs)
        graph, out = self.graphs[span]
        graph.replay()
        return out

    def _record(self, warm_up: bool):
        """Record ``token`` as a CUDA graph at the span set in ``self.cache``. Before the first capture
        of a decode, a few warm-up runs on a side stream (as capture requires), then the position and
        mask put back (the warm-up's cache writes sit at positions the real steps overwrite before
        they read them); a capture itself launches nothing. Returns the graph and its output buffer."""
        if warm_up:
            at = self.prompt + self.fed - 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(min(2, self.max_new_tokens)):
                    self.token()
            torch.cuda.current_stream().wait_stream(side)
            self.at.fill_(at)
            self.valid[..., at:] = False
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.token()
        return graph, out


def _model_steps(model, input_ids, attention_mask):
    """The same steps through the model's own forward and a transformers cache."""
    from transformers import DynamicCache

    attn = attention_mask.long()
    kwargs = {}
    # The prompt's forward needs the lm head at its last position only, where the model allows it.
    first = {"logits_to_keep": 1} if accepts(model, "logits_to_keep") else {}
    positions = accepts(model, "position_ids")
    state = {}
    if positions:
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        kwargs["position_ids"] = pos
        state["pos"] = pos[:, -1:]
    # Transformers 5 names the cache argument `cache`; earlier versions and some families `past_key_values`.
    cache_arg = "cache" if accepts(model, "cache") else "past_key_values"
    kwargs[cache_arg] = DynamicCache()  # filled in place by every forward
    ones = torch.ones(attn.shape[0], 1, dtype=attn.dtype, device=attn.device)
    state["attn"] = attn

    def step(tok):
        if tok is None:
            return model(input_ids=input_ids, attention_mask=attn, use_cache=True, **kwargs, **first).logits[:, -1]
        state["attn"] = torch.cat([state["attn"], ones], dim=1)
        if positions:
            state["pos"] = state["pos"] + 1
            kwargs["position_ids"] = state["pos"]
        return model(input_ids=tok.unsqueeze(1), attention_mask=state["attn"], use_cache=True, **kwargs).logits[:, -1]
    return step
