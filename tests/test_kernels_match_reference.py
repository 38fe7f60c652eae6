"""The Triton kernels equal their PyTorch references; the references mean what carryover needs.

The Triton checks run `support/kernel_sweep.py` and the GPU benchmark's `--smoke` in
fresh processes with `TRITON_INTERPRET=1`: Triton decides to interpret a kernel
when the kernel's module is imported, which an earlier import in this process
could have done without the variable.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_carryover.kernels.testing import random_paged_batch

from vllm_carryover import kernels

TESTS = Path(__file__).resolve().parent
INTERPRETED = {"TRITON_INTERPRET": "1", "VLLM_CARRYOVER_KERNELS": "triton"}


def run_interpreted(*command: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Run a Python command in a fresh process with Triton's CPU interpreter on."""
    env = {**os.environ, **INTERPRETED}
    return subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=TESTS.parent)


@pytest.mark.parametrize("kind", ["projection", "attention"])
def test_triton_kernel_equals_reference_over_seeded_random_shapes(kind: str) -> None:
    """Batch 1..64, 0..K rejected rows, head dims 64/128, GQA 1..8, pages 4..16, fp32/fp16."""
    proc = run_interpreted(str(TESTS / "support" / "kernel_sweep.py"), kind)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 of" in proc.stdout.splitlines()[-1]


def test_triton_kernels_compile_for_hopper_in_bfloat16_without_register_spills() -> None:
    """Compiled (not interpreted) for sm_90 with Triton's bundled ptxas; no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(TESTS / "support" / "kernel_compile.py")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=TESTS.parent)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_gpu_benchmark_smoke_checks_correctness_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "kernels_gpu.json"
    proc = run_interpreted("benchmarks/kernels_gpu.py", "--smoke", "--tune", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["correct"]
    assert all(r["unfused_matches_reference"] for r in result["projection"] + result["attention"])
    assert set(result["goals"]) == {"timings_meaningful", "attention_slot_within_1.1x",
                                    "projection_3x_at_batch_32"}
    assert result["goals"]["timings_meaningful"] is False
    assert all(t["best"]["correct"] for t in result["tuning"].values())


def test_dispatcher_uses_the_reference_on_a_machine_without_gpu() -> None:
    if torch.cuda.device_count() > 0 or os.environ.get(kernels.ENV_VAR):
        pytest.skip("a GPU (or an explicit backend) is present")
    assert kernels.default_backend() == "reference"
    assert kernels.backend() == "reference"


def test_dispatcher_override_switches_every_entry_point_and_rejects_unknown_names() -> None:
    proc = run_interpreted("-c", (
        "from vllm_carryover import kernels;"
        "import vllm_carryover.kernels.carryover_projection_triton as p;"
        "from triton.runtime.interpreter import InterpretedFunction as I;"
        "assert kernels.backend() == 'triton', kernels.backend();"
        "assert isinstance(p._project_context_kv_kernel, I);"
        "assert kernels._impl['project'] is p.project_context_kv_triton;"
        "kernels.use_kernels('reference');"
        "assert kernels._impl['project'] is kernels.project_context_kv_reference;"
        "assert kernels._impl['attention'] is kernels.carryover_attention_reference"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with pytest.raises(ValueError, match="unknown backend"):
        kernels.use_kernels("cuda")


def test_auto_backend_sends_float32_to_the_reference_and_16_bit_dtypes_to_triton() -> None:
    """The GPU default: Triton's exact float32 dots are 1.3-44x slower than cuBLAS there."""
    proc = run_interpreted("-c", (
        "import torch;"
        "from vllm_carryover import kernels;"
        "import vllm_carryover.kernels.carryover_projection_triton as p;"
        "import vllm_carryover.kernels.carryover_attention_triton as a;"
        "calls = [];"
        "kernels.project_context_kv_reference = lambda *x: calls.append('reference');"
        "p.project_context_kv_triton = lambda *x: calls.append('triton');"
        "kernels.carryover_attention_reference = lambda *x, **k: calls.append('reference');"
        "a.carryover_attention_triton = lambda *x, **k: calls.append('triton');"
        "kernels.use_kernels('auto');"
        "[kernels.project_context_kv(torch.zeros(1, 8, dtype=d), None, None, None)"
        " for d in (torch.float32, torch.bfloat16, torch.float16)];"
        "[kernels.carryover_attention(torch.zeros(1, 1, 8, dtype=d), *[None] * 5)"
        " for d in (torch.float32, torch.bfloat16)];"
        "assert calls == ['reference', 'triton', 'triton', 'reference', 'triton'], calls"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    visible: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v for q [Q, H, D], k/v [S, H, D], explicit and in float64."""
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def test_reference_attention_is_one_softmax_over_context_slot_and_block() -> None:
    """Keys of context | slot | block, gathered through a shuffled block table."""
    gen = torch.Generator().manual_seed(0)
    pb = random_paged_batch(gen, context_lens=[9, 0, 30], slot_lens=[3, 2, 0],
                            query_lens=[4, 4, 4], num_heads=6, num_kv_heads=2, head_dim=16,
                            page_size=5, dtype=torch.float32)
    out = kernels.carryover_attention_reference(*pb.args())
    for b, seq_len in enumerate(pb.seq_lens.tolist()):
        keys = torch.arange(seq_len)
        blocks = pb.block_table[b, keys // 5].long()
        k = pb.k_cache[blocks, keys % 5].repeat_interleave(3, dim=1)
        v = pb.v_cache[blocks, keys % 5].repeat_interleave(3, dim=1)
        q = pb.q[4 * b:4 * b + 4]
        torch.testing.assert_close(out[4 * b:4 * b + 4].double(), dense_attention(q, k, v),
                                   atol=1e-5, rtol=1e-5)


def test_reference_causal_block_sees_context_and_slot_fully_and_itself_up_to_each_query() -> None:
    gen = torch.Generator().manual_seed(1)
    ctx, slot, block = 7, 3, 5
    pb = random_paged_batch(gen, context_lens=[ctx], slot_lens=[slot], query_lens=[block],
                            num_heads=2, num_kv_heads=1, head_dim=16, page_size=4,
                            dtype=torch.float32)
    out = kernels.carryover_attention_reference(*pb.args(), causal=True)
    keys = torch.arange(ctx + slot + block)
    blocks = pb.block_table[0, keys // 4].long()
    k = pb.k_cache[blocks, keys % 4].repeat_interleave(2, dim=1)
    v = pb.v_cache[blocks, keys % 4].repeat_interleave(2, dim=1)
    for j in range(block):  # query j sees keys 0 .. ctx + slot + j
        seen = ctx + slot + j + 1
        want = dense_attention(pb.q[j:j + 1], k[:seen], v[:seen])
        torch.testing.assert_close(out[j:j + 1].double(), want, atol=1e-5, rtol=1e-5)
