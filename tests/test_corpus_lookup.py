"""The corpus lookup's table (`corpus_lookup.CorpusTable`): confident continuations of
the target's own writing, chained, and the same table after a save and a load."""

from __future__ import annotations

from pathlib import Path

import torch
from vllm_carryover.train.lookup_headroom import NO_DRAFT, anchored_drafts

from vllm_carryover.corpus_lookup import CorpusTable

TEXTS = [([9, 1], [2, 3, 4]), ([9, 1], [2, 3, 4]), ([7, 1], [2, 3, 5]),
         ([6], [8, 0]), ([6], [8, 1]), ([5], [6, 7]), ([5], [6, 7]), ([5], [6, 1]),
         ([5], [6, 2]), ([5], [6, 0])]


def test_the_corpus_lookup_chains_the_targets_confident_continuations() -> None:
    """(1, 2) was followed by 3 three times, (1, 2, 3) by 4 twice and by 5 once; a
    continuation seen once ((7, 1) -> 2, (6, 8) -> 0 or 1) is not proposed, nor one
    that is no majority of its context's ((5, 6) -> 7 twice in five)."""
    table = CorpusTable.build(TEXTS)
    assert table.propose([5, 1, 2], 3) == [3, 4]  # then (2, 3, 4) / (3, 4) were never seen
    assert table.propose([9, 1], 3) == [2, 3, 4]
    assert table.propose([7, 1], 3) == []  # (7, 1) -> 2 was seen once
    assert table.propose([6, 8], 3) == []  # 0 and 1 each once after (6, 8)
    assert table.propose([5, 6], 3) == []  # 7 twice, 1, 2 and 0 once each
    assert table.propose([5, 1, 2], 1) == [3]


def test_a_looser_rule_keeps_the_most_frequent_continuation_whatever_its_share() -> None:
    table = CorpusTable.build(TEXTS, min_share=0)
    assert table.propose([5, 6], 3) == [7]  # 7 twice in five: no majority, yet the most
    assert table.propose([7, 1], 3) == []  # seen once: still below min_count 2
    assert CorpusTable.build(TEXTS, min_count=1, min_share=0).propose([7, 1], 1) == [2]


def test_the_headroom_walk_gets_the_corpus_drafts_of_every_anchor() -> None:
    table = CorpusTable.build(TEXTS)
    drafts, proposed = anchored_drafts(torch.tensor([5, 1, 2, 3, 4]), start=1, num_drafts=2,
                                       propose=table.propose)
    assert proposed.tolist() == [False, True, True]
    assert drafts.tolist() == [[NO_DRAFT] * 2, [3, 4], [4, NO_DRAFT]]


def test_a_saved_table_loads_the_same(tmp_path: Path) -> None:
    table = CorpusTable.build(TEXTS)
    table.save(tmp_path / "t.npz")
    loaded = CorpusTable.load(tmp_path / "t.npz")
    assert loaded.next_token == table.next_token and len(loaded) == len(table) > 0
