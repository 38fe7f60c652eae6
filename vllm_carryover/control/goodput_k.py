"""K by measured goodput: how many tokens to draft per step at the current load.

Drafting K tokens pays when the extra accepted tokens are worth more than the
extra time: at batch size B a step yields B * E(K) tokens, with
E(K) = 1 + sum_{j<=K} P(the first j drafts are all accepted), and costs t(B, K).
Both sides are measured while serving, in the scheduler's process:

- acceptance per draft position, from every verified request, as conditional rates
  p_j = P(position j accepted | positions < j accepted), decayed so that the
  estimate follows the traffic; a position seldom reached leans on the one before;
- the step time, wall clock between the ends of consecutive decode steps, fitted
  by least squares with no negative coefficient as t = c0 + c1 * target rows
  + c2 * tokens drafted + c3 * [any draft verified] + c4 * [any token drafted]. A
  step's target rows are its requests plus the drafts it verifies: a verified draft
  is one more row of the target's forward, so one coefficient prices both (fitted
  apart, the two trade cost wherever K stays put while the batch size moves), and a
  K never tried at this batch size still gets a cost; what a request costs besides
  its row is charged to every row, which errs towards drafting less. The indicator
  terms are what speculating at all costs, whatever K (rejection sampling,
  spec-decode metadata, the drafter's launch): without them a K = 1 step looks
  nearly as cheap as a plain one.

`choose(B)` is the K in 0..k_max with the most tokens per second, if that beats
K = 0 by `MIN_GAIN`: near break-even the fit's error would decide, and the risk is
all on the side of losing to no speculation. K = 0 drafts nothing but still pays
for the drafter keeping its context. Now and then a step probes a neighbour of the
chosen K, so that the fit sees more than one K and acceptance is still measured
while K is 0; a far K is never probed, since it can cost several plain steps at a
large batch. Until the fit is ready and `MIN_WARM_UP_REQUESTS` requests have had
drafts verified, steps alternate between K = k_max and K = 0, the two ends that give
the fit its firmest slope and every draft position its acceptance. Verification is
unchanged by K, so greedy output is too. The measurements behind these choices are
in docs/results.md.

vLLM's dynamic speculative decoding (`num_speculative_tokens_per_batch_size`)
supplies the rest: the scheduler asks `lookup[batch size]` for each step's K, and
the runner drafts that many; `patches.goodput_scheduler` hands it a `KLookup` over this.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PROBE_EVERY = 16  # at first one step in PROBE_EVERY drafts a neighbour of the chosen K
MAX_PROBE_EVERY = 128  # ... and at least one in MAX_PROBE_EVERY once the choice holds
PRIOR_REQUESTS = 8.0  # weight of the previous position's rate in a later position's
MIN_GAIN = 0.05  # a K > 0 must promise this much more tokens/s than K = 0
MIN_WARM_UP_REQUESTS = 64  # requests with verified drafts before the warm-up ends
MIN_FIT_STEPS = 32  # decode steps timed before the fit replaces the warm-up
HALF_LIFE_STEPS = 512  # acceptance counts and timed steps age over this many steps
REFIT_EVERY = 8  # steps between refits of the cost model
# a timed step as a row of the fit: its TERMS terms (1, target rows, drafted, any
# verified, any drafted), then its K per request and its seconds
TERMS, K_COLUMN, SECONDS_COLUMN = 5, 5, 6


@dataclass(frozen=True)
class TimedStep:
    """One decode step as the scheduler saw it."""

    batch: int  # requests in the step
    verified: int  # drafts the target verified (beyond one token per request)
    drafted: int  # tokens drafted at the end of the step, for the next one
    seconds: float


def expected_tokens_by_k(accept: np.ndarray) -> np.ndarray:
    """Tokens per request per step for K = 0..len(accept), given conditional
    acceptance rates `accept[j]` of position j + 1: the bonus token plus each
    accepted prefix."""
    return 1.0 + np.concatenate(([0.0], np.cumsum(np.cumprod(accept))))


def expected_tokens(accept: np.ndarray, k: int) -> float:
    """`expected_tokens_by_k` for one K."""
    return float(expected_tokens_by_k(accept[:k])[-1])


def nonnegative_least_squares(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a term that fits negative is dropped
    and the rest refitted. A negative cost is what terms that move together in the
    steps seen do to each other (drafted tokens against the indicator of drafting any,
    at batch 1); clipping it to 0 without refitting would leave the others fitted
    around a cost that is not there."""
    keep = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    while keep.any():
        coef[:] = 0.0
        coef[keep], *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all():
            break
        keep[np.argmin(coef)] = False  # drop the most negative term
    return coef


class GoodputK:
    """Acceptance and step-cost estimates, and the K they make best per batch size."""

    def __init__(self, k_max: int, probe_every: int = PROBE_EVERY,
                 min_fit_steps: int = MIN_FIT_STEPS, half_life: int = HALF_LIFE_STEPS):
        self.k_max = k_max
        self.probe_every = probe_every
        self.min_fit_steps = min_fit_steps
        self.decay = 0.5 ** (1.0 / half_life)
        # decayed counts: requests that reached position j, and were accepted there
        self.reached = np.zeros(k_max)
        self.accepted = np.zeros(k_max)
        # the latest timed steps as the fit's rows, a ring; rebuilding them from step
        # objects took 3-4x as long per fit, in the engine core's decode loop
        self._steps = np.zeros((4 * half_life, SECONDS_COLUMN + 1))
        # the fit's weights, newest last: each step weighs `decay` times the next
        self._weights = np.sqrt(self.decay ** np.arange(len(self._steps))[::-1])
        self.coef: np.ndarray | None = None  # c0..c4 of the cost fit
        self.timed_steps = 0
        self._since_fit = 0
        self._probe_interval = probe_every
        self._since_probe = 0
        self._probe_up = False  # which neighbour the next probe tries
        self._last_best: int | None = None
        self._warm_up_drafts_next = True  # warm-up alternates k_max and 0
        self.drafted_requests = 0  # requests whose drafts were verified, never decayed

    # -- what the scheduler reports ------------------------------------------------
    def observe_request(self, drafted: int, accepted: int) -> None:
        """One verified request: `accepted` of its `drafted` tokens were accepted."""
        drafted = min(drafted, self.k_max)
        accepted = max(0, min(accepted, drafted))
        self.drafted_requests += drafted > 0
        # position j (0-based) was reached if all before it were accepted
        reached = min(drafted, accepted + 1)
        self.reached[:reached] += 1.0
        self.accepted[:accepted] += 1.0

    def observe_step(self, step: TimedStep) -> None:
        """One timed decode step; ages the acceptance counts by one step."""
        self._steps[self.timed_steps % len(self._steps)] = (
            1.0, step.batch + step.verified, step.drafted, step.verified > 0, step.drafted > 0,
            step.drafted // max(step.batch, 1), step.seconds)
        self.timed_steps += 1
        self.reached *= self.decay
        self.accepted *= self.decay
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            self.coef = self.fit()

    # -- estimates -----------------------------------------------------------------
    def acceptance(self) -> np.ndarray:
        """Conditional acceptance rate per draft position. Position 1 is what it was
        seen to be (0 if never drafted); each later one is shrunk towards the position
        before it by `PRIOR_REQUESTS` pseudo-requests. A position is reached only after
        every earlier draft was accepted, so positions past the chosen K + 1 are seldom
        or never seen: counted as 0 they would keep K from ever climbing, and a handful
        of requests would decide them; rates that fall gently from one position to the
        next are what drafters show."""
        out = np.zeros(self.k_max)
        if self.reached[0] > 1e-9:
            out[0] = self.accepted[0] / self.reached[0]
        for j in range(1, self.k_max):
            out[j] = ((self.accepted[j] + PRIOR_REQUESTS * out[j - 1])
                      / (self.reached[j] + PRIOR_REQUESTS))
        return out

    def fit(self) -> np.ndarray | None:
        """Least-squares step cost over the timed steps (older steps weigh less);
        None until there are enough of them with more than one K."""
        n = min(self.timed_steps, len(self._steps))
        if n < self.min_fit_steps:
            return None
        rows = self._steps[np.arange(self.timed_steps - n, self.timed_steps) % len(self._steps)]
        if (rows[:, K_COLUMN] == rows[0, K_COLUMN]).all():
            return None  # one K only: the cost of another is not measured yet
        x, y = rows[:, :TERMS].copy(), rows[:, SECONDS_COLUMN]
        # an indicator that is 1 in every step cannot be told from c0: leave it out
        x[:, 3:] *= ~x[:, 3:].astype(bool).all(axis=0)
        w = self._weights[-n:]
        return nonnegative_least_squares(x * w[:, None], y * w)

    def step_seconds(self, batch: int, k: int | np.ndarray) -> float | np.ndarray:
        """Fitted cost of a steady step: each step verifies as many drafts as it drafts."""
        c = self.coef
        assert c is not None
        k = np.asarray(k)
        return c[0] + c[1] * batch * (1 + k) + c[2] * batch * k + (c[3] + c[4]) * (k > 0)

    def best_k(self, batch: int) -> int:
        """The K with the most tokens per second at this batch size (the smallest on
        ties), or 0 unless it beats K = 0 by `MIN_GAIN`; k_max while the cost fit is
        not ready (`choose` then alternates it with 0)."""
        if self.coef is None:
            return self.k_max
        # called every scheduler step: all Ks at once
        seconds = self.step_seconds(batch, np.arange(self.k_max + 1))
        rates = batch * expected_tokens_by_k(self.acceptance()) / np.maximum(seconds, 1e-9)
        best = int(np.argmax(rates))
        return best if rates[best] >= (1.0 + MIN_GAIN) * rates[0] else 0

    # -- what the scheduler asks -----------------------------------------------------
    def choose(self, batch: int) -> int:
        """K for the next step at this batch size, or now and then a probe of a
        neighbouring K (one less and one more in turn, inside 0..k_max); k_max and 0
        in turn while warming up (no cost fit yet, or too few drafted requests)."""
        if self.coef is None or self.drafted_requests < MIN_WARM_UP_REQUESTS:
            drafts = self._warm_up_drafts_next
            self._warm_up_drafts_next = not drafts
            return self.k_max if drafts else 0
        best = self.best_k(batch)
        if best != self._last_best:  # a new choice: look around it closely again
            self._last_best, self._probe_interval = best, self.probe_every
            self._since_probe = 0
        if not self.probe_every:
            return best
        self._since_probe += 1
        if self._since_probe < self._probe_interval:
            return best
        self._since_probe = 0
        self._probe_interval = min(2 * self._probe_interval,
                                   max(MAX_PROBE_EVERY, self.probe_every))
        self._probe_up = not self._probe_up
        up = self._probe_up if 0 < best < self.k_max else best == 0
        return best + 1 if up else best - 1

    def schedule(self, max_batch: int) -> list[tuple[int, int, int]]:
        """The current choice as vLLM's `[(first, last, K), ...]` ranges (for logs)."""
        out: list[tuple[int, int, int]] = []
        for b in range(1, max_batch + 1):
            k = self.best_k(b)
            if out and out[-1][2] == k:
                out[-1] = (out[-1][0], b, k)
            else:
                out.append((b, b, k))
        return out


class KLookup:
    """What vLLM's scheduler indexes as `dynamic_sd_lookup[batch size]`: asks the
    controller instead of a fixed table."""

    def __init__(self, controller: GoodputK):
        self.controller = controller

    def __getitem__(self, batch: int) -> int:
        return self.controller.choose(batch)
