"""Tests of the per-step gate (:mod:`vllm_output_rate.policy.gate`).

The gate runs over a real :class:`OutputRateLimiter`; time is a plain integer
(a fake clock) passed to :meth:`StepGate.plan`.  Keys are plain strings.

A step follows the protocol the scheduler adapter uses: ``plan`` (which
prepays the decoding streams it offers) -> ``charge`` (or only ask, ``take=False``) /
``release`` / ``throttled_victims`` -> ``admit`` of newly scheduled requests
-> ``set_progressing`` of prefills and admissions -> ``ledger.settle(sampled)`` ->
``idle_wait_ns``.
"""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.policy.gate import (
    CLEANUP_EVERY_STEPS,
    MAX_IDLE_WAIT_NS,
    StepGate,
)
from vllm_output_rate.policy.limiter import OutputRateLimiter
from vllm_output_rate.policy.victims import throttled_victims

MS = 1_000_000
S = 1_000_000_000

# With the default 100 ms burst:
#   5 tok/s  -> interval 200 ms, 1 token available when idle
#   20 tok/s -> interval 50 ms, 3 tokens available when idle
#   1000/s   -> interval 1 ms, 101 tokens available when idle
#   0.5/s    -> interval 2 s, 1 token available when idle
RATES = {"one": 5, "three": 20, "lots": 1000, "slow": 0.5}


class CountingLimiter(OutputRateLimiter):
    """A real limiter that records what the gate asks of it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.takes: list[tuple[str, int]] = []
        self.refunds: list[tuple[str, int]] = []
        self.cleanups: list[int] = []

    def try_take(self, user, now_ns, count=1):
        self.takes.append((user, count))
        return super().try_take(user, now_ns, count)

    def take_up_to(self, user, now_ns, count):
        taken = super().take_up_to(user, now_ns, count)
        if taken:
            self.takes.append((user, taken))
        return taken

    def refund(self, user, now_ns, count=1):
        self.refunds.append((user, count))
        return super().refund(user, now_ns, count)

    def cleanup_idle_users(self, now_ns):
        self.cleanups.append(now_ns)
        return super().cleanup_idle_users(now_ns)


def new_gate(default=1000, rates=None, **kw) -> tuple[StepGate, CountingLimiter]:
    lim = CountingLimiter(default, RATES if rates is None else rates)
    return StepGate(lim, **kw), lim


def add(gate: StepGate, user: str, *keys: str, progressing: bool = False) -> None:
    for k in keys:
        gate.lanes.track(k, user)
        gate.lanes.admit(k, progressing)


def step(gate: StepGate, now: int, slots: int, serve=None):
    """One step: plan, charge every visible key (or ``serve``), all sampled."""
    plan = gate.plan(now, slots)
    keys = plan.visible if serve is None else serve
    sampled = {k for k in keys if gate.ledger.charge(k)}
    gate.ledger.settle(sampled)
    return plan


def observe(lim: OutputRateLimiter, users, now):
    return {u: (lim.available(u, now), lim.ready_at_ns(u, now)) for u in users}


def taken(lim: CountingLimiter) -> int:
    return sum(c for _, c in lim.takes)


# ---------------------------------------------------------------------------
# Membership bookkeeping
# ---------------------------------------------------------------------------


def test_membership():
    gate, _ = new_gate()
    gate.lanes.track("p", "u")
    assert gate.lanes.user_of["p"] == "u"
    assert "p" not in gate.lanes.lane_of
    add(gate, "u", "d1", "d2")
    gate.lanes.admit("p", True)
    add(gate, "v", "x")
    assert len(gate.lanes.lane_of) == 4
    # Lane by lane, prefills before decoding streams.
    assert list(gate.lanes.resident()) == ["p", "d1", "d2", "x"]
    gate.lanes.set_progressing("p", False)
    gate.lanes.set_progressing("d1", True)
    assert list(gate.lanes.resident()) == ["d1", "d2", "p", "x"]
    gate.lanes.set_progressing("d1", True)  # idempotent
    gate.lanes.set_progressing("x", False)  # idempotent
    gate.lanes.set_progressing("nobody", True)  # not resident: ignored
    assert list(gate.lanes.resident()) == ["d1", "d2", "p", "x"]
    gate.lanes.release("d2")
    gate.lanes.release("d2")  # twice is harmless
    assert "d2" not in gate.lanes.lane_of
    assert gate.lanes.user_of["d2"] == "u"  # still tracked
    gate.lanes.forget("x")
    assert "x" not in gate.lanes.lane_of
    with pytest.raises(KeyError):
        gate.lanes.user_of["x"]
    assert len(gate.lanes.lane_of) == 2
    assert list(gate.lanes.resident()) == ["d1", "p"]
    gate.lanes.release("d1")
    gate.lanes.release("p")
    assert len(gate.lanes.lane_of) == 0
    assert list(gate.lanes.resident()) == []
    plan = gate.plan(0, 10)
    assert (plan.visible, plan.hidden, plan.over_cap) == ([], 0, False)
    assert (plan.prepaid, plan.prefills, plan.throttled) == (set(), [], False)


# ---------------------------------------------------------------------------
# plan() prepays; charge / ask / settle
# ---------------------------------------------------------------------------


def test_plan_prepays_offered_streams_in_one_take_per_user():
    gate, lim = new_gate()
    add(gate, "three", "p", progressing=True)
    add(gate, "three", "a", "b")
    add(gate, "lots", "l1", "l2")
    plan = gate.plan(0, 10)
    assert plan.visible == ["p", "a", "b", "l1", "l2"]
    assert plan.prefills == ["p"]
    assert plan.prepaid == {"a", "b", "l1", "l2"}
    assert sorted(lim.takes) == [("lots", 2), ("three", 2)]
    assert lim.available("three", 0) == 1
    assert lim.available("lots", 0) == 99
    assert all(gate.ledger.is_charged(k) for k in ("a", "b", "l1", "l2"))
    assert not gate.ledger.is_charged("p")
    # Paid streams pass for free, and so does asking again.
    for k in ("a", "b", "a"):
        assert gate.ledger.charge(k) and gate.ledger.charge(k, take=False)
    assert len(lim.takes) == 2
    assert gate.ledger.settle({"a", "b", "l1", "l2"}) == 0
    assert lim.available("three", 0) == 1
    assert lim.available("lots", 0) == 99


def test_charge_at_most_once_per_key_per_step():
    gate, lim = new_gate()
    add(gate, "three", "p", progressing=True)
    gate.plan(0, 10)
    assert gate.ledger.charge("p") and gate.ledger.charge("p") and gate.ledger.charge("p")
    assert gate.ledger.charge("p", take=False)
    assert lim.takes == [("three", 1)]
    assert lim.available("three", 0) == 2
    assert gate.ledger.is_charged("p")
    assert gate.ledger.settle({"p"}) == 0
    assert lim.available("three", 0) == 2
    assert not gate.ledger.is_charged("p")
    # A new step charges again.
    gate.plan(0, 10)
    assert gate.ledger.charge("p")
    assert lim.takes == [("three", 1), ("three", 1)]
    assert lim.available("three", 0) == 1
    gate.ledger.settle({"p"})


def test_refused_user_is_not_asked_again_in_the_step():
    gate, lim = new_gate()
    add(gate, "one", "a", "b", "c", progressing=True)
    add(gate, "three", "x", progressing=True)
    gate.plan(0, 10)
    assert gate.ledger.charge("a")
    assert not gate.ledger.charge("b")  # quota gone: the limiter says no
    assert lim.takes == [("one", 1), ("one", 1)]
    # Even if quota comes back mid-step, the user is not asked again.
    lim.refund("one", 0)
    assert lim.available("one", 0) == 1
    assert not gate.ledger.charge("c")
    assert not gate.ledger.charge("c", take=False)
    assert lim.takes == [("one", 1), ("one", 1)]  # not asked again
    assert gate.ledger.charge("a")  # already charged keys stay charged
    assert gate.ledger.charge("x")  # other users are unaffected
    gate.ledger.settle({"a", "x"})
    # Next step: asked again.
    gate.plan(0, 10)
    assert gate.ledger.charge("b")
    assert lim.takes[-1] == ("one", 1)
    gate.ledger.settle(set())


def test_asking_takes_nothing_but_a_no_sticks():
    gate, lim = new_gate()
    add(gate, "one", "a", "b", progressing=True)
    gate.plan(0, 10)
    assert gate.ledger.charge("a", take=False)
    assert gate.ledger.charge("b", take=False)
    assert lim.takes == [] and lim.available("one", 0) == 1
    assert gate.ledger.charge("a")
    assert not gate.ledger.charge("b", take=False)  # refused: remembered
    lim.refund("one", 0)
    assert not gate.ledger.charge("b")
    assert lim.takes == [("one", 1)]
    gate.ledger.settle(set())


def test_settle_refunds_exactly_the_unsampled_charges():
    gate, lim = new_gate()
    ref = OutputRateLimiter(1000, RATES)
    now = 7 * S
    add(gate, "three", "t1", "t2", "t3")
    add(gate, "lots", "l1", "l2", "l3", "l4")
    add(gate, "lots", "lp1", "lp2", progressing=True)
    add(gate, "one", "o1")
    gate.lanes.track("w", "one")  # a waiting request of "one"
    plan = gate.plan(now, 100)
    assert plan.prepaid == {"t1", "t2", "t3", "l1", "l2", "l3", "l4", "o1"}
    assert gate.ledger.charge("lp1") and gate.ledger.charge("lp2")
    assert not gate.ledger.charge("w")  # "one" spent its token on o1
    sampled = {"t2", "l1", "l4", "lp2", "not-charged", "w"}
    # Unsampled: t1, t3, l2, l3, o1 (prepaid) and lp1 (charged).
    assert gate.ledger.settle(sampled) == 6
    for k in ["t2", "l1", "l4", "lp2"]:
        assert ref.try_take(gate.lanes.user_of[k], now)
    users = ["three", "lots", "one"]
    for t in (now, now + 10 * MS, now + 60 * MS, now + S):
        assert observe(lim, users, t) == observe(ref, users, t)
    # Nothing is refunded twice.
    assert gate.ledger.settle(sampled) == 0
    assert observe(lim, users, now) == observe(ref, users, now)


def test_settle_refunds_charges_of_requests_that_left_mid_step():
    gate, lim = new_gate()
    add(gate, "lots", "a", "b", "c")
    add(gate, "lots", "p", progressing=True)
    gate.plan(0, 10)
    assert gate.ledger.charge("p")
    assert lim.available("lots", 0) == 101 - 4
    gate.lanes.release("a")  # preempted after being paid for
    gate.lanes.forget("b")  # aborted after being paid for
    gate.lanes.release("p")  # preempted after being charged
    assert gate.ledger.settle({"c"}) == 3
    assert lim.available("lots", 0) == 100
    assert len(gate.lanes.lane_of) == 1


def test_charge_of_newly_admitted_request():
    gate, lim = new_gate()
    add(gate, "three", "a")
    gate.plan(0, 10)  # prepays a
    gate.lanes.track("new", "three")  # a waiting request scheduled in this step
    assert gate.ledger.charge("new")
    gate.lanes.admit("new", False)
    assert gate.ledger.settle({"new"}) == 1  # a was offered but did not sample
    assert lim.available("three", 0) == 2
    assert list(gate.lanes.resident()) == ["a", "new"]


# ---------------------------------------------------------------------------
# Rotation and service order
# ---------------------------------------------------------------------------


def test_served_stream_moves_behind_the_users_other_streams():
    gate, _ = new_gate()
    add(gate, "lots", "k0", "k1", "k2", "k3", "k4")
    plan = gate.plan(0, 2)
    assert plan.visible == ["k0", "k1"]
    assert gate.ledger.settle({"k1"}) == 1  # only k1 sampled
    assert list(gate.lanes.resident()) == ["k0", "k2", "k3", "k4", "k1"]
    assert step(gate, 0, 2).visible == ["k0", "k2"]
    assert step(gate, 0, 2).visible == ["k3", "k4"]
    assert step(gate, 0, 2).visible == ["k1", "k0"]


def test_unserved_offered_streams_keep_their_order():
    gate, _ = new_gate()
    add(gate, "lots", "k0", "k1", "k2", "k3", "k4")
    assert gate.plan(0, 4).visible == ["k0", "k1", "k2", "k3"]
    assert gate.ledger.settle({"k2", "k0"}) == 2
    assert list(gate.lanes.resident()) == ["k1", "k3", "k4", "k0", "k2"]
    assert gate.plan(0, 2).visible == ["k1", "k3"]
    gate.ledger.settle(set())


def test_rotation_when_an_offered_stream_left_mid_step():
    gate, _ = new_gate()
    add(gate, "lots", "k0", "k1", "k2", "k3")
    assert gate.plan(0, 2).visible == ["k0", "k1"]
    gate.lanes.release("k0")  # preempted
    gate.ledger.settle({"k1"})
    assert list(gate.lanes.resident()) == ["k2", "k3", "k1"]
    assert gate.plan(0, 2).visible == ["k2", "k3"]
    gate.ledger.settle(set())


def test_rotation_round_robin_under_quota():
    # One token per step: each step serves the stream after the last served.
    gate, _ = new_gate()
    add(gate, "one", "a", "b", "c")
    served = []
    for i in range(9):
        plan = step(gate, i * 200 * MS, 10)
        assert len(plan.visible) == 1
        served.extend(plan.visible)
    assert served == ["a", "b", "c"] * 3


def test_progressing_keys_are_offered_without_quota():
    gate, lim = new_gate()
    add(gate, "one", "p1", "p2", progressing=True)
    add(gate, "one", "d1", "d2")
    assert lim.try_take("one", 0)  # drain the user's quota
    plan = gate.plan(0, 10)
    assert plan.visible == ["p1", "p2"]
    assert plan.prefills == ["p1", "p2"]
    assert plan.hidden == 2
    assert plan.throttled
    gate.ledger.settle(set())
    plan = gate.plan(200 * MS, 10)
    assert plan.visible == ["p1", "p2", "d1"]
    assert plan.prepaid == {"d1"}
    gate.ledger.settle({"d1"})
    # Prefills do not rotate; the served stream does.
    assert list(gate.lanes.resident()) == ["p1", "p2", "d2", "d1"]


def test_users_least_recently_served_first():
    gate, _ = new_gate()
    add(gate, "lots", "a1", "a2")
    add(gate, "three", "b1")
    add(gate, "one", "c1")
    # Room for one request per step: users take turns.
    seen = [step(gate, i * S, 1).visible for i in range(6)]
    assert seen == [["a1"], ["b1"], ["c1"], ["a2"], ["b1"], ["c1"]]


def test_user_offered_but_not_served_keeps_its_place():
    gate, _ = new_gate()
    add(gate, "lots", "a1")
    add(gate, "three", "b1")
    plan = gate.plan(0, 10)
    assert plan.visible == ["a1", "b1"]
    gate.ledger.settle({"b1"})  # a1 was offered and paid for but did not sample
    assert gate.plan(0, 1).visible == ["a1"]
    gate.ledger.settle(set())


def test_user_served_through_a_charge_moves_back():
    gate, _ = new_gate()
    add(gate, "lots", "a1")
    add(gate, "three", "bp", progressing=True)
    add(gate, "one", "c1")
    gate.plan(0, 10)
    assert gate.ledger.charge("bp")
    gate.lanes.set_progressing("bp", False)  # its prefill reached the sampling position
    gate.ledger.settle({"a1", "bp", "c1"})
    gate.ledger.settle(set())
    # Everyone was served; then "three" alone is served next step.
    gate.plan(S, 10)
    gate.ledger.settle({"bp"})
    assert gate.plan(S, 1).visible == ["a1"]
    gate.ledger.settle(set())
    users = []
    for k in gate.lanes.resident():
        if gate.lanes.user_of[k] not in users:
            users.append(gate.lanes.user_of[k])
    assert users[-1] == "three"


def test_unserved_user_goes_before_users_served_in_the_step():
    gate, _ = new_gate()
    add(gate, "lots", "a1")
    add(gate, "three", "b1")
    add(gate, "one", "c1")
    gate.plan(0, 10)
    gate.ledger.settle({"a1", "b1"})
    # c1 was not served: now first; a and b (served together) follow.
    plan = gate.plan(S, 10)
    assert plan.visible[0] == "c1"
    assert set(plan.visible[1:]) == {"a1", "b1"}
    gate.ledger.settle(set())


def test_service_order_survives_preemption_and_readmission():
    gate, _ = new_gate()
    add(gate, "lots", "a1")
    add(gate, "three", "b1")
    step(gate, 0, 1)  # serves a: order is now b, a
    assert gate.plan(S, 1).visible == ["b1"]
    gate.ledger.settle(set())  # b not served (e.g. no KV for it)
    gate.lanes.release("b1")  # b's only request is preempted ...
    gate.lanes.admit("b1", False)  # ... and comes back
    # b was served less recently than a (never vs. step 1): b goes first.
    assert gate.plan(2 * S, 1).visible == ["b1"]


def test_all_prepaid_sampled_shortcut_matches_the_full_settlement():
    def build():
        gate, lim = new_gate()
        add(gate, "lots", "a0", "a1", "a2", "a3")
        add(gate, "three", "b0", "b1", "b2", "b3", "b4")
        add(gate, "three", "bp", progressing=True)
        add(gate, "one", "c0")
        return gate, lim

    results = []
    for shortcut in (False, True):
        gate, lim = build()
        plan = gate.plan(0, 7)
        assert plan.visible == ["a0", "a1", "a2", "a3", "bp", "b0", "b1"]
        assert gate.ledger.charge("bp")
        gate.lanes.track("new", "three")
        assert not gate.ledger.charge("new")  # "three" is out: 2 prepaid + bp
        gate.lanes.admit("new", False)
        sampled = set(plan.prepaid) | {"bp"}
        refunded = gate.ledger.settle(sampled, all_prepaid_sampled=shortcut)
        results.append((refunded, list(gate.lanes.resident()), observe(lim, RATES, 0)))
    assert results[0] == results[1]
    assert results[0][1] == [
        "c0", "a0", "a1", "a2", "a3", "bp", "b2", "b3", "b4", "new", "b0", "b1"
    ]


# ---------------------------------------------------------------------------
# plan(): slots and quota
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("slots", [-3, 0])
def test_no_slots_no_visible(slots):
    gate, lim = new_gate()
    add(gate, "lots", "a", "b")
    plan = gate.plan(0, slots)
    assert plan.visible == []
    assert plan.prepaid == set()
    assert plan.hidden == 2
    assert plan.over_cap
    assert lim.takes == []


def test_plan_respects_slots_and_quota():
    gate, lim = new_gate()
    add(gate, "three", "t1", "t2", "t3", "t4", "t5")
    add(gate, "lots", "l1", "l2", "l3")
    add(gate, "lots", "lp", progressing=True)
    plan = gate.plan(0, 100)
    # "three" can pay for 3 of its 5 streams; "lots" for all.
    assert plan.visible == ["t1", "t2", "t3", "lp", "l1", "l2", "l3"]
    assert plan.hidden == 2
    assert not plan.over_cap
    assert plan.throttled
    gate.ledger.settle(set())
    for slots in range(0, 9):
        plan = gate.plan(0, slots)
        assert plan.visible == ["t1", "t2", "t3", "lp", "l1", "l2", "l3"][:slots]
        assert plan.hidden == 9 - len(plan.visible)
        assert plan.over_cap == (slots < 7)
        assert gate.ledger.settle(set()) == len(plan.prepaid)
    # Quota spent by serving two streams: one left.
    step(gate, 0, 100, serve=["t1", "t2"])
    assert lim.available("three", 0) == 1
    plan = gate.plan(0, 100)
    assert [k for k in plan.visible if k.startswith("t")] == ["t3"]
    gate.ledger.settle(set())


def test_over_cap_false_when_only_quota_hides_requests():
    gate, _ = new_gate()
    add(gate, "one", "a", "b", "c")
    plan = gate.plan(0, 1)
    assert plan.visible == ["a"]
    assert not plan.over_cap  # b, c wait for quota, not for room
    assert plan.throttled
    gate.ledger.settle(set())


def test_prefills_are_cut_at_the_slot_limit():
    gate, _ = new_gate()
    add(gate, "lots", "p1", "p2", "p3", progressing=True)
    add(gate, "three", "q1", progressing=True)
    plan = gate.plan(0, 2)
    assert plan.visible == ["p1", "p2"] == plan.prefills
    assert plan.hidden == 2
    assert plan.over_cap  # q1 was not reached
    gate.ledger.settle(set())


def test_over_cap_when_prefills_of_the_last_lane_are_cut_by_slots():
    gate, _ = new_gate()
    add(gate, "lots", "p1", "p2", "p3", progressing=True)
    plan = gate.plan(0, 2)
    assert plan.visible == ["p1", "p2"]
    # p3 can run without quota and was hidden only for lack of room.
    assert plan.over_cap


# ---------------------------------------------------------------------------
# idle_wait_ns (asked after ledger.settle(), as the adapter does)
# ---------------------------------------------------------------------------


def test_idle_wait_none_when_nobody_blocked():
    gate, _ = new_gate()
    add(gate, "lots", "a", "b")
    add(gate, "one", "p", progressing=True)
    step(gate, 0, 10)
    assert gate.idle_wait_ns() is None


def test_idle_wait_is_earliest_ready_time_of_blocked_users():
    gate, lim = new_gate()
    now = 10 * S
    add(gate, "one", "o1", "o2")  # 200 ms interval
    add(gate, "three", "t1", "t2", "t3", "t4")  # 50 ms interval
    add(gate, "lots", "l1")  # never blocked
    # Drain both throttled users completely.
    assert lim.try_take("one", now)
    assert lim.try_take("three", now, 3)
    gate.plan(now, 10)
    gate.ledger.settle({"l1"})
    # one: TAT now+200ms -> ready at now+100ms; three: TAT now+150ms -> +50ms.
    assert lim.ready_at_ns("three", now) == now + 50 * MS
    assert lim.ready_at_ns("one", now) == now + 100 * MS
    assert gate.idle_wait_ns() == 50 * MS
    # 60 ms later "three" has a token again (and is still throttled).
    plan = gate.plan(now + 60 * MS, 10)
    assert plan.prepaid == {"t1", "l1"}
    gate.ledger.settle(set())  # nothing sampled: refunded
    assert gate.idle_wait_ns() == 0
    # Served this time: the wait is until the next token.
    plan = gate.plan(now + 60 * MS, 10)
    gate.ledger.settle({"t1"})
    assert gate.idle_wait_ns() == 40 * MS  # one: ready at now+100ms


def test_idle_wait_is_capped():
    gate, lim = new_gate()
    add(gate, "slow", "s1")  # 0.5 tok/s: 2 s interval
    assert lim.try_take("slow", 0)
    gate.plan(0, 10)
    gate.ledger.settle(set())
    assert gate.idle_wait_ns() == MAX_IDLE_WAIT_NS  # 2 s away, capped
    gate2, lim2 = new_gate(max_idle_wait_ns=7 * S)
    add(gate2, "slow", "s1")
    assert lim2.try_take("slow", 0)
    gate2.plan(0, 10)
    gate2.ledger.settle(set())
    assert gate2.idle_wait_ns() == 2 * S - 100 * MS


def test_idle_wait_counts_users_refused_at_charge():
    gate, lim = new_gate(max_idle_wait_ns=S)
    add(gate, "one", "o1")
    gate.plan(0, 10)  # prepays o1: "one" is not throttled
    gate.lanes.track("w", "one")  # a waiting request of the same user
    assert not gate.ledger.charge("w")
    gate.ledger.settle({"o1"})
    assert gate.idle_wait_ns() == 200 * MS - 100 * MS  # interval - burst
    # A new step forgets who was blocked.
    gate.plan(S, 10)
    gate.ledger.settle({"o1"})
    assert gate.idle_wait_ns() is None


def test_idle_wait_counts_refusals_to_an_ask():
    gate, lim = new_gate(max_idle_wait_ns=S)
    gate.lanes.track("w", "one")
    assert lim.try_take("one", 0)
    gate.plan(0, 10)
    assert not gate.ledger.charge("w", take=False)
    gate.ledger.settle(set())
    assert gate.idle_wait_ns() == 100 * MS


# ---------------------------------------------------------------------------
# throttled_victims
# ---------------------------------------------------------------------------


def test_throttled_victims_are_hidden_streams_of_throttled_users():
    gate, lim = new_gate()
    add(gate, "three", "t1", "t2", "t3", "t4", "t5")  # 3 tokens: t4, t5 hidden
    add(gate, "one", "o1", "o2")  # 1 token: o2 hidden
    add(gate, "lots", "l1", "l2", "l3")  # plenty of quota, but no room
    add(gate, "slow", "sp", progressing=True)
    assert lim.try_take("slow", 0)
    add(gate, "slow", "s1", "s2")  # no quota at all
    plan = gate.plan(0, 6)
    assert plan.visible == ["t1", "t2", "t3", "o1", "l1", "l2"]
    assert plan.over_cap
    # "slow" was not reached (no room left), so it was not judged throttled.
    # Users whose quota comes back last go first: "one" (ready at 100 ms)
    # before "three" (ready at 50 ms).
    assert list(throttled_victims(gate.lanes, gate.ledger)) == ["o2", "t4", "t5"]
    gate.ledger.settle(set())
    plan = gate.plan(0, 100)
    assert plan.visible == ["t1", "t2", "t3", "o1", "l1", "l2", "l3", "sp"]
    victims = list(throttled_victims(gate.lanes, gate.ledger))
    assert victims == ["s1", "s2", "o2", "t4", "t5"]  # "slow" is ready at 1.9 s
    assert not set(victims) & set(plan.visible)
    # Evicting victims one by one (as the adapter does) lists the rest.
    gate.lanes.release("t4")
    assert list(throttled_victims(gate.lanes, gate.ledger)) == ["s1", "s2", "o2", "t5"]
    gate.ledger.settle(set())


def test_throttled_victims_empty_without_throttling():
    gate, _ = new_gate()
    add(gate, "lots", "a", "b", "c")
    plan = gate.plan(0, 1)
    assert not plan.throttled
    assert list(throttled_victims(gate.lanes, gate.ledger)) == []
    gate.ledger.settle(set())


def test_paid_request_is_never_a_victim():
    gate, _ = new_gate()
    add(gate, "three", "t0", "t1", "t2", "t3")  # 3 tokens, 4 streams
    plan = gate.plan(0, 2)  # room for two: one token left over
    assert plan.visible == ["t0", "t1"] and plan.throttled
    # t2, t3 wait for room, not quota: no victims while the user can pay.
    assert list(throttled_victims(gate.lanes, gate.ledger)) == []
    gate.lanes.track("w", "three")  # a waiting request scheduled in this step
    assert gate.ledger.charge("w")  # ... spends the last token
    assert list(throttled_victims(gate.lanes, gate.ledger)) == ["t2", "t3"]
    gate.lanes.admit("w", False)  # paid for, now resident behind t2, t3
    assert list(throttled_victims(gate.lanes, gate.ledger)) == ["t2", "t3"]
    gate.ledger.settle({"w"})


def test_throttled_victims_after_a_visible_stream_is_preempted():
    gate, _ = new_gate()
    add(gate, "one", "a0", "a1", "a2")
    plan = gate.plan(0, 10)
    assert plan.visible == ["a0"]
    assert list(throttled_victims(gate.lanes, gate.ledger)) == ["a1", "a2"]
    gate.lanes.release("a0")  # the scheduler preempts the visible stream
    assert list(throttled_victims(gate.lanes, gate.ledger)) == ["a1", "a2"]


# ---------------------------------------------------------------------------
# Limiter cleanup cadence
# ---------------------------------------------------------------------------


def test_cleanup_every_256_plans():
    gate, lim = new_gate()
    assert lim.try_take("idle-user", 0)
    t = 10 * S  # idle-user's TAT is long past
    for i in range(1, 256):
        gate.plan(t + i, 1)
        gate.ledger.settle(set())
    assert len(lim.state) == 1
    assert lim.cleanups == []
    gate.plan(t + 256, 1)
    assert lim.cleanups == [t + 256]
    assert len(lim.state) == 0
    assert lim.try_take("idle-user", t + 300)
    for i in range(257, 512):
        gate.plan(t + i + S, 1)
    assert len(lim.state) == 1
    assert len(lim.cleanups) == 1
    gate.plan(t + 512 + S, 1)
    assert lim.cleanups == [t + 256, t + 512 + S]
    assert len(lim.state) == 0


def test_cleanup_keeps_users_with_debt():
    gate, lim = new_gate(cleanup_every=1)
    add(gate, "slow", "s")
    step(gate, 0, 1)  # slow's TAT is now 2 s
    gate.plan(S, 1)
    assert len(lim.state) == 1
    gate.ledger.settle(set())
    gate.lanes.release("s")
    gate.plan(2 * S, 1)
    assert len(lim.state) == 0


# ---------------------------------------------------------------------------
# Repeated steps (steady)
# ---------------------------------------------------------------------------


def test_steady_repeats_a_full_undisturbed_step_with_one_take_per_user():
    gate, lim = new_gate()
    add(gate, "lots", "l1", "l2")
    add(gate, "dflt", "d1")
    assert not gate.steady(0, 10)  # nothing planned yet
    plan = gate.plan(0, 10)
    gate.ledger.settle(set(plan.visible), all_prepaid_sampled=True)
    lim.takes.clear()
    order = list(gate.lanes.resident())
    assert gate.steady(10 * MS, 10)
    assert sorted(lim.takes) == [("dflt", 1), ("lots", 2)]
    assert all(gate.ledger.charge(k) for k in order)  # paid: asking takes nothing more
    assert len(lim.takes) == 2
    assert gate.ledger.settle_repeat(order, set(order), all_sampled=True) == 0
    assert list(gate.lanes.resident()) == order
    assert gate.steady(20 * MS, 10)


def test_steady_refused_after_membership_change_slots_or_partial_step():
    gate, lim = new_gate()
    add(gate, "lots", "l1", "l2")
    step(gate, 0, 10)  # settled without all_prepaid_sampled
    assert not gate.steady(MS, 10)  # that step was not declared undisturbed
    plan = gate.plan(2 * MS, 10)
    gate.ledger.settle(set(plan.visible), all_prepaid_sampled=True)
    assert not gate.steady(3 * MS, 1)  # fewer slots than resident requests
    add(gate, "lots", "l3")  # joined since the last plan
    assert not gate.steady(4 * MS, 10)
    plan = gate.plan(5 * MS, 10)
    gate.ledger.settle(set(plan.visible), all_prepaid_sampled=True)
    gate.lanes.release("l1")
    assert not gate.steady(6 * MS, 10)


def test_steady_takes_nothing_when_a_user_is_short():
    gate, lim = new_gate()
    add(gate, "lots", "l1")
    add(gate, "three", "a", "b", "c")  # 20 tok/s: 3 tokens at once
    plan = gate.plan(0, 10)
    gate.ledger.settle(set(plan.visible), all_prepaid_sampled=True)
    before = observe(lim, ["lots", "three"], MS)
    assert not gate.steady(MS, 10)  # "three" cannot pay 3 streams again
    assert observe(lim, ["lots", "three"], MS) == before


def test_settle_repeat_settles_a_disturbed_step_like_settle():
    gate, lim = new_gate()
    add(gate, "lots", "l1", "l2", "l3")
    add(gate, "dflt", "d1")
    plan = gate.plan(0, 10)
    gate.ledger.settle(set(plan.visible), all_prepaid_sampled=True)
    order = list(gate.lanes.resident())
    assert gate.steady(MS, 10)
    refunded = gate.ledger.settle_repeat(order, {"l1", "d1"}, all_sampled=False)
    assert refunded == 2  # l2 and l3 did not sample
    assert list(gate.lanes.resident()) == ["l2", "l3", "l1", "d1"]
    assert not gate.steady(2 * MS, 10)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**64), slots=st.integers(1, 12))
def test_steady_steps_match_planned_steps(seed, slots):
    """A gate that repeats steps whenever steady() allows and one that always
    plans see the same events: same visible sets, limiter states and orders."""
    rng = random.Random(seed)
    fast, fast_lim = new_gate(default=200)
    slow, slow_lim = new_gate(default=200)
    users = ["lots", "dflt", "three", "one"]
    next_key = 0
    now = 0
    for _ in range(60):
        roll = rng.random()
        if roll < 0.15:
            key, user = f"k{next_key}", rng.choice(users)
            next_key += 1
            for gate in (fast, slow):
                add(gate, user, key)
        elif roll < 0.25 and slow.lanes.lane_of:
            key = rng.choice(sorted(slow.lanes.resident()))
            for gate in (fast, slow):
                gate.lanes.forget(key)
        now += rng.choice([0, MS, 10 * MS, 50 * MS, 300 * MS])
        start = list(fast.lanes.resident())
        repeated = fast.steady(now, slots)
        plan = slow.plan(now, slots)
        if repeated:
            assert set(plan.visible) == set(start)
        else:
            assert fast.plan(now, slots).visible == plan.visible
        drop = rng.random() < 0.2 and plan.visible
        sampled = set(plan.visible) - ({rng.choice(plan.visible)} if drop else set())
        complete = not drop and not plan.prefills
        if repeated:
            fast.ledger.settle_repeat(start, sampled, all_sampled=complete)
        else:
            fast.ledger.settle(sampled, all_prepaid_sampled=complete)
        slow.ledger.settle(sampled, all_prepaid_sampled=complete)
        # Every lane here holds a resident request (keys leave only through
        # forget()), so the resident order is the whole service order.
        assert list(fast.lanes.resident()) == list(slow.lanes.resident())
        assert observe(fast_lim, users, now) == observe(slow_lim, users, now)


# ---------------------------------------------------------------------------
# Randomized protocol test against a model
# ---------------------------------------------------------------------------


class Model:
    """Independent bookkeeping of what the gate must hold.

    Orders are checked through "stamps" from one event counter: a decoding
    stream is stamped when it joins its lane's decoding streams or is served;
    a user when its lane is created or it is served.  The gate's orders must
    be sorted by stamp (ties, i.e. things served in the same step, in any
    order).  Once checked, the gate's own order is adopted, so the expected
    plan can be computed exactly.
    """

    def __init__(self):
        self.user_of: dict[str, str] = {}
        self.where: dict[str, str] = {}  # resident key -> user
        self.pro: dict[str, list] = {}  # user -> prefills in admission order
        self.dec: dict[str, list] = {}  # user -> decoding streams (gate order)
        self.order: list[str] = []  # users with a lane (gate order)
        self.key_stamp: dict[str, int] = {}
        self.user_stamp: dict[str, int] = {}
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def admit(self, key, progressing):
        user = self.user_of[key]
        if user not in self.user_stamp:
            self.user_stamp[user] = self.tick()
            self.order.append(user)
            self.pro[user], self.dec[user] = [], []
        self.where[key] = user
        if progressing:
            self.pro[user].append(key)
        else:
            self.dec[user].append(key)
            self.key_stamp[key] = self.tick()

    def release(self, key):
        user = self.where.pop(key, None)
        if user is None:
            return
        if key in self.pro[user]:
            self.pro[user].remove(key)
        else:
            self.dec[user].remove(key)
        self.drop_lane_if_gone(user)

    def drop_lane_if_gone(self, user):
        """A lane lives while its user has resident requests or any request
        at all: a user whose requests went back to waiting keeps its place."""
        if user not in self.user_stamp or self.pro[user] or self.dec[user]:
            return
        if any(u == user for u in self.user_of.values()):
            return
        del self.pro[user], self.dec[user], self.user_stamp[user]
        self.order.remove(user)

    def set_progressing(self, key, progressing):
        user = self.where.get(key)
        if user is None:
            return
        if progressing and key in self.dec[user]:
            self.dec[user].remove(key)
            self.pro[user].append(key)
        elif not progressing and key in self.pro[user]:
            self.pro[user].remove(key)
            self.dec[user].append(key)
            self.key_stamp[key] = self.tick()

    def plan(self, slots, avail):
        visible, prefills, prepaid, throttled, hidden_dec = [], [], set(), [], {}
        room = max(slots, 0)
        for user in self.order:
            if room <= 0:
                break
            pro = self.pro[user][:room]
            visible += pro
            prefills += pro
            room -= len(pro)
            dec = self.dec[user]
            if not dec:
                continue
            n = min(len(dec), room, avail[user])
            visible += dec[:n]
            prepaid.update(dec[:n])
            hidden_dec[user] = list(dec[n:])
            room -= n
            if avail[user] < len(dec):
                throttled.append(user)
        return visible, prefills, prepaid, throttled, hidden_dec

    def served(self, offers, charged, sampled, all_prepaid_sampled, user_of):
        """Stamp what was served at the end of a step, and move served users.

        A served user moves behind the others (if it still has a lane): first
        the users whose prepaid streams sampled (all of them, under the
        caller's all-sampled promise), in plan order, then the user of each
        sampled charge, in charge order (moved again each time).  A served
        prepaid stream moves behind its user's other streams.  (A charged,
        non-prepaid request was just admitted or just finished its prefill:
        it already joined the back of its user's streams.)
        """
        stamp = self.tick()
        movers = []
        for user, batch in offers:
            if user not in self.user_stamp:
                continue  # no lane left
            got = [key for key in batch if key in sampled]
            if got or all_prepaid_sampled:
                movers.append(user)
            for key in got:
                if self.where.get(key) == user and key in self.dec[user]:
                    self.key_stamp[key] = stamp
        for key in charged:
            if key in sampled and user_of[key] in self.user_stamp:
                movers.append(user_of[key])
        for user in movers:
            self.order.remove(user)
            self.order.append(user)
            self.user_stamp[user] = stamp

    def adopt(self, gate: StepGate):
        """Check the gate's orders against the stamps, then adopt them."""
        order = list(gate.lanes.resident())
        assert len(order) == len(set(order))
        assert set(order) == set(self.where)
        assert len(gate.lanes.lane_of) == len(self.where)
        users, runs = [], {}
        for key in order:
            user = self.where[key]
            if not users or users[-1] != user:
                assert user not in runs, f"lane of {user} is not contiguous"
                users.append(user)
                runs[user] = []
            runs[user].append(key)
        # The model keeps the service order itself (see served()); the gate
        # shows it through the lanes of resident requests and, for users
        # without one, through where their next admission is planned.
        assert [u for u in self.order if u in runs] == users
        stamps = [self.user_stamp[u] for u in self.order]
        assert stamps == sorted(stamps), "users not in least-recently-served order"
        for user in self.order:
            n_pro = len(self.pro[user])
            run_of_user = runs.get(user, [])
            assert run_of_user[:n_pro] == self.pro[user]
            dec = run_of_user[n_pro:]
            assert sorted(dec) == sorted(self.dec[user])
            ks = [self.key_stamp[k] for k in dec]
            assert ks == sorted(ks), f"streams of {user} not in rotation order"
            self.dec[user] = dec
        for key in self.user_of:
            assert (key in gate.lanes.lane_of) == (key in self.where)
            assert gate.lanes.user_of[key] == self.user_of[key]


USERS = list(RATES) + ["dflt"]
# Users drawn for new requests: biased to those with quota for several streams.
NEW_USERS = ["lots", "lots", "dflt", "dflt", "three", "one", "slow"]


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**64),
    cleanup_every=st.sampled_from([1, 3, CLEANUP_EVERY_STEPS]),
    population=st.integers(0, 30),
    churn=st.sampled_from([0.0, 0.1, 0.3]),
)
def test_random_protocol_keeps_invariants(seed, cleanup_every, population, churn):
    """Random admit/release/plan/charge/finish sequences, checked every step.

    The sequence comes from ``random.Random(seed)`` (uniform choices give
    far busier lanes than Hypothesis's own data would); Hypothesis picks and
    reports the seed and the shape parameters.
    """
    rng = random.Random(seed)
    lim = OutputRateLimiter(50, RATES)
    gate = StepGate(lim, cleanup_every=cleanup_every)
    ref = OutputRateLimiter(50, RATES)  # sees only the tokens that were sampled
    model = Model()
    next_key = 0
    now = rng.randint(0, 10**12)
    ever_user: dict[str, str] = {}  # every key's user, even after forget()

    def coin(p=0.5):
        return rng.random() < p

    def new_key(user):
        nonlocal next_key
        key = f"k{next_key}"
        next_key += 1
        gate.lanes.track(key, user)
        model.user_of[key] = user
        ever_user[key] = user
        return key

    def admit(key, progressing):
        gate.lanes.admit(key, progressing)
        model.admit(key, progressing)

    def set_progressing(key, progressing):
        gate.lanes.set_progressing(key, progressing)
        model.set_progressing(key, progressing)

    def release(key, forget=False):
        if forget:
            gate.lanes.forget(key)
            user = model.user_of.pop(key)
            model.release(key)
            model.drop_lane_if_gone(user)
        else:
            gate.lanes.release(key)
            model.release(key)

    for _ in range(population):
        admit(new_key(rng.choice(NEW_USERS)), rng.random() < 0.3)

    for _ in range(rng.randint(1, 30)):
        # -- between steps: arrivals, admissions, departures ----------------
        for _ in range(rng.randint(0, 4)):
            op = rng.choices(
                ["arrive", "admit", "release", "forget", "flip"],
                [1, 1, churn * 4, churn * 2, 1],
            )[0]
            outside = sorted(k for k in model.user_of if k not in model.where)
            resident = sorted(model.where)
            if op == "arrive" or (op == "admit" and not outside):
                key = new_key(rng.choice(NEW_USERS))
                if coin():
                    admit(key, coin())
            elif op == "admit":
                admit(rng.choice(outside), coin())
            elif op == "release" and resident:
                release(rng.choice(resident))
            elif op == "forget" and model.user_of:
                release(rng.choice(sorted(model.user_of)), forget=True)
            elif op == "flip" and resident:
                set_progressing(rng.choice(resident), coin())
            model.adopt(gate)

        # -- plan ----------------------------------------------------------
        now += rng.choice([0, 1, 10 * MS, 50 * MS, 200 * MS, 3 * S])
        slots = rng.choice([-1, 0, 1, 2, 3, 5, 8, 12, 20, 40])
        avail = {u: lim.available(u, now) for u in USERS}
        plan = gate.plan(now, slots)
        visible = plan.visible
        exp_visible, exp_prefills, exp_prepaid, exp_throttled, exp_hidden = model.plan(
            slots, avail
        )
        assert len(visible) == len(set(visible))
        assert len(visible) <= max(slots, 0)
        assert set(visible) <= set(model.where)
        assert plan.hidden == len(model.where) - len(visible)
        for user in USERS:
            n_dec = sum(1 for k in visible if k in model.dec.get(user, ()))
            assert n_dec <= avail[user]
            # The offered streams are paid for in plan(), nothing more.
            assert lim.available(user, now) == avail[user] - n_dec
        if len(visible) < max(slots, 0):
            # Room to spare: every prefill and all affordable streams shown.
            for user in model.order:
                assert set(model.pro[user]) <= set(visible)
                n_dec = sum(1 for k in visible if k in model.dec[user])
                assert n_dec == min(len(model.dec[user]), avail[user])
        if not plan.over_cap:
            for user in model.order:
                n_dec = sum(1 for k in visible if k in model.dec[user])
                assert n_dec == min(len(model.dec[user]), avail[user])
        assert visible == exp_visible
        assert plan.prefills == exp_prefills
        assert plan.prepaid == exp_prepaid
        assert plan.throttled == bool(exp_throttled)
        out_of_quota = [
            u
            # Users whose quota comes back last first (stable sort).
            for u in sorted(exp_throttled, key=lambda u: -gate.limiter.ready_at_ns(u, gate.ledger.now_ns))
            if avail[u] == len(model.dec[u]) - len(exp_hidden[u])  # all it could pay was offered
        ]
        assert list(throttled_victims(gate.lanes, gate.ledger)) == [
            k for u in out_of_quota for k in exp_hidden[u]
        ]
        model.adopt(gate)

        # -- during the step -------------------------------------------------
        charged: list[tuple[str, str]] = []  # non-prepaid charges, in order
        refused: set[str] = set()
        blocked = set(exp_throttled)
        scheduled_new: list[str] = []  # waiting requests scheduled this step
        left: set[str] = set()  # keys that stopped being resident mid-step
        shifted: set[str] = set()  # users whose offered stream left mid-step
        for _ in range(rng.randint(0, 16)):
            op = rng.choices(
                ["charge", "can", "new", "preempt", "victims", "abort"],
                [6, 1, 1, churn * 3, 1, churn * 2],
            )[0]
            candidates = [k for k in visible if k in model.where] + [
                k for k in scheduled_new if k in model.user_of
            ]
            charged_keys = {k for k, _ in charged}
            if op in ("charge", "can") and candidates:
                key = rng.choice(candidates)
                user = model.user_of[key]
                paid = key in charged_keys or key in exp_prepaid
                before = lim.available(user, now)
                if paid:
                    expected = True
                elif user in refused:
                    expected = False
                else:
                    expected = before > 0
                if op == "charge":
                    assert gate.ledger.charge(key) == expected
                    if expected and not paid:
                        charged.append((key, user))
                        assert lim.available(user, now) == before - 1
                    else:
                        assert lim.available(user, now) == before
                else:
                    assert gate.ledger.charge(key, take=False) == expected
                    assert lim.available(user, now) == before
                if not expected:
                    refused.add(user)
                    blocked.add(user)
            elif op == "new":
                scheduled_new.append(new_key(rng.choice(NEW_USERS)))
            elif op in ("preempt", "abort"):
                pool = sorted(model.where) if op == "preempt" else sorted(model.user_of)
                if pool:
                    key = rng.choice(pool)
                    if key in model.where:
                        left.add(key)
                    if key in exp_prepaid:
                        shifted.add(model.user_of[key])
                    release(key, forget=op == "abort")
            elif op == "victims":
                got = list(throttled_victims(gate.lanes, gate.ledger))
                assert len(got) == len(set(got))
                for key in got:
                    # Only hidden, unpaid, resident streams of throttled users.
                    assert key in model.where
                    assert key not in visible
                    assert key not in charged_keys
                    assert model.where[key] in exp_throttled
                    assert key in model.dec[model.where[key]]
                complete = [
                    k
                    # Users whose quota comes back last first (stable sort).
                    for u in sorted(
                        exp_throttled, key=lambda u: -gate.limiter.ready_at_ns(u, gate.ledger.now_ns)
                    )
                    if u not in shifted and gate.limiter.available(u, gate.ledger.now_ns) == 0
                    for k in exp_hidden[u]
                    if model.where.get(k) == u and k not in charged_keys
                ]
                assert [k for k in got if model.where[k] not in shifted] == complete
            charged_keys = {k for k, _ in charged}
            for key in model.user_of:
                assert gate.ledger.is_charged(key) == (key in charged_keys or key in exp_prepaid)
            for key in charged_keys:
                assert key in visible or key in scheduled_new

        # -- settle membership: scheduled waiting requests become resident ----
        admitted = []
        for key in scheduled_new:
            if key in model.user_of and key not in model.where and coin():
                admit(key, coin())
                admitted.append(key)
        for key in exp_prefills + admitted:
            if key in model.where and coin():
                set_progressing(key, coin())
        model.adopt(gate)

        # -- finish ----------------------------------------------------------
        paid = [k for k, _ in charged] + sorted(exp_prepaid)
        if coin():
            sampled = set(exp_prepaid) | {k for k, _ in charged if coin()}
        else:
            sampled = {k for k in paid if coin()}
        sampled -= left  # a request preempted mid-step did not sample
        noise = {k for k in visible if rng.random() < 0.2}
        sampled |= noise - set(paid)  # scheduled prefill chunks that sample nothing
        n_unsampled = sum(1 for k in paid if k not in sampled)
        promise = not left and exp_prepaid <= sampled
        if promise:
            # The shortcut must settle exactly like the full path.
            other = copy.deepcopy(gate)
            assert other.ledger.settle(sampled, all_prepaid_sampled=False) == n_unsampled
            assert gate.ledger.settle(sampled, all_prepaid_sampled=True) == n_unsampled
            assert list(other.lanes.resident()) == list(gate.lanes.resident())
            assert observe(other.limiter, USERS, now) == observe(lim, USERS, now)
        else:
            assert gate.ledger.settle(sampled) == n_unsampled
        for key in paid:
            if key in sampled:
                assert ref.try_take(ever_user[key], now)
        offers: dict[str, list] = {}  # user -> prepaid keys, in plan order
        for key in visible:
            if key in exp_prepaid:
                offers.setdefault(ever_user[key], []).append(key)
        model.served(offers.items(), [k for k, _ in charged], sampled, promise, ever_user)
        model.adopt(gate)
        for key in model.user_of:
            assert not gate.ledger.is_charged(key)
        # The limiter is exactly as if only the sampled tokens had been taken
        # (and cleanup, at any cadence, changed nothing).
        assert observe(lim, USERS, now) == observe(ref, USERS, now)
        assert observe(lim, USERS, now + 30 * MS) == observe(ref, USERS, now + 30 * MS)

        # -- idle wait -------------------------------------------------------
        wait = gate.idle_wait_ns()
        if not blocked:
            assert wait is None
        else:
            earliest = min(lim.ready_at_ns(u, now) for u in blocked)
            assert wait == min(earliest - now, MAX_IDLE_WAIT_NS)
            assert 0 <= wait <= MAX_IDLE_WAIT_NS


# ---------------------------------------------------------------------------
# waiting requests that take turns (no chunked prefill)
# ---------------------------------------------------------------------------


def test_waiting_request_takes_its_turn_between_resident_streams():
    gate, lim = new_gate()
    add(gate, "one", "r1")  # "one": 5 tok/s, one token per 200 ms
    gate.lanes.track("w", "one")
    gate.lanes.wait_in_turn("w")
    assert list(gate.lanes.resident()) == ["r1"]
    # r1 is first in the rotation: served.
    plan = step(gate, 0, 4)
    assert plan.visible == ["r1"] and plan.reserved == 0
    # Next turn is w's: its token is kept for its admission, r1 waits.
    plan = gate.plan(200 * MS, 4)
    assert plan.visible == [] and plan.reserved == 1
    assert gate.ledger.is_charged("w") and gate.ledger.charge("w", take=False)
    gate.lanes.admit("w", False)
    gate.ledger.settle({"w"})
    assert lim.available("one", 200 * MS) == 0
    # Both resident now, rotation continues with r1.
    assert gate.plan(400 * MS, 4).visible == ["r1"]
    gate.ledger.settle({"r1"})


def test_waiting_request_not_admitted_gets_its_token_back_and_passes_its_turn():
    # Without KV for it, a waiting request that kept its turn would take its
    # user's token in every step while the resident stream that holds the KV
    # it waits for never ran: the user stalled and the engine spun.
    gate, lim = new_gate()
    add(gate, "one", "r1")
    gate.lanes.track("w", "one")
    gate.lanes.wait_in_turn("w")
    step(gate, 0, 4)
    plan = gate.plan(200 * MS, 4)
    assert plan.reserved == 1
    assert gate.ledger.settle(set()) == 1  # w was not admitted (e.g. no KV): refunded
    assert lim.available("one", 200 * MS) == 1
    # At the same instant the resident stream has the turn, and the token.
    plan = gate.plan(200 * MS, 4)
    assert plan.reserved == 0 and plan.visible == ["r1"]
    gate.ledger.settle({"r1"})
    # No token is kept for w while nothing has left (no room came)...
    plan = gate.plan(400 * MS, 4)
    assert plan.reserved == 0 and plan.visible == ["r1"]
    gate.ledger.settle({"r1"})
    # ...and once a request has left, w's turn comes again.
    gate.lanes.forget("r1")
    plan = gate.plan(600 * MS, 4)
    assert plan.reserved == 1 and plan.visible == []
    gate.ledger.settle(set())


def test_a_user_whose_waiting_requests_find_no_room_sleeps_until_the_users_holding_it_can_run():
    # "one" has only waiting requests and the token to admit one; "lots"
    # holds the KV and waits for quota.  The admission fails for room: "one"
    # is blocked with quota in hand, and an idle wait of 0 would repeat the
    # same refused admission until "lots" can run.
    gate, lim = new_gate(max_idle_wait_ns=S)
    now = 10 * S
    add(gate, "three", "t1")  # 20 tok/s: the holder of the KV
    assert lim.try_take("three", now, 3)  # drained: ready at now + 50 ms
    for key in ("w1", "w2"):
        gate.lanes.track(key, "one")
        gate.lanes.wait_in_turn(key)
    plan = gate.plan(now, 4)
    assert plan.reserved == 1 and plan.visible == []
    gate.ledger.settle(set())  # not admitted: no KV
    assert gate.ledger.blocked == {"one", "three"}
    assert lim.ready_at_ns("one", now) == now  # its token came back
    assert gate.idle_wait_ns() == 50 * MS
    # Alone (the holder gone), nothing it knows of frees room: the cap.
    gate.lanes.forget("t1")
    gate.plan(now, 4)
    gate.ledger.settle(set())
    assert gate.ledger.blocked == {"one"}
    assert gate.idle_wait_ns() == S


def test_a_user_whose_waiting_request_finds_no_room_runs_its_resident_stream_at_once():
    gate, lim = new_gate()
    add(gate, "one", "r1")
    gate.lanes.track("w", "one")
    gate.lanes.wait_in_turn("w")
    step(gate, 0, 4)  # r1 served: w's turn next
    plan = gate.plan(200 * MS, 4)
    assert plan.reserved == 1
    gate.ledger.settle(set())
    assert gate.idle_wait_ns() == 0  # r1 can use the token now
    assert gate.plan(200 * MS, 4).visible == ["r1"]


def test_waiting_request_without_room_to_get_in_does_not_hold_up_streams():
    gate, _ = new_gate()
    add(gate, "one", "r1", "r2")
    gate.lanes.track("w", "one")
    gate.lanes.wait_in_turn("w")
    step(gate, 0, 2)  # r1 (burst allows one token)
    # Two slots, both taken by resident requests: w cannot get in, so the
    # rotation passes over it to r2.
    plan = gate.plan(200 * MS, 2)
    assert plan.visible == ["r2"] and plan.reserved == 0
    gate.ledger.settle({"r2"})
    gate.lanes.forget("w")
    assert list(gate.lanes.resident()) == ["r1", "r2"]


def test_a_group_member_held_for_its_prompt_is_kept_no_token_for_admissions():
    """Without chunked prefill, a token kept for the admission of a member
    whose prompt must wait for another member's turn would be refused, and
    would have taken the group's quota from the member whose turn it is."""
    from vllm_output_rate.policy.prompt_cost import PromptCost

    gate, lim = new_gate()
    prompt = PromptCost(gate.ledger, 1)
    prompt.group_of = lambda user: "g" if user in ("one", "three") else None
    gate.prompt_cost = prompt
    for key, user in (("w1", "one"), ("w3", "three")):
        gate.lanes.track(key, user)
        gate.lanes.wait_in_turn(key)
    now = 10 * S
    # "three" started waiting first: its turn.
    prompt._waiting["g"] = {"three": (now - 1, now), "one": (now, now)}
    plan = gate.plan(now, 4)
    assert plan.reserved == 1
    assert gate.ledger.offers == [("three", ["w3"])]  # "one" waits its turn: no token kept
