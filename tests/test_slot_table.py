"""The slot table stays consistent under any schedule, and catches misplaced slots.

The fuzz drives the real slot planning (`plan_slots`, `shift_query_slots`) the way
vLLM's runner calls it, over a model scheduler with a paged block pool: requests
arrive, prefill, verify drafts with any number accepted, get preempted (blocks
freed, recomputed later), finish or are aborted. After every drafting round the
proposer's `SlotTable` has checked ownership; the machine also asserts that the
table holds exactly the round's requests (no stale entries, bounded size) and
that a freed block's slots only reappear under a new owner.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vllm_carryover.slot import plan_slots, shift_query_slots
from vllm_carryover.slot_table import RequestSlot, SlotOwnershipError, SlotTable, round_slots

NULL_BLOCK = 0  # vLLM reserves block 0; block tables are padded with it


@dataclass
class Request:
    req_id: str
    length: int  # tokens known: prompt + generated
    computed: int = 0  # tokens whose K/V are committed (0: needs a (re)prefill)
    blocks: list[int] = field(default_factory=list)


@dataclass
class Round:
    """The tensors vLLM hands the proposer for one drafting round."""

    req_ids: list[str]
    query_start_loc: torch.Tensor
    context_slots: torch.Tensor
    num_rejected: torch.Tensor
    query_positions: torch.Tensor
    block_table: torch.Tensor
    committed: list[int]


def cache_slot(blocks: list[int], position: int, block_size: int) -> int:
    return blocks[position // block_size] * block_size + position % block_size


def build_round(reqs: list[Request], accepted: dict[str, int], k: int,
                block_size: int) -> Round:
    """Verify rows, rejected counts and the query block as vLLM's runner lays them out."""
    starts, ctx, rejected, qpos, committed = [0], [], [], [], []
    for r in reqs:
        if r.computed == 0:  # (re)prefill: every known token, nothing rejected
            rows = list(range(r.length))
            n_rej, done = 0, r.length
        else:  # padded verify rows [x_n, d_1..d_K]
            rows = list(range(r.computed, r.computed + 1 + k))
            n_rej, done = k - accepted[r.req_id], r.computed + 1 + accepted[r.req_id]
        starts.append(starts[-1] + len(rows))
        ctx += [cache_slot(r.blocks, p, block_size) for p in rows]
        rejected.append(n_rej)
        qpos += [done + j for j in range(1 + k)]
        committed.append(done)
    width = max(len(r.blocks) for r in reqs)
    table = torch.full((len(reqs), width), NULL_BLOCK, dtype=torch.int32)
    for i, r in enumerate(reqs):
        table[i, : len(r.blocks)] = torch.tensor(r.blocks, dtype=torch.int32)
    return Round([r.req_id for r in reqs], torch.tensor(starts, dtype=torch.int32),
                 torch.tensor(ctx, dtype=torch.int64), torch.tensor(rejected, dtype=torch.int32),
                 torch.tensor(qpos, dtype=torch.int64), table, committed)


def plan_and_read(rnd: Round, k: int, block_size: int,
                  shift_queries: bool = True) -> list[RequestSlot]:
    """What `CarryoverProposer.set_inputs_first_pass` does, then the table's reading."""
    q = 1 + k
    layout = plan_slots(rnd.query_start_loc, rnd.num_rejected, rnd.context_slots.shape[0], k)
    carried = layout.carried if shift_queries else torch.zeros_like(layout.carried)
    query_slots = shift_query_slots(rnd.query_positions, carried, q, rnd.block_table,
                                    block_size)
    seq_lens = torch.tensor(rnd.committed) + layout.carried + q
    return round_slots(rnd.req_ids, rnd.query_positions[::q], layout.rejected_rows,
                       rnd.query_start_loc, rnd.context_slots, query_slots, seq_lens,
                       rnd.block_table)


class SchedulerMachine(RuleBasedStateMachine):
    """A paged KV pool, a scheduler and the proposer's slot table, under random events."""

    @initialize(k=st.integers(1, 7), block_size=st.sampled_from([4, 8, 16]),
                num_blocks=st.integers(8, 48), max_running=st.integers(1, 6))
    def setup(self, k: int, block_size: int, num_blocks: int, max_running: int) -> None:
        self.k, self.block_size, self.max_running = k, block_size, max_running
        self.free = list(range(1, num_blocks))
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.table = SlotTable(k, block_size, max_running)
        self.last_round: set[str] = set()
        self.next_id = 0

    # -- events ---------------------------------------------------------------------

    @rule(prompt_len=st.integers(1, 40))
    def add_request(self, prompt_len: int) -> None:
        self.waiting.append(Request(f"r{self.next_id}", prompt_len))
        self.next_id += 1

    @rule(data=st.data())
    def draft_round(self, data: st.DataObject) -> None:
        """Schedule, verify with random acceptance, and plan the next drafts."""
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))
        scheduled = [r for r in self.running if self._allocate(r)]
        if not scheduled:
            return
        accepted = {r.req_id: data.draw(st.integers(0, self.k)) for r in scheduled}
        rnd = build_round(scheduled, accepted, self.k, self.block_size)
        self.table.update(plan_and_read(rnd, self.k, self.block_size))
        for r, done in zip(scheduled, rnd.committed, strict=True):
            r.length, r.computed = done + 1, done  # plus the bonus token, not yet cached
            owned = set(r.blocks)
            slot = self.table.slots[r.req_id]
            assert {c // self.block_size for c in slot.carried + slot.query} <= owned
        self.last_round = {r.req_id for r in scheduled}

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        r = data.draw(st.sampled_from(self.running))
        self._free(r)
        r.computed = 0
        self.running.remove(r)
        self.waiting.insert(0, r)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), aborted=st.booleans())
    def finish_or_abort(self, data: st.DataObject, aborted: bool) -> None:
        r = data.draw(st.sampled_from(self.running))
        self._free(r)
        self.running.remove(r)

    # -- model allocator --------------------------------------------------------------

    def _allocate(self, r: Request) -> bool:
        """Blocks for the verify rows, the slot and the query block (vLLM's lookahead)."""
        last = (r.length if r.computed == 0 else r.computed + 1 + self.k) + self.k + 1
        need = -(-last // self.block_size) - len(r.blocks)
        if need > len(self.free):
            return False
        r.blocks += [self.free.pop() for _ in range(max(need, 0))]
        return True

    def _free(self, r: Request) -> None:
        self.free += r.blocks
        r.blocks = []

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def table_holds_exactly_the_last_round(self) -> None:
        """No stale entries and bounded size: the table is the latest round's batch, so a
        finished, aborted or preempted request is gone from it after the next round."""
        if hasattr(self, "table"):
            assert set(self.table.slots) == self.last_round
            assert len(self.table.slots) <= self.max_running


TestSlotTableUnderRandomSchedules = SchedulerMachine.TestCase
TestSlotTableUnderRandomSchedules.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


# -- the table refuses what would leak or lose states ----------------------------------


def two_requests() -> tuple[list[Request], int, int]:
    k, bs = 3, 4
    reqs = [Request("a", 9, computed=8, blocks=[1, 2, 3, 4]),
            Request("b", 6, computed=5, blocks=[5, 6, 7])]
    return reqs, k, bs


def test_query_block_over_the_carried_states_is_refused() -> None:
    reqs, k, bs = two_requests()
    rnd = build_round(reqs, {"a": 1, "b": 0}, k, bs)
    table = SlotTable(k, bs, 4)
    with pytest.raises(SlotOwnershipError, match="query block at cache slots"):
        table.update(plan_and_read(rnd, k, bs, shift_queries=False))


def test_slot_read_through_another_requests_block_row_is_refused() -> None:
    reqs, k, bs = two_requests()
    rnd = build_round(reqs, {"a": 0, "b": 1}, k, bs)
    slots = plan_and_read(rnd, k, bs)
    swapped = [RequestSlot(s.req_id, s.committed, s.carried, s.query, s.attended,
                           other.block_row) for s, other in zip(slots, slots[::-1],
                                                                strict=True)]
    with pytest.raises(SlotOwnershipError, match="expected its own"):
        SlotTable(k, bs, 4).update(swapped)


def test_cache_slot_of_a_live_request_reused_by_another_is_refused() -> None:
    reqs, k, bs = two_requests()
    table = SlotTable(k, bs, 4)
    table.update(plan_and_read(build_round(reqs, {"a": 0, "b": 0}, k, bs), k, bs))
    thief = Request("c", 9, computed=8, blocks=reqs[0].blocks)  # a's blocks, a still alive
    rnd = build_round([reqs[0], thief], {"a": 0, "c": 0}, k, bs)
    with pytest.raises(SlotOwnershipError, match=r"used by both|before its release"):
        table.update(plan_and_read(rnd, k, bs))


def test_released_request_slots_may_be_reused() -> None:
    reqs, k, bs = two_requests()
    table = SlotTable(k, bs, 4)
    table.update(plan_and_read(build_round(reqs, {"a": 0, "b": 0}, k, bs), k, bs))
    heir = Request("c", 9, computed=8, blocks=reqs[0].blocks)  # "a" finished
    table.update(plan_and_read(build_round([heir, reqs[1]], {"c": 1, "b": 2}, k, bs), k, bs))
    assert set(table.slots) == {"c", "b"}
    assert len(table.slots["c"].carried) == k - 1


def test_more_carried_states_than_draft_tokens_are_refused() -> None:
    reqs, k, bs = two_requests()
    slots = plan_and_read(build_round(reqs, {"a": 0, "b": 0}, k, bs), k, bs)
    with pytest.raises(SlotOwnershipError, match="carries 3 states, more than 2"):
        SlotTable(k - 1, bs, 4).update(slots)
