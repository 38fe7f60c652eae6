"""Carryover attention: the draft block's queries over a request's paged K/V.

Carryover keeps no separate slot tensor. A request's KV blocks hold, in order,
the committed context, the carried-over (rejected) states and then the query
block itself, and `seq_lens` covers all three (see `vllm_carryover.slot`).
One softmax over keys `[0, seq_len)` is therefore the attention over context +
slot + block that the method asks for; an empty slot is just a shorter sequence.

KV cache layout (one drafter layer), shared by the reference and the Triton kernel:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_table:      [batch, max_blocks_per_request] int32, physical block ids
    key i of request b lives at k_cache[block_table[b, i // block_size], i % block_size]

This is the layout of each half of vLLM's FlashAttention cache
(`[2, num_blocks, block_size, num_kv_heads, head_dim]`), which is why vLLM's own
CUDA backends already run carryover drafting on GPU without these kernels. The
kernels here serve a standalone fused path and the benchmark comparisons.

Queries are packed like vLLM's: `q` [num_tokens, num_heads, head_dim] with
request b's tokens at `query_start_loc[b]:query_start_loc[b + 1]`; they are the
LAST `q_len` keys of the request's sequence. Masking:

- non-causal (DFlash, carryover's drafter): every query sees all `seq_len` keys;
- causal: query j of the block (0-based) sees keys `0 .. seq_len - q_len + j`,
  that is context and slot fully and the block up to itself (bottom-right
  aligned causal mask, as FlashAttention's `causal=True` with varlen queries).

Grouped-query attention: query head h reads KV head `h // (num_heads // num_kv_heads)`.
"""

from __future__ import annotations

import math

import torch


def gather_request_kv(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Keys (or values) `[0, seq_len)` of one request: [seq_len, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    idx = torch.arange(seq_len, device=cache.device)
    blocks = block_table_row[idx // block_size].long()
    return cache[blocks, idx % block_size]


def carryover_attention_reference(
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
    """Attention of each request's query block over its keys, one explicit softmax.

    Gathers the request's K/V through its block table, computes the scores in
    float32 and normalizes them over the whole sequence (context + slot +
    block) at once. `max_query_len` is accepted for signature parity with the
    Triton kernel and not needed here.
    """
    del max_query_len
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k_cache.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_lo, q_hi = starts[b], starts[b + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        k = gather_request_kv(k_cache, block_table[b], seq_len).repeat_interleave(group, dim=1)
        v = gather_request_kv(v_cache, block_table[b], seq_len).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_lo:q_hi].float(), k.float()) * scale
        if causal:
            last_visible = seq_len - q_len + torch.arange(q_len, device=q.device)
            hidden = torch.arange(seq_len, device=q.device)[None, :] > last_visible[:, None]
            scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_lo:q_hi] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out
