"""How lookup proposals become drafts: the suffix lookup's (`lookups.suffix`) tokens
in the leading slots of a request's draft row, the drafter's beside them.

A request the lookup has a proposal for drafts it; the others keep the drafter's
first `lookup_drafter_k` tokens (`draft_lengths`; why one drafter token:
docs/results.md). The lookup runs first: a step in which every request has a
proposal skips the drafter's forward (`lookups_suffice`; most steps at batch 1). A
step in which the drafter does run scores only the positions a request can keep
(`drafter_rows_kept`, `score_leading_rows`): with `lookup_drafter_k` 1 its LM head
covers one row per request instead of K.

Sampling stays exact: a lookup token is a deterministic proposal, so its draft
distribution is one-hot (`one_hot_probs`, `make_lookup_probs_one_hot`; what vLLM's
rejection sampler assumes for n-gram and suffix drafts). Where a row must stay K
wide (vLLM's async scheduling), the drafter's tokens after a short run stay too;
they were drawn from distributions that do not depend on the lookup's. The
rejected lookup tokens are carried into the next draft like any other: they are
the target's states of rejected tokens, which is what the drafter's rejected
embedding marks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def lookups_suffice(proposals: list[Sequence[int]], k: int, rows_stay_wide: bool,
                    drafter_k: int | None) -> bool:
    """Whether a step's drafts can all come from the lookups, so that the drafter's
    forward is skipped: every request has a proposal, of all K tokens where rows stay
    K wide (async scheduling verifies the row's tail too), or keeps none of the
    drafter's tokens anyway (`drafter_k` 0: see `draft_lengths`)."""
    if rows_stay_wide:
        return all(len(p) >= k for p in proposals)
    return drafter_k == 0 or all(len(p) for p in proposals)


def write_drafts(drafts: torch.Tensor, proposals: list[Sequence[int]]) -> torch.Tensor:
    """Put (in place) each request's proposal into the leading tokens of its draft row
    [batch, K]; returns [batch, K] bool, True where a draft token came from a lookup."""
    import torch

    from_lookup = torch.zeros(drafts.shape, dtype=torch.bool)
    for i, found in enumerate(proposals):
        if len(found):
            drafts[i, : len(found)] = torch.as_tensor(np.asarray(found, dtype=np.int64))
            from_lookup[i, : len(found)] = True
    return from_lookup.to(drafts.device)


def one_hot_probs(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The draft distributions [..., V] of lookup tokens [...]: one-hot at each (what
    rejection sampling needs for deterministic drafts)."""
    import torch

    probs = torch.zeros((*drafts.shape, vocab_size), dtype=torch.float32, device=drafts.device)
    return probs.scatter_(-1, drafts.long().unsqueeze(-1), 1.0)


def make_lookup_probs_one_hot(probs: torch.Tensor, drafts: torch.Tensor,
                              from_lookup: torch.Tensor) -> None:
    """Set (in place) the draft distribution [batch, K, V] of each lookup token to
    one-hot at that token."""
    flat = probs.view(-1, probs.shape[-1])
    rows = from_lookup.flatten().nonzero().squeeze(1)
    flat[rows] = one_hot_probs(drafts.flatten()[rows], probs.shape[-1])


def drafter_rows_kept(k: int, drafter_k: int | None, rows_stay_wide: bool) -> int:
    """How many of its K positions the drafter drafts that any request can keep: all
    where rows stay K wide (async scheduling verifies the whole row) or without a
    `drafter_k`, else the first `drafter_k`."""
    return k if rows_stay_wide or drafter_k is None else min(drafter_k, k)


def draft_lengths(from_lookup: torch.Tensor, drafter_k: int | None) -> list[int]:
    """How many drafts each request keeps (synchronous scheduling): its lookup run
    where it has one (the drafter's tokens after a short run were drafted for another
    prefix), else the drafter's first `drafter_k` (None: all; its later positions are
    rarely accepted)."""
    import torch

    width = from_lookup.shape[1]
    run = from_lookup.sum(dim=1)
    kept = drafter_rows_kept(width, drafter_k, rows_stay_wide=False)
    return torch.where(run > 0, run, kept).tolist()


Sample = Callable[["torch.Tensor"], "tuple[torch.Tensor, torch.Tensor | None]"]


def score_leading_rows(hidden: torch.Tensor, k: int, rows: int, sample: Sample
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens [batch * K] (and their distributions [batch * K, V] where sampled)
    from the drafter's last hidden states [batch * K, H], scoring only each request's
    first `rows` positions (the drafter's LM head at up to 16 requests on the 2-core
    CPU: 2.2 ms a step over 7 rows per request, 0.7 ms over 1). The positions after
    them repeat each request's last drafted token with a one-hot distribution, a
    valid draft that no request keeps (`draft_lengths`)."""
    import torch

    if rows == k:
        return sample(hidden)
    leading = hidden.view(-1, k, hidden.shape[-1])[:, :rows].flatten(0, 1)
    tokens, probs = sample(leading)
    tokens = tokens.view(-1, rows)
    tail = tokens[:, -1:].expand(-1, k - rows)
    wide = torch.cat((tokens, tail), dim=1).flatten()
    if probs is None:
        return wide, None
    vocab = probs.shape[-1]
    return wide, torch.cat((probs.view(-1, rows, vocab), one_hot_probs(tail, vocab)),
                           dim=1).flatten(0, 1)
