"""The K = 0 steps' context kept for later (`deferred_context`), without an engine
(`test_carryover_path` checks the drafts that read it inside vLLM)."""

from __future__ import annotations

import torch

from vllm_carryover.deferred_context import MAX_ROWS, DeferredContext, latest_per_slot


class RecordingDrafter:
    """What `DeferredContext.write` calls on the drafter, recorded."""

    def __init__(self) -> None:
        self.writes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def combine_hidden_states(self, states: torch.Tensor) -> torch.Tensor:
        return states * 2

    def precompute_and_store_context_kv(self, states, positions, slots, rejected) -> None:
        assert rejected is None  # a step that drafts nothing rejects nothing
        self.writes.append((states, positions, slots))


def test_a_slot_kept_twice_keeps_its_later_row_and_rows_stay_in_order() -> None:
    assert latest_per_slot(torch.tensor([5, 3, 5, 7, 3, 9])).tolist() == [2, 3, 4, 5]
    assert latest_per_slot(torch.tensor([4, 1, 2])).tolist() == [0, 1, 2]


def test_kept_steps_are_written_in_one_call_and_then_forgotten() -> None:
    deferred, drafter = DeferredContext(), RecordingDrafter()
    positions = torch.arange(10, 16)
    buffer = torch.arange(100, 200)  # vLLM's slot buffer is longer than the rows
    assert not deferred.keep(torch.ones(3, 4), positions[:3], buffer[:50])
    assert not deferred.keep(torch.full((3, 4), 3.0), positions[3:], buffer[3:50])
    buffer.zero_()  # vLLM reuses its buffers: the kept rows are copies
    deferred.write(drafter)
    (states, pos, slots), = drafter.writes
    assert torch.equal(states, torch.cat([torch.full((3, 4), 2.0), torch.full((3, 4), 6.0)]))
    assert pos.tolist() == list(range(10, 16)) and slots.tolist() == [100, 101, 102, 103, 104, 105]
    deferred.write(drafter)
    assert len(drafter.writes) == 1 and deferred.rows == 0


def test_enough_kept_rows_ask_to_be_written() -> None:
    deferred = DeferredContext()
    rows = torch.arange(MAX_ROWS)
    assert not deferred.keep(torch.zeros(MAX_ROWS - 1, 2), rows[:-1], rows[:-1])
    assert deferred.keep(torch.zeros(1, 2), rows[-1:], rows[-1:])
