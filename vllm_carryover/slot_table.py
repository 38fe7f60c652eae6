"""Which request owns which carried-over states: a checked record of every round.

Carryover is safe only if each draft sees its own request's rejected states and
nobody else's. `slot` guarantees that by construction; this table
checks the tensors vLLM really used in the round against that module's rule,
request by request:

- the carried states sit at cache slots of positions `committed .. committed+c-1`
  of the request's own block-table row, with `c <= num_speculative_tokens`;
- the query block sits right after them, so it overwrites none of them;
- the drafter's attention covers exactly context + slot + block;
- no cache slot belongs to two requests in one round, and a slot that was one
  request's last round goes to another only once the first no longer holds its
  block (finished, aborted or preempted): slots are reused only after release.

Each round replaces the table with that round's requests, so a request that
leaves the batch is forgotten: no stale entries, one entry per scheduled request.

Checking copies the round's slot mappings to the CPU (a device sync on GPUs),
so the proposer keeps the table only when `VLLM_CARRYOVER_CHECK_SLOTS=1`
(tests and soak runs).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_carryover.slot import attended_keys, query_storage, slot_positions

ENV_CHECK = "VLLM_CARRYOVER_CHECK_SLOTS"


def checks_enabled() -> bool:
    return os.environ.get(ENV_CHECK, "").lower() in ("1", "true", "yes")


class SlotOwnershipError(RuntimeError):
    """A round's carried states or query block are not where the request owns them."""


@dataclass(frozen=True)
class RequestSlot:
    """One request's carryover slot and draft block in one round, as cache slots."""

    req_id: str
    committed: int  # committed context length; the slot starts at this position
    carried: tuple[int, ...]  # cache slots of the carried states, in position order
    query: tuple[int, ...]  # cache slots of the draft query block
    attended: int  # keys the query block attends to (its seq_len)
    block_row: tuple[int, ...]  # the request's block-table row


def round_slots(
    req_ids: Sequence[str],
    committed: torch.Tensor,
    rejected_rows: torch.Tensor | None,
    query_start_loc: torch.Tensor,
    context_slot_mapping: torch.Tensor,
    query_slot_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> list[RequestSlot]:
    """Read one round's slots out of the proposer's tensors (`rejected_rows=None`:
    nothing carried, as with carryover off)."""
    batch = len(req_ids)
    starts = query_start_loc[: batch + 1].tolist()
    ctx = context_slot_mapping.tolist()
    marked = rejected_rows.tolist() if rejected_rows is not None else [False] * len(ctx)
    q = query_slot_mapping.shape[0] // batch if batch else 0
    query = query_slot_mapping.tolist()
    committed_l, seq_l = committed[:batch].tolist(), seq_lens[:batch].tolist()
    rows = block_table[:batch].tolist()
    return [
        RequestSlot(
            req_id=req_ids[i],
            committed=int(committed_l[i]),
            carried=tuple(ctx[r] for r in range(starts[i], starts[i + 1]) if marked[r]),
            query=tuple(query[i * q : (i + 1) * q]),
            attended=int(seq_l[i]),
            block_row=tuple(rows[i]),
        )
        for i in range(batch)
    ]


class SlotTable:
    """Request id -> its slot of the latest round, checked on every update."""

    def __init__(self, max_slot: int, block_size: int, max_requests: int) -> None:
        self.max_slot = max_slot
        self.block_size = block_size
        self.max_requests = max_requests
        self.slots: dict[str, RequestSlot] = {}
        self.owner: dict[int, str] = {}  # cache slot -> request id, latest round
        self.rounds = 0

    def update(self, round_: Sequence[RequestSlot]) -> None:
        """Replace the table by this round's slots; raise if any is misplaced."""
        ids = [s.req_id for s in round_]
        if len(set(ids)) != len(ids):
            raise SlotOwnershipError(f"round {self.rounds}: a request appears twice: {ids}")
        if len(ids) > self.max_requests:
            raise SlotOwnershipError(
                f"round {self.rounds}: {len(ids)} slots exceed max {self.max_requests}")
        rows = {s.req_id: set(s.block_row) for s in round_}
        owner: dict[int, str] = {}
        for s in round_:
            self._check_placement(s)
            for cache_slot in s.carried + s.query:
                other = owner.setdefault(cache_slot, s.req_id)
                if other != s.req_id:
                    raise SlotOwnershipError(
                        f"round {self.rounds}: cache slot {cache_slot} used by both "
                        f"{other} and {s.req_id}")
                last = self.owner.get(cache_slot)
                if (last is not None and last != s.req_id
                        and cache_slot // self.block_size in rows.get(last, ())):
                    raise SlotOwnershipError(
                        f"round {self.rounds}: cache slot {cache_slot} of {last}, which still "
                        f"holds its block, reused by {s.req_id} before its release")
        self.slots = {s.req_id: s for s in round_}
        self.owner = owner
        self.rounds += 1

    def _cache_slot(self, s: RequestSlot, position: int) -> int:
        block = position // self.block_size
        if block >= len(s.block_row):
            raise SlotOwnershipError(
                f"round {self.rounds}: {s.req_id} position {position} lies beyond its "
                f"{len(s.block_row)} blocks")
        return s.block_row[block] * self.block_size + position % self.block_size

    def _check_placement(self, s: RequestSlot) -> None:
        c, q = len(s.carried), len(s.query)
        if c > self.max_slot:
            raise SlotOwnershipError(
                f"round {self.rounds}: {s.req_id} carries {c} states, more than "
                f"{self.max_slot}")
        expected = tuple(self._cache_slot(s, p) for p in slot_positions(s.committed, c))
        if s.carried != expected:
            raise SlotOwnershipError(
                f"round {self.rounds}: {s.req_id} carried states at cache slots "
                f"{list(s.carried)}, expected its own {list(expected)} right after its "
                f"{s.committed} committed tokens")
        expected = tuple(self._cache_slot(s, int(query_storage(p, c)))
                         for p in range(s.committed, s.committed + q))
        if s.query != expected:
            raise SlotOwnershipError(
                f"round {self.rounds}: {s.req_id} query block at cache slots "
                f"{list(s.query)}, expected {list(expected)} after its slot")
        if s.attended != attended_keys(s.committed, c, q):
            raise SlotOwnershipError(
                f"round {self.rounds}: {s.req_id} attends to {s.attended} keys, expected "
                f"{s.committed} context + {c} carried + {q} block")
