"""How lookup proposals become drafts (`vllm_carryover.lookups.drafts`), without an
engine: proposals in the leading slots, the drafter's tokens beside them, one-hot draft
distributions for lookup tokens, and only the drafter rows a request can keep scored."""

from __future__ import annotations

import torch

from vllm_carryover.lookups.drafts import (
    draft_lengths,
    drafter_rows_kept,
    lookups_suffice,
    make_lookup_probs_one_hot,
    one_hot_probs,
    score_leading_rows,
    write_drafts,
)


def test_proposals_fill_the_leading_slots_and_the_rest_keeps_the_drafter() -> None:
    drafts = torch.full((3, 4), -7, dtype=torch.int64)
    from_lookup = write_drafts(drafts, [[7, 8, 9, 5], [5, 3], ()])
    assert drafts.tolist() == [[7, 8, 9, 5], [5, 3, -7, -7], [-7] * 4]
    assert from_lookup.tolist() == [[True] * 4, [True, True, False, False], [False] * 4]


def test_the_drafter_is_skipped_where_no_request_keeps_its_tokens() -> None:
    assert lookups_suffice([[1], [2, 3]], k=3, rows_stay_wide=False, drafter_k=1)
    assert not lookups_suffice([[1], []], k=3, rows_stay_wide=False, drafter_k=1)
    # a request without a proposal keeps none of the drafter's tokens with drafter_k 0
    assert lookups_suffice([[1], []], k=3, rows_stay_wide=False, drafter_k=0)
    # async scheduling verifies whole rows: a short run would leave the tail undrafted
    assert not lookups_suffice([[1], [2, 3, 4]], k=3, rows_stay_wide=True, drafter_k=None)
    assert not lookups_suffice([[1], [2, 3, 4]], k=3, rows_stay_wide=True, drafter_k=0)
    assert lookups_suffice([[1, 2, 3], [2, 3, 4]], k=3, rows_stay_wide=True, drafter_k=None)


def test_a_step_of_lookups_alone_has_one_hot_draft_probabilities() -> None:
    probs = one_hot_probs(torch.tensor([[1, 4], [0, 0]]), vocab_size=5)
    assert probs.shape == (2, 2, 5)
    assert probs[0, 1].tolist() == [0, 0, 0, 0, 1] and probs[1, 0].tolist() == [1, 0, 0, 0, 0]


def test_lookup_tokens_get_one_hot_draft_probabilities() -> None:
    probs = torch.full((2, 3, 5), 0.2)
    drafts = torch.tensor([[1, 4, 0], [2, 2, 2]])
    from_lookup = torch.tensor([[True, True, False], [False, False, False]])
    make_lookup_probs_one_hot(probs, drafts, from_lookup)
    assert probs[0, 0].tolist() == [0, 1, 0, 0, 0]
    assert probs[0, 1].tolist() == [0, 0, 0, 0, 1]
    assert torch.allclose(probs[0, 2], torch.full((5,), 0.2))
    assert torch.allclose(probs[1], torch.full((3, 5), 0.2))


def test_a_request_keeps_its_lookup_run_else_the_drafters_first_tokens() -> None:
    from_lookup = torch.tensor([[True, True, True, False], [False] * 4, [True] * 4])
    assert draft_lengths(from_lookup, 1) == [3, 1, 4]
    assert draft_lengths(from_lookup, 0) == [3, 0, 4]
    assert draft_lengths(from_lookup, None) == [3, 4, 4]


def test_the_drafter_scores_only_the_positions_a_request_can_keep() -> None:
    assert drafter_rows_kept(7, drafter_k=1, rows_stay_wide=False) == 1
    assert drafter_rows_kept(3, drafter_k=5, rows_stay_wide=False) == 3
    assert drafter_rows_kept(7, drafter_k=None, rows_stay_wide=False) == 7
    assert drafter_rows_kept(7, drafter_k=1, rows_stay_wide=True) == 7  # async verifies all


def test_scored_leading_rows_draft_what_the_whole_head_drafts_there() -> None:
    torch.manual_seed(0)
    batch, k, rows, vocab = 3, 4, 2, 11
    head = torch.randn(vocab, 6)
    hidden = torch.randn(batch * k, 6)
    scored: list[int] = []

    def sample(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scored.append(h.shape[0])
        probs = (h @ head.T).softmax(-1)
        return probs.argmax(-1), probs

    whole_tokens, whole_probs = score_leading_rows(hidden, k, k, sample)
    tokens, probs = score_leading_rows(hidden, k, rows, sample)
    assert scored == [batch * k, batch * rows]
    assert tokens.shape == whole_tokens.shape and probs.shape == whole_probs.shape
    lead = tokens.view(batch, k)[:, :rows]
    assert torch.equal(lead, whole_tokens.view(batch, k)[:, :rows])
    assert torch.equal(probs.view(batch, k, vocab)[:, :rows],
                       whole_probs.view(batch, k, vocab)[:, :rows])
    # the positions no request keeps: its last drafted token, one-hot
    assert torch.equal(tokens.view(batch, k)[:, rows:], lead[:, -1:].expand(-1, k - rows))
    assert torch.equal(probs.view(batch, k, vocab)[:, rows:],
                       one_hot_probs(lead[:, -1:].expand(-1, k - rows), vocab))
