"""Compile the Triton kernels for a GPU that this machine does not have.

Takes each wrapper's real launch (grid, arguments and meta-parameters for
representative drafter shapes, in bfloat16), specializes it the way Triton's
launcher would (dtypes, 16-byte divisibility, constants), compiles it for sm_90
(H100/H200) with the ptxas bundled in Triton's wheel, and reads registers and
spills from `ptxas -v`. This catches GPU-only compile errors on a CPU-only CI
machine, which Triton's interpreter cannot.

    python tests/support/kernel_compile.py  # a line per configuration; exit 1 on error or spill

It uses two internals of Triton 3.x's launcher (`create_function_from_signature`
and `JITFunction._pack_args`); with another Triton it exits 3 ("cannot check").
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from typing import Any

import torch
from vllm_carryover.kernels.carryover_attention_triton import Launch, attention_launches
from vllm_carryover.kernels.carryover_projection_triton import GEMMS, projection_launches
from vllm_carryover.kernels.testing import (
    random_paged_batch,
    random_projection_weights,
    random_verify_rows,
)

ARCH = 90  # sm_90: H100 / H200


def compile_launch(kernel: Any, args: tuple[Any, ...], meta: dict[str, Any]) -> tuple[int, int]:
    """Compile one launch for sm_90; return (registers per thread, spill store bytes)."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", ARCH, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound,
                                                              specialization, options)
    compiled = compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                       options=options.__dict__)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([get_ptxas(ARCH).path, "-v", f"--gpu-name=sm_{ARCH}a", ptx.name,
                                 "-o", "/dev/null"], capture_output=True, text=True, check=True)
    registers = re.search(r"Used (\d+) registers", report.stderr)
    spills = re.search(r"(\d+) bytes spill stores", report.stderr)
    assert registers and spills, report.stderr
    return int(registers.group(1)), int(spills.group(1))


def attention_cases() -> list[tuple[str, Launch]]:
    """Representative draft-block attention launches (one drafter layer)."""
    cases = []
    for head_dim, heads, kv_heads, q_len, causal in [
        (128, 32, 8, 8, False), (128, 32, 8, 8, True), (128, 32, 4, 8, False),
        (128, 32, 4, 16, False),
        (128, 16, 16, 8, False), (64, 8, 1, 16, False), (64, 16, 16, 4, False),
    ]:
        gen = torch.Generator().manual_seed(0)
        pb = random_paged_batch(gen, context_lens=[5, 20], slot_lens=[2, 0],
                                query_lens=[q_len] * 2, num_heads=heads, num_kv_heads=kv_heads,
                                head_dim=head_dim, page_size=16, dtype=torch.bfloat16)
        [launch] = attention_launches(*pb.args(), torch.empty_like(pb.q), causal=causal,
                                      scale=None, max_query_len=q_len)
        name = f"attention hd={head_dim} gqa={heads // kv_heads} block={q_len} causal={causal}"
        cases.append((name, launch))
    return cases


def projection_cases() -> list[tuple[str, Launch]]:
    """Representative projection launches (bf16, Qwen3-like head layout)."""
    cases = []
    for rows, head_dim, rotary, neox, bias, into_cache in [
        (8, 128, 128, True, False, False), (256, 128, 128, True, False, False),
        (256, 128, 128, True, False, True), (32, 64, 32, False, True, False),
    ]:
        gen = torch.Generator().manual_seed(0)
        w = random_projection_weights(gen, hidden=4096, num_layers=2, num_kv_heads=8,
                                      head_dim=head_dim, dtype=torch.bfloat16,
                                      rotary_dim=rotary, is_neox=neox, bias=bias)
        r = random_verify_rows(gen, batch=rows // 8, rows_per_request=8, hidden=4096,
                               dtype=torch.bfloat16)
        k = torch.empty(2, rows, 8, head_dim, dtype=torch.bfloat16)
        cache_shape = (2, rows // 16 + 1, 16, 8, head_dim)  # [layers, blocks, page, kv, hd]
        cache = (torch.arange(rows), torch.empty(cache_shape, dtype=torch.bfloat16),
                 torch.empty(cache_shape, dtype=torch.bfloat16))
        name = (f"rows={rows} hd={head_dim} rot={rotary} neox={neox} bias={bias} "
                f"into_cache={into_cache}")
        kernels = {}  # the Triton kernels of both GEMM paths, the shared norm kernel once
        for gemm in GEMMS:
            for launch in projection_launches(r.states, r.positions, r.rejected_rows, w,
                                              None if into_cache else (k, torch.empty_like(k)),
                                              cache if into_cache else None, gemm=gemm):
                if launch[1] is not None:  # not the cuBLAS GEMM
                    kernels.setdefault(launch[0].__name__, launch)
        cases += [(f"projection {kernel} {name}", launch) for kernel, launch in kernels.items()]
    return cases


def main() -> int:
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
        from triton.runtime.jit import create_function_from_signature  # noqa: F401
    except ImportError as e:
        print(f"cannot check: this Triton lacks {e.name}")
        return 3
    failed = 0
    for name, (kernel, _, args, meta) in attention_cases() + projection_cases():
        try:
            registers, spills = compile_launch(kernel, args, meta)
        except Exception as e:  # a compile error is the finding
            print(f"FAIL {name}: {type(e).__name__}: {e}")
            failed += 1
            continue
        status = "ok" if spills == 0 else "FAIL"
        failed += spills > 0
        tiles = {k: v for k, v in meta.items() if k.startswith("BLOCK") or k == "num_warps"}
        print(f"{status:4} {name}: {registers} registers, {spills} bytes spilled {tiles}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
