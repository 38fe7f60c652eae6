"""Slot proposals for training (train/slot_proposals.py): the suffix lookup's drafts as
serving makes them, from an answer tree that never holds the sequence's own answer."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from vllm_carryover.train.slot_proposals import (
    NONE,
    ProposalSettings,
    SlotProposals,
    fill_slots,
)

K = 3
VOCAB = 100
IDS_ALONE = ProposalSettings(confidence_levels=0)  # a drafter that reads no levels


def answers() -> dict[int, np.ndarray]:
    return {1: np.array([10, 11, 12, 13, 14, 15], dtype=np.int32),
            2: np.array([20, 21, 22, 23, 24, 25], dtype=np.int32)}


def test_a_train_row_gets_proposals_from_the_other_halfs_answers_only() -> None:
    props = SlotProposals(answers(), IDS_ALONE, K, VOCAB)
    own = torch.tensor([5, 20, 21, 22, 23, 24, 25])  # row 2's own answer after prompt [5]
    got = props.of(own, 1, half=2 % 2)
    assert (got == NONE).all()  # row 2's answer is only in the other tree
    other = torch.tensor([5, 10, 11, 12, 13, 14, 15])  # an even row repeating row 1's
    got = props.of(other, 1, half=0)
    assert got[1].tolist() == [11, 12, 13]  # after the bonus token 10
    assert got[4].tolist() == [14, 15, NONE]
    assert (got[0] == NONE).all()  # the prompt: no block is anchored there


def test_the_request_tree_proposes_what_the_text_repeats_and_trees_stay_unchanged() -> None:
    props = SlotProposals(answers(), IDS_ALONE, K, VOCAB)
    seq = torch.tensor([7, 30, 31, 32, 33, 30, 31, 32, 33])
    first = props.of(seq, 1, half=1)
    assert first[5].tolist() == [31, 32, 33]  # the second 30 continues like the first
    assert torch.equal(props.of(seq, 1, half=1), first)  # nothing of it stayed behind
    # one seeded answer in each answer tree, as before
    assert [set(lookup.cache.cached_requests) for lookup in props.lookups] == [{0}, {0}]


def test_fill_slots_puts_proposals_in_place_of_the_mask_where_there_are_some() -> None:
    query = torch.tensor([[9, 0, 0, 0], [8, 0, 0, 0]])
    proposals = torch.tensor([[NONE] * K, [4, 5, NONE], [6, NONE, NONE]])
    filled = fill_slots(query, torch.tensor([1, 2]), proposals)
    assert filled.tolist() == [[9, 4, 5, 0], [8, 6, 0, 0]]
    assert fill_slots(query, torch.tensor([1, 2]), None) is query


def test_serving_fills_each_requests_query_block_slots_with_its_proposal() -> None:
    from vllm_carryover.lookups.slots import fill_query_slots

    mask = 0
    ids = torch.tensor([9, mask, mask, mask, 8, mask, mask, mask, 7, mask, mask, mask, 0, 0])
    codes = torch.tensor([[4, 5], [NONE, NONE], [6, 1]])  # a step of K = 2 in blocks of 3
    fill_query_slots(ids, codes, K)
    assert ids.tolist() == [9, 4, 5, mask, 8, mask, mask, mask, 7, 6, 1, mask, 0, 0]


def test_slot_codes_carry_each_proposals_confidence_level_beside_its_token() -> None:
    """A proposal continuing a long match the trees always saw continued so gets a
    high level, a guess after a short match a low one; the codes split back into the
    token ids and the levels, and a drafter without levels gets the ids alone."""
    from vllm_carryover.lookups.slots import (
        CONFIDENCE_LEVELS,
        LONG_MATCH,
        confidence_levels,
        slot_codes,
        split_codes,
    )

    sure = SimpleNamespace(token_ids=[11, 12], probs=[1.0, 0.95], match_len=LONG_MATCH)
    guess = SimpleNamespace(token_ids=[13], probs=[0.1], match_len=1)
    levels = confidence_levels(sure.probs, sure.match_len) + confidence_levels(guess.probs, 1)
    assert levels == [CONFIDENCE_LEVELS - 1, CONFIDENCE_LEVELS - 1, 1]
    codes = slot_codes([sure, None, guess], K, VOCAB)
    ids, got = split_codes(codes[codes >= 0], VOCAB)
    assert ids.tolist() == [11, 12, 13] and got.tolist() == levels
    assert (codes[1] == NONE).all() and codes[0, 2] == NONE
    assert slot_codes([sure, None, guess], K, None).tolist() == [
        [11, 12, NONE], [NONE] * K, [13, NONE, NONE]]
    # ... and training's proposals carry them too
    props = SlotProposals(answers(), ProposalSettings(), K, VOCAB)
    coded = props.of(torch.tensor([5, 10, 11, 12, 13, 14, 15]), 1, half=0)
    assert split_codes(coded[1], VOCAB)[0].tolist() == [11, 12, 13]
    assert (split_codes(coded[1], VOCAB)[1] > 0).all()
