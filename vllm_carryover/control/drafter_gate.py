"""Whether the drafter pays beside the lookups, by measured goodput.

With the suffix lookup, a step in which some request has no lookup run runs the
drafter for that request's first `lookup_drafter_k` tokens. That costs
the drafter's forward and one more verified row per such request, and buys the
tokens accepted from it. Which is larger depends on the machine and the load (on a
2-core CPU at concurrency 16, one interleaved run: the lookups alone served 1.05x no
speculation, one drafter token per request 0.98x; docs/results.md), so
with K by goodput it is measured while serving, per batch size, as each choice's own
goodput, without a model of its costs:

- a *cycle* is the wall time from one `propose` call to the next: the drafting of
  that step (with the drafter, or from the lookups alone), the scheduler, the
  target verifying those drafts, the sampling. Its tokens are what that
  verification emitted. Both belong to the choice made at the cycle's start.
- only cycles the choice decides count (some request without a lookup run, under
  synchronous scheduling), and only pure decode cycles: the same requests at both
  ends, none of them in a prefill chunk. Others are dropped.
- per batch-size bucket (1, 2, 3-4, 5-8, ...) and choice: decayed sums of seconds
  and tokens. Until both choices have `MIN_CYCLES` cycles the bucket alternates them
  in runs of `RUN` cycles; then it uses the one with more tokens per second (the
  other must beat the current one by `MIN_GAIN` to take over, so noise does not
  flap it), and every `PROBE_EVERY` cycles tries the other for `RUN` cycles, so
  that its estimate follows the traffic.

Verification is unchanged, so greedy output is too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_CYCLES = 12  # cycles of each choice in a bucket before its rates decide
RUN = 4  # consecutive cycles of one choice while warming up or probing
PROBE_EVERY = 64  # cycles between probes of the choice not in use
MIN_GAIN = 0.03  # the other choice must promise this much more tokens/s to take over
HALF_LIFE_CYCLES = 256  # a bucket's sums age over this many of its cycles

DRAFTER, LOOKUPS_ALONE = True, False  # the two choices


def bucket_of(batch: int) -> int:
    """Batch sizes 1, 2, 3-4, 5-8, ... share a bucket: neighbouring sizes cost alike,
    and a serving batch moves among them as requests come and go."""
    return max(batch - 1, 0).bit_length()


@dataclass
class _Bucket:
    """Decayed seconds and tokens of each choice's cycles, and the probing schedule."""

    seconds: dict[bool, float] = field(default_factory=lambda: {DRAFTER: 0.0,
                                                                LOOKUPS_ALONE: 0.0})
    tokens: dict[bool, float] = field(default_factory=lambda: {DRAFTER: 0.0,
                                                               LOOKUPS_ALONE: 0.0})
    cycles: dict[bool, int] = field(default_factory=lambda: {DRAFTER: 0, LOOKUPS_ALONE: 0})
    current: bool = DRAFTER  # the choice in use once warmed up
    run_left: int = RUN  # cycles left in the present run of `running`
    running: bool = DRAFTER
    since_probe: int = 0

    def rate(self, choice: bool) -> float:
        return self.tokens[choice] / self.seconds[choice] if self.seconds[choice] else 0.0

    def warm(self) -> bool:
        return min(self.cycles.values()) >= MIN_CYCLES

    def preferred(self) -> bool:
        """The current choice, unless the other one is `MIN_GAIN` faster."""
        other = not self.current
        return other if self.rate(other) > (1.0 + MIN_GAIN) * self.rate(self.current) else (
            self.current)


@dataclass(frozen=True)
class _Step:
    """A step's `propose` call: when it began, over which requests."""

    start: float
    req_ids: tuple[str, ...]


class DrafterGate:
    """Per batch-size bucket, whether the drafter drafts for the requests that have no
    lookup run, by each choice's measured tokens per second."""

    def __init__(self, half_life: int = HALF_LIFE_CYCLES):
        self.decay = 0.5 ** (1.0 / half_life)
        self.buckets: dict[int, _Bucket] = {}
        self.counted = 0  # cycles that counted, in all buckets
        self._step: _Step | None = None  # the step whose `propose` call is under way
        self._open: tuple[_Step, bool] | None = None  # a decided step and its choice

    # -- what the proposer reports -------------------------------------------------------
    def step(self, now: float, req_ids: tuple[str, ...], tokens: int | None) -> bool:
        """A `propose` call begins at `now` over `req_ids`: the open cycle ends here, with
        `tokens` emitted by the verification just done (None where some request was in
        a prefill chunk). It counts (returns True) if the same requests were verified as
        drafted."""
        opened, self._open = self._open, None
        self._step = _Step(now, req_ids)
        if opened is None or tokens is None or req_ids != opened[0].req_ids:
            return False
        began, choice = opened
        b = self.buckets.setdefault(bucket_of(len(req_ids)), _Bucket())
        for c in (DRAFTER, LOOKUPS_ALONE):
            b.seconds[c] *= self.decay
            b.tokens[c] *= self.decay
        b.seconds[choice] += now - began.start
        b.tokens[choice] += tokens
        b.cycles[choice] += 1
        self.counted += 1
        return True

    # -- what the proposer asks ----------------------------------------------------------
    def choose(self) -> bool:
        """DRAFTER or LOOKUPS_ALONE for the step under way, in which some request has no
        lookup run; its cycle begins with the step's `propose` call."""
        assert self._step is not None, "step() first"
        self._open = (self._step, choice := self._choice(len(self._step.req_ids)))
        return choice

    def _choice(self, batch: int) -> bool:
        b = self.buckets.setdefault(bucket_of(batch), _Bucket())
        if b.run_left > 0:  # inside a warm-up or probe run
            b.run_left -= 1
            return b.running
        if not b.warm():  # warming up: the next run is of the other choice
            b.running, b.run_left = not b.running, RUN - 1
            return b.running
        b.current = b.preferred()
        b.since_probe += 1
        if b.since_probe >= PROBE_EVERY:
            b.since_probe = 0
            b.running, b.run_left = not b.current, RUN - 1
            return b.running
        return b.current

    def summary(self) -> dict[str, tuple[str, float, float]]:
        """Per bucket ("1", "2", "3-4", ...): the choice its rates make now ("warming
        up" before they decide) and each choice's tokens/s (drafter, lookups alone),
        for the log."""
        out = {}
        for key in sorted(self.buckets):
            b = self.buckets[key]
            lo, hi = (1 << (key - 1)) + 1 if key else 1, 1 << key
            out[f"{lo}-{hi}" if hi > lo else str(hi)] = (
                ("drafter" if b.preferred() else "lookups alone") if b.warm()
                else "warming up",
                round(b.rate(DRAFTER), 1), round(b.rate(LOOKUPS_ALONE), 1))
        return out
