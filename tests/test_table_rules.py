"""The table rules (`train.table_rules`) on hand-made token sequences: the copy rule copies
what followed the last earlier occurrence of (previous token, bonus token), the trigram
table chains the train split's most frequent continuations, copy+trigram extends a short
copy with the chain, and a walk jumps past each block's accepted drafts; `lookup-headroom`
prints the rules with and without a drafter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support.tiny_models import make_tiny_target
from test_train_lookup_headroom import walk_heldout
from vllm_carryover.train.data import write_dataset
from vllm_carryover.train.dflash_loss import WalkStats
from vllm_carryover.train.lookup_headroom import (
    LOOKUP_POLICIES,
    SLOT1_COLUMNS,
    response_labels,
)
from vllm_carryover.train.main import main
from vllm_carryover.train.paths import data_dir
from vllm_carryover.train.table_rules import (
    NO_DRAFT,
    RULES,
    TrigramTable,
    copy_drafts,
    rule_drafts,
)

X = NO_DRAFT


def test_trigram_table_chains_the_most_frequent_continuation() -> None:
    table = TrigramTable.build([
        ([9, 1], [2, 3, 4]), ([9, 1], [2, 3, 4]), ([9, 1], [2, 5]),  # 1 2 -> 3 twice, 5 once
        ([7, 8], [10]), ([7, 8], [11]),  # a tie: the continuation seen first
    ])
    chain = table.chain(np.array([9, 50, 7, 60]), np.array([1, 2, 8, 61]), 4)
    assert chain.tolist() == [
        [2, 3, 4, X],  # 9 1 -> 2, 1 2 -> 3, 2 3 -> 4; neither "3 4" nor "4" was followed
        [3, 4, X, X],  # "50 2" unseen: the bigram's 2 -> 3, then the trigram 2 3 -> 4
        [10, X, X, X],
        [X, X, X, X],  # nothing known
    ]
    # the prompt's tokens only lead into the response: "9 1" is no context of anything
    assert table.next_token(np.array([0]), np.array([9])).tolist() == [X]


def test_copy_rule_copies_what_followed_the_last_earlier_pair() -> None:
    # prompt 20 21 22 23 24 30, response 20 21 22 23 31
    tokens = np.array([20, 21, 22, 23, 24, 30, 20, 21, 22, 23, 31])
    drafts, matched = copy_drafts(tokens, start=6, k=3)
    assert matched.tolist() == [False, True, True, True]  # "30 20" never stood before
    assert drafts.tolist() == [[X, X, X], [22, 23, 24], [23, 24, 30], [24, 30, 20]]
    # the last earlier occurrence, and never a token past the anchor
    drafts, matched = copy_drafts(np.array([5, 5, 5, 5, 6]), start=1, k=3)
    assert matched.tolist() == [False, True, True]
    assert drafts.tolist() == [[X, X, X], [5, X, X], [5, X, X]]
    drafts, _ = copy_drafts(np.array([1, 2, 7, 1, 2, 8, 1, 2, 9]), start=7, k=2)
    assert drafts.tolist() == [[8, 1]]  # after the second "1 2", not the first


def test_copy_then_trigram_extends_a_short_copy() -> None:
    table = TrigramTable.build([([0, 40], [41, 77])])  # 40 41 -> 77; 40 -> 41
    tokens = np.array([40, 41, 42, 40, 41, 99])
    drafts, matched = rule_drafts(tokens, start=3, k=4, table=table)
    assert set(drafts) == set(RULES)
    assert matched.tolist() == [False, True]
    # anchor 3 ("42 40"): no copy; the chain 40 -> 41, then 40 41 -> 77
    # anchor 4 ("40 41" at 0-1): copies 42 40 41 (up to the anchor), the chain adds 77
    assert drafts["copy"].tolist() == [[X, X, X, X], [42, 40, 41, X]]
    assert drafts["trigram"].tolist() == [[41, 77, X, X], [77, X, X, X]]
    assert drafts["copy+trigram"].tolist() == [[41, 77, X, X], [42, 40, 41, 77]]


def test_walk_advances_past_the_accepted_drafts() -> None:
    prompt = list(range(10, 18))
    tokens = torch.tensor(prompt + prompt + prompt)  # the response repeats the prompt twice
    start, k = len(prompt), 3
    drafts, _ = rule_drafts(tokens.numpy(), start, k, TrigramTable.build([]))
    labels = response_labels(tokens, start, k)
    walk = WalkStats()
    visits = walk.add(torch.from_numpy(drafts["copy"]), labels)
    # first step: "17 10" never stood together, nothing drafted, the bonus token only;
    # then each block copies 3 right tokens and the next starts past them and the bonus
    assert torch.nonzero(visits).flatten().add(start).tolist() == [8, 9, 13, 17]
    # (anchor 21's block would run past the response's end: the walk stops before it)
    assert (walk.rounds, walk.accepted) == (4, 9)
    assert walk.tau() == 3.25
    empty = WalkStats()
    empty.add(torch.from_numpy(drafts["trigram"]), labels)  # an empty table drafts nothing
    assert empty.tau() == 1.0


def test_lookup_headroom_prints_the_rules_without_a_drafter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    target = make_tiny_target(tmp_path / "target", vocab=64)
    phrase = [3, 4, 5, 6, 7, 8, 9, 10]
    rows = [{"id": f"t{i}", "group": f"t{i}", "category": "chat", "messages": [],
             "prompt_ids": [1, 2], "response_ids": phrase * 2, "response": "",
             "split": "train"} for i in range(2)]
    rows += [{"id": f"h{i}", "group": f"h{i}", "category": ("chat", "code")[i],
              "messages": [], "prompt_ids": [1, 2], "response_ids": phrase * 2,
              "response": "", "split": "heldout"} for i in range(2)]
    monkeypatch.setenv("VLLM_CARRYOVER_CACHE", str(tmp_path / "cache"))
    write_dataset(data_dir("tiny-rules"), rows, {"target": str(target)})
    out = tmp_path / "rules.json"
    main(["lookup-headroom", "--target", str(target), "--data", "tiny-rules", "-k", "3",
          "--threads", "1", "--out", str(out)])
    assert "copy+trigram" in capsys.readouterr().out
    table = json.loads(out.read_text())
    assert set(table["all"]) == set(LOOKUP_POLICIES)
    # the held-out text is the train text: the trigram chain drafts all of it right
    assert table["all"]["trigram"] == table["all"]["copy+trigram"] == 4.0
    assert 1.0 < table["all"]["copy"] < 4.0  # nothing to copy before the phrase repeats


def test_lookup_headroom_splits_the_drafters_first_draft_by_copy_match(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = walk_heldout(tmp_path, monkeypatch, lambda prompt, gen: prompt * 2)
    for row in table.values():
        assert all(0.0 <= row[c] <= 1.0 for c in SLOT1_COLUMNS)
        assert row["copy"] > 3.0  # the repeats of the prompt are copied
        assert row["trigram"] == 1.0  # no train split: an empty table
