"""The suffix lookup's proposals in the drafter's slots, for a drafter trained on them.

A DFlash query block is `[bonus, MASK x K]`. A drafter trained with `python -m train
baseline --slot-proposals` (`train/slot_proposals.py`) instead reads, at every slot the
suffix trees have a proposal for, that token, and learned where to keep it and where
to correct it. Its config.json's `slot_proposals` says how its trees proposed in
training (depth, answers kept, least token probability, length factor); serving asks
its own trees (`lookups.suffix`, seeded from the folder's suffix_seed.npz and learning
while serving) the same way. The drafts are still the drafter's outputs, verified as
any others, so greedy output stays the target's.

A slot also says how sure the trees are of its proposal, when the drafter was trained
with `confidence_levels` in those settings: one of `CONFIDENCE_LEVELS` levels from the
proposal's path probability in the tree and the length of the match it continues
(`confidence_levels`), which the drafter reads as a learned embedding added to the
proposed token's. Without it the drafter would have to tell a proposal that continues a
long, always-repeated match from a one-token guess by itself; a three-layer drafter
kept fewer right proposals than the trees alone would have drafted. The level travels
with the token id through vLLM's query ids as one slot code, `token + vocab_size x
level` (`slot_codes`, `split_codes`); level 0 is no level (the bonus token, mask tokens).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

CONFIG_KEY = "slot_proposals"  # in the drafter's config.json
LEVELS_KEY = "confidence_levels"  # in its settings: CONFIDENCE_LEVELS, or absent (none)
NONE = -1  # no proposal for this slot: it keeps the mask token
PROB_EDGES = (0.25, 0.5, 0.9)  # of a proposal's path probability in the tree
LONG_MATCH = 4  # matched tokens from which a proposal continues a long match
CONFIDENCE_LEVELS = 1 + 2 * (len(PROB_EDGES) + 1)  # level 0: none; short / long x 4 bands


def slot_settings(hf_config: Any) -> dict[str, Any] | None:
    """The drafter's slot-proposal settings, None for a drafter that reads MASK tokens."""
    return getattr(hf_config, CONFIG_KEY, None) or None


def confidence_levels(probs: Sequence[float], match_len: int) -> list[int]:
    """Each proposed token's level (1 .. CONFIDENCE_LEVELS - 1): its path probability's
    band, counted twice over, for a short and for a long match."""
    base = 1 + (len(PROB_EDGES) + 1) * (match_len >= LONG_MATCH)
    return [base + bisect_right(PROB_EDGES, p) for p in probs]


def slot_codes(drafts: Sequence[Any], k: int, level_vocab: int | None) -> torch.Tensor:
    """The suffix trees' drafts (`SuffixLookup.drafts`: token_ids, probs, match_len; None
    where there is none) as [N, k] slot codes, NONE past each draft: the token ids, plus
    `level_vocab` (the vocabulary size) times their levels for a drafter that reads them
    (None: ids alone)."""
    out = torch.full((len(drafts), k), NONE, dtype=torch.int64)
    for i, draft in enumerate(drafts):
        if draft is None or not len(draft.token_ids):
            continue
        ids = np.asarray(draft.token_ids[:k], dtype=np.int64)
        if level_vocab is not None:
            ids = ids + level_vocab * np.asarray(
                confidence_levels(draft.probs[:k], draft.match_len), dtype=np.int64)
        out[i, :len(ids)] = torch.from_numpy(ids)
    return out


def split_codes(codes: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, confidence levels) of query ids holding slot codes."""
    return codes % vocab_size, codes // vocab_size


def levels_of(settings: dict[str, Any] | None) -> int:
    """How many confidence levels a drafter with these slot settings reads (0: none)."""
    return (settings or {}).get(LEVELS_KEY) or 0


def level_vocab(settings: dict[str, Any] | None, vocab_size: int) -> int | None:
    """What `slot_codes` multiplies levels by for a drafter with these slot settings:
    its vocabulary size where it reads levels, else None."""
    return vocab_size if levels_of(settings) else None


def in_slots(query_ids: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """Query blocks [N, 1 + K] with each slot's proposal ([N, K] slot codes, NONE where
    there is none) in place of its mask token: the one rule training and serving share."""
    props = proposals.to(query_ids.device)
    slots = torch.where(props >= 0, props, query_ids[:, 1:])
    return torch.cat([query_ids[:, :1], slots], dim=1)


def fill_query_slots(input_ids: torch.Tensor, codes: torch.Tensor, k: int) -> None:
    """Write each request's slot codes ([N, k'], `slot_codes`, for a step's K of k' <= k)
    into the slots of its query block, in place: `input_ids` holds the blocks
    request-major, `1 + k` ids each (the bonus token, then the slots)."""
    n = codes.shape[0]
    codes = torch.nn.functional.pad(codes, (0, k - codes.shape[1]), value=NONE)
    blocks = input_ids[:n * (1 + k)].view(n, 1 + k)
    blocks.copy_(in_slots(blocks, codes))
