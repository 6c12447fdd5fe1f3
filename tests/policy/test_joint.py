"""Tests of :class:`vllm_output_rate.policy.joint.JointLimiter` (two quotas paid together).

Fake clock (integer nanoseconds passed in), exact GCRA limiters underneath.
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_output_rate.policy.gcra import DEFAULT_BURST_NS, NS_PER_S
from vllm_output_rate.policy.joint import JointLimiter
from vllm_output_rate.policy.limiter import OutputRateLimiter

MS = 1_000_000
GROUP_OF = {"a": "g", "b": "g"}  # "c" belongs to no group
FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def joint(user_rate: float = 10, group_rate: float = 15) -> JointLimiter:
    return JointLimiter(
        OutputRateLimiter(user_rate), OutputRateLimiter(group_rate), GROUP_OF.get
    )


def bound(window_ns: int, rate: float) -> int:
    return int((window_ns + DEFAULT_BURST_NS) * rate / NS_PER_S) + 1


def test_a_user_alone_gets_its_own_rate_and_a_group_pair_shares_the_group_rate():
    lim = joint(user_rate=10, group_rate=15)
    taken = {"a": 0, "b": 0, "c": 0}
    for step in range(10_000):  # 10 s in 1 ms steps
        now = step * MS
        for user in taken:
            taken[user] += lim.take_up_to(user, now, 1)
    assert taken["c"] <= bound(10 * NS_PER_S, 10) and taken["c"] >= 100
    assert taken["a"] + taken["b"] <= bound(10 * NS_PER_S, 15)
    assert taken["a"] + taken["b"] >= 150
    assert min(taken["a"], taken["b"]) >= 50  # neither starves: one take each per turn


def test_either_group_member_alone_gets_its_own_rate_when_the_group_has_room():
    lim = joint(user_rate=10, group_rate=15)
    got = sum(lim.take_up_to("a", step * MS, 1) for step in range(10_000))
    assert 100 <= got <= bound(10 * NS_PER_S, 10)


def test_a_take_refused_by_the_group_leaves_the_users_quota_untouched():
    lim = joint(user_rate=100, group_rate=1)
    assert lim.take_up_to("a", 0, 5) == 1  # the group's burst: one token
    own_before = lim.own.available("b", 0)
    assert not lim.try_take("b", 0)
    assert lim.take_up_to("b", 0, 3) == 0
    assert lim.own.available("b", 0) == own_before
    assert lim.ready_at_ns("b", 0) == lim.shared.ready_at_ns("g", 0) > 0


def test_refund_goes_back_to_both_quotas():
    lim = joint(user_rate=10, group_rate=10)
    assert lim.take_up_to("a", 0, 2) == 2
    lim.refund("a", 0, 2)
    assert lim.own.available("a", 0) == lim.own.available("zz", 0)
    assert lim.shared.available("g", 0) == lim.shared.available("other-group", 0)


def ops():
    return st.lists(
        st.tuples(
            st.sampled_from(["take_up_to", "try_take", "refund", "available", "ready"]),
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 30 * MS),  # time advance
            st.integers(1, 4),  # count
        ),
        max_size=120,
    )


@FAST
@given(ops(), st.sampled_from([1, 2.5, 10, 40]), st.sampled_from([1, 3, 15, 60]))
def test_equals_paying_each_token_on_both_quotas_in_turn(seq, user_rate, group_rate):
    """Every bulk operation equals single tokens paid on both limiters, one by
    one, stopping at the first token either refuses."""
    lim = joint(user_rate, group_rate)
    own, shared = OutputRateLimiter(user_rate), OutputRateLimiter(group_rate)
    held = {"a": 0, "b": 0, "c": 0}
    now = 0

    def single_take(user: str) -> bool:
        key = GROUP_OF.get(user)
        if own.available(user, now) < 1 or (key is not None and shared.available(key, now) < 1):
            return False
        own.try_take(user, now)
        if key is not None:
            shared.try_take(key, now)
        return True

    for op, user, advance, count in seq:
        now += advance
        key = GROUP_OF.get(user)
        if op == "take_up_to":
            expected = 0
            while expected < count and single_take(user):
                expected += 1
            assert lim.take_up_to(user, now, count) == expected
            held[user] += expected
        elif op == "try_take":
            probe_own, probe_shared = copy.deepcopy(own), copy.deepcopy(shared)
            expected = 0
            while expected < count and single_take(user):
                expected += 1
            if expected < count:  # all or nothing: undo the partial model take
                own, shared = probe_own, probe_shared
            assert lim.try_take(user, now, count) == (expected == count)
            held[user] += count if expected == count else 0
        elif op == "refund":
            back = min(count, held[user])
            lim.refund(user, now, back)
            own.refund(user, now, back)
            if key is not None:
                shared.refund(key, now, back)
            held[user] -= back
        elif op == "available":
            expected = own.available(user, now)
            if key is not None:
                expected = min(expected, shared.available(key, now))
            assert lim.available(user, now) == expected
        else:
            expected = own.ready_at_ns(user, now)
            if key is not None:
                expected = max(expected, shared.ready_at_ns(key, now))
            assert lim.ready_at_ns(user, now) == expected


@FAST
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 20 * MS), st.integers(1, 6)), max_size=200))
def test_the_group_bound_holds_over_every_window(attempts):
    lim = joint(user_rate=20, group_rate=7)
    now, log = 0, []
    for user, advance, count in attempts:
        now += advance
        log.extend([now] * lim.take_up_to(user, now, count))
    for i, start in enumerate(log):
        for j in range(i, len(log)):
            assert j - i + 1 <= bound(log[j] - start, 7)
