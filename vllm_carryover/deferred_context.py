"""Context K/V written late: a step that drafts nothing (K = 0) only keeps its target states.

Every verified token's target states become drafter context, so a step that drafts
nothing still projected them into K/V at once (the fused projection and the drafter's
K/V for each layer): at batch 4 on a 2-core CPU that made a K = 0 step about 1.1-1.2x a
plain one, the floor that K by goodput could not go under. Nothing reads that K/V until
a request drafts again, so such a step now keeps the rows (the target's concatenated
states, their positions and cache slots) and the next step that writes context (a draft,
or a step after a drafting round) first writes them all in one call. Many steps' rows
in one projection cost little more than one step's.

The slots are the ones vLLM gave the tokens when they were computed. Written before
any later context, a slot that has since changed hands (its request finished or was
preempted) is overwritten by its new owner's own rows afterwards, and a block kept for
prefix caching gets the K/V its tokens had, as if written at once. A slot kept twice
(its block freed and reused between two K = 0 steps) gets its later row, as it would
have.
"""

from __future__ import annotations

from typing import Any

import torch

# Rows kept before they are written anyway (a long run of K = 0 steps): at 1,728
# features (SmolLM2's three target layers) about 3.5 MB in bf16, one ~15 ms projection.
MAX_ROWS = 1024


class DeferredContext:
    """The target states of K = 0 steps, kept until the drafter next writes context."""

    def __init__(self) -> None:
        self._chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.rows = 0

    def keep(self, states: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor) -> bool:
        """Keep one step's rows (copied: vLLM reuses its buffers); returns whether
        enough are kept to write them now (`MAX_ROWS`)."""
        n = states.shape[0]  # vLLM's position and slot buffers may be longer
        self._chunks.append((states.clone(), positions[:n].clone(), slots[:n].clone()))
        self.rows += n
        return self.rows >= MAX_ROWS

    def write(self, model: Any) -> None:
        """Project every kept row into the drafter's paged K/V cache."""
        if not self._chunks:
            return
        states, positions, slots = (torch.cat(parts) for parts in zip(*self._chunks, strict=True))
        self._chunks, self.rows = [], 0
        keep = latest_per_slot(slots)
        model.precompute_and_store_context_kv(model.combine_hidden_states(states[keep]),
                                              positions[keep], slots[keep], None)


def latest_per_slot(slots: torch.Tensor) -> torch.Tensor:
    """Indices of the last row for each distinct slot, in row order (one cache write
    with a slot twice would keep either row)."""
    unique, inverse = torch.unique(slots, return_inverse=True)
    if len(unique) == len(slots):
        return torch.arange(len(slots), device=slots.device)
    rows = torch.arange(len(slots), device=slots.device)
    last = torch.full_like(unique, -1, dtype=rows.dtype).scatter_reduce_(
        0, inverse, rows, reduce="amax")
    return last.sort().values
