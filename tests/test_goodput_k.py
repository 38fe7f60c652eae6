"""K by measured goodput (`goodput_k`): the acceptance counts, the cost fit, the choice
and the probes, on synthetic steps whose true costs are known."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_carryover.control.goodput_k import (
    MAX_PROBE_EVERY,
    MIN_GAIN,
    MIN_WARM_UP_REQUESTS,
    GoodputK,
    KLookup,
    TimedStep,
    expected_tokens,
    nonnegative_least_squares,
)

K_MAX = 7


def feed(g: GoodputK, cost: tuple[float, ...], accept: float,
         steps: int = 400, seed: int = 0) -> None:
    """Steps at random batch sizes, each verifying the last step's K drafts and drafting
    a random K, timed by a known linear cost (plus 1 % noise): c0, per target row (a
    request or a verified draft), per drafted token, and optionally a fixed cost of
    verifying any and of drafting any; every request accepts each draft with
    probability `accept`."""
    rng = np.random.default_rng(seed)
    c0, c_row, c_draft, c_any_verify, c_any_draft = (*cost, 0.0, 0.0)[:5]
    last_k = K_MAX
    for _ in range(steps):
        batch, k = int(rng.integers(1, 33)), int(rng.integers(0, K_MAX + 1))
        for _ in range(batch):
            if last_k:
                accepted = 0
                while accepted < last_k and rng.random() < accept:
                    accepted += 1
                g.observe_request(last_k, accepted)
        verified, drafted = batch * last_k, batch * k
        last_k = k
        seconds = (c0 + c_row * (batch + verified) + c_draft * drafted
                   + c_any_verify * (verified > 0) + c_any_draft * (drafted > 0))
        g.observe_step(TimedStep(batch, verified, drafted, seconds * rng.normal(1, 0.01)))


def test_expected_tokens_counts_the_bonus_token_and_each_accepted_prefix() -> None:
    accept = np.array([0.5, 0.5, 1.0])
    assert expected_tokens(accept, 0) == 1.0
    assert expected_tokens(accept, 1) == 1.5
    assert expected_tokens(accept, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.25)


def test_acceptance_is_conditional_on_reaching_the_position() -> None:
    g = GoodputK(K_MAX)
    for _ in range(1000):
        g.observe_request(drafted=7, accepted=2)  # positions 1, 2 accepted, 3 rejected
        g.observe_request(drafted=7, accepted=0)  # position 1 rejected
        g.observe_request(drafted=2, accepted=2)  # both accepted, nothing further drafted
    assert g.acceptance()[:3] == pytest.approx([2 / 3, 1.0, 0.0], abs=0.01)


def test_positions_seldom_reached_lean_on_the_one_before() -> None:
    """Position 1 is taken as seen; a later position seen by few requests is pulled
    towards the one before it, and one never reached takes its rate."""
    g = GoodputK(K_MAX)
    for _ in range(100):
        g.observe_request(drafted=2, accepted=0)
        g.observe_request(drafted=2, accepted=2)
    g.observe_request(drafted=3, accepted=2)  # position 3 reached once, rejected
    accept = g.acceptance()
    assert accept[0] == pytest.approx(101 / 201)
    assert 0.95 < accept[1] < 1.0  # 101 of 101 seen: the data outweighs the prior
    assert accept[1] > accept[2] > 0.8  # 0 of 1 seen: mostly the prior
    assert (accept[3:] == accept[2]).all()


def test_the_cost_fit_recovers_the_true_costs() -> None:
    g = GoodputK(K_MAX)
    cost = (0.02, 0.0005, 0.0002)
    feed(g, cost, accept=0.5)
    assert g.coef == pytest.approx((*cost, 0.0, 0.0), rel=0.1, abs=2e-4)


def test_the_cost_fit_recovers_what_speculating_at_all_costs() -> None:
    """A fixed cost of verifying and of drafting, whatever K, is told apart from the
    plain step's, and makes a marginal drafter not worth running at batch 1."""
    g = GoodputK(K_MAX)
    cost = (0.02, 0.0005, 0.0002, 0.004, 0.003)
    feed(g, cost, accept=0.15)
    assert g.coef is not None
    assert g.coef[[0, 1, 2]] == pytest.approx(cost[:3], rel=0.1, abs=2e-4)
    assert g.coef[3] + g.coef[4] == pytest.approx(0.007, rel=0.1)
    assert g.best_k(1) == 0


def test_a_term_that_fits_negative_is_dropped_and_the_rest_refitted() -> None:
    """y = 2 + x1 + noise, where x2 is x1 plus that noise's negative: least squares
    gives x2 a negative weight and x1 1.3; clipping x2 to 0 would leave x1 at 1.3,
    refitted without x2, x1 is 1 again."""
    rng = np.random.default_rng(0)
    x1 = rng.uniform(0, 10, 200)
    noise = rng.normal(0, 0.5, 200)
    x = np.stack([np.ones(200), x1, x1 + noise], axis=1)
    y = 2 + x1 - 0.3 * noise
    assert np.linalg.lstsq(x, y, rcond=None)[0] == pytest.approx([2.0, 1.3, -0.3])
    assert nonnegative_least_squares(x, y) == pytest.approx([2.0, 1.0, 0.0], abs=0.05)


def test_the_fit_keeps_only_the_latest_steps() -> None:
    """It keeps four half-lives of steps (256 here): once the machine's costs change,
    400 steps later the fit has the new ones alone."""
    g = GoodputK(K_MAX, half_life=64)
    feed(g, (0.05, 0.001, 0.0), accept=0.5, seed=1)
    cost = (0.02, 0.0005, 0.0002)
    feed(g, cost, accept=0.5, seed=2)
    assert g.coef == pytest.approx((*cost, 0.0, 0.0), rel=0.1, abs=2e-4)


def test_no_fit_until_it_has_seen_two_ks() -> None:
    g = GoodputK(K_MAX, min_fit_steps=4)
    for _ in range(10):
        g.observe_step(TimedStep(batch=4, verified=28, drafted=28, seconds=0.05))
    assert g.coef is None and g.best_k(4) == K_MAX


def warm_up(g: GoodputK, batch: int) -> list[int]:
    """Steps at one batch size until the warm-up is over; every draft is rejected."""
    last, chosen = 0, []
    for _ in range(1000):
        k = g.choose(batch)
        chosen.append(k)
        for _ in range(batch if last else 0):
            g.observe_request(last, 0)
        g.observe_step(TimedStep(batch=batch, verified=batch * last, drafted=batch * k,
                                 seconds=0.02 + 0.002 * batch * (last + k)))
        last = k
        if g.coef is not None and g.drafted_requests >= MIN_WARM_UP_REQUESTS:
            break
    return chosen


def test_warm_up_alternates_k_max_and_zero_until_fit_and_acceptance_are_ready() -> None:
    """The warm-up's own choices give the fit both ends of 0..k_max: at batch 16 it is
    over after `min_fit_steps` steps, where drafting k_max alone would wait for a probe;
    at batch 1 it goes on until `MIN_WARM_UP_REQUESTS` requests had drafts verified."""
    g = GoodputK(K_MAX, min_fit_steps=8)
    assert warm_up(g, 16) == [K_MAX, 0] * 4
    assert g.best_k(16) == 0  # nothing was accepted
    g = GoodputK(K_MAX, min_fit_steps=8)
    assert warm_up(g, 1) == [K_MAX, 0] * MIN_WARM_UP_REQUESTS


@pytest.mark.parametrize(("verify_cost", "k"), [(0.45, 0), (0.30, 1)])
def test_drafting_must_beat_k0_by_a_margin(verify_cost: float, k: int) -> None:
    """Half the drafts accepted, a verified row costing `verify_cost` of a plain step's
    share per request: K = 1 yields 1.5x the tokens for 1 + verify_cost the time. 3 %
    better than K = 0 is a break-even left at K = 0; 15 % better drafts."""
    g = GoodputK(K_MAX)
    g.reached[:], g.accepted[:] = 100.0, 50.0
    g.coef = np.array([16 * (1 - verify_cost), verify_cost, 0.0, 0.0, 0.0])
    gain = 1.5 / (1 + verify_cost) - 1
    assert (gain >= MIN_GAIN) == (k > 0)
    assert g.best_k(16) == k


def test_nothing_accepted_means_no_drafts() -> None:
    g = GoodputK(K_MAX)
    feed(g, (0.02, 0.0005, 0.0002), accept=0.0)
    assert [g.best_k(b) for b in (1, 4, 16)] == [0, 0, 0]


def test_cheap_drafts_that_are_always_accepted_mean_k_max() -> None:
    g = GoodputK(K_MAX)
    feed(g, (0.05, 0.0001, 0.00005), accept=1.0)
    assert [g.best_k(b) for b in (1, 4, 16)] == [K_MAX] * 3


def test_k_falls_as_the_batch_grows_when_verifying_costs_per_token() -> None:
    """A fixed step cost dominates small batches, the per-token cost large ones: the
    same acceptance pays for deep drafts at batch 1 and for none at batch 32."""
    g = GoodputK(K_MAX)
    feed(g, (0.03, 0.002, 0.0005), accept=0.6)
    ks = [g.best_k(b) for b in (1, 2, 4, 8, 16, 32)]
    assert ks[0] >= 3 and ks[-1] == 0
    assert ks == sorted(ks, reverse=True)
    assert [r[2] for r in g.schedule(32)] == sorted({*ks}, reverse=True)


def test_probes_try_only_the_neighbours_of_the_chosen_k() -> None:
    g = GoodputK(K_MAX, probe_every=4)
    g.coef, g.drafted_requests = np.zeros(5), MIN_WARM_UP_REQUESTS  # a fit is there ...
    g.best_k = lambda batch: 3  # type: ignore[method-assign]  # ... and it says K = 3
    chosen = [KLookup(g)[8] for _ in range(200)]
    assert set(chosen) == {2, 3, 4}
    assert chosen.count(2) >= 1 and chosen.count(4) >= 1


def test_at_k_max_probes_go_down_only() -> None:
    g = GoodputK(K_MAX, probe_every=4)
    g.coef, g.drafted_requests = np.zeros(5), MIN_WARM_UP_REQUESTS
    g.best_k = lambda batch: K_MAX  # type: ignore[method-assign]
    assert set(KLookup(g)[8] for _ in range(200)) == {K_MAX, K_MAX - 1}


def test_probes_thin_out_while_the_choice_holds_and_return_when_it_changes() -> None:
    g = GoodputK(K_MAX, probe_every=4)
    g.coef, g.drafted_requests = np.zeros(5), MIN_WARM_UP_REQUESTS
    best = 0
    g.best_k = lambda batch: best  # type: ignore[method-assign]
    first = [g.choose(8) for _ in range(1000)]
    probe_steps = [i for i, k in enumerate(first) if k != 0]
    gaps = np.diff(probe_steps)
    assert gaps[0] < gaps[-1] == MAX_PROBE_EVERY
    best = 5
    after = [g.choose(8) for _ in range(4)]
    assert after[-1] != 5  # probing closely again around the new choice


def test_k_learnt_at_small_batches_stays_small_where_rows_cost_compute() -> None:
    """Steps at batch 1 and then mostly 4, all drafting k_max (but for the warm-up's
    K = 0 steps), so that batch size and drafts verified move together, on a cost
    shaped like a 2-core CPU's: 30 ms a step, a target row 0.2 ms while the first 8
    rows are bound by reading the weights and 0.9 ms each after that, 0.3 ms a drafted
    token. At batch 16, K = 1 is best (1.14x the tokens/s of K = 0) and K >= 4 loses
    to K = 0; a fit with a cost per request apart from a cost per verified draft
    chose K = 5 there from these steps."""
    rng = np.random.default_rng(0)
    g = GoodputK(K_MAX)
    last: list[int] = []  # drafts of each request in the step before
    for step in range(1300):
        # concurrency 4: batch 4 but while requests come and go
        batch = 1 if step < 1000 else 4 - int(rng.random() < 0.3) * int(rng.integers(1, 4))
        k = 0 if step < 300 and step % 2 else K_MAX
        for drafted in last[:batch]:
            accepted = 0
            while accepted < drafted and rng.random() < 0.7:
                accepted += 1
            g.observe_request(drafted, accepted)
        verified = sum(last[:batch])
        # a lookup drafts a run of 1..K tokens
        last = [int(rng.integers(1, k + 1)) if k else 0 for _ in range(batch)]
        rows = batch + verified
        seconds = 0.030 + 0.0002 * min(rows, 8) + 0.0009 * max(rows - 8, 0) + 0.0003 * batch * k
        g.observe_step(TimedStep(batch, verified, batch * k, seconds * rng.lognormal(0, 0.1)))
    assert g.best_k(1) >= K_MAX - 1
    assert 1 <= g.best_k(16) <= 2
