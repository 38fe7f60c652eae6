"""Kernels of the carryover drafting path, each beside its PyTorch reference.

`project_context_kv` is the one entry point the vLLM drafter calls. Only the
PyTorch reference exists so far; a Triton implementation for CUDA plugs in here.
"""

from kernels.carryover_projection import (
    ContextProjectionWeights,
    apply_rope,
    project_context_kv_reference,
    rms_norm,
)

project_context_kv = project_context_kv_reference

__all__ = [
    "ContextProjectionWeights",
    "apply_rope",
    "project_context_kv",
    "project_context_kv_reference",
    "rms_norm",
]
