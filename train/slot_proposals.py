"""Lookup proposals in the draft block's slots, which the drafter keeps or corrects.

A plain DFlash block is `[bonus, MASK x K]`: every slot's query starts as the same mask
embedding, so a drafter of few layers cannot continue text that the request repeats,
which is most of what this target's answers make predictable. Here slot j gets the id
of the token the suffix lookup (`vllm_carryover.lookups.suffix`, the lookup serving
runs) proposes for its position wherever it proposes one, and MASK elsewhere; the
drafter learns where to keep a proposal and where to correct it.

Training sees proposals as serving makes them: from the request's own tree (its prompt
and its answer up to the bonus token) and from a tree of other answers. So that no
sequence's own labels are in its answer tree, the train split is halved by row and each
half gets its proposals from a tree of the other half's answers (at most
`max_cached_requests` of them, as serving's seed); held-out sequences use the first
half's tree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from vllm_carryover.lookups.slots import (
    CONFIDENCE_LEVELS,
    CONFIG_KEY,
    LEVELS_KEY,
    NONE,
    in_slots,
    levels_of,
    slot_codes,
)
from vllm_carryover.lookups.suffix import SuffixLookup
from vllm_carryover.lookups.texts import WholeTexts


@dataclass(frozen=True)
class ProposalSettings:
    """How the suffix trees propose for slots; the drafter's config keeps them, so that
    serving asks its trees the same way."""

    max_tree_depth: int = 24  # vLLM's suffix_decoding_max_tree_depth default
    max_cached_requests: int = 10_000  # answers in the answer tree, as serving's seed
    min_token_prob: float = 0.0  # every continuation the trees have: the drafter judges
    max_spec_factor: float = 8.0  # proposals up to 8x the matched length
    confidence_levels: int = CONFIDENCE_LEVELS  # 0: the slots hold token ids alone

    def to_dict(self) -> dict[str, Any]:
        return {"source": "suffix", **self.__dict__}


class SlotProposals:
    """Per-position proposals [T, K] of sequences, from answer trees they are not in."""

    def __init__(self, answers: dict[int, np.ndarray], settings: ProposalSettings,
                 num_slots: int, vocab_size: int) -> None:
        """`answers`: the train split's answers by dataset row; `vocab_size`: the
        target's, for the slot codes of a drafter that reads confidence levels."""
        self.settings, self.num_slots = settings, num_slots
        self.level_vocab = vocab_size if settings.confidence_levels else None
        self.lookups = []  # lookup h: the answers of the rows whose parity is not h
        for h in (0, 1):
            lookup = SuffixLookup(settings.max_tree_depth, settings.max_cached_requests,
                                  settings.max_spec_factor, settings.min_token_prob,
                                  max_model_len=1 << 30)
            lookup.seed([a for row, a in answers.items() if row % 2 != h])
            self.lookups.append(lookup)

    def of(self, tokens: torch.Tensor, response_start: int, half: int) -> torch.Tensor:
        """[T, K] int64 slot codes: row p is what the lookup proposes after
        `tokens[:p + 1]` (the bonus token at p), as serving's would at that step;
        NONE-padded, and NONE before the response."""
        lookup, req = self.lookups[half], ["slot-proposals"]  # not a seeded answer's id
        ids = tokens.cpu().numpy().astype(np.int32)
        out = torch.full((len(ids), self.num_slots), NONE, dtype=torch.int64)
        for p in range(response_start, len(ids) - 1):
            text = WholeTexts([ids[:p + 1]])
            lookup.learn(req, text, [response_start])
            out[p] = slot_codes(lookup.drafts(req, text, self.num_slots), self.num_slots,
                                self.level_vocab)[0]
        lookup.learn([], WholeTexts([]), [])  # the request ends ...
        lookup.cache.evict_cached_response(req[0])  # ... and leaves no answer behind
        return out


def slot_proposals_of(data: str, settings: dict[str, Any], num_slots: int,
                      vocab_size: int) -> SlotProposals:
    """The proposals a drafter's `slot_proposals` config asks for, over dataset `data`."""
    from vllm_carryover.train.data import load_samples
    from vllm_carryover.train.paths import data_dir

    # settings without levels are a drafter's from before them: token ids alone
    kept = {LEVELS_KEY: 0} | {k: v for k, v in settings.items() if k != "source"}
    # rows numbered as `baseline.load_sequences` numbers them
    answers = {row: np.asarray(r["response_ids"], dtype=np.int32)
               for row, r in enumerate(load_samples(data_dir(data))) if r["split"] == "train"}
    return SlotProposals(answers, ProposalSettings(**kept), num_slots, vocab_size)


def with_slot_proposals(cfg: dict[str, Any], asked: bool, continued: bool) -> dict[str, Any]:
    """A drafter config with the slot settings `--slot-proposals` asks for: a new
    drafter's, or confidence levels added to a continued one whose slots hold token ids
    alone (their embedding starts at zero, so it drafts as before)."""
    have = cfg.get(CONFIG_KEY)
    if not asked or levels_of(have):
        return cfg
    if continued and not have:
        raise SystemExit("--slot-proposals makes a new drafter; the --init-run drafter "
                         "reads mask tokens in its slots: drop one of the two")
    new = ProposalSettings().to_dict()
    return cfg | {CONFIG_KEY: have | {LEVELS_KEY: new[LEVELS_KEY]} if have else new}


def proposal_feeds(cfg: dict[str, Any], data: str, feed: Callable[[Any], Any]
                   ) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """(train feed, held-out feed): `feed` as it is for a drafter that reads MASK
    tokens, else with each sequence's slot proposals as the drafter's config asks."""
    if not cfg.get(CONFIG_KEY):
        return feed, feed
    proposals = slot_proposals_of(data, cfg[CONFIG_KEY], cfg["block_size"] - 1,
                                  cfg["vocab_size"])
    return (with_proposals(feed, proposals, heldout=False),
            with_proposals(feed, proposals, heldout=True))


def with_proposals(feed: Callable[[Any], Any], proposals: SlotProposals, heldout: bool
                   ) -> Callable[[Any], Any]:
    """A sequence feed that also gives each sequence its slot proposals: train rows from
    the other half's tree, held-out ones from the first tree."""
    def fed(seq: Any) -> Any:
        seq = feed(seq)
        half = 0 if heldout else seq.row % 2
        props = proposals.of(seq.tokens, seq.response_start, half)
        return replace(seq, proposals=props.to(seq.tokens.device))

    return fed


def fill_slots(query_ids: torch.Tensor, anchors: torch.Tensor,
               proposals: torch.Tensor | None) -> torch.Tensor:
    """Block query ids [A, 1 + K] with the proposals of a sequence ([T, K] slot codes,
    row p for the block anchored at p) in their slots, as serving fills them
    (`lookups.slots`)."""
    return query_ids if proposals is None else in_slots(query_ids, proposals[anchors])
