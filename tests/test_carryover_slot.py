"""Slot planning: which verify rows are carried over and where the query block goes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_carryover.slot import (
    attended_keys,
    carried_drafts,
    draft_positions,
    plan_slots,
    query_storage,
    required_lookahead,
    shift_query_slots,
    slot_positions,
)

K = 4


def test_rejected_rows_are_the_last_num_rejected_rows_of_each_request():
    # request 0: prefill chunk of 3 rows (no drafts); 1: verify [x, d1..d4] with 3 rejected;
    # 2: verify with everything accepted; 3: verify with all 4 drafts rejected.
    qsl = torch.tensor([0, 3, 8, 13, 18])
    layout = plan_slots(qsl, torch.tensor([0, 3, 0, 4], dtype=torch.int32), 18, K)
    assert layout.carried.tolist() == [0, 3, 0, 4]
    expected = [False] * 3 + [False, False, True, True, True] + [False] * 5 + \
        [False, True, True, True, True]
    assert layout.rejected_rows.tolist() == expected


def test_request_without_any_valid_token_carries_nothing():
    layout = plan_slots(torch.tensor([0, 5]), torch.tensor([K + 1], dtype=torch.int32), 5, K)
    assert layout.carried.tolist() == [0]
    assert not layout.rejected_rows.any()


def test_query_block_is_stored_after_the_slot_at_its_own_blocks():
    block_size, q = 4, K + 1
    block_table = torch.tensor([[7, 3, 9, 5], [2, 8, 6, 1]])
    # logical query positions: request 0 starts at 5, request 1 at 2
    positions = torch.tensor([5, 6, 7, 8, 9, 2, 3, 4, 5, 6])
    slots = shift_query_slots(positions, torch.tensor([3, 0]), q, block_table, block_size)
    physical = [8, 9, 10, 11, 12, 2, 3, 4, 5, 6]
    req = [0] * q + [1] * q
    want = [block_table[r, p // block_size] * block_size + p % block_size
            for r, p in zip(req, physical, strict=True)]
    assert slots.tolist() == [int(w) for w in want]


def test_the_rule_carries_exactly_the_rejected_drafts_at_their_own_positions() -> None:
    accepted = torch.tensor([0, 2, K])
    carried = carried_drafts(accepted, K)
    assert carried.sum(1).tolist() == [K, K - 2, 0]  # K - a carried, none if all accepted
    assert carried[1].tolist() == [False, False] + [True] * (K - 2)
    bonus = torch.tensor([10, 20, 30])
    pos = draft_positions(bonus, K)
    assert pos[1].tolist() == list(range(21, 21 + K))
    # the carried drafts of request 1 sit right after its committed context n + a + 1
    assert pos[1][carried[1]].tolist() == list(slot_positions(20 + 2 + 1, K - 2))
    # the next block is stored after the slot and attends to context + slot + block
    assert query_storage(23, K - 2) == 23 + K - 2
    assert attended_keys(23, K - 2, K + 1) == 23 + (K - 2) + (K + 1)


def dflash_spec(k: int) -> SimpleNamespace:
    """What vLLM's lookahead rule reads of a translated (DFlash) speculative config."""
    return SimpleNamespace(num_speculative_tokens=k, use_dflash=lambda: True,
                           use_dspark=lambda: False, use_eagle=lambda: False,
                           uses_draft_model=lambda: False, draft_model_config=None)


def test_startup_refuses_a_vllm_that_reserves_too_few_kv_slots(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import VllmConfig

    from vllm_carryover.errors import CarryoverConfigError
    from vllm_carryover.patches.integration import check_kv_lookahead

    # the worst case (nothing accepted) stores the block's last token K + 1 slots past
    # the verified rows n..n+K
    committed, carried = 10 + 0 + 1, K
    last = query_storage(committed + K, carried)
    assert last - (10 + K) == required_lookahead(K)
    check_kv_lookahead(dflash_spec(K))  # vLLM 0.32 reserves K + 1 for DFlash
    monkeypatch.setattr(VllmConfig, "num_lookahead_tokens",
                        property(lambda self: self.num_speculative_tokens))
    with pytest.raises(CarryoverConfigError, match=r"reserves 4 KV slots.*needs 5"):
        check_kv_lookahead(dflash_spec(K))
