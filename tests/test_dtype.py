"""The default dtype is the machine's fastest: bf16 only where matmuls run natively in it."""

from __future__ import annotations

import pytest
import torch

from vllm_carryover import dtype


@pytest.mark.parametrize("cuda,native_bf16,want", [
    (True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32")])
def test_fastest_dtype_follows_the_hardware(monkeypatch: pytest.MonkeyPatch, cuda: bool,
                                            native_bf16: bool, want: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(dtype, "cpu_has_native_bf16", lambda: native_bf16)
    assert dtype.fastest_dtype() == want
    assert dtype.resolve_dtype("auto") == want
    assert dtype.resolve_dtype("float16") == "float16"  # an explicit choice is kept
