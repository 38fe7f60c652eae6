"""Where a training recipe runs: its device and the precision of its forward passes.

`--device auto` is the GPU when torch sees one (under torchrun the process's own,
cuda:LOCAL_RANK), else the CPU. `--dtype auto` is bfloat16 autocast on CUDA and on
a CPU with native bf16 matmuls (AVX512-BF16 or AMX; a training step x1.6 faster on
an AVX512-BF16 EPYC, docs/results.md), plain float32 on other CPUs, where
bf16 is emulated and slower. The drafter's weights and optimizer state stay float32
everywhere; only the forward passes (the drafter's under autocast, the target's in its
weights' dtype) use the lower precision.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from vllm_carryover.dtype import cpu_has_native_bf16


def resolve_device(name: str = "auto") -> torch.device:
    """The device `name` names; "auto": CUDA when available, else the CPU. A CUDA device
    without an index is the process's own under torchrun (LOCAL_RANK), else cuda:0."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: torch sees no CUDA device here")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


@dataclass(frozen=True)
class Placement:
    """A recipe's device and compute dtype (float32: no autocast at all)."""

    device: torch.device
    dtype: torch.dtype

    def autocast(self) -> AbstractContextManager[object]:
        """The block's forward passes in `dtype` (a no-op in float32)."""
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def placement(device: str = "auto", dtype: str = "auto") -> Placement:
    """`--device` and `--dtype` resolved: "auto" dtype is bfloat16 on CUDA and on a CPU with
    native bf16 matmuls, else float32 (the rule of `vllm_carryover.dtype`, for the device
    chosen rather than the machine)."""
    dev = resolve_device(device)
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" or cpu_has_native_bf16() else "float32"
    return Placement(dev, getattr(torch, dtype))
