"""Ulysses sequence parallelism (``parallel.sequence=N``): each rank of a group of N runs 1/N of every
sequence's tokens through the model, so activations, logits and the loss's per-token tensors shrink
N-fold; around each attention DeepSpeed's ``UlyssesSPAttentionHF`` trades the sequence slices for
head slices (an all-to-all), attends over the whole sequence with 1/N of the heads, and trades back.

    python launch.py hardware=cpu-2rank step=sft parallel.sequence=2 zero=2

What crosses the slices is per-token and small: a forward through ``per_token`` returns one value per
token (a log-prob, a loss, a reward model's score), gathered over the group to the whole sequence, so
the steps' pooling (answer sums, the last token's score, token means) runs unchanged on every rank.

Why the gradients are exact, and at every ZeRO stage: every rank of a group computes the group's
loss from the gathered values; the gather's backward sums the group's upstream gradients (an
all-reduce), so each rank's parameter gradients are its slice's part of the sum of the N ranks'
losses; DeepSpeed, which is not told about the groups, averages the ranks' gradients over the whole
world (N x the data-parallel ranks) as it does for plain data parallelism at every stage, which
leaves the mean over data-parallel groups of each group's gradient: the unsliced run's. Registering
the groups with DeepSpeed (its ``mpu``) instead makes stages 0-2 divide by the data-parallel ranks
alone, since there each rank's loss is assumed to be its own slice's share, and with a loss every
rank holds whole the gradients come out N times too large.

A forward is sliced only when its ``position_ids`` came from ``per_token`` (they carry a mark, and
the same tensor reaches every layer, also when gradient checkpointing recomputes one in the
backward): generation and any other whole-sequence forward attend as they would without this.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf.errors import ConfigError

# Model types whose attention receives the positions the model was given (the mark that slices a
# forward travels with them) and whose loss and gradients tests/test_sequence.py checks against the
# unsliced run. Not OPT: its attention never sees position_ids, so its slices would attend alone.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The attention implementations Ulysses can wrap: they take no 4D mask (causal order from the
# positions, padding on the right only), unlike "eager", which needs one.
WRAPPED = ("sdpa", "rlhf_sdpa_fp32_on_cpu", "flash_attention_2", "flash_attention_3")

_size = 1
_group = None
_groups: dict[int, object] = {}
_wrapped = False
_ulysses: dict[tuple, object] = {}


def size() -> int:
    """Ranks per sequence (1: no sequence parallelism)."""
    return _size


def data_rank(rank: int) -> int:
    """The data-parallel rank of global ``rank``: the ranks of one group read the same rows."""
    return rank // _size


def data_world(world: int) -> int:
    return world // _size


def setup(n: int) -> None:
    """Split the world into groups of ``n`` consecutive ranks and wrap the attention functions (once).
    Every rank calls this after the process group is up, at the start of each step: a chain's steps
    may share sequences over different numbers of ranks."""
    global _size, _group, _wrapped
    if n > 1 and n not in _groups:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        world, rank = dist.get_world_size(), dist.get_rank()
        for start in range(0, world, n):
            group = dist.new_group(list(range(start, start + n)))  # every rank creates every group
            if start <= rank < start + n:
                _groups[n] = group
        if not _wrapped:
            for name in WRAPPED:
                if name in ALL_ATTENTION_FUNCTIONS:
                    ALL_ATTENTION_FUNCTIONS[name] = _wrap(ALL_ATTENTION_FUNCTIONS[name])
            _wrapped = True
    _size, _group = n, _groups.get(n)


def _wrap(attention):
    def attend(module, query, key, value, attention_mask, *args, **kwargs):
        if not getattr(kwargs.get("position_ids"), "sliced", False):
            return attention(module, query, key, value, attention_mask, *args, **kwargs)
        # Causal order comes from the positions after the exchange; the model's mask was built for
        # the slice's length and means nothing over the whole sequence (and the rows are right-padded).
        return _layer(attention, module, query.shape[0])(module, query, key, value, None, *args, **kwargs)
    return attend


def _layer(attention, module, batch: int):
    """DeepSpeed's Ulysses attention for this batch size (it checks shapes against the one it was built for)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    config = module.config.get_text_config() if hasattr(module.config, "get_text_config") else module.config
    heads = config.num_attention_heads
    shape = (heads, getattr(config, "num_key_value_heads", None) or heads,
             getattr(config, "head_dim", None) or config.hidden_size // heads, config.num_hidden_layers)
    key = (attention, batch, shape, _size)  # a run's models may differ (a policy and a reward model of two families)
    if key not in _ulysses:
        _ulysses[key] = UlyssesSPAttentionHF(
            attn=attention, batch_size=batch, attn_head_count=shape[0], kv_head_count=shape[1],
            attn_head_size=shape[2], num_hidden_layers=shape[3], process_group=_group, seq_length_is_variable=True)
    return _ulysses[key]


def problems(model_type: str, name: str, heads: int, kv_heads: int, n: int) -> str | None:
    """Why parallel.sequence=n cannot run a model of these sizes (None when it can): its family must
    be one whose slices attend as one sequence, and every rank must hold whole heads. The pre-flight
    asks this from the model's config.json before anything loads, the run again of the loaded model."""
    if n == 1:
        return None
    if model_type not in MODEL_TYPES:
        return (f"parallel.sequence={n} is not supported for {name} (model type {model_type!r}): supported model "
                f"types: {', '.join(MODEL_TYPES)}; set parallel.sequence=1")
    if heads % n:
        return (f"parallel.sequence={n} does not divide {name}'s {heads} attention heads (each rank attends with "
                f"whole heads); choose a divisor of {heads}")
    if kv_heads % n and n % kv_heads:
        return (f"parallel.sequence={n} and {name}'s {kv_heads} key/value heads: one must divide the other (each rank "
                f"holds whole key/value heads, or copies of one)")
    return None


def model_problems(model) -> str | None:
    """``problems`` of a loaded model (an engine's module, a PEFT model, a reward model), and its attention."""
    config = getattr(model, "module", model).config
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    name = (config.architectures or [config.model_type])[0]
    if why := problems(config.model_type, name, heads, getattr(config, "num_key_value_heads", None) or heads, _size):
        return why
    if _size > 1 and config._attn_implementation not in WRAPPED:
        return (f"{name} attends through {config._attn_implementation!r}, which needs a mask over the whole sequence; "
                f"parallel.sequence needs one of {', '.join(WRAPPED)}")
    return None


class _Gather(torch.autograd.Function):
    """The group's slices side by side along dim 1; the backward hands each rank its slice of the
    upstream gradients summed over the group (the gradient of the sum of the group's losses)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(_size)]
        dist.all_gather(parts, local.contiguous(), group=_group)
        ctx.width = local.shape[1]
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=_group)
        start = dist.get_rank(_group) * ctx.width
        return grad[:, start:start + ctx.width]


def per_token(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, targets: torch.Tensor | None, fn,
              **model_kwargs) -> torch.Tensor:
    """``fn(output, targets)``, one value per token ([rows, width]), of ``model`` over right-padded rows.

    One rank per sequence: the model runs on the rows as they are. With N: this rank runs its slice
    (the width padded to a multiple of N, positions counted over the whole row) and the values of the
    group's slices are gathered. ``targets`` ([rows, width], aligned with the positions: the next
    token's id or label) is sliced alike."""
    if _size == 1:
        return fn(model(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs), targets)
    if why := model_problems(model):
        raise ConfigError(why)
    if (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
        # The attention drops the mask: a pad before a real token would be attended to.
        raise ValueError("sequence parallelism needs right-padded rows; these have padding before real tokens")
    rows, width = input_ids.shape
    part = -(-width // _size)
    pad = part * _size - width
    me = dist.get_rank(_group)
    cut = slice(me * part, (me + 1) * part)
    ids = torch.nn.functional.pad(input_ids, (0, pad))[:, cut]
    positions = torch.arange(part * _size, device=input_ids.device).expand(rows, -1)[:, cut]
    # The mark per_token's attention wrapper reads (a plain attribute: models pass this very tensor on).
    positions.sliced = True
    if targets is not None:
        # Any valid id or label: the padded positions are cut off after the gather.
        targets = torch.nn.functional.pad(targets, (0, pad))[:, cut]
    local = fn(model(input_ids=ids, position_ids=positions, **model_kwargs), targets)
    return _Gather.apply(local)[:, :width]


def next_tokens(input_ids: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """The token after each position (``fill`` after the last): the target a position's logits predict."""
    return torch.nn.functional.pad(input_ids[:, 1:], (0, 1), value=fill)

