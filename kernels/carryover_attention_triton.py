"""Triton paged attention for the carryover draft block (semantics: `carryover_attention`).

One program handles one request, one KV head and a tile of its query block.
The tile's rows are (query token, query head of the KV head's group) pairs, so
all GQA heads that share a KV head reuse each loaded K/V tile. The program then
walks the request's keys `[0, seq_len)` (context, slot and block alike) in
tiles of BLOCK_N keys, looking each key's physical block up in the block table,
and keeps an online softmax (running max and sum, FlashAttention style) in
float32. Any KV page size works: keys are gathered one by one through the table.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _carryover_attention_kernel(
    q_ptr, stride_qt, stride_qh,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    stride_cb, stride_cs, stride_ch,  # cache strides: block, in-block slot, kv head
    block_table_ptr, stride_bt,  # [batch, max_blocks] int32
    seq_lens_ptr,  # [batch]
    query_start_loc_ptr,  # [batch + 1]
    out_ptr, stride_ot, stride_oh,  # like q
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows per tile: (BLOCK_M // GROUP) tokens x GROUP heads
    BLOCK_N: tl.constexpr,  # keys per inner step
    PRECISION: tl.constexpr,  # tl.dot input precision ("ieee" keeps float32 exact)
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    tokens_per_tile: tl.constexpr = BLOCK_M // GROUP

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    tok0 = tl.program_id(2) * tokens_per_tile
    if tok0 < q_len:
        seq_len = tl.load(seq_lens_ptr + req)

        # Rows of the tile: token tok0 + r // GROUP, head kv_head * GROUP + r % GROUP.
        r = tl.arange(0, BLOCK_M)
        tok = tok0 + r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_ok = (r < tokens_per_tile * GROUP) & (tok < q_len)
        d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = d < HEAD_DIM
        q_off = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
        q = tl.load(q_ptr + q_off + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        # The block is the last q_len keys: token t sits at key seq_len - q_len + t.
        last_visible = seq_len - q_len + tok
        kv_end = seq_len
        if CAUSAL:
            kv_end = tl.minimum(seq_len, seq_len - q_len + tok0 + tokens_per_tile)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        for n0 in range(0, kv_end, BLOCK_N):
            # Gather BLOCK_N keys through the block table: key n is at slot n % PAGE_SIZE
            # of physical block block_table[req, n // PAGE_SIZE].
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < kv_end
            block = tl.load(block_table_ptr + req * stride_bt + n // PAGE_SIZE, mask=n_ok, other=0)
            kv_off = (block.to(tl.int64) * stride_cb + (n % PAGE_SIZE) * stride_cs
                      + kv_head * stride_ch)
            k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
            s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
            visible = n_ok[None, :]
            if CAUSAL:
                visible = visible & (n[None, :] <= last_visible[:, None])
            s = tl.where(visible, s, float("-inf"))

            # Online softmax; a row that has seen no visible key yet keeps m = -inf,
            # and subtracting 0 instead keeps exp2 away from (-inf) - (-inf).
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_off = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(out_ptr + o_off + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])


Launch = tuple[Any, tuple[int, ...], tuple[Any, ...], dict[str, Any]]  # kernel, grid, args, meta
ATTENTION_TILES = {"BLOCK_N", "num_warps", "num_stages"}


def attention_launches(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    *,
    causal: bool,
    scale: float | None,
    max_query_len: int,
    tiles: dict[str, int] | None = None,
) -> list[Launch]:
    """The single launch of one attention call (also used to compile it offline).

    BLOCK_M follows from the block and GQA sizes. For tiles of up to 32 x 128 query
    values the defaults are the fastest of 12 tried on an H100 at 32 requests x 2048
    keys (`benchmarks/kernels_gpu.py --tune`: BLOCK_N 128, 4 warps, 3 stages); larger
    ones keep the untuned BLOCK_N 64 and 8 warps. All compile for sm_90 in bfloat16
    without register spills (tests/support/kernel_compile.py). `tiles` overrides BLOCK_N,
    num_warps or num_stages (for tuning).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("k_cache and v_cache need equal strides and contiguous head_dim")
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))

    # Rows per tile: the whole block of one KV head's group when it fits in 128 rows.
    block_m = max(16, triton.next_power_of_2(group),
                  min(128, triton.next_power_of_2(max(max_query_len, 1) * group)))
    grid = (seq_lens.shape[0], num_kv_heads,
            triton.cdiv(max(max_query_len, 1), block_m // group))
    args = (q, q.stride(0), q.stride(1),
            k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_table, block_table.stride(0),
            seq_lens, query_start_loc,
            out, out.stride(0), out.stride(1),
            scale * math.log2(math.e))
    small = block_m * head_dim_pad <= 32 * 128  # e.g. 8 queries x GQA 4 at head_dim 128
    tiles = {"BLOCK_N": 128 if small else 64, "num_warps": 4 if small else 8,
             "num_stages": 3 if small else 2, **(tiles or {})}
    if set(tiles) != ATTENTION_TILES:
        raise ValueError(f"tiles: only {sorted(ATTENTION_TILES)} can be set, got {sorted(tiles)}")
    meta = dict(
        PAGE_SIZE=k_cache.shape[1],
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        CAUSAL=causal,
        BLOCK_M=block_m,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **tiles,
    )
    return [(_carryover_attention_kernel, grid, args, meta)]


def carryover_attention_triton(
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
    """Triton version of `carryover_attention_reference` (same arguments and result).

    Pass `max_query_len` (vLLM's metadata has it) to avoid a device-to-host sync.
    Rows of `q` past `query_start_loc[-1]` (padding) are left unwritten.
    """
    out = torch.empty_like(q)
    if q.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    for kernel, grid, args, meta in attention_launches(
            q, k_cache, v_cache, block_table, seq_lens, query_start_loc, out, causal=causal,
            scale=scale, max_query_len=max_query_len):
        kernel[grid](*args, **meta)
    return out
