"""A draft vocabulary: the drafter's LM head over the tokens the target actually writes.

On a CPU most of a drafting step is the LM head (K rows times the whole
vocabulary; 49,152 tokens for SmolLM2). A drafter can only gain where it
proposes what the target writes, and a small model writes a few thousand tokens
most of the time, so the head is cut to the `size` tokens most frequent in the
target's own responses (FR-Spec's frequency-ranked head; EAGLE-3 stores the same
map as `d2t`). vLLM's DFlash drafter computes the logits over those rows and
scatters them back into the full vocabulary (the others at -inf) before drafting,
so verification, and with it the output, is unchanged; sampled drafting gives
rejection sampling the probabilities it really drew from.

The drafter's LM head is the target's, frozen (never trained), so any trained
drafter converts exactly: its logits over the kept tokens are the same numbers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from vllm_carryover.drafter.format import D2T, LM_HEAD
from vllm_carryover.drafter.target_weights import target_lm_head


def token_counts(sequences: Iterable[Iterable[int]], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in `sequences` [vocab_size] (int64)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for seq in sequences:
        ids = torch.as_tensor(list(seq), dtype=torch.int64)
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def most_frequent(counts: torch.Tensor, size: int,
                  always: Iterable[int] = ()) -> torch.Tensor:
    """The `size` most frequent token ids, `always` included (special tokens such as the
    end-of-turn token), sorted ascending."""
    forced = torch.as_tensor(sorted(set(always)), dtype=torch.int64)
    if size > counts.numel() or size < forced.numel():
        raise ValueError(f"a draft vocabulary of {size} tokens must hold the "
                         f"{forced.numel()} forced ones and fit a {counts.numel()}-token "
                         "vocabulary")
    score = counts.double().clone()
    score[forced] = float("inf")
    # stable order among equal counts: the lower id first
    order = torch.argsort(-score, stable=True)
    return order[:size].sort().values


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """The share of counted tokens that the draft vocabulary `ids` holds."""
    return float(counts[ids].sum()) / max(int(counts.sum()), 1)


def to_offsets(ids: torch.Tensor) -> torch.Tensor:
    """`d2t`: target id minus draft id, per draft id."""
    return ids - torch.arange(ids.numel(), dtype=ids.dtype)


def from_offsets(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary (the inverse of `to_offsets`)."""
    return d2t.long() + torch.arange(d2t.numel(), dtype=torch.int64)


def with_draft_vocab(cfg: dict[str, Any], state: dict[str, torch.Tensor],
                     target_lm_head: torch.Tensor, ids: torch.Tensor
                     ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A drafter's config and weights with its LM head cut to target ids `ids`: its own
    head (the target's rows) and the `d2t` map. A draft vocabulary already there is
    replaced."""
    ids = ids.long()
    if ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError("draft vocabulary ids must be non-empty, sorted and unique")
    cfg = dict(cfg, draft_vocab_size=int(ids.numel()))
    state = {k: v for k, v in state.items() if k not in (LM_HEAD, D2T)}
    state[LM_HEAD] = target_lm_head[ids].detach().clone()
    state[D2T] = to_offsets(ids)
    return cfg, state


def expand_logits(draft_logits: torch.Tensor, ids: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
    """Logits over the draft vocabulary [..., len(ids)] as logits over the whole
    vocabulary [..., vocab_size], -inf elsewhere (what vLLM's DFlash does)."""
    full = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    full[..., ids] = draft_logits
    return full


def end_tokens(target: str | Path) -> list[int]:
    """The target's end-of-sequence ids (always kept in a draft vocabulary)."""
    eos = json.loads((Path(target) / "config.json").read_text()).get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def build(cfg: dict[str, Any], state: dict[str, torch.Tensor], target: str | Path,
          counts: torch.Tensor, size: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """`with_draft_vocab` over the `size` tokens most frequent in `counts` (the target's
    responses), its end tokens included; the coverage is recorded in the config."""
    ids = most_frequent(counts, size, always=end_tokens(target))
    cfg, state = with_draft_vocab(cfg, state, target_lm_head(target), ids)
    meta = dict(cfg.get("carryover_config") or {},
                draft_vocab={"size": size, "coverage": round(coverage(counts, ids), 5),
                             "counted_tokens": int(counts.sum())})
    return dict(cfg, carryover_config=meta), state
