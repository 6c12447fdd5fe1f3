"""Tests of :mod:`vllm_output_rate.policy.quota`: several quotas paid together.

A composition of levels (a user's rate, its ceiling, its group's rate and
ceiling) over exact in-memory GCRA limiters, on a fake clock (integer
nanoseconds passed in).  The properties: every bulk operation equals paying
single tokens on every level in turn; payment is all or nothing (every level
that applies holds the same net takes for the user); a refund lands only on
the levels that paid, whatever the user's levels are when it comes; the
ready time is the latest level's; asking has no side effect; a short take
declares the shortfall to every level.
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_output_rate.policy.gcra import DEFAULT_BURST_NS, NS_PER_S
from vllm_output_rate.policy.limiter import OutputRateLimiter
from vllm_output_rate.policy.quota import UNBOUNDED, ComposedLimiter, Level, payers, refund_payers
from vllm_output_rate.stores.backend import LeaseConfig
from vllm_output_rate.stores.lease import LeasedOutputRateLimiter

MS = 1_000_000
USERS = ("a", "b", "c", "d")
CEILED = {"a", "c"}  # users whose ceiling is a level of theirs
FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Counting(OutputRateLimiter):
    """An in-memory limiter that also counts, per key, net takes and wants."""

    def __init__(self, rate: float) -> None:
        super().__init__(rate)
        self.net: dict[str, int] = {}
        self.wanted: list[tuple[str, int]] = []

    def try_take(self, user: str, now_ns: int, count: int = 1) -> bool:
        ok = super().try_take(user, now_ns, count)
        if ok and count > 0:
            self.net[user] = self.net.get(user, 0) + count
        return ok

    def take_up_to(self, user: str, now_ns: int, count: int) -> int:
        got = super().take_up_to(user, now_ns, count)
        self.net[user] = self.net.get(user, 0) + got
        return got

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        super().refund(user, now_ns, count)
        self.net[user] = self.net.get(user, 0) - count

    def want(self, user: str, now_ns: int, count: int = 1) -> None:
        self.wanted.append((user, count))


class Quotas:
    """A user's rate, its ceiling (users in CEILED), its group's rate and
    ceiling (groups in ``ceiled_groups``); membership may change."""

    def __init__(self, rate: float, ceil: float, group_rate: float, group_ceil: float) -> None:
        self.rate, self.ceil = Counting(rate), Counting(ceil)
        self.group_rate, self.group_ceil = Counting(group_rate), Counting(group_ceil)
        self.group_of: dict[str, str] = {"a": "g", "b": "g", "c": "h"}  # d: no group
        self.ceiled_groups = {"g"}
        self.limiter = ComposedLimiter([
            Level(self.rate),
            Level(self.ceil, applies=CEILED.__contains__),
            Level(self.group_rate, self.group_of.get),
            Level(self.group_ceil, self.group_of.get, self.ceiled_groups.__contains__),
        ])

    def levels_of(self, user: str) -> list[tuple[Counting, str]]:
        out: list[tuple[Counting, str]] = [(self.rate, user)]
        if user in CEILED:
            out.append((self.ceil, user))
        group = self.group_of.get(user)
        if group is not None:
            out.append((self.group_rate, group))
            if group in self.ceiled_groups:
                out.append((self.group_ceil, group))
        return out


def bound(window_ns: int, rate: float) -> int:
    return int((window_ns + DEFAULT_BURST_NS) * rate / NS_PER_S) + 1


def test_payers_are_the_levels_that_apply_in_order():
    q = Quotas(10, 20, 15, 30)
    assert list(payers(q.limiter, "a")) == [(q.rate, "a"), (q.ceil, "a"), (q.group_rate, "g"), (q.group_ceil, "g")]
    assert list(payers(q.limiter, "b")) == [(q.rate, "b"), (q.group_rate, "g"), (q.group_ceil, "g")]
    assert list(payers(q.limiter, "c")) == [(q.rate, "c"), (q.ceil, "c"), (q.group_rate, "h")]
    assert list(payers(q.limiter, "d")) == [(q.rate, "d")]
    plain = OutputRateLimiter(5)
    assert payers(plain, "x") == ((plain, "x"),)


def test_a_user_alone_gets_its_own_rate_and_a_group_pair_shares_the_group_rate():
    q = Quotas(10, 100, 15, 100)
    lim = q.limiter
    taken = {"a": 0, "b": 0, "d": 0}
    for step in range(10_000):  # 10 s in 1 ms steps
        now = step * MS
        for user in taken:
            taken[user] += lim.take_up_to(user, now, 1)
    assert 100 <= taken["d"] <= bound(10 * NS_PER_S, 10)
    assert 150 <= taken["a"] + taken["b"] <= bound(10 * NS_PER_S, 15)
    assert min(taken["a"], taken["b"]) >= 50  # neither starves: one take each per turn


def test_a_take_refused_by_one_level_leaves_every_other_untouched_and_declares_the_want():
    q = Quotas(100, 100, 1, 100)
    lim = q.limiter
    assert lim.take_up_to("a", 0, 5) == 1  # the group's burst: one token
    own_before = q.rate.available("b", 0)
    assert not lim.try_take("b", 0)
    assert lim.take_up_to("b", 0, 3) == 0
    assert q.rate.available("b", 0) == own_before
    assert q.rate.net.get("b", 0) == 0 and q.group_ceil.net["g"] == 1
    assert lim.ready_at_ns("b", 0) == q.group_rate.ready_at_ns("g", 0) > 0
    # Every level heard the shortfall, the ones never asked to take included.
    assert ("b", 3) in q.rate.wanted and ("g", 3) in q.group_ceil.wanted


def test_a_level_that_shrank_since_it_was_asked_has_the_others_refunded():
    class Shrinking(Counting):
        def take_up_to(self, user: str, now_ns: int, count: int) -> int:
            return super().take_up_to(user, now_ns, min(count, 2))

    first, last = Counting(100), Shrinking(100)
    lim = ComposedLimiter([Level(first), Level(last)])
    assert lim.take_up_to("u", 0, 5) == 2
    assert first.net["u"] == last.net["u"] == 2
    assert not lim.try_take("u", 0, 5)  # all or nothing
    assert first.net["u"] == last.net["u"] == 2


def test_no_level_that_applies_is_unbounded():
    lim = ComposedLimiter([Level(OutputRateLimiter(1), applies=lambda user: False)])
    assert lim.available("u", 0) == UNBOUNDED
    assert lim.take_up_to("u", 0, 7) == 7
    assert lim.ready_at_ns("u", 5) == 5


def test_cleanup_reaches_every_level_once():
    q = Quotas(10, 10, 10, 10)
    lim = q.limiter
    lim.take_up_to("a", 0, 1)
    assert len(q.ceil.state) == len(q.group_ceil.state) == 1
    assert lim.cleanup_idle_users(10 * NS_PER_S) == 1  # the first level's count
    assert not (q.rate.state or q.ceil.state or q.group_rate.state or q.group_ceil.state)


def ops():
    return st.lists(
        st.tuples(
            st.sampled_from(["take_up_to", "try_take", "refund", "available", "ready", "want", "move"]),
            st.sampled_from(USERS),
            st.integers(0, 30 * MS),  # time advance
            st.integers(1, 4),  # count
        ),
        max_size=120,
    )


RATES = st.sampled_from([1, 2.5, 10, 40])


@FAST
@given(ops(), RATES, RATES, RATES, RATES)
def test_equals_paying_each_token_on_every_level_in_turn(seq, rate, ceil, group_rate, group_ceil):
    """Every bulk operation equals single tokens paid on every level that
    applies, one by one, stopping at the first token any level refuses; the
    ready time is the latest level's; asking changes nothing."""
    q = Quotas(rate, ceil, group_rate, group_ceil)
    lim = q.limiter
    model = {id(c): OutputRateLimiter(r) for c, r in
             ((q.rate, rate), (q.ceil, ceil), (q.group_rate, group_rate), (q.group_ceil, group_ceil))}
    held: dict[str, list] = {u: [] for u in USERS}  # per user: (payers, count) of each take
    now = 0

    def model_levels(user: str) -> list[tuple[OutputRateLimiter, str]]:
        return [(model[id(c)], key) for c, key in q.levels_of(user)]

    def single_take(user: str) -> bool:
        levels = model_levels(user)
        if any(m.available(key, now) < 1 for m, key in levels):
            return False
        for m, key in levels:
            assert m.try_take(key, now)
        return True

    for op, user, advance, count in seq:
        now += advance
        if op in ("take_up_to", "try_take"):
            probe = copy.deepcopy(model)
            expected = 0
            while expected < count and single_take(user):
                expected += 1
            paid_by = payers(lim, user)
            if op == "take_up_to":
                assert lim.take_up_to(user, now, count) == expected
            else:
                if expected < count:  # all or nothing: undo the partial model take
                    model, expected = probe, 0
                assert lim.try_take(user, now, count) == (expected == count)
            if expected:
                held[user].append((paid_by, expected))
        elif op == "refund" and held[user]:
            paid_by, got = held[user].pop()
            back = min(count, got)
            refund_payers(paid_by, now, back)  # to who paid, whatever the levels are now
            for c, key in paid_by:
                model[id(c)].refund(key, now, back)
            if got > back:
                held[user].append((paid_by, got - back))
        elif op == "available":
            before = copy.deepcopy(q)
            expected = min((m.available(key, now) for m, key in model_levels(user)), default=UNBOUNDED)
            assert lim.available(user, now) == expected
            assert _state(q) == _state(before)  # asking changes nothing
        elif op == "ready":
            before = copy.deepcopy(q)
            expected = max([now] + [m.ready_at_ns(key, now) for m, key in model_levels(user)])
            assert lim.ready_at_ns(user, now) == expected
            assert _state(q) == _state(before)
        elif op == "want":
            before = _state(q)
            lim.want(user, now, count)
            assert _state(q) == before
            assert all((key, count) in c.wanted for c, key in q.levels_of(user))
        elif op == "move":  # a reload moves the user to another group (or out of any)
            groups = [None, "g", "h"]
            new = groups[(groups.index(q.group_of.get(user)) + count) % 3]
            if new is None:
                q.group_of.pop(user, None)
            else:
                q.group_of[user] = new
        # All or nothing: what the user holds was paid, net, on exactly the
        # levels that paid each take; no level holds a token another did not.
        _check_nets(q, held)


def _state(q: Quotas) -> list[dict[str, int]]:
    return [dict(c.state) for c in (q.rate, q.ceil, q.group_rate, q.group_ceil)]


def _check_nets(q: Quotas, held: dict[str, list]) -> None:
    expected: dict[tuple[int, str], int] = {}
    for takes in held.values():
        for paid_by, count in takes:
            for c, key in paid_by:
                expected[id(c), key] = expected.get((id(c), key), 0) + count
    for c in (q.rate, q.ceil, q.group_rate, q.group_ceil):
        for key, net in c.net.items():
            assert net == expected.get((id(c), key), 0), (key, net)


@FAST
@given(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 20 * MS), st.integers(1, 6)), max_size=200),
    st.booleans(),
)
def test_every_levels_bound_holds_over_every_window(attempts, group_ceiled):
    q = Quotas(20, 9, 30, 7)
    if not group_ceiled:
        q.ceiled_groups.clear()
    lim = q.limiter
    now, log, log_a = 0, [], []
    for user, advance, count in attempts:
        now += advance
        got = lim.take_up_to(user, now, count)
        log.extend([now] * got)
        if user == "a":
            log_a.extend([now] * got)
    group_cap = 7 if group_ceiled else 30
    for times, rate in ((log, group_cap), (log_a, 9)):  # the group's; a's ceiling
        for i, start in enumerate(times):
            for j in range(i, len(times)):
                assert j - i + 1 <= bound(times[j] - start, rate)


class _Backend:
    """A store that is never reached (the lease thread is never started)."""

    def describe(self) -> str:
        return "nowhere"

    def close(self) -> None:
        pass


def test_asking_a_leased_quota_declares_nothing_and_want_declares_the_user():
    lim = LeasedOutputRateLimiter(30, None, _Backend(), config=LeaseConfig(), clock=lambda: 0, start=False)
    book = lim.book
    assert lim.available("u", 0) == 0
    assert lim.ready_at_ns("u", 0) == 0  # never short: a first ask brings tokens
    assert not book.wanted_at and not book.new_users
    lim.want("u", 0)
    assert "u" in book.wanted_at and book.new_users == {"u"}
    lim.want("u", 0)  # idempotent
    assert book.new_users == {"u"}
    # Through a composition: a level another level stopped is told too.
    group = OutputRateLimiter(1)
    composed = ComposedLimiter([Level(group, lambda user: "g"), Level(lim)])
    group.take_up_to("g", 0, 1)  # the group's burst is spent
    assert composed.take_up_to("v", 0, 1) == 0
    assert "v" in book.wanted_at
