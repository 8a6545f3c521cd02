"""Tensor-parallel shards of a ZeRO-3 actor for generation (``step.zero3_generation=tp``): what
DeepSpeed-Chat's hybrid engine does with ``--inference_tp_size``.

Under ZeRO-3 every rank holds 1/world of each weight. Gathering the whole actor on every rank for a
generate call needs its full 16-bit weights on one device (134 GB for OPT-66B), and ZeRO-3's own
layer-by-layer gathers move the whole model over the network again for every token. Here each rank
of a group of ``t`` (consecutive ranks: one node's devices) gathers one module at a time, keeps its
1/t slice of every attention and MLP projection, and the group decodes its ranks' prompts together:
each rank computes its own heads and MLP neurons, and one all-reduce per row-split projection (two
per layer) adds the partial sums. A decoding step then reads 1/t of the weights per device.

The copy is an ordinary transformers model of the same class with sliced tensors, run by our family
forward (rlhf.generation.forwards.FORWARDS): it reshapes projections into heads by head size, so each rank's
slice is simply fewer heads. LoRA adapters (PEFT) are merged into the copy's weights.

    .venv/bin/python -m pytest -q tests/test_zero3_generate.py   # 2 CPU ranks: the whole model's tokens
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# Per family (transformers class): the projections split by output features (each rank computes its
# own heads or MLP neurons, no communication) and those split by input features (each rank's product
# is a partial sum, added up by one all-reduce). Every other weight (embeddings, norms, the head) is
# copied whole to each rank of the group.
PLANS = {
    "OPTForCausalLM": (("q_proj", "k_proj", "v_proj", "fc1"), ("out_proj", "fc2")),
    "LlamaForCausalLM": (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")),
    "Qwen2ForCausalLM": (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")),
    "MistralForCausalLM": (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")),
    # Qwen3's per-head query/key norms act within a head: each rank's slice of heads keeps them whole.
    "Qwen3ForCausalLM": (("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("o_proj", "down_proj")),
}
# model.family (conf/model) -> the class its checkpoints load as, for deciding before anything loads.
FAMILY_CLASSES = {"opt": "OPTForCausalLM", "llama": "LlamaForCausalLM"}


def unsupported(family: str, heads: int, ffn: int, t: int, kv_heads: int | None = None) -> str | None:
    """Why a model cannot be split over ``t`` ranks for generation; None if it can."""
    if FAMILY_CLASSES.get(family, family) not in PLANS:
        return (f"model.family={family!r} has no tensor-parallel plan (rlhf.generation.shards.PLANS has "
                f"{', '.join(PLANS)}): use step.zero3_generation=gather or layerwise")
    for what, n in (("attention heads", heads), ("key/value heads", kv_heads or heads), ("MLP width", ffn)):
        if n % t:
            return f"its {n} {what} do not split over {t} ranks"
    return None


_GROUPS: dict[int, object] = {}


def tp_group(t: int):
    """This rank's group of ``t`` consecutive ranks. Every rank creates every group (torch requires
    each new_group on all ranks, in the same order), once per process."""
    if t not in _GROUPS:
        world = dist.get_world_size()
        if world % t:
            raise ValueError(f"{t} generation ranks per group do not divide the world of {world}")
        groups = [dist.new_group(list(range(first, first + t))) for first in range(0, world, t)]
        _GROUPS[t] = groups[dist.get_rank() // t]
    return _GROUPS[t]


class RowParallelLinear(nn.Module):
    """A linear layer holding the columns of its weight for this rank's slice of the input features:
    its product is a partial sum, added up over the group by one all-reduce; the bias once, after."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


def _merged(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias of a gathered linear module, a PEFT LoRA layer's adapters merged in."""
    if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
        weight = module.base_layer.weight
        for adapter in module.active_adapters:
            if adapter in module.lora_A:
                weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
        return weight, module.base_layer.bias
    return module.weight, getattr(module, "bias", None)


@contextlib.contextmanager
def tensor_parallel_copy(model: nn.Module, t: int):
    """This rank's slice of ``model`` (a ZeRO-3 engine's module, PEFT-wrapped or not) for generation
    in its group of ``t`` ranks, with the group: an unpartitioned model of the same class, freed on
    exit. Every rank of the world enters together (the gathers are collectives over all of them)."""
    copy, group = _build(model, t)
    try:
        yield copy, group
    finally:
        del copy


@torch.no_grad()
def _build(model: nn.Module, t: int):
    import deepspeed  # here, not at the top: the pre-flight reads unsupported() without loading DeepSpeed

    base = model.module if hasattr(model, "module") else model
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    name = type(base).__name__
    if name not in PLANS:
        raise ValueError(f"{name} has no tensor-parallel plan (rlhf.generation.shards.PLANS): use "
                         "step.zero3_generation=gather or layerwise")
    config = base.config
    kv = getattr(config, "num_key_value_heads", None)
    ffn = getattr(config, "ffn_dim", None) or config.intermediate_size
    if why := unsupported(name, config.num_attention_heads, ffn, t, kv):
        raise ValueError(f"{name}: {why}: set step.generation_tp_size to a divisor")
    columns, rows = PLANS[name]
    group = tp_group(t)
    part = dist.get_rank(group)
    with torch.device("meta"):
        copy = type(base)(config)
    copy.eval()
    made: dict[int, nn.Parameter] = {}  # tied weights (the head and the embedding) stay one tensor
    for path, module in list(copy.named_modules()):
        own = dict(module.named_parameters(recurse=False))
        if not own:
            continue
        source = base.get_submodule(path)
        leaf = path.rsplit(".", 1)[-1]
        with deepspeed.zero.GatheredParameters(list(source.parameters())):
            if leaf in rows:
                weight, bias = _merged(source)
                parent, child = path.rsplit(".", 1)
                copy.get_submodule(parent).register_module(child, RowParallelLinear(
                    weight.chunk(t, dim=1)[part].clone(), None if bias is None else bias.clone(), group))
                continue
            if leaf in columns:
                weight, bias = _merged(source)
                tensors = {"weight": weight.chunk(t, dim=0)[part], "bias": None if bias is None else bias.chunk(t)[part]}
            elif hasattr(source, "base_layer"):  # an adapted layer the plan copies whole
                tensors = dict(zip(("weight", "bias"), _merged(source), strict=True))
            else:
                tensors = dict(source.named_parameters(recurse=False))
            for key, param in own.items():
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(tensors[key].detach().clone(), requires_grad=False)
                setattr(module, key, made[id(param)])
    # Buffers (LLaMA's rotary frequencies) are never partitioned: copied as they are.
    for path, _ in list(copy.named_buffers()):
        owner, _, key = path.rpartition(".")
        copy.get_submodule(owner).register_buffer(key, base.get_buffer(path).clone(), persistent=False)
    return copy, group
