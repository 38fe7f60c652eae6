"""Triton context K/V projection (semantics: `project_context_kv_reference`).

Two launches do the whole context path for every row of the batch, committed
and rejected alike, whatever the number of rows per request:

1. `_hidden_norm_kernel`, BLOCK_R rows per program: hidden RMSNorm, then +
   rejected embedding on rejected rows. It writes the normalized rows once (N x hidden,
   small) so that the GEMM below streams them like any GEMM operand instead of
   renormalizing them for each of its column tiles.
2. `_project_context_kv_kernel`: the K/V GEMM of every drafter layer with
   per-head K RMSNorm and RoPE in its epilogue, stored as K/V or straight into
   paged caches.

`gemm="cublas"` replaces step 2 by cuBLAS's GEMM into an N x (layers * 2 *
kv_heads * head_dim) buffer and `_kv_epilogue_kernel` (the same epilogue,
`_finish_head_tile`). On an H100 the fused GEMM reached 150 of ~800 TFLOP/s at
256 rows, 2.2x the reference's cuBLAS GEMM plus small ops; cuBLAS plus one
epilogue launch may beat it, which `benchmarks/kernels_gpu.py` measures
(both paths, side by side). Until it has, the fused kernel stays the default.

Tiling of the fused GEMM: program (m, t) computes BLOCK_M rows x one head tile t,
where t runs over (layer, K|V, kv head) in the order of `kv_weight`'s rows. A
head tile is the natural column tile here: K-norm reduces over exactly one head
and RoPE mixes dimensions of one head only, so both run on registers. RoPE pairs
dimension a with b (neox: i with i + rot/2; GPT-J: 2i with 2i + 1), so the
kernel keeps two accumulators, one for the `a` dimensions and one for their `b`
partners, each a GEMM against the matching weight rows; rotating is then
elementwise. Dimensions beyond the rotary dim are paired too and pass through
unrotated. Row tiles vary fastest in the grid, so the programs that share a head
tile's weights run together and the weights come from HBM about once.

Rounding follows the reference: normalized states, GEMM output and normed K are
rounded to the states' dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from vllm_carryover.kernels.carryover_projection import ContextProjectionWeights


@triton.jit
def _hidden_norm_kernel(
    x_ptr, stride_xm,  # states [N, hidden]
    rej_ptr,  # [N] uint8 rejected mask (read when HAS_REJECTED)
    norm_w_ptr, emb_ptr,  # hidden norm weight and rejected embedding [hidden]
    out_ptr, stride_om,  # normalized rows [N, hidden]
    N, HIDDEN, eps,
    HAS_REJECTED: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_H: tl.constexpr,  # hidden columns per step
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    out_rows = out_ptr + rows.to(tl.int64)[:, None] * stride_om
    dtype = x_ptr.dtype.element_ty

    # Pass 1: each row's sum of squares, BLOCK_H columns at a time.
    sum_sq = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    for h0 in range(0, HIDDEN, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = row_ok[:, None] & (cols < HIDDEN)[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        sum_sq += x * x
    rstd = tl.rsqrt(tl.sum(sum_sq, axis=1) / HIDDEN + eps)
    if HAS_REJECTED:
        rejected = tl.load(rej_ptr + rows, mask=row_ok, other=0) != 0

    # Pass 2 (the rows are in L1/L2 by now): normalize, mark, round as the reference does.
    for h0 in range(0, HIDDEN, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_ok = cols < HIDDEN
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        nw = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        xn = (x * rstd[:, None] * nw[None, :]).to(dtype)
        if HAS_REJECTED:
            emb = tl.load(emb_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            xn = (xn.to(tl.float32) + tl.where(rejected[:, None], emb[None, :], 0.0)).to(dtype)
        tl.store(out_rows + cols[None, :], xn, mask=mask)


@triton.jit
def _rotary_pairs(i, ROT_DIM: tl.constexpr, IS_NEOX: tl.constexpr):
    """A head's dimensions as rotary pairs (a[i], b[i]), i < head_dim // 2."""
    if IS_NEOX:
        half_rot = ROT_DIM // 2
        dim_a = tl.where(i < half_rot, i, ROT_DIM + 2 * (i - half_rot))
        dim_b = tl.where(i < half_rot, i + half_rot, dim_a + 1)
    else:
        dim_a = 2 * i
        dim_b = 2 * i + 1
    return dim_a, dim_b


@triton.jit
def _finish_head_tile(
    acc_a, acc_b,  # [BLOCK_M, HALF_PAD] float32: the head's `a` and `b` dims, bias included
    rows, row_ok, i, i_ok, dim_a, dim_b, layer, is_k, kv_head,
    pos_ptr, knorm_ptr, stride_knl, cs_ptr, stride_csp, k_out_ptr, v_out_ptr,
    slot_ptr, k_cache_ptr, v_cache_ptr, stride_cl, stride_cs, stride_ch,
    N, eps,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    WRITE_KV: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
):
    """K-norm and RoPE on a K head tile's registers, then store to K/V and/or the caches."""
    dtype = k_out_ptr.dtype.element_ty  # the states' dtype (an unused output is the states)
    out_a = acc_a.to(dtype).to(tl.float32)
    out_b = acc_b.to(dtype).to(tl.float32)
    if is_k:
        # Padding dims (i >= HEAD_DIM // 2) hold zeros, so they add nothing to the sum.
        k_rstd = tl.rsqrt((tl.sum(out_a * out_a, axis=1) + tl.sum(out_b * out_b, axis=1))
                          / HEAD_DIM + eps)
        kn_at = knorm_ptr + layer * stride_knl
        kn_a = tl.load(kn_at + dim_a, mask=i_ok, other=0.0).to(tl.float32)
        kn_b = tl.load(kn_at + dim_b, mask=i_ok, other=0.0).to(tl.float32)
        out_a = (out_a * k_rstd[:, None] * kn_a[None, :]).to(dtype).to(tl.float32)
        out_b = (out_b * k_rstd[:, None] * kn_b[None, :]).to(dtype).to(tl.float32)
        # RoPE: cos | sin halves of the cache row at each row's own position;
        # pairs past the rotary dim get cos 1, sin 0.
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        cs_mask = row_ok[:, None] & (i < ROT_DIM // 2)[None, :]
        cs_row = cs_ptr + pos[:, None] * stride_csp + i[None, :]
        cos = tl.load(cs_row, mask=cs_mask, other=1.0).to(dtype).to(tl.float32)
        sin = tl.load(cs_row + ROT_DIM // 2, mask=cs_mask, other=0.0).to(dtype).to(tl.float32)
        rot_a = out_a * cos - out_b * sin
        out_b = out_b * cos + out_a * sin
        out_a = rot_a

    store_mask = row_ok[:, None] & i_ok[None, :]
    if WRITE_KV:
        # K and V outputs are [layers, N, kv_heads, head_dim].
        out_row = ((layer * N + rows).to(tl.int64) * NUM_KV_HEADS + kv_head) * HEAD_DIM
        out_base = tl.where(is_k, k_out_ptr, v_out_ptr) + out_row[:, None]
        tl.store(out_base + dim_a[None, :], out_a.to(dtype), mask=store_mask)
        tl.store(out_base + dim_b[None, :], out_b.to(dtype), mask=store_mask)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        cache_row = layer.to(tl.int64) * stride_cl + slot * stride_cs + kv_head * stride_ch
        cache_base = tl.where(is_k, k_cache_ptr, v_cache_ptr) + cache_row[:, None]
        cache_mask = store_mask & (slot >= 0)[:, None]
        tl.store(cache_base + dim_a[None, :], out_a.to(dtype), mask=cache_mask)
        tl.store(cache_base + dim_b[None, :], out_b.to(dtype), mask=cache_mask)


@triton.jit
def _kv_epilogue_kernel(
    kv_ptr, stride_kvm,  # GEMM output [N, layers * 2 * kv_heads * head_dim], bias included
    pos_ptr, knorm_ptr, stride_knl, cs_ptr, stride_csp, k_out_ptr, v_out_ptr,
    slot_ptr, k_cache_ptr, v_cache_ptr, stride_cl, stride_cs, stride_ch,
    N, eps,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
    WRITE_KV: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The fused GEMM's epilogue alone, after a cuBLAS GEMM: program (m, t) finishes
    BLOCK_M rows of head tile t."""
    tile = tl.program_id(1)
    layer = tile // (2 * NUM_KV_HEADS)
    is_k = (tile // NUM_KV_HEADS) % 2 == 0
    kv_head = tile % NUM_KV_HEADS
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    i = tl.arange(0, HALF_PAD)
    i_ok = i < HEAD_DIM // 2
    dim_a, dim_b = _rotary_pairs(i, ROT_DIM, IS_NEOX)
    head = kv_ptr + rows.to(tl.int64)[:, None] * stride_kvm + tile * HEAD_DIM
    mask = row_ok[:, None] & i_ok[None, :]
    acc_a = tl.load(head + dim_a[None, :], mask=mask, other=0.0).to(tl.float32)
    acc_b = tl.load(head + dim_b[None, :], mask=mask, other=0.0).to(tl.float32)
    _finish_head_tile(acc_a, acc_b, rows, row_ok, i, i_ok, dim_a, dim_b, layer, is_k, kv_head,
                      pos_ptr, knorm_ptr, stride_knl, cs_ptr, stride_csp, k_out_ptr, v_out_ptr,
                      slot_ptr, k_cache_ptr, v_cache_ptr, stride_cl, stride_cs, stride_ch,
                      N, eps, NUM_KV_HEADS, HEAD_DIM, ROT_DIM, WRITE_KV, WRITE_CACHE)


@triton.jit
def _project_context_kv_kernel(
    x_ptr, stride_xm,  # normalized states [N, hidden] (from _hidden_norm_kernel)
    w_ptr, stride_wn, stride_wk,  # kv_weight [layers * 2 * kv_heads * head_dim, hidden]
    bias_ptr,  # kv_bias (read when HAS_BIAS)
    pos_ptr,  # [N] positions
    knorm_ptr, stride_knl,  # K-norm weight [layers, head_dim]
    cs_ptr, stride_csp,  # cos_sin_cache [max_position, rot_dim]
    k_out_ptr, v_out_ptr,  # [layers, N, kv_heads, head_dim] (written when WRITE_KV)
    slot_ptr,  # [N] cache slots, < 0 skips the row (read when WRITE_CACHE)
    k_cache_ptr, v_cache_ptr, stride_cl, stride_cs, stride_ch,  # caches: layer, slot, kv head
    N, HIDDEN, eps,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,  # HEAD_DIM // 2 rounded up to a power of two (>= 16)
    IS_NEOX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    WRITE_KV: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input precision ("ieee" keeps float32 exact)
):
    dtype = x_ptr.dtype.element_ty
    pid_m = tl.program_id(0)  # row tiles vary fastest: programs sharing weights run together
    tile = tl.program_id(1)  # (layer * 2 + (0: K, 1: V)) * NUM_KV_HEADS + kv_head
    layer = tile // (2 * NUM_KV_HEADS)
    is_k = (tile // NUM_KV_HEADS) % 2 == 0
    kv_head = tile % NUM_KV_HEADS

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm

    i = tl.arange(0, HALF_PAD)
    i_ok = i < HEAD_DIM // 2
    dim_a, dim_b = _rotary_pairs(i, ROT_DIM, IS_NEOX)
    w_a = w_ptr + (tile * HEAD_DIM + dim_a).to(tl.int64)[None, :] * stride_wn
    w_b = w_ptr + (tile * HEAD_DIM + dim_b).to(tl.int64)[None, :] * stride_wn

    # GEMM over the hidden dim: [BLOCK_M, BLOCK_K] rows x [BLOCK_K, HALF_PAD] weights, twice.
    acc_a = tl.zeros([BLOCK_M, HALF_PAD], tl.float32)
    acc_b = tl.zeros([BLOCK_M, HALF_PAD], tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < HIDDEN
        x = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & i_ok[None, :]
        wa = tl.load(w_a + cols[:, None] * stride_wk, mask=w_mask, other=0.0)
        wb = tl.load(w_b + cols[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc_a = tl.dot(x, wa.to(dtype), acc_a, input_precision=PRECISION)
        acc_b = tl.dot(x, wb.to(dtype), acc_b, input_precision=PRECISION)

    # Epilogue on registers: bias, K-norm and RoPE (K tiles only), store.
    if HAS_BIAS:
        bias_at = bias_ptr + tile * HEAD_DIM
        acc_a += tl.load(bias_at + dim_a, mask=i_ok, other=0.0).to(tl.float32)[None, :]
        acc_b += tl.load(bias_at + dim_b, mask=i_ok, other=0.0).to(tl.float32)[None, :]
    _finish_head_tile(acc_a, acc_b, rows, row_ok, i, i_ok, dim_a, dim_b, layer, is_k, kv_head,
                      pos_ptr, knorm_ptr, stride_knl, cs_ptr, stride_csp, k_out_ptr, v_out_ptr,
                      slot_ptr, k_cache_ptr, v_cache_ptr, stride_cl, stride_cs, stride_ch,
                      N, eps, NUM_KV_HEADS, HEAD_DIM, ROT_DIM, WRITE_KV, WRITE_CACHE)

Launch = tuple[Any, tuple[int, ...] | None, tuple[Any, ...], dict[str, Any]]
"""kernel, grid, args, meta; a grid of None is a plain PyTorch call `kernel(*args)`."""
GEMM_TILES = {"BLOCK_M", "BLOCK_K", "num_warps", "num_stages"}
GEMMS = ("fused", "cublas")


def run_launch(launch: Launch) -> None:
    """Launch one step of `projection_launches`."""
    kernel, grid, args, meta = launch
    if grid is None:
        kernel(*args)
    else:
        kernel[grid](*args, **meta)


def _cublas_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 out: torch.Tensor) -> None:
    """out = x @ weight.T (+ bias), rounded to x's dtype, as the reference's `linear`."""
    if bias is None:
        torch.mm(x, weight.t(), out=out)
    else:
        torch.addmm(bias, x, weight.t(), out=out)


def projection_launches(
    states: torch.Tensor,
    positions: torch.Tensor,
    rejected_rows: torch.Tensor | None,
    w: ContextProjectionWeights,
    kv_out: tuple[torch.Tensor, torch.Tensor] | None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    tiles: dict[str, int] | None = None,
    gemm: str = "fused",
) -> list[Launch]:
    """The steps of one projection (also used to compile the kernels offline).

    `gemm="fused"` (the default): the hidden norm, then the fused GEMM with the
    epilogue on its registers, whose tiles `tiles` sets. `gemm="cublas"`: the hidden
    norm, cuBLAS's GEMM into an [N, layers * 2 * kv_heads * head_dim] buffer, then
    `_kv_epilogue_kernel` (K-norm, RoPE, store).

    The fused GEMM's default tiles (BLOCK_M up to 64, BLOCK_K 64, 4 warps, 3 stages) were
    the fastest of 16 tried at batch 32 on an H100 (`benchmarks/kernels_gpu.py --tune`)
    and compile without register spills for sm_90 (tests/support/kernel_compile.py); `tiles`
    overrides them (for tuning).
    """
    n, hidden = states.shape
    hd, nkv, layers = w.head_dim, w.num_kv_heads, w.num_layers
    rot = w.cos_sin_cache.shape[-1]
    if hd % 2 or rot % 2 or rot > hd:
        raise ValueError(f"head_dim {hd} and rotary dim {rot} must be even, rotary <= head_dim")
    if w.kv_weight.shape != (layers * 2 * nkv * hd, hidden):
        raise ValueError(f"kv_weight {tuple(w.kv_weight.shape)} does not match the config")
    if states.stride(1) != 1 or w.cos_sin_cache.stride(1) != 1:
        raise ValueError("states and cos_sin_cache need a contiguous last dim")
    for name, t in [("positions", positions), ("rejected_rows", rejected_rows),
                    ("slot_mapping", cache[0] if cache is not None else None)]:
        if t is not None and t.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},): one per row")
    normed = torch.empty((n, hidden), dtype=states.dtype, device=states.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    block_r = max(1, min(16, 4096 // block_h))  # 4 rows x 1024 columns at hidden >= 1024
    norm = (
        _hidden_norm_kernel, (triton.cdiv(n, block_r),),
        (states, states.stride(0),
         rejected_rows.view(torch.uint8) if rejected_rows is not None else states,
         w.hidden_norm_weight, w.rejected_embedding,
         normed, normed.stride(0),
         n, hidden, w.eps),
        dict(HAS_REJECTED=rejected_rows is not None, BLOCK_R=block_r, BLOCK_H=block_h,
             num_warps=4),
    )

    k_norm = w.k_norm_weight.reshape(layers, hd)
    dummy = states  # never read: the matching constexpr flag is off
    if cache is not None:
        slots, k_cache, v_cache = cache
        # [layers, num_blocks, block_size, kv_heads, head_dim] -> one slot axis.
        flat = (k_cache.shape[0], -1, *k_cache.shape[3:])  # a view, never a copy
        k_cache, v_cache = k_cache.view(flat), v_cache.view(flat)
        if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
            raise ValueError("k_cache and v_cache need equal strides and contiguous head_dim")
        cache_args = (slots, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
                      k_cache.stride(2))
    else:
        cache_args = (dummy, dummy, dummy, 0, 0, 0)
    k_out, v_out = kv_out if kv_out is not None else (dummy, dummy)
    if gemm not in GEMMS:
        raise ValueError(f"gemm: one of {', '.join(GEMMS)}, got {gemm!r}")
    head_tiles = layers * 2 * nkv
    epilogue_args = (positions, k_norm, k_norm.stride(0), w.cos_sin_cache,
                     w.cos_sin_cache.stride(0), k_out, v_out, *cache_args)
    head_meta = dict(NUM_KV_HEADS=nkv, HEAD_DIM=hd, ROT_DIM=rot,
                     HALF_PAD=max(16, triton.next_power_of_2(hd // 2)),
                     IS_NEOX=w.is_neox_style, WRITE_KV=kv_out is not None,
                     WRITE_CACHE=cache is not None)
    block_m = min(64, max(16, triton.next_power_of_2(n)))
    if gemm == "cublas":
        if tiles:
            raise ValueError("tiles apply to gemm='fused' only")
        kv = torch.empty((n, w.kv_weight.shape[0]), dtype=states.dtype, device=states.device)
        epilogue = (
            _kv_epilogue_kernel, (triton.cdiv(n, block_m), head_tiles),
            (kv, kv.stride(0), *epilogue_args, n, w.eps),
            dict(**head_meta, BLOCK_M=block_m, num_warps=4),
        )
        return [norm, (_cublas_gemm, None, (normed, w.kv_weight, w.kv_bias, kv), {}), epilogue]
    tiles = {"BLOCK_M": block_m, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3, **(tiles or {})}
    if set(tiles) != GEMM_TILES:
        raise ValueError(f"tiles: only {sorted(GEMM_TILES)} can be set, got {sorted(tiles)}")
    fused = (
        _project_context_kv_kernel, (triton.cdiv(n, tiles["BLOCK_M"]), head_tiles),
        (normed, normed.stride(0),
         w.kv_weight, w.kv_weight.stride(0), w.kv_weight.stride(1),
         w.kv_bias if w.kv_bias is not None else dummy,
         *epilogue_args,
         n, hidden, w.eps),
        dict(**head_meta, HAS_BIAS=w.kv_bias is not None,
             PRECISION="ieee" if states.dtype == torch.float32 else "tf32", **tiles),
    )
    return [norm, fused]


def _run(
    states: torch.Tensor,
    positions: torch.Tensor,
    rejected_rows: torch.Tensor | None,
    w: ContextProjectionWeights,
    kv_out: tuple[torch.Tensor, torch.Tensor] | None,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    gemm: str,
) -> None:
    """Launch every step; an empty batch launches nothing."""
    if states.shape[0] == 0:
        return
    for launch in projection_launches(states, positions, rejected_rows, w, kv_out, cache,
                                      gemm=gemm):
        run_launch(launch)


def project_context_kv_triton(
    states: torch.Tensor,
    positions: torch.Tensor,
    rejected_rows: torch.Tensor | None,
    w: ContextProjectionWeights,
    gemm: str = "fused",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `project_context_kv_reference`: K, V [layers, N, kv_heads, hd]."""
    shape = (w.num_layers, states.shape[0], w.num_kv_heads, w.head_dim)
    k = torch.empty(shape, dtype=states.dtype, device=states.device)
    v = torch.empty_like(k)
    _run(states, positions, rejected_rows, w, (k, v), None, gemm)
    return k, v


def project_context_kv_into_cache_triton(
    states: torch.Tensor,
    positions: torch.Tensor,
    rejected_rows: torch.Tensor | None,
    w: ContextProjectionWeights,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    gemm: str = "fused",
) -> None:
    """Project and write straight into paged caches, skipping the K/V round trip.

    Caches are [layers, num_blocks, block_size, kv_heads, head_dim] (every
    layer's cache in the layout of `carryover_attention`); row r goes to flat
    slot `slot_mapping[r]` (block * block_size + offset) of every layer, and a
    negative slot skips the row (vLLM's padding convention).
    """
    _run(states, positions, rejected_rows, w, None, (slot_mapping, k_cache, v_cache), gemm)
