"""Carryover counters: exact per round on CPU, one file per TP group, summed over engines."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_carryover import metrics
from vllm_carryover.metrics import CarryoverCounters, read_counters


@pytest.fixture
def counter_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(metrics.ENV_DIR, str(tmp_path))
    return tmp_path


def test_cpu_rounds_are_counted_exactly(counter_dir: Path) -> None:
    c = CarryoverCounters(counter_dir / "worker-1.bin")
    c.record(torch.tensor([0, 3, 7], dtype=torch.int32))
    c.record(torch.tensor([2], dtype=torch.int32))
    c.record_lookup(torch.tensor([[True, True], [False, False], [True, False]]), True)
    c.record_lookup(torch.tensor([[True, False]]), False)  # a step of lookups alone
    c.record_lookup(torch.tensor([[True, False], [False, False]]), False, gated_off=True)
    assert c.as_dict() == {"carryover_draft_rounds": 4, "carryover_nonempty_slot_rounds": 3,
                           "carryover_rejected_states": 12, "carryover_lookup_rounds": 4,
                           "carryover_lookup_only_steps": 2,
                           "carryover_drafter_gated_off_steps": 1}
    assert read_counters(counter_dir) == c.as_dict()


def test_tensor_parallel_ranks_count_once_and_engines_add_up(
        counter_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two data-parallel engines of TP size 2: four workers, each drafting its engine's
    requests; only TP rank 0 of each engine writes, so nothing is counted twice."""
    workers = []
    for pid, tp_rank, carried in ((101, 0, [1, 2]), (102, 1, [1, 2]),
                                  (201, 0, [4]), (202, 1, [4])):
        monkeypatch.setattr(metrics.os, "getpid", lambda pid=pid: pid)
        w = CarryoverCounters.for_this_process(tp_rank)
        w.record(torch.tensor(carried))
        workers.append(w)
    assert sorted(p.name for p in counter_dir.iterdir()) == ["worker-101.bin", "worker-201.bin"]
    assert read_counters(counter_dir) == {"carryover_draft_rounds": 3,
                                          "carryover_nonempty_slot_rounds": 3,
                                          "carryover_rejected_states": 7,
                                          "carryover_lookup_rounds": 0,
                                          "carryover_lookup_only_steps": 0,
                                          "carryover_drafter_gated_off_steps": 0}
