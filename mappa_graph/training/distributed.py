"""Data-parallel adapter training under torch distributed: plain DDP-style all-reduce of the LoRA gradients.

Launch with `torchrun --nproc-per-node N your_script.py` (gloo on CPU, nccl on GPU); the same script with one
process, no torchrun, takes the single-process path unchanged.

Each rank rolls out and judges its own shard of the iteration's rollouts (so rollouts and judge calls get the
speed-up), then the episodes and rewards are gathered, in job order, onto every rank: credit assignment
(filters, the global REINFORCE++ normalisation) then runs on the same global batch everywhere, whatever one
rank's judge or sandbox did differently. That makes the set of adapters to update, and so the number of
gradient all-reduces, identical on every rank (a rank with no samples of an adapter contributes zeros): no hang.
Each rank takes its shard of each adapter's samples for the loss, divided by the GLOBAL token (or action) count,
so the summed gradient is the single-process gradient of the global batch (up to float rounding). Rank 0 alone
writes checkpoints, metrics and the trace store (the other ranks' episodes and rewards included).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from ..models.policies import AgentPolicies

T = TypeVar("T")


def is_distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    return torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1


def rank() -> int:
    """This process's rank: the process group's, or torchrun's RANK before init, or 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Rank 0 writes checkpoints, metrics and the store; in a single process this is always True."""
    return rank() == 0


def init_from_env(backend: str | None = None) -> bool:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); a no-op, returning
    False, when WORLD_SIZE is unset or 1. Backend: nccl when CUDA is available, else gloo."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group(backend=backend)
    return True


def shard(samples: Sequence[T], rank: int, world: int) -> list[T]:
    """Rank `rank`'s share of `samples`, by index (i % world == rank): deterministic, disjoint, and covering."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world} processes")
    return list(samples[rank::world])


def gather_in_order(items: Sequence[tuple[int, T]]) -> list[T]:
    """Every rank's `(position, item)` pairs, on every rank, as one list sorted by position: the global batch in
    the order a single process would have made it. Objects travel pickled (`all_gather_object`)."""
    if not is_distributed():
        return [item for _, item in sorted(items, key=lambda pair: pair[0])]
    per_rank: list[list[tuple[int, T]] | None] = [None] * world_size()
    torch.distributed.all_gather_object(per_rank, list(items))
    merged = [pair for pairs in per_rank for pair in (pairs or [])]
    return [item for _, item in sorted(merged, key=lambda pair: pair[0])]


def _device_for_collectives(like: torch.Tensor | None = None) -> torch.device:
    if like is not None:
        return like.device
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: Sequence[float], *, dtype: torch.dtype = torch.float64) -> list[float]:
    """Sum a few scalars over ranks (token counts, loss and clip statistics) in one collective."""
    t = torch.tensor(list(values), dtype=dtype, device=_device_for_collectives())  # (K,)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
    return t.tolist()


def all_reduce_adapter_grads(policies: AgentPolicies, adapter: str) -> None:
    """SUM the LoRA gradients of one adapter over ranks, in one flat bucket.

    Each rank's loss must already be divided by the global token count (see the module docstring): then the sum
    is the single-process gradient of the global batch. A rank whose shard had no samples for this adapter
    contributes zeros, so every rank takes part in the collective and ends with the same gradient."""
    params = list(policies.adapter_parameters(adapter).values())
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # (P,)
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    offset = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n
