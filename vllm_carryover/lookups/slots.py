"""The suffix lookup's proposals in the drafter's slots, for a drafter trained on them.

A DFlash query block is `[bonus, MASK x K]`. A drafter trained with `python -m train
baseline --slot-proposals` (`train/slot_proposals.py`) instead reads, at every slot the
suffix trees have a proposal for, that token, and learned where to keep it and where
to correct it. Its config.json's `slot_proposals` says how its trees proposed in
training (depth, answers kept, least token probability, length factor); serving asks
its own trees (`lookups.suffix`, seeded from the folder's suffix_seed.npz and learning
while serving) the same way. The drafts are still the drafter's outputs, verified as
any others, so greedy output stays the target's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

CONFIG_KEY = "slot_proposals"  # in the drafter's config.json
NONE = -1  # no proposal for this slot: it keeps the mask token


def slot_settings(hf_config: Any) -> dict[str, Any] | None:
    """The drafter's slot-proposal settings, None for a drafter that reads MASK tokens."""
    return getattr(hf_config, CONFIG_KEY, None) or None


def padded(proposals: Sequence[Sequence[int]], k: int) -> torch.Tensor:
    """Proposals of at most `k` tokens as one [N, k] tensor, NONE where there is none."""
    out = torch.full((len(proposals), k), NONE, dtype=torch.int64)
    for i, found in enumerate(proposals):
        if len(found):
            out[i, :len(found)] = torch.as_tensor(np.asarray(found, dtype=np.int64))
    return out


def in_slots(query_ids: torch.Tensor, proposals: torch.Tensor) -> torch.Tensor:
    """Query blocks [N, 1 + K] with each slot's proposal ([N, K], NONE where there is
    none) in place of its mask token: the one rule training and serving share."""
    props = proposals.to(query_ids.device)
    slots = torch.where(props >= 0, props, query_ids[:, 1:])
    return torch.cat([query_ids[:, :1], slots], dim=1)


def fill_query_slots(input_ids: torch.Tensor, proposals: Sequence[Sequence[int]],
                     k: int) -> None:
    """Write each request's proposal (at most `k` tokens) into the slots of its query
    block, in place: `input_ids` holds the blocks request-major, `1 + k` ids each (the
    bonus token, then the slots)."""
    blocks = input_ids[:len(proposals) * (1 + k)].view(-1, 1 + k)
    blocks.copy_(in_slots(blocks, padded(proposals, k)))
