"""Drafting near the drafter's length limit, decided per request instead of per batch.

vLLM's runner drafts only while the batch's LONGEST request leaves room for the
draft block (`GPUModelRunner._input_fits_in_drafter`: max_seq_len + K + 1 <=
the drafter's max_model_len); past that it drafts nothing for anyone and
schedules K dummy tokens (id 0) per request, which the target verifies at full
cost. So one long request turns speculation into pure overhead for every
request beside it, and a drafter with a shorter limit than the serving length
does so on every batch with one long request.

Here the same rule is applied to each request. While any request fits, the
drafter runs for the whole batch; the requests over the limit go through it
harmlessly (positions clamped to 0, no K/V written, attention over their first
few cached keys only) and their drafts are then dropped, so the scheduler
verifies none for them (0 drafts). When none fits, all get 0 drafts. A request
over the limit stays over it (its length only grows), so it never needs its
drafter cache again.

This holds where the runner hands drafts to the scheduler as lists (vLLM's
synchronous scheduling, the CPU default). Under async scheduling (a GPU
default) the scheduler has already reserved K placeholders per request when the
drafts come, so requests over the limit still verify K tokens there (now real,
if unlikely, drafts rather than dummies); reviewed, not run.
"""

from __future__ import annotations

from typing import Any

import torch

PAD_SLOT = -1  # vLLM's PADDING_SLOT_ID: KV-cache writes skip this slot


def over_limit(seq_lens: torch.Tensor, num_query: int, limit: int) -> torch.Tensor:
    """Requests whose next draft block (num_query tokens past seq_len) would pass limit."""
    return seq_lens + num_query > limit


def row_mask(over: torch.Tensor, query_start_loc: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Per flattened row: does it belong to a request over the limit (rows past the last
    request, padding, do not)."""
    ends = query_start_loc[1: over.numel() + 1].contiguous()
    rows = torch.arange(num_rows, device=over.device, dtype=ends.dtype)
    request = torch.searchsorted(ends, rows, right=True)
    return torch.cat([over, over.new_zeros(1)])[request]


class LengthLimit:
    """This round's requests over the drafter's limit, for the proposer and the runner."""

    def __init__(self, num_query: int) -> None:
        self.num_query = num_query  # tokens the drafter queries past a request's verified ones
        self.over: torch.Tensor | None = None  # [batch] bool on the device; None: all fit
        self.over_req_ids: frozenset[str] = frozenset()

    def plan(self, cad: Any, limit: int, req_ids: list[str]) -> bool:
        """Decide who drafts this round; returns whether the drafter runs at all."""
        self.over, self.over_req_ids = None, frozenset()
        if cad is None:
            return False
        if cad.max_seq_len + self.num_query <= limit:  # vLLM's own rule: the common case
            return True
        batch = cad.batch_size()
        seq_lens = (cad.seq_lens_cpu_upper_bound if cad.seq_lens_cpu_upper_bound is not None
                    else cad.seq_lens.cpu())[:batch]  # an upper bound errs towards "over"
        over = over_limit(seq_lens, self.num_query, limit)
        flags = over.tolist()
        self.over_req_ids = frozenset(r for r, o in zip(req_ids[:batch], flags, strict=True) if o)
        if bool(over.all()):
            return False
        self.over = over.to(cad.seq_lens.device)
        return True

    def clamp_positions(self, positions: torch.Tensor, query_start_loc: torch.Tensor
                        ) -> torch.Tensor:
        """A copy of the verify rows' positions with those of requests over the limit at 0,
        so every position the drafter derives from them stays inside its RoPE table and
        every block-table lookup inside the request's first block."""
        assert self.over is not None
        rows = row_mask(self.over, query_start_loc, positions.shape[0])
        return positions.masked_fill(rows, 0)

    def disable(self, context_slots: torch.Tensor, query_slots: torch.Tensor,
                query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Make the requests over the limit write nothing (their slots padded, in place) and
        attend to their first num_query cached keys only; returns the new seq_lens."""
        assert self.over is not None
        context_slots.masked_fill_(row_mask(self.over, query_start_loc, context_slots.numel()),
                                   PAD_SLOT)
        query_slots.masked_fill_(self.over.repeat_interleave(self.num_query), PAD_SLOT)
        return torch.where(self.over, torch.full_like(seq_lens, self.num_query), seq_lens)

    def drop_drafts(self, req_ids: list[str], drafts: list[list[int]]) -> list[list[int]]:
        """The runner's draft lists with none for the requests over the limit."""
        return [[] if r in self.over_req_ids else d for r, d in zip(req_ids, drafts, strict=True)]
