"""The fastest dtype this machine runs the target in.

On a GPU, bfloat16. On a CPU it depends on the instruction set: with native
bf16 matmuls (AVX512-BF16 or AMX, which oneDNN reports) bfloat16 is the fast
dtype; without them (AVX2-only CPUs such as AMD Zen 3) bf16 is emulated and a
linear layer costs about 4x its float32 time, so float32 is.
"""

from __future__ import annotations


def cpu_has_native_bf16() -> bool:
    import torch

    return bool(torch.backends.mkldnn.is_available()
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def fastest_dtype() -> str:
    """"bfloat16" on a GPU or a CPU with native bf16 matmuls, else "float32"."""
    import torch

    return "bfloat16" if torch.cuda.is_available() or cpu_has_native_bf16() else "float32"


def resolve_dtype(dtype: str) -> str:
    """`dtype` itself, or the fastest one for "auto"."""
    return fastest_dtype() if dtype == "auto" else dtype
