"""Kernels of the carryover drafting path, each beside its PyTorch reference.

One dispatcher for all of them. Its backends:
- "auto", when this process sees a CUDA device and Triton is installed: Triton
  for float16 and bfloat16, the reference for float32. On an H100, Triton's exact
  float32 dots ran 1.3-44x slower than the reference's cuBLAS calls (29 ms vs
  0.66 ms for the projection at batch 32; `benchmarks/results/kernels_gpu/`).
- "reference", everywhere else: the PyTorch reference.
- "triton": Triton for every dtype (tests and benchmarks).
The choice is made once, at import, and can be overridden
by `VLLM_CARRYOVER_KERNELS=auto|triton|reference` (read at import) or by
`use_kernels(...)` at any time. The Triton modules are imported only when
chosen, so CPU installs never touch Triton, and `TRITON_INTERPRET=1` (which
Triton reads when a kernel module is imported) can still be set before that.

Entry points (same arguments and results in both implementations):
- `project_context_kv(states, positions, rejected_rows, weights) -> (K, V)`:
  the drafter's context K/V projection; the vLLM drafter calls it.
- `project_context_kv_into_cache(..., slot_mapping, k_cache, v_cache)`: the
  same, written straight into paged caches.
- `carryover_attention(q, k_cache, v_cache, block_table, seq_lens,
  query_start_loc, *, causal, scale, max_query_len)`: the draft block's paged
  attention over context + slot + block.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
from vllm_carryover.kernels.carryover_attention import carryover_attention_reference
from vllm_carryover.kernels.carryover_projection import (
    ContextProjectionWeights,
    apply_rope,
    project_context_kv_into_cache_reference,
    project_context_kv_reference,
    rms_norm,
)

ENV_VAR = "VLLM_CARRYOVER_KERNELS"
BACKENDS = ("auto", "triton", "reference")

_impl: dict[str, Callable[..., Any]] = {}
_backend = ""


def default_backend() -> str:
    """`$VLLM_CARRYOVER_KERNELS` if set, else auto on a GPU machine with Triton.

    `torch.cuda.device_count()` asks NVML and does not initialize CUDA, so the
    check is safe in vLLM's parent process before it forks workers.
    """
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        return forced
    has_triton = importlib.util.find_spec("triton") is not None
    return "auto" if has_triton and torch.cuda.device_count() > 0 else "reference"


def use_kernels(backend: str) -> None:
    """Route every entry point to `backend` (one of BACKENDS) from now on."""
    global _backend
    if backend not in BACKENDS:
        raise ValueError(f"{ENV_VAR}/use_kernels: unknown backend {backend!r}; "
                         f"choose one of {', '.join(BACKENDS)}")
    reference = dict(project=project_context_kv_reference,
                     project_into_cache=project_context_kv_into_cache_reference,
                     attention=carryover_attention_reference)
    if backend == "reference":
        _impl.update(reference)
    else:
        from vllm_carryover.kernels.carryover_attention_triton import carryover_attention_triton
        from vllm_carryover.kernels.carryover_projection_triton import (
            project_context_kv_into_cache_triton,
            project_context_kv_triton,
        )

        triton = dict(project=project_context_kv_triton,
                      project_into_cache=project_context_kv_into_cache_triton,
                      attention=carryover_attention_triton)
        if backend == "auto":
            triton = {name: _float32_to(reference[name], fn) for name, fn in triton.items()}
        _impl.update(triton)
    _backend = backend


def _float32_to(reference: Callable[..., Any], triton: Callable[..., Any]) -> Callable[..., Any]:
    """`triton`, except that float32 inputs (the first argument's dtype) go to `reference`."""
    def call(first: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (reference if first.dtype == torch.float32 else triton)(first, *args, **kwargs)

    return call


def backend() -> str:
    """The implementation the entry points use now: one of BACKENDS."""
    return _backend


def project_context_kv(
    states: torch.Tensor,
    positions: torch.Tensor,
    rejected_rows: torch.Tensor | None,
    w: ContextProjectionWeights,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Context K and V [layers, N, kv_heads, head_dim]; see `project_context_kv_reference`."""
    return _impl["project"](states, positions, rejected_rows, w)


def project_context_kv_into_cache(
    states: torch.Tensor,
    positions: torch.Tensor,
    rejected_rows: torch.Tensor | None,
    w: ContextProjectionWeights,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Project and write into caches; see `project_context_kv_into_cache_reference`."""
    _impl["project_into_cache"](states, positions, rejected_rows, w, slot_mapping, k_cache,
                                v_cache)


def carryover_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Paged attention of draft blocks; see `kernels.carryover_attention`."""
    return _impl["attention"](q, k_cache, v_cache, block_table, seq_lens, query_start_loc,
                              causal=causal, scale=scale, max_query_len=max_query_len)


use_kernels(default_backend())

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "ContextProjectionWeights",
    "apply_rope",
    "backend",
    "carryover_attention",
    "carryover_attention_reference",
    "default_backend",
    "project_context_kv",
    "project_context_kv_into_cache",
    "project_context_kv_into_cache_reference",
    "project_context_kv_reference",
    "rms_norm",
    "use_kernels",
]
