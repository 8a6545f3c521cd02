"""The family forwards of the decode loop (rlhf.generation.decode): for LLaMA-like and OPT models
whose every weight is present, a short forward over the model's own submodules (so LoRA layers and
any bias still apply) that writes keys and values into a cache preallocated for prompt + answer and
attends with one ``scaled_dot_product_attention``, leaving out what transformers does per token for
generality. A family without one here decodes through the model's own forward.

    python bench/decode.py --families   # each family's tokens/s, and which path it took
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F


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
