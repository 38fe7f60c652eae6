"""Random inputs in the kernels' layouts, shared by the tests and the GPU benchmark.

They mirror what a drafting round sees: a request's verify rows `[x_n, d_1..d_K]`
whose last `num_rejected` rows are carried over, and a paged KV cache holding,
per request, committed context, then the slot, then the query block.
Everything is drawn from the given generator, on its device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm_carryover.kernels.carryover_projection import ContextProjectionWeights

# How far a kernel may stray from its reference in each dtype (atol = rtol).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def rope_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 1e6,
                       dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """vLLM's RoPE table: [max_position, rotary_dim] with cos | sin halves."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, device=device).float() / rotary_dim)
    freqs = torch.arange(max_position, device=device).float()[:, None] * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=gen.device).to(dtype)


def random_projection_weights(
    gen: torch.Generator, *, hidden: int, num_layers: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, rotary_dim: int | None = None, is_neox: bool = True,
    bias: bool = False, max_position: int = 4096, cos_sin_dtype: torch.dtype = torch.float32,
) -> ContextProjectionWeights:
    """Weights of the context path at realistic scales (unit-RMS outputs)."""
    out = num_layers * 2 * num_kv_heads * head_dim
    return ContextProjectionWeights(
        hidden_norm_weight=1 + 0.1 * _randn(gen, hidden, dtype=dtype),
        rejected_embedding=_randn(gen, hidden, dtype=dtype),
        kv_weight=_randn(gen, out, hidden, dtype=dtype) * hidden ** -0.5,
        kv_bias=0.1 * _randn(gen, out, dtype=dtype) if bias else None,
        k_norm_weight=1 + 0.1 * _randn(gen, num_layers, head_dim, dtype=dtype),
        cos_sin_cache=rope_cos_sin_cache(max_position, rotary_dim or head_dim,
                                         dtype=cos_sin_dtype, device=gen.device),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        eps=1e-6,
        is_neox_style=is_neox,
    )


@dataclass(frozen=True)
class VerifyRows:
    """Target states of one verify step: `rows_per_request` rows for each request."""

    states: torch.Tensor  # [N, hidden]
    positions: torch.Tensor  # [N] int64
    rejected_rows: torch.Tensor  # [N] bool: the last num_rejected rows of each request
    num_rejected: torch.Tensor  # [batch] int


def random_verify_rows(
    gen: torch.Generator, *, batch: int, rows_per_request: int, hidden: int,
    dtype: torch.dtype, max_position: int = 4096, empty_slots: bool = False,
) -> VerifyRows:
    """Rows `[x_n, d_1..d_K]` per request, 0..K of them rejected (none if `empty_slots`)."""
    dev = gen.device
    k = rows_per_request - 1
    num_rejected = torch.randint(0, k + 1, (batch,), generator=gen, device=dev)
    if empty_slots:
        num_rejected.zero_()
    start = torch.randint(0, max_position - rows_per_request, (batch,), generator=gen, device=dev)
    offset = torch.arange(rows_per_request, device=dev)
    positions = (start[:, None] + offset).reshape(-1)
    rejected = (offset[None, :] >= rows_per_request - num_rejected[:, None]).reshape(-1)
    states = 3 * _randn(gen, batch * rows_per_request, hidden, dtype=dtype)
    return VerifyRows(states, positions, rejected, num_rejected)


@dataclass(frozen=True)
class PagedBatch:
    """A batch of draft blocks and the paged K/V they attend to (one drafter layer)."""

    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [batch, max_blocks] int32
    seq_lens: torch.Tensor  # [batch] int32: context + slot + block
    query_start_loc: torch.Tensor  # [batch + 1] int32
    max_query_len: int
    context_lens: list[int]
    slot_lens: list[int]

    def args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of `carryover_attention`."""
        return (self.q, self.k_cache, self.v_cache, self.block_table, self.seq_lens,
                self.query_start_loc)


def random_paged_batch(
    gen: torch.Generator, *, context_lens: list[int], slot_lens: list[int],
    query_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
    dtype: torch.dtype, spare_blocks: int = 3,
) -> PagedBatch:
    """Requests' keys `context | slot | block` in randomly placed pages.

    Every cache entry is random, including unused page tails and spare pages,
    so a kernel that reads past `seq_len` or into another request's pages fails.
    Block-table padding points at random (valid) pages for the same reason.
    """
    dev = gen.device
    seq_lens = [c + s + q for c, s, q in zip(context_lens, slot_lens, query_lens, strict=True)]
    pages = [-(-n // page_size) for n in seq_lens]
    max_pages = max(max(pages), 1)
    num_blocks = sum(pages) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen, device=dev).to(torch.int32)
    table = torch.randint(0, num_blocks, (len(seq_lens), max_pages), generator=gen,
                          device=dev, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n]
        used += n
    cache_shape = (num_blocks, page_size, num_kv_heads, head_dim)
    return PagedBatch(
        q=_randn(gen, sum(query_lens), num_heads, head_dim, dtype=dtype),
        k_cache=_randn(gen, *cache_shape, dtype=dtype),
        v_cache=_randn(gen, *cache_shape, dtype=dtype),
        block_table=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, *query_lens], device=dev).cumsum(0).to(torch.int32),
        max_query_len=max(query_lens, default=0),
        context_lens=list(context_lens),
        slot_lens=list(slot_lens),
    )
