"""The drafter compiles every context-projection variant at startup (CUDA, Triton).

Triton compiles a kernel per variant on first use: per constexpr flag (rejected
rows or not), per tile of the epilogue (chosen from the row count) and per its own
specialisation of integer arguments (== 1, divisible by 16). vLLM's dummy run
drafts without rejected rows at one size, so without a warm-up the first real
requests would wait for compilations. Compiling needs a GPU; here the row
counts are checked to reach every variant, and the warm-up to run them all.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm_carryover.kernels.carryover_projection_triton import projection_launches
from vllm_carryover.kernels.testing import random_projection_weights

HIDDEN = 64


@pytest.fixture(scope="module")
def weights():
    return random_projection_weights(torch.Generator().manual_seed(0), hidden=HIDDEN,
                                     num_layers=2, num_kv_heads=2, head_dim=32,
                                     dtype=torch.float32)


def variants(rows, weights) -> set[tuple]:
    """What Triton compiles separately for a projection of each row count."""
    out = set()
    for n in rows:
        states, positions = torch.zeros(n, HIDDEN), torch.zeros(n, dtype=torch.int64)
        kv = (torch.empty(0), torch.empty(0))
        for rejected in (None, torch.ones(n, dtype=torch.bool)):
            launches = projection_launches(states, positions, rejected, weights, kv, None)
            norm, last = launches[0], launches[-1]  # the hidden norm, the epilogue
            out.add((norm[3]["HAS_REJECTED"], last[3]["BLOCK_M"], last[3]["num_warps"],
                     n == 1, n % 16 == 0))
    return out


def test_warm_up_row_counts_reach_every_compiled_projection_variant(weights):
    from vllm_carryover.drafter.vllm_model import WARMUP_ROWS

    assert variants(WARMUP_ROWS, weights) == variants(range(1, 1025), weights)


def test_warm_up_projects_every_row_count_with_and_without_rejected_rows(
        weights, monkeypatch: pytest.MonkeyPatch):
    from vllm_carryover.drafter import vllm_model as vllm_drafter

    calls = []
    monkeypatch.setattr(vllm_drafter, "project_context_kv",
                        lambda states, positions, rejected, w: calls.append(
                            (states.shape[0], rejected is not None, w is weights)))
    vllm_drafter.CarryoverDFlashModel.warm_up_kernels(SimpleNamespace(_projection=weights))
    assert sorted(calls) == sorted((n, r, True) for n in vllm_drafter.WARMUP_ROWS
                                   for r in (False, True))
