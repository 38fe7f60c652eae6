"""Data-parallel training over processes started by torchrun (NCCL on CUDA, gloo on CPU).

Every process holds the whole drafter, draws its own training sequences and
averages its gradients with the others after backward, so all processes apply
the same update and keep identical weights. A plain all-reduce of `.grad` is
used instead of DistributedDataParallel because the recipes call the drafter
through several methods (fuse, context_kv, forward), not one `forward`.
Alone (no torchrun), every helper here is a no-op. Under NCCL the collectives'
tensors live on the process's GPU (`torch.cuda.set_device` at the start), under
gloo on the CPU; the values handed back are plain Python numbers either way.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist


def launched() -> bool:
    """Whether torchrun started this process as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    """Only rank 0 writes logs, checkpoints and evaluations."""
    return rank() == 0


@contextmanager
def process_group(device: torch.device | None = None) -> Iterator[None]:
    """Join torchrun's process group for the block: NCCL when training on a CUDA
    `device` (made this process's current GPU), else gloo; nothing when run alone."""
    if not launched() or dist.is_initialized():
        yield
        return
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    try:
        yield
    finally:
        dist.destroy_process_group()


def check_joined() -> None:
    """Refuse to train alone inside a torchrun job (the ranks would silently diverge)."""
    if launched() and not dist.is_initialized():
        raise RuntimeError("started by torchrun but not in its process group: call the "
                           "recipe inside train.distributed.process_group()")


@contextmanager
def rank0_first() -> Iterator[None]:
    """Rank 0 runs the block before the others, e.g. to fill a cache they then read."""
    if world_size() > 1 and rank() != 0:
        dist.barrier()
    yield
    if world_size() > 1 and rank() == 0:
        dist.barrier()


def average_gradients(params: list[torch.nn.Parameter]) -> None:
    """Replace every `.grad` with its mean over the ranks, in one all-reduce.

    A parameter without a gradient on some rank counts as zero there; one
    without a gradient on every rank keeps `grad is None` (AdamW skips it),
    as in a single-process step.
    """
    n = world_size()
    if n == 1:
        return
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                       device=_device())
    dist.all_reduce(has)
    live = [p for p, h in zip(params, has.tolist(), strict=True) if h]
    if not live:
        return
    for p in live:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in live])
    dist.all_reduce(flat)
    flat /= n
    offset = 0
    for p in live:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def sum_over_ranks(values: list[float]) -> list[float]:
    """Element-wise sum of a list of numbers over the ranks (float64)."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return t.tolist()


def from_rank0(value: float) -> float:
    """Rank 0's `value` on every rank, e.g. a decision that depends on its clock."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.broadcast(t, src=0)
    return float(t.item())


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (on every rank)."""
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def _device() -> torch.device:
    """Where a collective's tensors must be: the current GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
