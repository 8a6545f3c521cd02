"""Saving models in Hugging Face format from any ZeRO stage, with LoRA merged by default.

    python -c "from rlhf.checkpoint import save_hf_model; ..."   # used by the runners
"""

from __future__ import annotations

from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist


def gather_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Full CPU state dict on rank 0 (None elsewhere).

    Under ZeRO-3 each parameter is gathered on its own, so peak device memory stays one parameter
    above the shard, not a whole model.
    """
    module = engine.module
    rank = dist.get_rank() if dist.is_initialized() else 0
    if engine.zero_optimization_stage() != 3:
        if rank != 0:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if rank == 0:
                out[name] = param.detach().to("cpu", copy=True)
    if rank == 0:
        for name, buf in module.named_buffers():
            out.setdefault(name, buf.detach().to("cpu", copy=True))
    return out if rank == 0 else None


def param_fingerprint(engine) -> tuple[float, float]:
    """(sum, sum of squares) of every parameter, summed over ranks: a cheap check that a model that
    must not train (PPO's reference) did not, and that one that must (the actor) did."""
    totals = torch.zeros(2, dtype=torch.float64)
    for p in engine.module.parameters():
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p.data  # a ZeRO-3 rank holds a shard
        local = local.detach().double().cpu()
        totals += torch.stack([local.sum(), local.pow(2).sum()])
    if dist.is_initialized() and engine.zero_optimization_stage() == 3:
        dist.all_reduce(totals)
    return totals[0].item(), totals[1].item()


def _fresh_like(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """An untrained CPU twin of ``module`` (causal LM or reward model), built from its config."""
    from transformers import AutoModelForCausalLM

    from rlhf.models import RewardModel

    if isinstance(module, RewardModel):
        return RewardModel.from_config(module.config, dtype=dtype)
    return AutoModelForCausalLM.from_config(module.config, dtype=dtype)


def save_hf_model(engine, tokenizer, out: Path, merge_lora: bool = True) -> Path | None:
    """Write config, safetensors weights and tokenizer that from_pretrained loads (rank 0 writes).

    Causal LMs load with AutoModelForCausalLM, reward models with
    AutoModelForSequenceClassification. LoRA adapters are merged into the base weights unless
    ``merge_lora`` is false (then only the adapter is written, PEFT's format).
    """
    state = gather_state_dict(engine)
    if state is None:
        if dist.is_initialized():
            dist.barrier()
        return None
    module = engine.module
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(module, "peft_config") and merge_lora:
        from peft import get_peft_model

        # Rebuild the wrapped model on CPU, load the trained state, merge the adapters: the output
        # is a plain model that needs no PEFT to use.
        base = module.get_base_model()
        fresh = get_peft_model(_fresh_like(base, next(iter(state.values())).dtype), module.peft_config["default"])
        fresh.load_state_dict(state, strict=True)
        merged = fresh.merge_and_unload()
        if hasattr(base, "generation_config"):
            merged.generation_config = base.generation_config
        merged.save_pretrained(out, state_dict=merged.state_dict())
    else:
        module.save_pretrained(out, state_dict=state)
    tokenizer.save_pretrained(out)
    if dist.is_initialized():
        dist.barrier()
    return out
