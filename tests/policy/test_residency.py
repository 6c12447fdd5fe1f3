"""Residency caps (``policy/residency.py``): property tests, no vLLM."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.policy.residency import (
    DEFAULT_MIN_STREAM_TOKENS_PER_SECOND,
    Residency,
    residency_cap,
)

rates = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)
paces = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)


def _exact(x: float) -> Fraction:
    return Fraction(repr(x))


@given(rate=rates, pace=paces)
def test_cap_is_the_streams_the_rate_keeps_at_min_pace(rate, pace):
    cap = residency_cap(rate, pace)
    assert cap >= 1
    # The documented bound: floor(rate / pace) + 1.
    assert cap <= math.floor(_exact(rate) / _exact(pace)) + 1
    if cap > 1:
        # Every one of the cap's streams moves at least at the minimum pace...
        assert cap * _exact(pace) <= _exact(rate)
    # ...and one more would not.
    assert (cap + 1) * _exact(pace) > _exact(rate)


def test_cap_examples():
    assert residency_cap(4, 2) == 2
    assert residency_cap(5, 2) == 2
    assert residency_cap(1, 2) == 1  # slower than one stream's pace: one at a time
    assert residency_cap(0.6, 0.2) == 3  # decimal values, not 2.999...
    assert residency_cap(100, DEFAULT_MIN_STREAM_TOKENS_PER_SECOND) == 50
    assert residency_cap(None, 2) is None  # a borrower without ceiling
    assert residency_cap(4, 0) is None  # the rule off


def _limits(table):
    return lambda user: table.get(user, (4.0, 4.0))


@settings(max_examples=200)
@given(
    rate=rates,
    ceil=st.one_of(st.none(), rates),
    pace=st.one_of(st.just(0.0), paces),
    requests=st.integers(0, 300),
)
def test_admitting_while_admits_never_exceeds_the_cap(rate, ceil, pace, requests):
    if ceil is not None:
        ceil = max(ceil, rate)
    residency = Residency(pace, {}, _limits({"u": (rate, ceil)}))
    cap = residency.cap("u")
    resident = 0
    for _ in range(requests):
        if residency.admits("u", resident):
            resident += 1
        assert residency.surplus("u", resident) == 0
    if cap is None:
        assert resident == requests
        assert residency.room("u", resident) is None
    else:
        top = ceil  # a borrower with a ceiling counts it; a hard cap's ceil is its rate
        assert resident == min(requests, cap)
        assert resident <= math.floor(_exact(top) / _exact(pace)) + 1
        assert residency.room("u", resident) == cap - resident


@given(resident=st.integers(0, 100), rate=rates, pace=paces)
def test_surplus_is_what_exceeds_the_cap(resident, rate, pace):
    residency = Residency(pace, {}, _limits({"u": (rate, rate)}))
    cap = residency.cap("u")
    assert residency.surplus("u", resident) == max(0, resident - cap)
    assert residency.admits("u", resident) == (resident < cap)


def test_per_user_pace_and_update():
    limits = {"a": (10.0, 10.0), "b": (10.0, None), "c": (10.0, 30.0)}
    residency = Residency(2.0, {"a": 5.0}, _limits(limits))
    assert residency.cap("a") == 2  # its own pace
    assert residency.cap("b") is None  # no ceiling: no cap
    assert residency.cap("c") == 15  # a borrower counts its ceiling
    assert residency.cap("other") == 2  # the default 4 tok/s at 2 tok/s
    # A reload lowers a's rate: its cap follows, streams beyond it are surplus.
    limits["a"] = (5.0, 5.0)
    residency.update(2.0, {"a": 5.0}, _limits(limits))
    assert residency.cap("a") == 1
    assert residency.surplus("a", 2) == 1
    residency.update(0.0, {}, _limits(limits))
    assert residency.cap("a") is None


def test_negative_pace_is_refused():
    with pytest.raises(ValueError):
        Residency(-1.0, {}, _limits({}))


# -- the surplus gives way first (Displacement with a Residency) -------------

from vllm_output_rate.policy.displacement import Displacement  # noqa: E402
from vllm_output_rate.policy.eviction import EvictionBudget  # noqa: E402
from vllm_output_rate.policy.gate import StepGate  # noqa: E402
from vllm_output_rate.policy.limiter import OutputRateLimiter  # noqa: E402

SLOW = {"slow": 0.5}  # cap 1 at the default pace; everybody else 1000 tok/s (cap 500)


def surplus_setup(*, budget_tokens=1000, generated=None, held=None, pace=2.0):
    """``slow`` holds s1..s3 (two beyond its cap of one), its token spent."""
    gate = StepGate(OutputRateLimiter(1000, SLOW))
    for key in ("s1", "s2", "s3"):
        gate.lanes.track(key, "slow")
        gate.lanes.admit(key, False)
    assert gate.limiter.try_take("slow", 0)
    limits = {"slow": (0.5, 0.5)}
    residency = Residency(pace, {}, lambda u: limits.get(u, (1000.0, 1000.0)))
    generated = generated or {}
    held = held or {}
    part = Displacement(
        gate.lanes, gate.ledger, EvictionBudget(burst_tokens=budget_tokens), set(),
        tokens_held=lambda key: held.get(key, 10), priority_of=None,
        can_release=lambda key: True, residency=residency,
        generated_of=lambda key: generated.get(key, 5),
    )
    return gate, part


def test_surplus_goes_first_least_generated_even_for_a_user_with_resident_streams():
    gate, part = surplus_setup(generated={"s1": 9, "s2": 1, "s3": 4})
    gate.lanes.track("f1", "fast")
    gate.lanes.admit("f1", False)
    gate.lanes.track("f2", "fast")
    gate.plan(0, 10)
    # fast holds a stream already (no eviction for it without a surplus),
    # but slow's streams beyond its cap give way: the one that generated least.
    assert part.victim_for("f2", waiting=True) == "s2"
    gate.lanes.release("s2")
    assert part.victim_for("f2", waiting=True) == "s3"
    gate.lanes.release("s3")
    # slow is at its cap now: no surplus, and fast holds a stream: nothing.
    assert part.victim_for("f2", waiting=True) is None


def test_surplus_release_stays_within_the_budget():
    gate, part = surplus_setup(budget_tokens=50, generated={"s1": 0, "s2": 1, "s3": 2},
                               held={"s1": 400, "s2": 40, "s3": 30})
    gate.lanes.track("f1", "fast")
    gate.lanes.admit("f1", False)
    gate.lanes.track("f2", "fast")
    gate.plan(0, 10)
    assert part.victim_for("f2", waiting=True) == "s2"  # s1's 400 tokens: over the budget
    gate2, part2 = surplus_setup(budget_tokens=0)
    gate2.lanes.track("f1", "fast")
    gate2.lanes.admit("f1", False)
    gate2.lanes.track("f2", "fast")
    gate2.plan(0, 10)
    assert part2.victim_for("f2", waiting=True) is None  # budget 0: never for a waiting request


def test_no_surplus_release_for_a_requester_at_its_own_cap_or_without_quota():
    gate, part = surplus_setup()
    gate.lanes.track("s4", "slow")
    gate.plan(0, 10)
    assert part.victim_for("s4", waiting=True) is None  # its own user's streams, and no quota
    gate2, part2 = surplus_setup(pace=0.0)  # the rule off: nothing is surplus
    gate2.lanes.track("f1", "fast")
    gate2.lanes.admit("f1", False)
    gate2.lanes.track("f2", "fast")
    gate2.plan(0, 10)
    assert part2.victim_for("f2", waiting=True) is None


# -- where residency meets borrowing and priority (issue 43) ---------------------------


def _world(x_resident: int, x_waiting: int, y_waiting: int):
    """x {rate 0.01, ceil 8}: cap floor(8 / 2) = 4; y {rate 0.01, ceil 1000}."""
    from vllm_output_rate.policy.gate import StepGate
    from vllm_output_rate.policy.limiter import OutputRateLimiter

    gate = StepGate(OutputRateLimiter(0.01, {}))
    lanes = gate.lanes
    ceilings = {"x": 8.0, "y": 1000.0}
    residency = Residency(DEFAULT_MIN_STREAM_TOKENS_PER_SECOND, {}, lambda u: (0.01, ceilings[u]))
    for i in range(x_resident):
        lanes.track(f"x{i}", "x")
        lanes.admit(f"x{i}", progressing=False)
    waiting = [f"xw{i}" for i in range(x_waiting)] + [f"yw{i}" for i in range(y_waiting)]
    for key in waiting:
        lanes.track(key, key[0])
    now = 10**12
    for user in ("x", "y"):  # spend the rates' burst: both only borrow
        while gate.ledger.limiter.try_take(user, now):
            pass
    gate.plan(now, 16)
    return gate, residency, waiting


@pytest.mark.parametrize("x_waiting", [0, 1, 20])
def test_borrowing_demand_counts_no_request_its_users_cap_keeps_out(x_waiting):
    """Room set aside for x's waiting requests while x holds its cap would
    stay empty: they are not admitted (issue 43: the other borrower lost
    62 % of its borrowed tokens to it)."""
    from vllm_output_rate.policy.demand import waiting_demand

    gate, residency, waiting = _world(4, x_waiting, 3)
    queued: dict[str, list[int]] = {}
    demand = waiting_demand(
        waiting, gate.lanes, gate.ledger, lambda user: True, residency,
        limit=12, free_slots=48, output_left=lambda key: 100, queued=queued,
    )
    assert demand == (0, 3)
    assert queued == {"y": [100] * 3}
    # Without residency x's requests are counted (what 92d09f2 did), for
    # the room its 4 hidden streams leave: 12 - 4.
    queued = {}
    demand = waiting_demand(
        waiting, gate.lanes, gate.ledger, lambda user: True, None,
        limit=12, free_slots=48, output_left=lambda key: 100, queued=queued,
    )
    assert demand == (0, min(12, min(x_waiting, 12 - 4) + 3))


def test_borrowing_demand_counts_up_to_the_room_left_under_the_cap():
    from vllm_output_rate.policy.demand import waiting_demand

    gate, residency, waiting = _world(1, 10, 0)
    queued: dict[str, list[int]] = {}
    demand = waiting_demand(
        waiting, gate.lanes, gate.ledger, lambda user: True, residency,
        limit=12, free_slots=48, output_left=lambda key: 100, queued=queued,
    )
    assert demand == (0, 3) and queued == {"x": [100] * 3}  # cap 4, one held


def test_an_urgent_request_displaces_its_own_users_least_important_hidden_stream():
    """Priority within a user (docs/design.md): the victim is a stream of
    the requester's own user with a larger priority value, the least
    important first, then the one that generated least; hidden, affordable,
    releasable.  Never another user's, never an equally important one."""
    from vllm_output_rate.policy.displacement import Displacement
    from vllm_output_rate.policy.eviction import EvictionBudget
    from vllm_output_rate.policy.gate import StepGate
    from vllm_output_rate.policy.limiter import OutputRateLimiter

    gate = StepGate(OutputRateLimiter(4, {}))
    lanes = gate.lanes
    priority = {"a5": 5, "a10": 10, "a10b": 10, "b20": 20, "a-urgent": 0, "a-same": 10}
    generated = {"a5": 1, "a10": 7, "a10b": 3, "b20": 0}
    for key in ("a5", "a10", "a10b", "b20"):
        lanes.track(key, key[0])
        lanes.admit(key, progressing=False)
    for key in ("a-urgent", "a-same"):
        lanes.track(key, "a")
    visible: set[str] = set()
    budget = EvictionBudget(1000, ratio=0)

    def displacement(priority_of):
        return Displacement(
            lanes, gate.ledger, budget, set(), tokens_held=lambda k: 10 + generated[k],
            priority_of=priority_of, can_release=lambda k: True,
            generated_of=generated.__getitem__,
        )

    d = displacement(priority.__getitem__)
    hidden = lambda key: key not in visible  # noqa: E731
    assert d.own_stream_victim("a-urgent", hidden) == "a10b"  # least important, generated least
    visible.add("a10b")
    assert d.own_stream_victim("a-urgent", hidden) == "a10"
    visible.update({"a10"})
    assert d.own_stream_victim("a-urgent", hidden) == "a5"
    assert d.own_stream_victim("a-same", hidden) is None  # only less important ones give way
    visible.clear()
    assert d.own_stream_victim("a-same", hidden) is None
    assert displacement(None).own_stream_victim("a-urgent", hidden) is None  # fcfs: never
    spent = EvictionBudget(0, ratio=0)
    broke = Displacement(
        lanes, gate.ledger, spent, set(), tokens_held=lambda k: 10 + generated[k],
        priority_of=priority.__getitem__, can_release=lambda k: True,
        generated_of=generated.__getitem__,
    )
    assert broke.own_stream_victim("a-urgent", hidden) is None  # the budget affords nothing
