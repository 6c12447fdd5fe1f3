"""Shadow mode's counter alone (:mod:`vllm_output_rate.policy.shadow`), on a fake clock."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.policy.borrow import Share, ShareTable
from vllm_output_rate.policy.limiter import OutputRateLimiter
from vllm_output_rate.policy.shadow import ShadowCounter, residency_surplus

MS = 1_000_000


def counter(users=None, shares=None, groups=None, group_of=None):
    users = users or {}
    table = ShareTable(1000, users, None, shares or {})
    if groups is None:
        return ShadowCounter(table, (1000, users))
    return ShadowCounter(table, (1000, users), ShareTable(1000, groups, None, {}), (1000, groups),
                         group_of)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=300), st.sampled_from([3, 20, 50]))
def test_held_equals_what_a_separate_limiter_refuses(per_step, rate):
    """Any pattern of tokens per 10 ms step: held is what take_up_to on an
    independent limiter at the same rate refuses, and sampled every token."""
    c = counter({"u": rate})
    ref = OutputRateLimiter(1000, {"u": rate})
    refused = 0
    for i, n in enumerate(per_step):
        now = i * 10 * MS
        c.observe(now, {"u": n})
        refused += n - ref.take_up_to("u", now, n)
    assert c.users.held.get("u", 0) == refused
    assert c.sampled.get("u", 0) == sum(per_step)
    assert not c.users.borrowed


def test_twice_the_rate_holds_half():
    c = counter({"u": 50})
    for i in range(1000):  # 100 tok/s for 10 s
        c.observe(i * 10 * MS, {"u": 1})
    assert abs(c.users.held["u"] - 500) <= 0.1 * 50 + 1
    # About half of the steps held a token, each counting its 10 ms.
    assert abs(c.users.throttled_ns["u"] - 5 * 10**9) <= 0.11 * 10**9


def test_throttled_time_stops_when_the_engine_goes_quiet():
    """A step with a held token counts until the next step, but at most the
    time the quota needs to pay it back (1 token at 10 tok/s: 100 ms)."""
    c = counter({"u": 10})
    c.observe(0, {"u": 3})  # 1 + burst (1 at 10 tok/s x 0.1 s) paid, 1 held
    assert c.users.held["u"] == 1
    c.observe(60 * 10**9, {})  # a minute later
    assert c.users.throttled_ns["u"] == 100 * MS


def test_a_borrower_borrows_up_to_its_ceiling_and_the_rest_is_held():
    c = counter({"b": 10, "open": 10}, {"b": Share(30, 1), "open": Share(None, 1)})
    for i in range(1000):  # 50 tok/s each for 20 s
        c.observe(i * 20 * MS, {"b": 1, "open": 1})
    assert abs(c.users.borrowed["b"] - 400) <= 6  # 30 - 10 tok/s over 20 s
    assert abs(c.users.held["b"] - 400) <= 6  # 50 - 30
    assert abs(c.users.borrowed["open"] - 800) <= 6  # no ceiling: all beyond the rate
    assert "open" not in c.users.held


def test_a_group_counts_what_its_members_own_quotas_paid():
    c = counter({"a": 100, "b": 100}, groups={"g": 50}, group_of={"a": "g", "b": "g"}.get)
    for i in range(1000):  # each 50 tok/s for 20 s, within its own rate; together 100
        c.observe(i * 20 * MS, {"a": 1, "b": 1})
    assert not c.users.held
    assert c.groups is not None
    assert abs(c.groups.held["g"] - 1000) <= 0.1 * 50 + 2  # the group's 50 tok/s pays half


def test_a_reload_keeps_state_and_forget_drops_totals():
    c = counter({"u": 10})
    c.observe(0, {"u": 5})
    held = c.users.held["u"]
    c.configure(ShareTable(1000, {"u": 1000}, None, {}), (1000, {"u": 1000}))
    c.observe(10 * MS, {"u": 5})
    assert c.users.held["u"] == held + 5  # the old TAT is kept (at the new rate, no fresh burst)
    c.forget(["u"])
    assert "u" not in c.users.held and "u" not in c.sampled


def test_residency_surplus():
    caps = {"a": 2, "b": None, "c": 5}.get
    assert residency_surplus({"a": 5, "b": 9, "c": 5}, caps) == {"a": 3}
