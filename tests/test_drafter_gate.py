"""The drafter beside the lookups, on or off by measured goodput (`drafter_gate`)."""

from __future__ import annotations

from vllm_carryover.control.drafter_gate import (
    DRAFTER,
    LOOKUPS_ALONE,
    MIN_CYCLES,
    PROBE_EVERY,
    RUN,
    DrafterGate,
    bucket_of,
)

REQS = ("a", "b", "c")


def serve(gate: DrafterGate, steps: int, seconds: dict[bool, float],
          tokens: dict[bool, int], reqs: tuple[str, ...] = REQS) -> list[bool]:
    """`steps` gated steps of one batch, each choice's cycle taking `seconds[choice]`
    and emitting `tokens[choice]`; returns the choices made."""
    now, made = 0.0, []
    gate.step(now, reqs, None)  # the first step verifies nothing the gate decided
    for _ in range(steps):
        choice = gate.choose()
        now += seconds[choice]
        gate.step(now, reqs, tokens[choice])
        made.append(choice)
    return made


def test_batch_sizes_share_buckets_by_powers_of_two() -> None:
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_warm_up_alternates_runs_of_each_choice_then_the_faster_one_is_used() -> None:
    gate = DrafterGate()
    made = serve(gate, 2 * MIN_CYCLES, {DRAFTER: 1.0, LOOKUPS_ALONE: 1.0},
                 {DRAFTER: 6, LOOKUPS_ALONE: 5})
    assert made[:2 * RUN] == [DRAFTER] * RUN + [LOOKUPS_ALONE] * RUN
    assert made.count(DRAFTER) == made.count(LOOKUPS_ALONE) == MIN_CYCLES
    # drafting buys 6 tokens a second against 5: the drafter stays on
    assert serve(gate, 8, {DRAFTER: 1.0, LOOKUPS_ALONE: 1.0},
                 {DRAFTER: 6, LOOKUPS_ALONE: 5}) == [DRAFTER] * 8


def test_lookups_alone_take_over_where_the_drafter_costs_more_than_it_buys() -> None:
    """At a large batch the drafter's forward and its extra rows cost more time than
    its accepted tokens are worth: the gate turns it off, and probes it now and then."""
    gate = DrafterGate()
    cost = {DRAFTER: 1.2, LOOKUPS_ALONE: 1.0}
    gain = {DRAFTER: 20, LOOKUPS_ALONE: 18}  # 16.7 against 18 tokens/s
    serve(gate, 2 * MIN_CYCLES, cost, gain)
    made = serve(gate, 2 * (PROBE_EVERY + RUN), cost, gain)
    assert made.count(DRAFTER) == 2 * RUN  # two probes of RUN cycles each
    assert made[:PROBE_EVERY - 1] == [LOOKUPS_ALONE] * (PROBE_EVERY - 1)
    assert gate.summary() == {"3-4": ("lookups alone", 16.7, 18.0)}


def test_a_choice_within_the_margin_does_not_take_over() -> None:
    gate = DrafterGate()
    serve(gate, 2 * MIN_CYCLES, {DRAFTER: 1.0, LOOKUPS_ALONE: 1.0},
          {DRAFTER: 100, LOOKUPS_ALONE: 101})
    assert serve(gate, 8, {DRAFTER: 1.0, LOOKUPS_ALONE: 1.0},
                 {DRAFTER: 100, LOOKUPS_ALONE: 101}) == [DRAFTER] * 8


def test_cycles_over_other_requests_or_a_prefill_do_not_count() -> None:
    gate = DrafterGate()
    gate.step(0.0, REQS, None)
    assert gate.choose() == DRAFTER
    assert not gate.step(1.0, ("a", "b"), 3)  # a request finished: another batch
    gate.step(1.0, REQS, None)
    assert gate.choose() == DRAFTER
    assert not gate.step(2.0, REQS, None)  # some request in a prefill chunk
    assert not gate.step(3.0, REQS, 3)  # no cycle open (a step the gate did not decide)
    for _ in range(RUN - 2):  # the rest of the warm-up's first run, over prefill chunks
        gate.choose()
        assert not gate.step(3.0, REQS, None)
    assert gate.choose() == LOOKUPS_ALONE
    assert gate.step(3.5, REQS, 4)
    b = gate.buckets[bucket_of(len(REQS))]
    assert b.cycles == {DRAFTER: 0, LOOKUPS_ALONE: 1}
    assert b.rate(LOOKUPS_ALONE) == 8.0 and gate.counted == 1
    assert gate.summary() == {"3-4": ("warming up", 0.0, 8.0)}


def test_each_batch_size_bucket_decides_for_itself() -> None:
    gate = DrafterGate()
    one, many = ("a",), tuple("abcdefghijklmnop")
    for reqs, gain in ((one, {DRAFTER: 3, LOOKUPS_ALONE: 2}),
                       (many, {DRAFTER: 20, LOOKUPS_ALONE: 24})):
        serve(gate, 2 * MIN_CYCLES + 4, {DRAFTER: 1.0, LOOKUPS_ALONE: 1.0}, gain, reqs)
    assert gate.summary() == {"1": ("drafter", 3.0, 2.0),
                              "9-16": ("lookups alone", 20.0, 24.0)}
