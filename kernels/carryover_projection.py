"""Context K/V projection of the drafter, for committed and rejected target states.

Every target state that becomes drafter context (committed or carried over) goes
through the same path: hidden norm -> (+ rejected embedding, rejected rows only)
-> one GEMM producing K and V for every drafter layer -> per-layer K-norm ->
RoPE at the row's own position. This file is the PyTorch reference; a fused
Triton kernel with the same signature plugs in through `kernels.project_context_kv`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ContextProjectionWeights:
    """Weights of the context path, stacked over the drafter's layers."""

    hidden_norm_weight: torch.Tensor  # [hidden]
    rejected_embedding: torch.Tensor  # [hidden]
    kv_weight: torch.Tensor  # [num_layers * 2 * num_kv_heads * head_dim, hidden]
    kv_bias: torch.Tensor | None  # same rows as kv_weight, or None
    k_norm_weight: torch.Tensor  # [num_layers, head_dim]
    cos_sin_cache: torch.Tensor  # [max_position, rotary_dim]: cos | sin halves
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eps: float
    is_neox_style: bool = True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, returned in the input dtype (vLLM's convention)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """Rotary embedding of `x` [..., N, heads, head_dim] at `positions` [N]."""
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].to(x.dtype).chunk(2, dim=-1)  # [N, rot/2]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        rotated = rotated.flatten(-2)
    return torch.cat([rotated, x_pass], dim=-1)


def project_context_kv_reference(
    states: torch.Tensor,
    positions: torch.Tensor,
    rejected_rows: torch.Tensor | None,
    w: ContextProjectionWeights,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Project fused target states [N, hidden] into K and V [layers, N, kv_heads, hd].

    `rejected_rows` [N] bool marks carried-over (rejected) states; they get the
    learned rejected embedding added after the hidden norm. None means no row is
    rejected, which gives exactly the plain DFlash context path.
    """
    n = states.shape[0]
    x = rms_norm(states, w.hidden_norm_weight, w.eps)
    if rejected_rows is not None:
        mark = rejected_rows.to(x.dtype).unsqueeze(-1) * w.rejected_embedding.to(x.dtype)
        x = x + mark
    kv = torch.nn.functional.linear(x, w.kv_weight, w.kv_bias)
    kv = kv.view(n, w.num_layers, 2, w.num_kv_heads, w.head_dim).permute(2, 1, 0, 3, 4)
    k, v = kv[0], kv[1]  # [L, N, nkv, hd]
    k = rms_norm(k, w.k_norm_weight.view(w.num_layers, 1, 1, w.head_dim), w.eps)
    k = apply_rope(k, positions, w.cos_sin_cache, w.is_neox_style)
    return k.contiguous(), v.contiguous()


def project_context_kv_into_cache_reference(
    states: torch.Tensor,
    positions: torch.Tensor,
    rejected_rows: torch.Tensor | None,
    w: ContextProjectionWeights,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """Project, then scatter K/V into paged caches [layers, num_blocks, block_size, nkv, hd].

    Row r goes to flat slot `slot_mapping[r]` (block * block_size + offset) of
    every layer; a negative slot skips the row (vLLM's padding convention).
    """
    k, v = project_context_kv_reference(states, positions, rejected_rows, w)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat = (k_cache.shape[0], -1, *k_cache.shape[3:])  # a view: writes land in the cache
    k_cache.view(flat)[:, slots] = k[:, keep]
    v_cache.view(flat)[:, slots] = v[:, keep]
