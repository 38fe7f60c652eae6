"""Which tokens the drafter's softmax covers in training, to save CPU time.

The LM head (the target's tied embedding, frozen) dominates the drafter's cost.
Training restricts the softmax to the tokens of the training data plus a fresh
random sample of the other tokens each step (negatives), and remaps the labels;
evaluation always uses the full vocabulary. A drafter with a draft vocabulary
(`with_dataset_vocab`, from the data's responses) is trained over those tokens only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from vllm_carryover.train.data import response_token_counts
from vllm_carryover.train.dflash_loss import IGNORE
from vllm_carryover.train.paths import data_dir

from vllm_carryover.drafter.torch_model import TorchDrafter
from vllm_carryover.drafter.vocab import build as build_draft_vocab


def step_vocab(base: torch.Tensor, vocab_size: int, num_negatives: int,
               gen: torch.Generator, universe: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted ids: `base` (the data's tokens) plus up to `num_negatives` random others,
    drawn from `universe` (a draft vocabulary) when given, else from the vocabulary."""
    if num_negatives <= 0:
        return base
    if universe is None:
        neg = torch.randint(vocab_size, (num_negatives,), generator=gen)
    else:
        neg = universe[torch.randint(universe.numel(), (num_negatives,), generator=gen)]
    return torch.unique(torch.cat([base, neg]))


def remap_labels(labels: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Labels as indices into `ids`; labels outside the subset become IGNORE."""
    table = torch.full((vocab_size,), IGNORE, dtype=torch.long, device=labels.device)
    table[ids] = torch.arange(ids.numel(), device=labels.device)
    return torch.where(labels == IGNORE, labels, table[labels.clamp(min=0)])


@contextmanager
def restricted_head(model: TorchDrafter, ids: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the drafter's logits (LM head and Markov bias) cover only the
    tokens `ids` (None: all)."""
    if ids is None:
        yield
        return
    full = model.lm_head
    model.lm_head, model.vocab_ids = full[ids], ids
    try:
        yield
    finally:
        model.lm_head, model.vocab_ids = full, None


def with_dataset_vocab(cfg: dict[str, Any], state: dict[str, torch.Tensor], target: str,
                       data: str, size: int
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A drafter cut to the `size` tokens the target wrote most in dataset `data`'s
    train responses (`vllm_carryover.drafter.vocab`)."""
    counts = response_token_counts(data_dir(data), cfg["vocab_size"])
    return build_draft_vocab(cfg, state, target, counts, size)
