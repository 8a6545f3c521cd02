"""Reductions over the data-parallel ranks, for what a rank must not decide from its own share:
whitening and reward moments, the KL controller, logged statistics, and stop decisions.

Each is a no-op with one rank. Tensors travel through the accelerator under NCCL (which cannot
reduce host tensors) and stay on the host under gloo, and come back where they were.

    python -c "from rlhf.distributed import sum_over_ranks"   # used by the runners
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank_share(items: list, rank: int, world: int) -> list:
    """This rank's equal share of ``items``, the last ranks' filled up from the start (wrapping round):
    every rank runs as many forwards as the others, which ZeRO-3's parameter gathers need."""
    per_rank = -(-len(items) // world)
    return [items[i % len(items)] for i in range(rank * per_rank, (rank + 1) * per_rank)]


def first_copies(n_items: int, rank: int, world: int) -> int:
    """How many of ``rank_share``'s entries on ``rank`` are the items' first copies: a share is a
    contiguous run of indices and the wrapped-round copies are its tail, so its first entries count
    and the rest must not be counted again (each item once in a figure over all ranks)."""
    per_rank = -(-n_items // world)
    return max(0, min(per_rank, n_items - rank * per_rank))


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over ranks (a new tensor)."""
    if world_size() == 1:
        return t
    out = t.detach().to(_comm_device(), copy=True)
    dist.all_reduce(out)
    return out.to(t.device)


def min_over_ranks(n: float) -> float:
    """The least of every rank's ``n`` (for a decision every rank must take alike)."""
    if world_size() == 1:
        return n
    out = torch.tensor([float(n)], device=_comm_device())
    dist.all_reduce(out, op=dist.ReduceOp.MIN)
    return out.item()


def cat_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on each rank) concatenated along dim 0, in rank order."""
    if world_size() == 1:
        return t
    local = t.detach().to(_comm_device()).contiguous()
    parts = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(t.device)


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Average logged statistics over ranks, so rank 0's line describes the global batch."""
    if world_size() == 1:
        return values
    t = sum_over_ranks(torch.tensor(list(values.values()), dtype=torch.float64))
    return dict(zip(values, (t / world_size()).tolist(), strict=True))


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (for collective stop decisions)."""
    if world_size() == 1:
        return flag
    return bool(sum_over_ranks(torch.tensor([1.0 if flag else 0.0])).item() > 0)
