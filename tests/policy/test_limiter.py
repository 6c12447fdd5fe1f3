"""Tests of the exact-integer GCRA limiter (:mod:`vllm_output_rate.policy.limiter`).

Time is always passed in (integer nanoseconds); nothing here sleeps or reads a
clock.  Expected values are computed with exact integer / Fraction arithmetic,
never with floats, so an implementation that accumulates rounding error fails.
"""

from __future__ import annotations

import bisect
import copy
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm_output_rate.policy.limiter import (
    DEFAULT_BURST_NS,
    NS_PER_S,
    OutputRateLimiter,
    exact_rate,
)

MS = 1_000_000
S = NS_PER_S

FAST = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Rates as the limiter sees them: ints, "nice" floats (exact decimals), and
# true fractions.  All are converted with exact_rate() for the oracle.
RATES = st.one_of(
    st.integers(min_value=1, max_value=300),
    st.sampled_from([0.1, 0.5, 2.5, 0.3, 1.5, 33.3, 7.25, 1000.0]),
    st.builds(
        Fraction,
        st.integers(min_value=1, max_value=500),
        st.integers(min_value=1, max_value=97),
    ),
    st.floats(min_value=0.05, max_value=500.0, allow_nan=False, allow_infinity=False),
)
BURSTS = st.one_of(
    st.just(DEFAULT_BURST_NS),
    st.integers(min_value=1, max_value=2 * S),
)
USERS = ["a", "b", "c"]


def fr(limiter: OutputRateLimiter, user: str) -> Fraction:
    return limiter.rates.exact_rate_of(user)


def floor_tokens(duration_ns: int, rate: Fraction) -> int:
    """floor(duration * rate), duration in ns, exactly."""
    return (duration_ns * rate.numerator) // (rate.denominator * NS_PER_S)


def at_most_bound(count: int, window_ns: int, burst_ns: int, rate: Fraction) -> bool:
    """count <= (W + burst) * rate + 1, exactly."""
    return (count - 1) * rate.denominator * NS_PER_S <= (
        (window_ns + burst_ns) * rate.numerator
    )


# ---------------------------------------------------------------------------
# Construction and validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        0,
        0.0,
        -1,
        -0.5,
        Fraction(-1, 3),
        float("nan"),
        float("inf"),
        float("-inf"),
        True,
        False,
        "fast",
        "",
        "nan",
        "inf",
        "0",
        "-3",
        None,
        [5],
        {"rate": 5},
        1 + 2j,
    ],
)
def test_bad_default_rate_raises_value_error(bad):
    with pytest.raises(ValueError, match="default rate"):
        OutputRateLimiter(bad)


@pytest.mark.parametrize(
    "bad", [0, -2, float("nan"), float("inf"), True, "x", None, -1e-9]
)
def test_bad_user_rate_raises_value_error_naming_user(bad):
    with pytest.raises(ValueError, match="alice"):
        OutputRateLimiter(10, {"alice": bad})


@pytest.mark.parametrize("bad_user", ["", 5, None, b"bytes"])
def test_bad_user_name_raises(bad_user):
    with pytest.raises(ValueError, match="user names"):
        OutputRateLimiter(10, {bad_user: 5})


@pytest.mark.parametrize(
    "bad_burst", [0, -1, -DEFAULT_BURST_NS, 1.5, 100_000_000.0, True, False, "100", None]
)
def test_bad_burst_raises(bad_burst):
    with pytest.raises(ValueError, match="burst_ns"):
        OutputRateLimiter(10, burst_ns=bad_burst)


def test_exact_rate_conversions():
    assert exact_rate(0.1) == Fraction(1, 10)
    assert exact_rate(2.5) == Fraction(5, 2)
    assert exact_rate(3) == Fraction(3)
    assert exact_rate(Fraction(7, 3)) == Fraction(7, 3)
    assert exact_rate(1e-3) == Fraction(1, 1000)
    with pytest.raises(ValueError, match="my rate"):
        exact_rate(0, "my rate")


def test_rates_and_burst_are_reported():
    lim = OutputRateLimiter(2.5, {"slow": 0.1, "third": Fraction(7, 3)}, burst_ns=5 * MS)
    assert lim.burst_ns == 5 * MS
    assert lim.rate_of("anyone") == 2.5
    assert lim.rate_of("slow") == 0.1
    assert lim.rates.exact_rate_of("slow") == Fraction(1, 10)
    assert lim.rates.exact_rate_of("third") == Fraction(7, 3)
    assert lim.rates.exact_rate_of("anyone") == Fraction(5, 2)
    assert len(lim.state) == 0


# ---------------------------------------------------------------------------
# Simple deterministic behaviour
# ---------------------------------------------------------------------------


def test_fresh_user_gets_burst_plus_one_then_even_pacing():
    # 100 tok/s, 100 ms burst: 11 at once (1 + 100 ms worth), then one per 10 ms.
    lim = OutputRateLimiter(100)
    t = 5 * S
    assert lim.available("u", t) == 11
    assert lim.ready_at_ns("u", t) == t
    assert sum(lim.try_take("u", t) for _ in range(20)) == 11
    assert lim.available("u", t) == 0
    assert lim.ready_at_ns("u", t) == t + 10 * MS
    assert not lim.try_take("u", t + 10 * MS - 1)
    assert lim.try_take("u", t + 10 * MS)
    assert not lim.try_take("u", t + 10 * MS)
    assert len(lim.state) == 1


def test_users_are_independent_and_overrides_apply():
    lim = OutputRateLimiter(1, {"fast": 50}, burst_ns=DEFAULT_BURST_NS)
    assert lim.try_take("slow", 0)
    assert not lim.try_take("slow", 0)
    assert lim.available("other", 0) == 1
    assert lim.available("fast", 0) == 6  # 1 + floor(0.1 s * 50)
    assert lim.ready_at_ns("slow", 0) == S - DEFAULT_BURST_NS


def test_fractional_rate_interval_is_exact():
    # 0.1 tok/s: exactly one token per 10 s.
    lim = OutputRateLimiter(0.1)
    assert lim.try_take("u", 0)
    assert lim.ready_at_ns("u", 0) == 10 * S - DEFAULT_BURST_NS
    assert not lim.try_take("u", 10 * S - DEFAULT_BURST_NS - 1)
    assert lim.try_take("u", 10 * S - DEFAULT_BURST_NS)


def test_ready_at_rounds_up_to_whole_nanosecond():
    # 3 tok/s: interval 333_333_333.33.. ns.
    lim = OutputRateLimiter(3, burst_ns=1)
    assert lim.try_take("u", 0)
    assert lim.try_take("u", 0) is False
    # TAT = 1/3 s; earliest t with 1/3 s - t <= 1 ns is ceil(1e9/3) - 1.
    assert lim.ready_at_ns("u", 0) == 333_333_334 - 1
    assert not lim.try_take("u", 333_333_332)
    assert lim.try_take("u", 333_333_333)


def test_refund_for_unknown_user_is_noop():
    lim = OutputRateLimiter(5)
    lim.refund("ghost", 10)
    assert len(lim.state) == 0
    assert lim.available("ghost", 10) == 1


def test_refund_restores_immediately():
    lim = OutputRateLimiter(5)
    assert lim.try_take("u", 0)
    assert lim.available("u", 0) == 0
    lim.refund("u", 0)
    assert lim.available("u", 0) == 1
    assert len(lim.state) == 0  # idle again, state dropped
    assert lim.try_take("u", 0)


def test_cleanup_drops_only_idle_users():
    lim = OutputRateLimiter(1, {"fast": 1000})
    assert lim.try_take("slow", 0)
    assert lim.try_take("fast", 0)
    assert len(lim.state) == 2
    # fast's TAT = 1 ms, slow's TAT = 1 s.
    assert lim.cleanup_idle_users(MS - 1) == 0
    assert lim.cleanup_idle_users(MS) == 1  # TAT == now is not in the future
    assert len(lim.state) == 1
    assert lim.cleanup_idle_users(S) == 1
    assert len(lim.state) == 0
    assert lim.cleanup_idle_users(2 * S) == 0


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------


@st.composite
def attempt_patterns(draw):
    rates = {u: draw(RATES) for u in USERS}
    burst = draw(BURSTS)
    n = draw(st.integers(min_value=1, max_value=250))
    # Gaps mixing "same instant", sub-interval and long idle periods.
    gaps = draw(
        st.lists(
            st.one_of(
                st.just(0),
                st.integers(min_value=0, max_value=20 * MS),
                st.integers(min_value=0, max_value=3 * S),
            ),
            min_size=n,
            max_size=n,
        )
    )
    users = draw(st.lists(st.sampled_from(USERS), min_size=n, max_size=n))
    start = draw(st.integers(min_value=0, max_value=10**15))
    return rates, burst, start, gaps, users


@FAST
@given(attempt_patterns())
def test_bound_holds_for_any_attempt_pattern(pattern):
    rates, burst, start, gaps, users = pattern
    lim = OutputRateLimiter(rates["a"], {u: rates[u] for u in ("b", "c")}, burst_ns=burst)
    t = start
    taken: dict[str, list[int]] = {u: [] for u in USERS}
    for gap, user in zip(gaps, users):
        t += gap
        if lim.try_take(user, t):
            taken[user].append(t)
    for user, times in taken.items():
        rate = fr(lim, user)
        # Every window that starts and ends at a successful take (the
        # tightest windows there are).
        for i in range(len(times)):
            for j in range(i, len(times)):
                assert at_most_bound(j - i + 1, times[j] - times[i], burst, rate), (
                    user,
                    rate,
                    times[i],
                    times[j],
                    j - i + 1,
                )


@FAST
@given(rate=RATES, burst=BURSTS, start=st.integers(0, 10**14), w_frac=st.floats(0, 5))
def test_greedy_attempts_reach_the_bound_exactly(rate, burst, start, w_frac):
    """A user taking everything it can is allowed exactly the bound's worth."""
    lim = OutputRateLimiter(rate, burst_ns=burst)
    r = lim.rates.exact_rate_of("u")
    interval_ns = Fraction(r.denominator * NS_PER_S, r.numerator)
    window = int(w_frac * interval_ns)
    assume(floor_tokens(window + burst, r) < 2_000)
    # Attempt at every instant where a take might newly be allowed.
    t = start
    count = 0
    while t <= start + window:
        while lim.try_take("u", t):
            count += 1
        t = lim.ready_at_ns("u", t)
    assert at_most_bound(count, window, burst, r)
    # ... and the bound is attained up to the ns rounding: floor((W+B)*rate)+1.
    assert count == floor_tokens(window + burst, r) + 1


def _count_in(times: list[int], lo: int, hi: int) -> int:
    return bisect.bisect_right(times, hi) - bisect.bisect_left(times, lo)


@FAST
@given(
    rate=RATES,
    burst=BURSTS,
    start=st.integers(0, 10**14),
    n=st.integers(5, 400),
    windows=st.lists(st.floats(0.0, 40.0), min_size=1, max_size=4),
)
def test_liveness_when_taking_at_ready_times(rate, burst, start, n, windows):
    lim = OutputRateLimiter(rate, burst_ns=burst)
    r = lim.rates.exact_rate_of("u")
    interval_ns = Fraction(r.denominator * NS_PER_S, r.numerator)
    t = start
    times = []
    for _ in range(n):
        t = lim.ready_at_ns("u", t)
        assert lim.try_take("u", t)
        times.append(t)
    first, last = times[0], times[-1]
    for k in windows:
        w = int(k * interval_ns)
        floor_w = floor_tokens(w, r)
        for s in times:
            if s + w <= last:  # window starting at a take, inside the run
                c = _count_in(times, s, s + w)
                assert c >= floor_w, (s, w, c)
                assert c * NS_PER_S * r.denominator >= (w * r.numerator) - NS_PER_S * r.denominator
                assert at_most_bound(c, w, burst, r)
            if s - w >= first:  # window ending at a take
                c = _count_in(times, s - w, s)
                assert c >= floor_w, (s, w, c)
                assert at_most_bound(c, w, burst, r)
        # Windows not anchored at takes (1 ns rounding slack).
        for s in times[:: max(1, len(times) // 10)]:
            for off in (1, 7, int(interval_ns / 3) + 1):
                a = s + off
                if a + w <= last:
                    assert _count_in(times, a, a + w) >= floor_w


@FAST
@given(
    rate=RATES,
    burst=st.integers(min_value=10 * MS, max_value=2 * S),
    start=st.integers(0, 10**14),
    data=st.data(),
)
def test_liveness_with_dense_random_attempts(rate, burst, start, data):
    """Attempts at random times, never more than ``g <= burst`` apart, each
    taking whatever is allowed: no quota is ever lost, so every window of W
    inside the run holds at least floor((W - g) * rate) takes."""
    lim = OutputRateLimiter(rate, burst_ns=burst)
    r = lim.rates.exact_rate_of("u")
    interval_ns = Fraction(r.denominator * NS_PER_S, r.numerator)
    g = data.draw(st.integers(min_value=1, max_value=burst), label="max_gap")
    horizon = int(min(interval_ns * 60, Fraction(120 * S)))
    assume(horizon > 2 * g)
    gaps = data.draw(
        st.lists(st.one_of(st.just(g), st.integers(1, g)), min_size=1, max_size=600),
        label="gaps",
    )
    t = start
    attempts = [t]
    takes: list[int] = []
    for gap in gaps:
        if t + gap > start + horizon:
            break
        while lim.try_take("u", t):
            takes.append(t)
        t += gap
        attempts.append(t)
    while lim.try_take("u", t):
        takes.append(t)
    last = attempts[-1]
    # Nothing lost: takes so far equal the exact GCRA allowance of a user
    # whose TAT never fell behind now.
    assert len(takes) == floor_tokens(last - start + burst, r) + 1
    for k in (0.5, 1.0, 3.0, 10.0):
        w = int(k * interval_ns) + g
        for a in attempts[:: max(1, len(attempts) // 25)]:
            if a + w <= last:
                c = _count_in(takes, a, a + w)
                assert c >= floor_tokens(w - g, r), (a, w, g, c)
                assert at_most_bound(c, w, burst, r)


@st.composite
def op_sequences(draw, ops=("take", "ready", "avail")):
    rates = {u: draw(RATES) for u in USERS}
    burst = draw(BURSTS)
    n = draw(st.integers(min_value=1, max_value=120))
    seq = draw(
        st.lists(
            st.tuples(
                st.one_of(
                    st.just(0),
                    st.integers(0, 50 * MS),
                    st.integers(0, 4 * S),
                ),
                st.sampled_from(USERS),
                st.sampled_from(ops),
            ),
            min_size=n,
            max_size=n,
        )
    )
    start = draw(st.integers(0, 10**14))
    return rates, burst, start, seq


def make(rates, burst):
    return OutputRateLimiter(rates["a"], {"b": rates["b"], "c": rates["c"]}, burst_ns=burst)


def observe(lim: OutputRateLimiter, user: str, t: int):
    return (lim.available(user, t), lim.ready_at_ns(user, t))


def run_op(lim: OutputRateLimiter, op: str, user: str, t: int):
    if op == "take":
        return lim.try_take(user, t)
    if op == "ready":
        return lim.ready_at_ns(user, t)
    if op == "avail":
        return lim.available(user, t)
    if op == "refund":
        return lim.refund(user, t)
    raise AssertionError(op)


def replayed(seq_data):
    """Run a drawn op sequence on a fresh limiter; yield (limiter, time) after each op."""
    rates, burst, start, seq = seq_data
    lim = make(rates, burst)
    t = start
    for gap, user, op in seq:
        t += gap
        run_op(lim, op, user, t)
        yield lim, t


@FAST
@given(op_sequences(), st.data())
def test_ready_at_is_exact_and_available_counts_takes(seq_data, data):
    _, burst, _, _ = seq_data
    for lim, t in replayed(seq_data):
        probe = data.draw(st.sampled_from(USERS), label="probe user")
        ready = lim.ready_at_ns(probe, t)
        assert ready >= t
        # A take exactly at ready succeeds ...
        at = copy.deepcopy(lim)
        assert at.try_take(probe, ready)
        # ... and one ns earlier fails, unless ready is now.
        if ready > t:
            before = copy.deepcopy(lim)
            assert not before.try_take(probe, ready - 1)
            assert lim.available(probe, t) == 0
        # available() == number of consecutive successful takes right now.
        n_avail = lim.available(probe, t)
        clone = copy.deepcopy(lim)
        got = 0
        while clone.try_take(probe, t):
            got += 1
            assert got <= n_avail + 1
        assert got == n_avail
        # available() also equals the exact formula at a later instant.
        later = t + data.draw(st.integers(0, 3 * S), label="later")
        n_later = lim.available(probe, later)
        clone = copy.deepcopy(lim)
        got = 0
        while clone.try_take(probe, later):
            got += 1
        assert got == n_later
        assert n_later <= floor_tokens(burst, lim.rates.exact_rate_of(probe)) + 1


@FAST
@given(op_sequences(), st.data())
def test_refund_restores_prior_observable_state(seq_data, data):
    """Limiter B gets extra take(+refund) pairs inserted; A does not.  Every
    answer of the shared operations must be the same."""
    rates, burst, start, seq = seq_data
    a = make(rates, burst)
    b = make(rates, burst)
    pending: dict[str, int] = {}  # user -> outstanding inserted takes in b
    t = start
    for gap, user, op in seq:
        t += gap
        # Settle b's inserted takes for this user before it is touched again,
        # at this (possibly later) instant.  Other users' ops may have run in
        # between.
        if user in pending:
            for _ in range(pending.pop(user)):
                b.refund(user, t)
        # Maybe refund other users' pending takes now, too.
        for other in list(pending):
            if data.draw(st.booleans(), label="refund early"):
                for _ in range(pending.pop(other)):
                    b.refund(other, t)
        if data.draw(st.integers(0, 2), label="insert") == 0:
            extra_user = data.draw(st.sampled_from(USERS), label="extra user")
            n_extra = data.draw(st.integers(1, 3), label="n_extra")
            ok = 0
            for _ in range(n_extra):
                ok += b.try_take(extra_user, t)
            if extra_user == user:
                for _ in range(ok):
                    b.refund(user, t)  # same instant, before the op
            elif ok:
                # Refunded later (at a later instant), after other users' ops.
                pending[extra_user] = pending.get(extra_user, 0) + ok
        assert run_op(a, op, user, t) == run_op(b, op, user, t), (op, user, t)
        for u in USERS:
            if u not in pending:
                assert observe(a, u, t) == observe(b, u, t)
    for u, k in pending.items():
        for _ in range(k):
            b.refund(u, t)
    for u in USERS:
        assert observe(a, u, t) == observe(b, u, t)
        assert observe(a, u, t + 5 * S) == observe(b, u, t + 5 * S)


@FAST
@given(op_sequences(ops=("take", "take", "ready", "avail", "refund")), st.data())
def test_cleanup_never_changes_any_later_outcome(seq_data, data):
    rates, burst, start, seq = seq_data
    a = make(rates, burst)
    b = make(rates, burst)
    t = start
    cleaned = 0
    for gap, user, op in seq:
        t += gap
        if data.draw(st.integers(0, 3), label="cleanup") == 0:
            cleaned += b.cleanup_idle_users(t)
            assert len(b.state) <= len(a.state)
        assert run_op(a, op, user, t) == run_op(b, op, user, t), (op, user, t)
        for u in USERS:
            assert observe(a, u, t) == observe(b, u, t)
    # After a cleanup at the end, nothing idle is tracked.
    end = t + 10**12
    b.cleanup_idle_users(end)
    assert len(b.state) == 0
    for u in USERS:
        assert observe(a, u, end) == observe(b, u, end)


@FAST
@given(op_sequences(), st.data())
def test_bulk_take_and_refund_equal_repeated_single_ones(seq_data, data):
    """try_take(count) is all-or-none and, when it succeeds, exactly
    ``count`` single takes at that instant; refund(count) is ``count``
    single refunds."""
    for lim, t in replayed(seq_data):
        probe = data.draw(st.sampled_from(USERS), label="probe")
        count = data.draw(st.integers(1, 15), label="count")
        bulk, singles = copy.deepcopy(lim), copy.deepcopy(lim)
        n_ok = 0
        while n_ok < count and singles.try_take(probe, t):
            n_ok += 1
        ok = bulk.try_take(probe, t, count)
        assert ok == (n_ok == count) == (lim.available(probe, t) >= count)
        if ok:
            for u in USERS:
                assert observe(bulk, u, t) == observe(singles, u, t)
        else:
            for u in USERS:  # nothing taken
                assert observe(bulk, u, t) == observe(lim, u, t)
        # Refunds, possibly at a later instant, possibly more than was taken.
        later = t + data.draw(st.sampled_from([0, 1, 10 * MS, S]), label="later")
        back = data.draw(st.integers(1, count + 2), label="back")
        for _ in range(back):
            singles.refund(probe, later)
        bulk_ref = copy.deepcopy(bulk)
        if ok:
            bulk_ref.refund(probe, later, back)
            for u in USERS:
                assert observe(bulk_ref, u, later) == observe(singles, u, later)
        # count <= 0 takes nothing and succeeds.
        zero = copy.deepcopy(lim)
        assert zero.try_take(probe, t, 0)
        assert observe(zero, probe, t) == observe(lim, probe, t)


@FAST
@given(op_sequences(), st.data())
def test_take_up_to_equals_single_takes_until_the_first_refusal(seq_data, data):
    """take_up_to(count) takes what ``count`` single takes at that instant
    would, stopping at the first refusal, and leaves the same state."""
    for lim, t in replayed(seq_data):
        probe = data.draw(st.sampled_from(USERS), label="probe")
        count = data.draw(st.integers(-1, 15), label="count")
        up_to, singles = copy.deepcopy(lim), copy.deepcopy(lim)
        n_ok = 0
        while n_ok < count and singles.try_take(probe, t):
            n_ok += 1
        assert up_to.take_up_to(probe, t, count) == n_ok
        assert n_ok == max(0, min(count, lim.available(probe, t)))
        for u in USERS:
            assert observe(up_to, u, t) == observe(singles, u, t)


def test_bulk_take_examples():
    lim = OutputRateLimiter(20)  # 3 tokens when idle (100 ms burst, 50 ms interval)
    assert not lim.try_take("u", 0, 4)
    assert len(lim.state) == 0  # all or none
    assert lim.try_take("u", 0, 3)
    assert lim.available("u", 0) == 0
    assert lim.ready_at_ns("u", 0) == 50 * MS
    lim.refund("u", 0, 2)
    assert lim.available("u", 0) == 2
    lim.refund("u", 0, 5)  # more than outstanding: back to idle
    assert len(lim.state) == 0
    assert lim.available("u", 0) == 3


def test_cleanup_of_user_with_tat_exactly_now_is_invisible():
    lim = OutputRateLimiter(4, burst_ns=1)
    ref = OutputRateLimiter(4, burst_ns=1)
    for x in (lim, ref):
        assert x.try_take("u", 0)
    # TAT = 250 ms exactly.
    assert lim.cleanup_idle_users(250 * MS) == 1
    for x in (lim, ref):
        assert x.try_take("u", 250 * MS)
        assert not x.try_take("u", 250 * MS)
    assert lim.ready_at_ns("u", 250 * MS) == ref.ready_at_ns("u", 250 * MS)


# ---------------------------------------------------------------------------
# No drift over a long run
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rate, n",
    [(3, 1_000_000), (Fraction(7, 3), 1_000_000), (2.5, 200_000), (0.3, 200_000)],
)
def test_no_drift_over_many_paced_takes(rate, n):
    lim = OutputRateLimiter(rate)
    r = lim.rates.exact_rate_of("u")
    p, q = r.numerator, r.denominator
    burst = DEFAULT_BURST_NS
    ready = lim.ready_at_ns
    take = lim.try_take
    t = 0
    checkpoints = {1, 2, 3, 1000, 12_345, n // 3, n // 2, n - 1}
    seen = {}
    for i in range(n):
        t = ready("u", t)
        if not take("u", t):
            pytest.fail(f"take {i} at its ready time {t} was refused")
        if i in checkpoints:
            seen[i] = t
    # Take i (0-based) is due when TAT = i intervals, i.e. at
    # ceil(i * q * 1e9 / p) - burst, but never before 0 (the first ones are
    # the initial burst).
    for i, got in seen.items():
        expected = max(0, -((-i * q * NS_PER_S) // p) - burst)
        assert got == expected, (i, got, expected)
    # After n takes TAT is exactly n intervals.
    expected_next = -((-n * q * NS_PER_S) // p) - burst
    assert lim.ready_at_ns("u", t) == expected_next
    assert lim.available("u", expected_next - 1) == 0
    assert not lim.try_take("u", expected_next - 1)
    assert lim.try_take("u", expected_next)
    if rate == 3:
        # Spelled out: the millionth take is at 999_999 / 3 s - 100 ms.
        assert t == 333_333 * S - DEFAULT_BURST_NS


# ---------------------------------------------------------------------------
# Injected state store
# ---------------------------------------------------------------------------


class RecordingStore(dict):
    """A state store (any MutableMapping) that records which users were written."""

    def __init__(self):
        super().__init__()
        self.writes: list[str] = []

    def __setitem__(self, user, tat):
        self.writes.append(user)
        super().__setitem__(user, tat)


def test_injected_store_holds_the_state_and_behaves_like_the_default():
    store = RecordingStore()
    lim = OutputRateLimiter(20, store=store)
    ref = OutputRateLimiter(20)
    for x in (lim, ref):
        assert x.try_take("u", 0, 3)
        assert x.take_up_to("v", 0, 5) == 3
    assert sorted(store) == ["u", "v"] and store.writes == ["u", "v"]
    assert store["u"] == 3 * 50 * MS * 20  # TAT 150 ms on the scaled clock (p = 20)
    for u in ("u", "v", "w"):
        assert observe(lim, u, 0) == observe(ref, u, 0)
    # A second limiter over the same store continues the same state (restart).
    again = OutputRateLimiter(20, store=store)
    assert again.available("u", 0) == 0
    assert again.ready_at_ns("u", 0) == ref.ready_at_ns("u", 0)
    assert lim.cleanup_idle_users(S) == 2
    assert len(store) == 0


def test_default_store_is_a_plain_dict():
    # The scheduler calls the limiter every step; the default store must stay
    # the cheapest mapping there is.
    assert type(OutputRateLimiter(5).state) is dict


# ---------------------------------------------------------------------------
# Live rate changes
# ---------------------------------------------------------------------------


def test_update_rates_examples():
    lim = OutputRateLimiter(10, {"fast": 100})
    assert lim.take_up_to("fast", 0, 100) == 11  # TAT = 110 ms
    assert lim.take_up_to("slow", 0, 100) == 2  # TAT = 200 ms
    assert lim.take_up_to("same", 0, 100) == 2
    changed = lim.update_rates(10, {"fast": 20, "slow": 5})
    assert sorted(changed) == ["fast", "slow"]
    assert lim.rate_of("fast") == 20 and lim.rate_of("slow") == 5 and lim.rate_of("x") == 10
    # TAT kept as a point in time: fast's debt is 110 ms, past the 100 ms burst
    # until 10 ms; then one token, the next one 50 ms later (new interval).
    assert lim.ready_at_ns("fast", 0) == 10 * MS
    assert lim.try_take("fast", 10 * MS) and not lim.try_take("fast", 10 * MS)
    assert lim.ready_at_ns("fast", 10 * MS) == 60 * MS
    # slow: TAT 200 ms, new interval 200 ms.
    assert lim.ready_at_ns("slow", 0) == 100 * MS
    assert lim.try_take("slow", 100 * MS)
    assert lim.ready_at_ns("slow", 100 * MS) == 300 * MS
    # Unchanged user: untouched.
    ref = OutputRateLimiter(10)
    ref.take_up_to("same", 0, 100)
    assert observe(lim, "same", 0) == observe(ref, "same", 0)
    assert lim.rates.configured() == (Fraction(10), {"fast": Fraction(20), "slow": Fraction(5)})


def test_update_rates_is_all_or_nothing():
    lim = OutputRateLimiter(10, {"a": 5})
    assert lim.try_take("a", 0)
    before = observe(lim, "a", 0)
    with pytest.raises(ValueError, match="bob"):
        lim.update_rates(10, {"a": 50, "bob": -1})
    with pytest.raises(ValueError, match="default rate"):
        lim.update_rates(0, {"a": 50})
    assert lim.rate_of("a") == 5 and observe(lim, "a", 0) == before


def test_update_rates_rounds_the_tat_up_never_earlier():
    # 3 tok/s -> 7 tok/s: TAT 1/3 s is not a whole ns; on the new clock it
    # is rounded up, so the next take is never allowed earlier than 1/3 s - burst.
    lim = OutputRateLimiter(3, burst_ns=1)
    assert lim.try_take("u", 0)
    lim.update_rates(7)
    ready = lim.ready_at_ns("u", 0)
    assert ready == 333_333_334 - 1
    assert not lim.try_take("u", ready - 1)
    assert lim.try_take("u", ready)


@st.composite
def rate_changes(draw):
    rates = {u: draw(RATES) for u in USERS}
    new_rates = {u: draw(st.one_of(st.just(rates[u]), RATES)) for u in USERS}
    return rates, new_rates


@FAST
@given(op_sequences(ops=("take", "take", "ready", "avail", "refund")), rate_changes(), st.data())
def test_update_rates_keeps_unchanged_users_exactly(seq_data, change, data):
    """Limiter B changes rates mid-sequence, A never does: for every user
    whose rate stayed the same, every answer of B is A's."""
    _, burst, start, seq = seq_data
    rates, new_rates = change
    a = make(rates, burst)
    b = make(rates, burst)
    at = data.draw(st.integers(0, len(seq)), label="change at")
    unchanged = [u for u in USERS if exact_rate(rates[u]) == exact_rate(new_rates[u])]
    t = start
    for i, (gap, user, op) in enumerate(seq):
        t += gap
        if i == at:
            changed = b.update_rates(new_rates["a"], {"b": new_rates["b"], "c": new_rates["c"]})
            assert not set(changed) & set(unchanged)
        ra, rb = run_op(a, op, user, t), run_op(b, op, user, t)
        if user in unchanged:
            assert ra == rb, (op, user, t)
        for u in unchanged:
            assert observe(a, u, t) == observe(b, u, t)
    for u in USERS:
        assert b.rates.exact_rate_of(u) == exact_rate(new_rates[u] if at < len(seq) else rates[u])


@FAST
@given(
    rates=rate_changes(),
    burst=BURSTS,
    start=st.integers(0, 10**14),
    before=st.lists(st.integers(0, 30 * MS), min_size=0, max_size=80),
    after=st.lists(st.one_of(st.just(0), st.integers(0, 30 * MS), st.integers(0, 2 * S)),
                   min_size=1, max_size=150),
)
def test_update_rates_bound_at_new_rate_from_the_change(rates, burst, start, before, after):
    """Whatever was taken before, takes from the change on obey the bound at
    the new rate in every window starting at or after the change; a user taking
    at ready times reaches the new rate (the change takes effect at once)."""
    old, new = rates
    lim = OutputRateLimiter(old["a"], burst_ns=burst)
    t = start
    for gap in before:
        t += gap
        while lim.try_take("u", t):
            pass
    change = t
    lim.update_rates(new["a"])
    r = lim.rates.exact_rate_of("u")
    assert r == exact_rate(new["a"])
    times: list[int] = []
    for gap in after:
        t += gap
        while lim.try_take("u", t):
            times.append(t)
    # Windows starting at the change and at every take after it.
    anchors = [change] + times
    for s in anchors:
        for j in range(bisect.bisect_left(times, s), len(times)):
            count = j - bisect.bisect_left(times, s) + 1
            assert at_most_bound(count, times[j] - s, burst, r), (s, times[j], count)
    # Effect at once: once the burst is used up, takes at ready times are
    # spaced exactly by the new interval (up to ns rounding).
    while lim.try_take("u", t):
        pass
    paced = []
    for _ in range(6):
        t = lim.ready_at_ns("u", t)
        assert lim.try_take("u", t)
        paced.append(t)
    interval = Fraction(r.denominator * NS_PER_S, r.numerator)
    tail = paced[-5:]
    for x, y in zip(tail, tail[1:]):
        assert abs((y - x) - interval) <= 1


def test_make_limiter_without_store_is_the_in_memory_limiter():
    from vllm_output_rate.factory import make_limiter
    from vllm_output_rate.settings import OutputRateSettings

    settings = OutputRateSettings(default_rate=2.5, user_rates={"a": 20})
    lim = make_limiter(settings)
    assert type(lim) is OutputRateLimiter
    assert lim.rates.exact_rate_of("a") == 20 and lim.rates.exact_rate_of("z") == Fraction(5, 2)
    assert lim.burst_ns == DEFAULT_BURST_NS


# ---------------------------------------------------------------------------
# The Limiter protocol, the rate table and the GCRA part
# ---------------------------------------------------------------------------


def test_in_memory_limiter_has_every_limiter_operation():
    from vllm_output_rate.policy.limiter import Limiter

    operations = [name for name in vars(Limiter) if not name.startswith("_")]
    assert operations and all(callable(getattr(OutputRateLimiter(5), op)) for op in operations)
    lim = OutputRateLimiter(5)
    assert lim.figures() == {}
    lim.close()  # nothing to release; the limiter keeps working
    assert lim.take_up_to("u", 0, 1) == 1


def test_rate_table_division_and_changed_users():
    from vllm_output_rate.policy.rates import RateTable

    table = RateTable(30, {"a": 5, "b": Fraction(7, 3)}, burst_ns=5 * MS)
    half = table.divided(2)
    assert half.configured() == (Fraction(15), {"a": Fraction(5, 2), "b": Fraction(7, 6)})
    assert half.burst_ns == 5 * MS
    other = RateTable(30, {"a": 6, "b": Fraction(7, 3)})
    assert table.changed_for(other, ["a", "b", "c"]) == ["a"]
    assert table.changed_for(RateTable(31, {"a": 5}), ["a", "b", "c"]) == ["b", "c"]


def test_gcra_on_whole_ns_matches_the_exact_rate():
    """The store's form (interval in whole ns, scale 1) is the same GCRA: at an
    interval that is a whole number of ns both forms decide alike."""
    from vllm_output_rate.policy.gcra import Gcra

    on_ns = Gcra.on_ns(10 * MS, DEFAULT_BURST_NS)
    exact = Gcra.of_rate(Fraction(100), DEFAULT_BURST_NS)
    a: dict = {}
    b: dict = {}
    t = 0
    for gap, count in [(0, 20), (3 * MS, 1), (10 * MS, 2), (7 * MS, 5), (400 * MS, 30), (0, 1)]:
        t += gap
        assert on_ns.available(a, "u", t) == exact.available(b, "u", t)
        assert on_ns.ready_at(a, "u", t) == exact.ready_at(b, "u", t)
        assert on_ns.take_up_to(a, "u", t, count) == exact.take_up_to(b, "u", t, count)
    on_ns.refund(a, "u", t, 100)
    assert a == {}  # no debt left: idle, no entry
