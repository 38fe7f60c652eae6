"""The drafter in plain PyTorch: same weights and math as the vLLM model.

`train/` trains this module, and the tests use it as the oracle for the vLLM
path: the draft block's queries attend, non-causally, over explicit
concatenated K/V (committed context, the block itself, and the carryover slot).
Embeddings and LM head are the target's own and stay frozen. `forward` gives the
backbone's logits; a drafter with a Markov head adds its bias on top, left to
right when drafting (`draft_tokens`), teacher-forced in training (`teacher_forced`).
A drafter with a draft vocabulary (`drafter.vocab`) computes its logits over those
tokens only and returns them over the whole vocabulary, -inf elsewhere, as vLLM does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm_carryover.drafter.format import (
    D2T,
    LM_HEAD,
    REJECTED_EMBEDDING,
    SLOT_CONFIDENCE,
    DrafterConfig,
)
from vllm_carryover.drafter.markov_head import MarkovHead, draft_left_to_right, greedy
from vllm_carryover.drafter.vocab import expand_logits, from_offsets, to_offsets
from vllm_carryover.kernels import (
    ContextProjectionWeights,
    apply_rope,
    project_context_kv_reference,
    rms_norm,
)
from vllm_carryover.lookups.slots import split_codes


def rope_cache(head_dim: int, max_position: int, theta: float) -> torch.Tensor:
    """cos | sin table [max_position, head_dim], as vLLM's rotary embedding builds it."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class DraftLayer(nn.Module):
    def __init__(self, d: DrafterConfig) -> None:
        super().__init__()
        h, hd = d.hidden_size, d.head_dim
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, d.num_attention_heads * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(h, d.num_key_value_heads * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(h, d.num_key_value_heads * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(d.num_attention_heads * hd, h, bias=False)
        self.self_attn.q_norm = _Weight(hd)
        self.self_attn.k_norm = _Weight(hd)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, d.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, d.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(d.intermediate_size, h, bias=False)
        self.input_layernorm = _Weight(h)
        self.post_attention_layernorm = _Weight(h)


class _Weight(nn.Module):
    """An RMSNorm weight holder, named like the checkpoint's `*.weight`."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))


class TorchDrafter(nn.Module):
    def __init__(self, d: DrafterConfig, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = d
        n_feat = len(d.target_layer_ids)
        self.fc = nn.Linear(d.target_hidden_size * n_feat, d.hidden_size, bias=False)
        self.hidden_norm = _Weight(d.hidden_size)
        self.norm = _Weight(d.hidden_size)
        self.layers = nn.ModuleList(DraftLayer(d) for _ in range(d.num_hidden_layers))
        self.rejected_embedding = nn.Parameter(torch.zeros(d.hidden_size))
        self.markov_head = MarkovHead(d.vocab_size, d.markov_rank) if d.markov_rank else None
        # each slot's confidence level, added to its proposal's embedding (lookups.slots)
        self.slot_confidence = nn.Parameter(torch.zeros(d.confidence_levels, d.hidden_size)) \
            if d.confidence_levels else None
        self.vocab_ids: torch.Tensor | None = None  # set by train's sampled softmax
        # a draft vocabulary: target ids of the head's rows, and the head (checkpoint's)
        self.register_buffer("draft_ids", None, persistent=False)
        self.register_buffer("draft_head", None, persistent=False)
        self.register_buffer("embed", embed_weight.detach(), persistent=False)
        head = lm_head_weight if lm_head_weight is not None else embed_weight
        self.register_buffer("lm_head", head.detach(), persistent=False)
        self.register_buffer(
            "cos_sin", rope_cache(d.head_dim, d.max_position_embeddings, d.rope_theta),
            persistent=False)

    def load_checkpoint_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load a drafter checkpoint's tensors (a missing rejected embedding is zero, and
        so are missing confidence levels: the drafter then reads proposals as before)."""
        state = dict(state)
        state.setdefault(REJECTED_EMBEDDING, torch.zeros(self.config.hidden_size))
        if self.slot_confidence is not None:
            state.setdefault(SLOT_CONFIDENCE, torch.zeros_like(self.slot_confidence))
        head, d2t = state.pop(LM_HEAD, None), state.pop(D2T, None)
        if self.config.draft_vocab_size:
            assert head is not None and d2t is not None, "a draft vocabulary needs both"
            device = self.lm_head.device
            self.draft_ids, self.draft_head = from_offsets(d2t).to(device), head.float().to(
                device)
        self.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach().clone() for k, v in self.state_dict().items()}
        if self.draft_ids is not None and self.draft_head is not None:
            state |= {LM_HEAD: self.draft_head.detach().cpu().clone(),
                      D2T: to_offsets(self.draft_ids.cpu())}
        return state

    def projection_weights(self) -> ContextProjectionWeights:
        d = self.config
        kv = [torch.cat([lay.self_attn.k_proj.weight, lay.self_attn.v_proj.weight])
              for lay in self.layers]
        return ContextProjectionWeights(
            hidden_norm_weight=self.hidden_norm.weight,
            rejected_embedding=self.rejected_embedding,
            kv_weight=torch.cat(kv),
            kv_bias=None,
            k_norm_weight=torch.stack([lay.self_attn.k_norm.weight for lay in self.layers]),
            cos_sin_cache=self.cos_sin,
            num_layers=d.num_hidden_layers,
            num_kv_heads=d.num_key_value_heads,
            head_dim=d.head_dim,
            eps=d.rms_norm_eps,
        )

    def fuse(self, aux_states: torch.Tensor) -> torch.Tensor:
        """Target aux-layer states [..., n_layers * H_target] -> fused context states."""
        return self.fc(aux_states)

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor,
                   rejected: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [layers, N, kv_heads, hd] of context rows (rejected rows marked)."""
        return project_context_kv_reference(fused, positions, rejected,
                                            self.projection_weights())

    def forward(self, query_ids: torch.Tensor, query_pos: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                ctx_mask: torch.Tensor | None = None, row_k: torch.Tensor | None = None,
                row_v: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, Q, V] of query blocks [B, Q] over context K/V [L, B, S, kv, hd].

        Each query attends to every unmasked context key of its own row and to
        every key of its own block (non-causal). `ctx_mask` [B, S] (or [B, Q, S])
        is True where a key is visible. Context K/V of batch size 1 is shared by
        all B rows (training: every anchor of a sequence reads the same context,
        up to its own mask), and is then never copied per row. `row_k`, `row_v`
        [L, B, R, kv, hd] are more keys of each row's own, after the context
        (training's carried-over slot); `ctx_mask` then spans S + R.
        """
        d = self.config
        b, q = query_ids.shape
        s = ctx_k.shape[2] + (0 if row_k is None else row_k.shape[2])
        x = self.embed_query(query_ids)
        visible = torch.ones(b, q, s + q, dtype=torch.bool, device=x.device)
        if ctx_mask is not None:
            cm = ctx_mask if ctx_mask.dim() == 3 else ctx_mask[:, None, :].expand(b, q, s)
            visible[:, :, :s] = cm
        bias = torch.zeros(visible.shape, dtype=x.dtype, device=x.device)
        bias = bias.masked_fill(~visible, float("-inf"))[:, None]  # [B, 1, Q, S+Q]
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            h = rms_norm(x, layer.input_layernorm.weight, d.rms_norm_eps)
            qh = a.q_proj(h).view(b, q, d.num_attention_heads, d.head_dim)
            kh = a.k_proj(h).view(b, q, d.num_key_value_heads, d.head_dim)
            vh = a.v_proj(h).view(b, q, d.num_key_value_heads, d.head_dim)
            qh = self._rope(rms_norm(qh, a.q_norm.weight, d.rms_norm_eps), query_pos)
            kh = self._rope(rms_norm(kh, a.k_norm.weight, d.rms_norm_eps), query_pos)
            if row_k is not None and row_v is not None:  # a row's own keys: its slot, its block
                kh, vh = torch.cat([row_k[i], kh], dim=1), torch.cat([row_v[i], vh], dim=1)
            if ctx_k.shape[1] == 1 and b > 1:
                attn = self._attend_shared(qh, kh, vh, ctx_k[i, 0], ctx_v[i, 0], bias)
            else:
                attn = self._attend(qh, kh, vh, ctx_k[i], ctx_v[i], bias)
            x = x + a.o_proj(attn.transpose(1, 2).reshape(b, q, -1))
            h = rms_norm(x, layer.post_attention_layernorm.weight, d.rms_norm_eps)
            x = x + layer.mlp.down_proj(F.silu(layer.mlp.gate_proj(h)) * layer.mlp.up_proj(h))
        x = rms_norm(x, self.norm.weight, d.rms_norm_eps)
        if self.draft_ids is not None and self.draft_head is not None and self.vocab_ids is None:
            return expand_logits(x @ self.draft_head.T, self.draft_ids, d.vocab_size)
        return x @ self.lm_head.T.float()

    def embed_query(self, query_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings of query ids, which hold slot codes (a token and its
        confidence level) where the drafter reads levels."""
        if self.slot_confidence is None:
            return F.embedding(query_ids, self.embed).float()
        ids, levels = split_codes(query_ids, self.config.vocab_size)
        return F.embedding(ids, self.embed).float() + self.slot_confidence[levels]

    def _attend(self, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                ctx_k: torch.Tensor, ctx_v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Attention [B, heads, Q, hd] of queries qh [B, Q, heads, hd] over each row's
        context K/V [B, S, kv, hd] and its own keys kh, vh [B, R + Q, kv, hd]."""
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        keys = torch.cat([ctx_k, kh], dim=1).transpose(1, 2)  # [B, kv, S+Q, hd]
        vals = torch.cat([ctx_v, vh], dim=1).transpose(1, 2)
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        scores = qh.transpose(1, 2) @ keys.transpose(-1, -2) / math.sqrt(qh.shape[-1])
        return torch.softmax(scores + bias, dim=-1) @ vals

    def _attend_shared(self, qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                       ctx_k: torch.Tensor, ctx_v: torch.Tensor, bias: torch.Tensor
                       ) -> torch.Tensor:
        """`_attend` with one context K/V [S, kv, hd] shared by all rows: every row's
        queries meet the context keys in one matmul per KV head, its own keys (slot,
        block) in a small one per row, and the context is never expanded (in training, with ~32
        anchors per sequence, the copies and their gradients' sums cost more than the
        attention itself)."""
        b, q, heads, hd = qh.shape
        kv, own = ctx_k.shape[1], kh.shape[1]  # own: a row's own keys (slot, block)
        g, s = heads // kv, ctx_k.shape[0]
        q5 = qh.view(b, q, kv, g, hd) / math.sqrt(hd)  # head h reads KV head h // g
        q_ctx = q5.permute(2, 0, 3, 1, 4).reshape(kv, b * g * q, hd)
        s_ctx = (q_ctx @ ctx_k.permute(1, 2, 0)).view(kv, b, g, q, s).transpose(0, 1)
        q_blk = q5.permute(0, 2, 3, 1, 4).reshape(b, kv, g * q, hd)
        s_blk = (q_blk @ kh.permute(0, 2, 3, 1)).view(b, kv, g, q, own)
        scores = torch.cat([s_ctx, s_blk], dim=-1) + bias[:, :, None]  # [B, kv, g, Q, S+own]
        p = torch.softmax(scores, dim=-1)
        p_ctx = p[..., :s].transpose(0, 1).reshape(kv, b * g * q, s)
        out = (p_ctx @ ctx_v.transpose(0, 1)).view(kv, b, g, q, hd).transpose(0, 1)
        out = out + p[..., s:] @ vh.transpose(1, 2)[:, :, None]  # [B, kv, g, Q, hd]
        return out.reshape(b, heads, q, hd)

    def teacher_forced(self, logits: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """Backbone logits [..., V] plus the Markov bias of the true previous tokens
        `prev_ids` [...] (unchanged without a head)."""
        if self.markov_head is None:
            return logits
        return logits + self.markov_head.bias(prev_ids, self.vocab_ids)

    def draft_tokens(self, logits: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
        """Greedy drafts [B, K] from backbone logits [B, K, V] over the full vocabulary,
        left to right through the Markov head when there is one (as vLLM drafts)."""
        if self.markov_head is None:
            return logits.argmax(-1)
        return draft_left_to_right(logits, bonus, self.markov_head, greedy)[0]

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, *x.shape[2:])
        return apply_rope(flat, pos.reshape(-1), self.cos_sin, True).view_as(x)

    def draft_logits(self, fused_ctx: torch.Tensor, ctx_pos: torch.Tensor,
                     bonus_token: int, block_start: int, num_draft: int,
                     slot_states: torch.Tensor | None = None,
                     slot_pos: torch.Tensor | None = None,
                     slot_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [num_draft, V] of one request's next block, as the proposer drafts it.

        Keys: committed context, then the carried-over (rejected) states, if any.
        `slot_ids` [num_draft]: the block's slot codes where a drafter reads lookup
        proposals there (`lookups.slots`), else mask tokens.
        """
        k, v = self.context_kv(fused_ctx, ctx_pos)
        if slot_states is not None and slot_states.shape[0] > 0:
            assert slot_pos is not None
            sk, sv = self.context_kv(slot_states, slot_pos,
                                     torch.ones(slot_states.shape[0], dtype=torch.bool))
            k, v = torch.cat([k, sk], dim=1), torch.cat([v, sv], dim=1)
        slots = ([self.config.mask_token_id] * num_draft if slot_ids is None
                 else slot_ids.tolist())
        ids = torch.tensor([[bonus_token, *slots]])
        pos = torch.arange(block_start, block_start + num_draft + 1)[None]
        return self(ids, pos, k[:, None], v[:, None])[0, 1:]
