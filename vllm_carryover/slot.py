"""Where a request's carried-over K/V live: its slot, next to the query block.

vLLM's padded verify batch gives each request the rows `[x_n, d_1..d_K]`; the
last `num_rejected` of them are the rejected drafts. Their context K/V are
written at their own positions n+a+1..n+K, exactly where DFlash writes them.
DFlash then overwrites them with the next query block; carryover instead shifts
the query block's *physical* cache slots past them (its RoPE positions stay
logical) and extends `seq_lens` to cover them. The drafter is non-causal, so
every query of the block attends to committed context + block + slot.

The slot is therefore the span of at most K cache entries right after the
request's committed context, rewritten every round by construction: a round
with no rejection, the first draft after a prefill, or a resumed request has
`num_rejected == 0` and so an empty slot. It lies in the request's own blocks,
beyond its committed tokens, so prefix caching never shares it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ---- the rule, per request -----------------------------------------------------------
# A request whose bonus token sits at position n drafted d_1..d_K at n+1..n+K and had
# d_1..d_a accepted: it has `committed = n + a + 1` tokens of context, carries the
# K - a rejected drafts, and stores its next query block right after them. Every
# query of that block sees all committed keys and all carried ones (non-causal).
# Inference (below), training (`train.carryover`, `train.headroom`) and the slot
# checks (`slot_table`) take the rule from these functions.


def carried_drafts(accepted: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """[..., K] bool: draft j (0-based) is carried over iff it was rejected, j >= a."""
    return torch.arange(num_drafts, device=accepted.device) >= accepted[..., None]


def draft_positions(bonus_position: torch.Tensor, num_drafts: int) -> torch.Tensor:
    """[..., K] positions of d_1..d_K: a carried draft keeps its own position."""
    return bonus_position[..., None] + 1 + torch.arange(num_drafts,
                                                        device=bonus_position.device)


def slot_positions(committed: int, carried: int) -> range:
    """Positions of a request's carried states: right after its committed context."""
    return range(committed, committed + carried)


def query_storage(position: torch.Tensor | int, carried: torch.Tensor | int
                  ) -> torch.Tensor | int:
    """Where a query token of logical `position` is stored: past the slot, which it
    must not overwrite (its RoPE position stays logical)."""
    return position + carried


def attended_keys(committed: int, carried: int, block_len: int) -> int:
    """Keys the next block attends to: committed context + slot + the block itself."""
    return committed + carried + block_len


def required_lookahead(num_drafts: int) -> int:
    """KV slots a request needs past its verified rows (bonus n, drafts to n+K).

    The next block's last token is stored at committed + carried + K, at most
    (n + a + 1) + (K - a) + K = n + 2K + 1: K + 1 slots past n + K, whatever a is.
    vLLM reserves its `num_lookahead_tokens` there (K + 1 for DFlash in 0.32),
    so carryover fits exactly, with no slack; `patches.integration` checks it at startup.
    """
    return num_drafts + 1


# ---- vLLM's batch: the same rule over flattened requests ------------------------------


@dataclass(frozen=True)
class SlotLayout:
    """Per-round carryover layout for a batch of requests."""

    carried: torch.Tensor  # [batch] int32: rejected states kept in each request's slot
    rejected_rows: torch.Tensor  # [num_context] bool: rows that are carried over


def plan_slots(
    query_start_loc: torch.Tensor,
    num_rejected: torch.Tensor,
    num_context: int,
    max_slot: int,
) -> SlotLayout:
    """Decide which verify rows each request carries over this round.

    `num_rejected` comes from vLLM (`num_draft + 1 - valid_count`, 0 without
    drafts). A value above `max_slot` means the request had no valid token at
    all (a discarded request); nothing is carried for it.
    """
    batch = num_rejected.shape[0]
    carried = torch.where(num_rejected <= max_slot, num_rejected,
                          torch.zeros_like(num_rejected)).to(torch.int32)
    ends = query_start_loc[1 : batch + 1].to(torch.int64)
    rows = torch.arange(num_context, device=ends.device)
    owner = torch.searchsorted(ends, rows, right=True).clamp_(max=batch - 1)
    rejected_rows = rows >= (ends - carried.to(torch.int64))[owner]
    return SlotLayout(carried=carried, rejected_rows=rejected_rows)


def shift_query_slots(
    query_positions: torch.Tensor,
    carried: torch.Tensor,
    num_query_per_req: int,
    block_table: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Physical cache slots of the query block, placed after each request's slot.

    Query token j of request i has logical position p; it is stored at p +
    carried[i] so that it does not overwrite the carried-over K/V.
    """
    batch = carried.shape[0]
    shift = carried.to(torch.int64).repeat_interleave(num_query_per_req)
    physical = query_storage(query_positions[: batch * num_query_per_req].to(torch.int64),
                             shift)
    req = torch.arange(batch, device=physical.device).repeat_interleave(num_query_per_req)
    block_idx = (physical // block_size).clamp_(max=block_table.shape[1] - 1)
    block_ids = block_table[req, block_idx].to(torch.int64)
    return block_ids * block_size + physical % block_size
