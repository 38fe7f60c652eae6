"""The corpus lookup's table (`corpus_lookup.CorpusTable`): the continuations of the
target's own writing, chained, under the shipped rule and a stricter one, and the same
table after a save and a load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from vllm_carryover.train.dflash_loss import IGNORE
from vllm_carryover.train.lookup_headroom import NO_DRAFT, anchored_drafts, response_labels

from vllm_carryover.lookups.corpus import KEY_MASK, KEY_MUL, CorpusTable, context_keys

TEXTS = [([9, 1], [2, 3, 4]), ([9, 1], [2, 3, 4]), ([7, 1], [2, 3, 5]),
         ([6], [8, 0]), ([6], [8, 1]), ([5], [6, 7]), ([5], [6, 7]), ([5], [6, 1]),
         ([5], [6, 2]), ([5], [6, 0])]


def test_the_corpus_lookup_chains_the_continuation_of_the_longest_known_context() -> None:
    """The shipped rule keeps every context's most frequent continuation, even one seen
    once: (7, 1, 2, 3) was followed by 5 once, so it wins over (1, 2, 3) -> 4 (twice),
    and a text that ends like one the target wrote drafts that text's continuation."""
    table = CorpusTable.build(TEXTS)
    assert table.propose([7, 1, 2, 3], 1) == [5]
    assert table.propose([7, 1], 3) == [2, 3, 5]
    assert table.propose([9, 1], 3) == [2, 3, 4]
    assert table.propose([5, 6], 3) == [7]  # 7 twice in five; then (5, 6, 7) ends a text
    assert table.propose([3, 9], 3) == []  # (3, 9) was never continued


def test_a_stricter_rule_keeps_only_confident_continuations() -> None:
    """Seen twice and half of the context's continuations: (1, 2) -> 3 three times and
    (1, 2, 3) -> 4 two in three are kept; (7, 1) -> 2 was seen once, (6, 8) was followed
    by 0 and 1 once each, and (5, 6) by 7 twice in five."""
    table = CorpusTable.build(TEXTS, min_count=2, min_share=0.5)
    assert table.propose([5, 1, 2], 3) == [3, 4]  # then (2, 3, 4) / (3, 4) were never seen
    assert table.propose([7, 1], 3) == []
    assert table.propose([6, 8], 3) == []
    assert table.propose([5, 6], 3) == []


def test_context_keys_match_the_lookups_fold() -> None:
    """The arrays' keys (numpy, at load) and the lookup's (Python, token by token) agree,
    also for token ids whose products overflow 64 bits."""
    contexts = np.array([[49151, 3, 0], [0, 0, 0], [7, 8, 9]], dtype=np.int32)
    for row, key in zip(contexts.tolist(), context_keys(contexts).tolist(), strict=True):
        folded = 0
        for token in reversed(row):
            folded = (folded * KEY_MUL + token + 1) & KEY_MASK
        assert key == folded


def test_the_headroom_walk_gets_the_corpus_drafts_of_every_anchor() -> None:
    table = CorpusTable.build(TEXTS)
    drafts, proposed = anchored_drafts(torch.tensor([5, 1, 2, 3, 4]), start=1, num_drafts=2,
                                       propose=table.propose)
    assert proposed.tolist() == [False, True, True]
    assert drafts.tolist() == [[NO_DRAFT] * 2, [3, 4], [4, NO_DRAFT]]


def test_the_walk_without_a_drafter_labels_each_anchor_with_the_true_tokens_after_it() -> None:
    labels = response_labels(torch.tensor([5, 9, 2, 3, 4]), start=1, num_drafts=2)
    assert labels.tolist() == [[2, 3], [3, 4], [4, IGNORE]]


def test_a_saved_table_loads_the_same(tmp_path: Path) -> None:
    table = CorpusTable.build(TEXTS)
    table.save(tmp_path / "t.npz")
    loaded = CorpusTable.load(tmp_path / "t.npz")
    assert loaded.to_dict() == table.to_dict() and len(loaded) == len(table) > 0
    assert loaded.propose([7, 1], 3) == table.propose([7, 1], 3) == [2, 3, 5]
