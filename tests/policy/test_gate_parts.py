"""Each part of the gate on its own: lanes, ledger, planner, victim choice.

:mod:`tests.test_gate` drives the whole :class:`StepGate`; here every part is
built alone (a :class:`Lanes`, a :class:`Ledger` over a real limiter, the
planner function over both, the victim function) and its documented
invariants are checked, mostly on random operation sequences.  Time is a
plain integer; keys are strings.
"""

from __future__ import annotations

import random
from collections import deque
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_output_rate.policy.gate import StepGate
from vllm_output_rate.policy.lanes import Lane, Lanes
from vllm_output_rate.policy.ledger import Ledger
from vllm_output_rate.policy.plan import plan_step
from vllm_output_rate.policy.step import SampledView
from vllm_output_rate.policy.victims import throttled_victims
from vllm_output_rate.policy.limiter import OutputRateLimiter

MS = 1_000_000
S = 1_000_000_000

# With the default 100 ms burst, tokens available to an idle user:
#   "one" 5 tok/s -> 1, "three" 20 tok/s -> 3, "lots" 1000 tok/s -> 101, "slow" 0.5 tok/s -> 1
RATES = {"one": 5, "three": 20, "lots": 1000, "slow": 0.5}
USERS = ["one", "three", "lots", "slow"]


class CountingLimiter(OutputRateLimiter):
    """A real limiter that counts the takes it is asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: list[tuple[str, str, int]] = []  # (method, user, count)

    def try_take(self, user, now_ns, count=1):
        self.asked.append(("try_take", user, count))
        return super().try_take(user, now_ns, count)

    def take_up_to(self, user, now_ns, count):
        self.asked.append(("take_up_to", user, count))
        return super().take_up_to(user, now_ns, count)


def parts(default=1000):
    lim = CountingLimiter(default, RATES)
    lanes = Lanes()
    return lanes, Ledger(lim, lanes), lim


def admit(lanes: Lanes, user: str, *keys: str, progressing: bool = False) -> None:
    for key in keys:
        lanes.track(key, user)
        lanes.admit(key, progressing)


# ---------------------------------------------------------------------------
# Lanes: membership, service order, rotation
# ---------------------------------------------------------------------------


def check_lanes(lanes: Lanes) -> None:
    """Every invariant in the Lanes docstring that can be read off its state."""
    seen: set = set()
    for user, lane in lanes.order.items():
        for key in lane.progressing:
            assert lanes.lane_of[key] == user and key not in lanes.in_turn
        waiting = [key for key in lane.decoding if key in lanes.in_turn]
        assert lane.waiting == len(waiting)
        for key in lane.decoding:
            assert lanes.user_of[key] == user
            if key not in lanes.in_turn:
                assert lanes.lane_of[key] == user
        keys = list(lane.progressing) + list(lane.decoding)
        assert not seen & set(keys), "a key in two places"
        seen.update(keys)
        assert len(lane) == len(keys) - len(waiting) == lanes.resident_count(user)
    assert set(lanes.lane_of) | lanes.in_turn == seen
    assert not set(lanes.lane_of) & lanes.in_turn
    assert sorted(lanes.resident()) == sorted(lanes.lane_of)


def snapshot(lanes: Lanes):
    """What the version number must follow."""
    return (
        dict(lanes.lane_of),
        {key for lane in lanes.order.values() for key in lane.progressing},
        frozenset(lanes.in_turn),
    )


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_lanes_random_operations_keep_their_invariants(seed):
    rng = random.Random(seed)
    lanes = Lanes()
    tracked: dict[str, str] = {}  # model: key -> user
    ever_admitted: set[str] = set()  # users admitted or in turn since last fully forgotten
    admitted_seq: dict[str, int] = {}
    counter = 0
    for i in range(rng.randint(1, 120)):
        op = rng.choice(["track", "admit", "admit", "release", "forget", "flip", "turn", "noop"])
        key = rng.choice([f"k{j}" for j in range(12)])
        before = snapshot(lanes)
        version = lanes.version
        if op == "track":
            if key not in tracked:
                tracked[key] = rng.choice(USERS)
                lanes.track(key, tracked[key])
        elif op == "admit" and key in tracked and key not in lanes.lane_of:
            lanes.admit(key, rng.random() < 0.4)
            ever_admitted.add(tracked[key])
            counter += 1
            admitted_seq[key] = counter
        elif op == "release":
            lanes.release(key)
            admitted_seq.pop(key, None)
        elif op == "forget":
            lanes.forget(key)
            admitted_seq.pop(key, None)
            user = tracked.pop(key, None)
            if user is not None and user not in tracked.values():
                ever_admitted.discard(user)
        elif op == "flip":
            lanes.set_progressing(key, rng.random() < 0.5)
        elif op == "turn" and key in tracked:
            lanes.wait_in_turn(key)
            if key not in lanes.lane_of:
                ever_admitted.add(tracked[key])
        check_lanes(lanes)
        # A lane lives while its user was admitted (or waited in turn) and
        # still has a tracked request.
        assert set(lanes.order) == ever_admitted
        assert lanes.user_of == tracked
        changed = snapshot(lanes) != before
        assert (lanes.version != version) == changed, op
    keys = list(lanes.lane_of)
    rng.shuffle(keys)
    lanes.in_admission_order(keys)
    assert keys == sorted(keys, key=admitted_seq.__getitem__)


def test_new_user_joins_the_service_order_at_the_back_and_keeps_its_place():
    lanes = Lanes()
    admit(lanes, "a", "a1")
    admit(lanes, "b", "b1")
    lanes.order.move_to_end("a")  # a was served
    assert list(lanes.order) == ["b", "a"]
    lanes.release("b1")  # b's only request is preempted: b keeps its place
    assert list(lanes.order) == ["b", "a"] and lanes.resident_count("b") == 0
    lanes.admit("b1", False)
    assert list(lanes.order) == ["b", "a"]
    lanes.forget("b1")  # gone for good: the lane goes too
    assert list(lanes.order) == ["a"]
    admit(lanes, "b", "b2")  # comes back as a newcomer, at the back
    assert list(lanes.order) == ["a", "b"]


def test_streams_join_the_back_of_the_rotation_and_prefills_keep_admission_order():
    lanes = Lanes()
    admit(lanes, "u", "d1", "d2")
    admit(lanes, "u", "p1", "p2", progressing=True)
    lane = lanes.order["u"]
    assert list(lane.progressing) == ["p1", "p2"] and list(lane.decoding) == ["d1", "d2"]
    lanes.set_progressing("p2", False)  # done prefilling: joins the back
    lanes.set_progressing("d1", True)
    assert list(lane.progressing) == ["p1", "d1"] and list(lane.decoding) == ["d2", "p2"]
    assert list(lanes.resident()) == ["p1", "d1", "d2", "p2"]


def test_in_turn_request_keeps_its_place_when_admitted():
    lanes = Lanes()
    admit(lanes, "u", "r1")
    lanes.track("w", "u")
    lanes.wait_in_turn("w")
    admit(lanes, "u", "r2")
    lane = lanes.order["u"]
    assert list(lane.decoding) == ["r1", "w", "r2"] and lane.waiting == 1
    assert list(lanes.resident()) == ["r1", "r2"] and len(lane) == 2
    lanes.wait_in_turn("w")  # already there: nothing changes
    assert list(lane.decoding) == ["r1", "w", "r2"]
    lanes.admit("w", False)
    assert list(lane.decoding) == ["r1", "w", "r2"] and lane.waiting == 0
    assert list(lanes.resident()) == ["r1", "w", "r2"]
    lanes.track("x", "u")
    lanes.wait_in_turn("x")
    lanes.admit("x", True)  # admitted as a prefill: leaves the rotation
    assert list(lane.decoding) == ["r1", "w", "r2"] and list(lane.progressing) == ["x"]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 8),
    offered=st.integers(0, 8),
    served=st.sets(st.integers(0, 9)),
    gone=st.sets(st.integers(0, 7)),
)
def test_rotate_front_moves_exactly_the_served_offered_keys_to_the_back(n, offered, served, gone):
    keys = [f"k{i}" for i in range(n)]
    batch = keys[:offered]
    lane = Lane(decoding=deque(k for i, k in enumerate(keys) if i not in gone))
    start = list(lane.decoding)
    served_keys = [f"k{i}" for i in sorted(served)]
    lane.rotate_front(batch, served_keys)
    # Only the first len(batch) keys still there can move; served ones go
    # to the back in their order, everything else keeps its order.
    head = start[: min(len(batch), len(start))]
    moved = [k for k in head if k in served_keys]
    assert list(lane.decoding) == [k for k in start if k not in moved] + moved


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 8),
    offered=st.integers(0, 8),
    whole=st.booleans(),
    picks=st.lists(st.booleans(), min_size=8, max_size=8),
    others=st.sets(st.integers(0, 9), max_size=3),
    gone=st.sets(st.integers(0, 7), max_size=2),
)
def test_rotate_front_when_every_offered_key_or_as_many_keys_were_served(n, offered, whole, picks, others, gone):
    """The settle's cases: the whole offer served (a plain rotation when no key
    left), or a part of it; and served lists as long as the offer that hold
    keys outside it, which must not be taken for the whole offer."""
    keys = [f"k{i}" for i in range(n)]
    batch = keys[:offered]
    if whole:
        served_keys = list(batch)
    else:
        served_keys = [k for k, pick in zip(batch, picks) if pick]
        served_keys += [f"k{i}" for i in sorted(others) if f"k{i}" not in batch][: len(batch) - len(served_keys)]
    lane = Lane(decoding=deque(k for i, k in enumerate(keys) if i not in gone))
    start = list(lane.decoding)
    lane.rotate_front(batch, served_keys)
    head = start[: min(len(batch), len(start))]
    moved = [k for k in head if k in served_keys]
    assert list(lane.decoding) == [k for k in start if k not in moved] + moved


def test_served_to_back_keeps_both_groups_in_order():
    lane = Lane(decoding=deque(["a", "w", "b", "c", "d"]), waiting=1)
    lane.served_to_back({"d", "a"})
    assert list(lane.decoding) == ["w", "b", "c", "a", "d"]
    assert lane.waiting == 1


# ---------------------------------------------------------------------------
# Ledger: payments, refusals, refunds, blocked time
# ---------------------------------------------------------------------------


def test_a_key_is_charged_at_most_once_per_step():
    lanes, ledger, lim = parts()
    lanes.track("p", "three")
    ledger.open(0, False)
    assert ledger.charge("p") and ledger.charge("p") and ledger.charge("p", take=False)
    assert lim.asked == [("try_take", "three", 1)]
    assert lim.available("three", 0) == 2
    assert ledger.charged == {"p": "three"}
    ledger.open(0, False)  # a new step: charged again
    assert not ledger.is_charged("p")
    assert ledger.charge("p")
    assert lim.available("three", 0) == 1


def test_a_refused_user_is_not_asked_again_and_is_blocked():
    lanes, ledger, lim = parts()
    for key in ("a", "b", "c"):
        lanes.track(key, "one")
    lanes.track("x", "three")
    ledger.open(0, False)
    assert ledger.charge("a") and not ledger.charge("b")
    lim.refund("one", 0)  # quota comes back mid-step: still refused
    assert not ledger.charge("c") and not ledger.charge("c", take=False)
    assert ledger.quota_now("one") == 0
    assert [u for _, u, _ in lim.asked] == ["one", "one"]
    assert ledger.refused == ledger.blocked == {"one"}
    assert ledger.charge("x")  # others are unaffected
    ledger.open(10 * MS, False)  # next step asks again
    assert ledger.refused == set() and ledger.charge("b")


def test_asking_takes_nothing_and_agrees_with_charging():
    lanes, ledger, lim = parts()
    lanes.track("a", "one")
    lanes.track("b", "one")
    ledger.open(0, False)
    assert ledger.charge("a", take=False) and ledger.charge("b", take=False)
    assert lim.asked == [] and lim.available("one", 0) == 1
    assert ledger.charge("a")
    assert not ledger.charge("b", take=False) and not ledger.charge("b")


def test_prepaid_keys_pass_for_free_until_the_next_step():
    lanes, ledger, lim = parts()
    admit(lanes, "lots", "l1", "l2")
    ledger.open(0, False)
    ledger.prepay("lots", ["l1"])
    assert ledger.is_charged("l1") and ledger.charge("l1") and not ledger.is_charged("l2")
    assert lim.asked == []
    assert ledger.offers == [("lots", ["l1"])]
    assert ledger.settle({"l1"}) == 0
    assert not ledger.is_charged("l1") and ledger.offers == []


def test_a_repeated_step_pays_for_every_resident_key_and_nothing_else():
    lanes, ledger, lim = parts()
    admit(lanes, "lots", "l1", "l2")
    lanes.track("w", "lots")  # waiting, not resident
    ledger.open(0, True)
    assert ledger.is_charged("l1") and ledger.is_charged("l2")
    assert ledger.is_served_now("w")  # its user's streams were paid for
    assert not ledger.is_charged("w")
    assert ledger.charge("w") and ledger.charged == {"w": "lots"}
    assert ledger.settle_repeat(["l1", "l2"], {"l1", "l2", "w"}, all_sampled=True) == 0
    assert not ledger.is_charged("l1") and not ledger.is_served_now("w")


def test_is_served_now_follows_the_plans_offers():
    lanes, ledger, _ = parts()
    admit(lanes, "lots", "l1")
    admit(lanes, "one", "o1")
    lanes.track("w", "one")
    ledger.open(0, False)
    ledger.prepay("lots", ["l1"])
    assert ledger.is_served_now("l1") and not ledger.is_served_now("w")


def test_blocked_time_is_counted_when_the_next_step_opens():
    lanes, ledger, lim = parts()
    lanes.track("a", "one")
    ledger.open(5 * S, False)
    ledger.prepay("slow", [], short=True)
    assert lim.try_take("one", 5 * S)
    assert not ledger.charge("a")
    assert ledger.short == ["slow"] and ledger.blocked == {"slow", "one"}
    assert ledger.throttled_ns == {}
    ledger.open(5 * S + 30 * MS, False)
    assert ledger.throttled_ns == {"slow": 30 * MS, "one": 30 * MS}
    assert ledger.short == [] and ledger.blocked == set()
    ledger.open(5 * S + 90 * MS, False)  # nobody blocked in between
    assert ledger.throttled_ns == {"slow": 30 * MS, "one": 30 * MS}


@pytest.mark.parametrize("cap_ns, wait_ns", [(S, 50 * MS), (20 * MS, 20 * MS)])
def test_idle_wait_is_the_earliest_blocked_users_ready_time_capped(cap_ns, wait_ns):
    lim = CountingLimiter(1000, RATES)
    gate = StepGate(lim, max_idle_wait_ns=cap_ns)
    ledger = gate.ledger
    ledger.open(0, False)
    assert gate.idle_wait_ns() is None and gate.idle_steps == 0
    assert lim.try_take("one", 0) and lim.try_take("three", 0, 3)
    ledger.prepay("one", [], short=True)  # ready at 100 ms
    ledger.prepay("three", [], short=True)  # ready at 50 ms
    assert gate.idle_wait_ns() == wait_ns
    assert gate.idle_steps == 1


def test_settle_keeps_exactly_the_sampled_tokens():
    lanes, ledger, lim = parts()
    ref = OutputRateLimiter(1000, RATES)
    for key in ("a", "b", "c"):
        lanes.track(key, "lots")
    lanes.track("o", "one")
    ledger.open(S, False)
    for key in ("a", "b", "c"):
        assert ledger.charge(key)
    assert ledger.settle({"a"}) == 2  # b and c did not sample
    assert ref.try_take("lots", S)
    for t in (S, S + MS, S + 2 * S):
        assert lim.available("lots", t) == ref.available("lots", t)
        assert lim.ready_at_ns("lots", t) == ref.ready_at_ns("lots", t)
    assert ledger.charged_tokens == {"lots": 1} and ledger.ran == {"lots": 1}
    ledger.open(2 * S, False)
    for key in ("a", "b", "c", "o"):
        assert ledger.charge(key)
    assert ledger.settle({"a", "b", "c", "o"}) == 0
    assert ledger.charged_tokens == {"lots": 4, "one": 1}  # cumulative
    assert ledger.ran == {"lots": 3, "one": 1}  # the last step only


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.tuples(st.booleans(), st.booleans()), max_size=12),
    order=st.randoms(use_true_random=False),
)
def test_a_sampled_view_selects_in_order_exactly_the_requests_it_contains(requests, order):
    """The settle asks a step's view once per user's batch (``select``); the
    answer is the per-key ``in`` the view defines, in the batch's order."""
    reqs = [SimpleNamespace(request_id=f"r{i}", is_prefill_chunk=chunk) for i, (_, chunk) in enumerate(requests)]
    scheduled = {r.request_id: 1 for r, (is_scheduled, _) in zip(reqs, requests) if is_scheduled}
    view = SampledView(scheduled)
    batch = list(reqs)
    order.shuffle(batch)
    assert view.select(batch) == [r for r in batch if r in view]
    assert view.select(batch) == [r for r in batch if r.request_id in scheduled and not r.is_prefill_chunk]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_ledger_takes_one_token_per_first_charge_and_only_then(seed):
    """Random charge / ask (take=False) / prepay sequences over several steps: the
    limiter moves exactly as a reference that takes once per first charge."""
    rng = random.Random(seed)
    lanes, ledger, lim = parts(default=50)
    ref = OutputRateLimiter(50, RATES)
    keys = [f"k{i}" for i in range(10)]
    for key in keys:
        lanes.track(key, rng.choice(USERS + ["dflt"]))
    now = 0
    for _ in range(rng.randint(1, 8)):
        now += rng.choice([0, MS, 50 * MS, S])
        ledger.open(now, False)
        paid: set = set()
        refused: set = set()
        for key in rng.sample(keys, 3):
            user = lanes.user_of[key]
            if lim.take_up_to(user, now, 1):
                ref.try_take(user, now)
                ledger.prepay(user, [key])
                paid.add(key)
        for _ in range(rng.randint(0, 15)):
            key = rng.choice(keys)
            user = lanes.user_of[key]
            expected = key in paid or (user not in refused and ref.available(user, now) > 0)
            if rng.random() < 0.3:
                assert ledger.charge(key, take=False) == expected
            else:
                assert ledger.charge(key) == expected
                if expected and key not in paid:
                    assert ref.try_take(user, now)
                    paid.add(key)
            if not expected:
                refused.add(user)
            assert ledger.is_charged(key) == (key in paid)
            assert lim.available(user, now) == ref.available(user, now)
        assert ledger.refused == refused
        assert refused <= ledger.blocked
        assert ledger.settle(paid) == 0


# ---------------------------------------------------------------------------
# plan_step: which resident requests are shown
# ---------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**32), slots=st.integers(-1, 14))
def test_plan_step_invariants(seed, slots):
    rng = random.Random(seed)
    lanes, ledger, lim = parts(default=3)
    n = 0
    for _ in range(rng.randint(0, 20)):
        user = rng.choice(USERS + ["dflt"])
        admit(lanes, user, f"k{n}", progressing=rng.random() < 0.25)
        n += 1
    now = rng.randint(0, 10) * 50 * MS
    for user in USERS:  # spend some quota beforehand
        lim.take_up_to(user, now, rng.randint(0, 2))
    lim.asked.clear()
    quota = {user: lim.available(user, now) for user in lanes.order}
    ledger.open(now, False)
    plan = plan_step(lanes, ledger, slots)
    visible = plan.visible
    room = max(slots, 0)
    assert len(visible) == len(set(visible)) <= room
    assert set(visible) <= set(lanes.lane_of)
    assert plan.hidden == len(lanes.lane_of) - len(visible)
    assert set(plan.prefills) == {k for k in visible if k not in plan.prepaid}
    assert plan.prepaid == ledger.prepaid == {k for _, batch in ledger.offers for k in batch}
    assert [k for _, batch in ledger.offers for k in batch] == [k for k in visible if k in plan.prepaid]
    # At most one take per user, and it paid for exactly that user's offer.
    takers = [user for method, user, _ in lim.asked if method == "take_up_to"]
    assert len(takers) == len(set(takers))
    assert all(method == "take_up_to" for method, _, _ in lim.asked)
    left = room
    short = []
    for user, lane in lanes.order.items():
        if left <= 0:
            assert not any(lanes.user_of[k] == user for k in visible)
            continue
        mine = [k for k in visible if lanes.user_of[k] == user]
        pro = list(lane.progressing)[:left]
        assert mine[: len(pro)] == pro  # prefills first, in admission order
        left -= len(pro)
        streams = list(lane.decoding)
        count = min(len(streams), quota[user], left)
        assert mine[len(pro):] == streams[:count]  # the front of the rotation
        assert lim.available(user, now) == quota[user] - count
        left -= count
        if streams and quota[user] < len(streams):
            short.append(user)
    assert ledger.short == short
    assert plan.throttled == bool(short)
    assert ledger.blocked == set(short)


def test_plan_step_over_cap_only_when_room_hid_something_runnable():
    lanes, ledger, _ = parts()
    admit(lanes, "one", "o1", "o2")  # one token: o2 waits for quota
    ledger.open(0, False)
    plan = plan_step(lanes, ledger, 5)
    assert plan.visible == ["o1"] and plan.throttled and not plan.over_cap
    lanes2, ledger2, _ = parts()
    admit(lanes2, "lots", "l1", "l2")
    ledger2.open(0, False)
    plan = plan_step(lanes2, ledger2, 1)
    assert plan.visible == ["l1"] and plan.over_cap and not plan.throttled


def test_plan_step_keeps_out_of_sight_a_prefill_prompt_cost_will_refuse():
    lanes, ledger, _ = parts()
    admit(lanes, "one", "p1", "p2", progressing=True)  # two prefills of a user with one token
    admit(lanes, "lots", "l1", "l2")
    ledger.open(0, False)
    asked = []

    def refused(user, key, decoding):
        asked.append((user, key, decoding))
        return key == "p1"

    plan = plan_step(lanes, ledger, 3, prefill_refused=refused)
    # p1 gives its visible slot to a stream that can run; its user is blocked, not refused.
    assert plan.visible == ["p2", "l1", "l2"] and plan.prefills == ["p2"]
    assert plan.hidden == 1 and not plan.over_cap
    assert ledger.blocked == {"one"} and not ledger.refused
    assert asked == [("one", "p1", 0), ("one", "p2", 0)]
    # Without the question every prefill is shown, and room hides l2.
    lanes2, ledger2, _ = parts()
    admit(lanes2, "one", "p1", "p2", progressing=True)
    admit(lanes2, "lots", "l1", "l2")
    ledger2.open(0, False)
    plan = plan_step(lanes2, ledger2, 3)
    assert plan.visible == ["p1", "p2", "l1"] and plan.over_cap


def test_plan_step_reserves_quota_for_an_in_turn_request_that_can_get_in():
    lanes, ledger, lim = parts()
    admit(lanes, "three", "r1")
    lanes.track("w", "three")
    lanes.wait_in_turn("w")
    admit(lanes, "three", "r2")
    ledger.open(0, False)
    plan = plan_step(lanes, ledger, 4)
    assert plan.visible == ["r1", "r2"] and plan.reserved == 1
    assert ledger.is_charged("w") and lim.available("three", 0) == 0
    # No room to admit: the rotation passes over w, and nothing is kept for it.
    lanes2, ledger2, lim2 = parts()
    admit(lanes2, "three", "r1")
    lanes2.track("w", "three")
    lanes2.wait_in_turn("w")
    admit(lanes2, "three", "r2")
    ledger2.open(0, False)
    plan = plan_step(lanes2, ledger2, 2)
    assert plan.visible == ["r1", "r2"] and plan.reserved == 0
    assert not ledger2.is_charged("w") and lim2.available("three", 0) == 1


# ---------------------------------------------------------------------------
# throttled_victims
# ---------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32), slots=st.integers(0, 12))
def test_victims_are_unpaid_hidden_streams_of_users_out_of_quota(seed, slots):
    rng = random.Random(seed)
    lanes, ledger, lim = parts(default=2)
    for i in range(rng.randint(0, 20)):
        admit(lanes, rng.choice(USERS + ["dflt"]), f"k{i}", progressing=rng.random() < 0.2)
    now = rng.randint(0, 10) * 50 * MS
    for user in USERS:
        lim.take_up_to(user, now, rng.randint(0, 2))
    ledger.open(now, False)
    plan_step(lanes, ledger, slots)
    victims = list(throttled_victims(lanes, ledger))
    assert len(victims) == len(set(victims))
    users = [lanes.user_of[k] for k in victims]
    for key, user in zip(victims, users):
        assert key in lanes.order[user].decoding and lanes.lane_of[key] == user
        assert not ledger.is_charged(key)
        assert user in ledger.short and lim.available(user, now) == 0
    # Every unpaid stream of such a user is listed, users contiguous, the
    # user whose quota returns last first, streams in rotation order.
    expected_users = [
        u for u in sorted(ledger.short, key=lambda u: -lim.ready_at_ns(u, now))
        if lim.available(u, now) == 0
    ]
    assert victims == [
        k for u in expected_users for k in lanes.order[u].decoding if not ledger.is_charged(k)
    ]


def test_victims_skip_a_user_who_can_pay_and_a_released_key():
    lanes, ledger, lim = parts()
    admit(lanes, "three", "t0", "t1", "t2", "t3")  # 3 tokens for 4 streams
    ledger.open(0, False)
    plan_step(lanes, ledger, 2)  # room for two: one token left over
    assert list(throttled_victims(lanes, ledger)) == []  # waiting for room, not quota
    lanes.track("w", "three")
    assert ledger.charge("w")  # the last token
    victims = throttled_victims(lanes, ledger)
    assert next(victims) == "t2"
    lanes.release("t3")  # preempted while the caller iterates
    assert list(victims) == []


@pytest.mark.parametrize("one_rate, first", [(5, "slow"), (0.1, "one")])
def test_victims_come_from_the_user_whose_quota_returns_last(one_rate, first):
    lim = OutputRateLimiter(1000, {**RATES, "one": one_rate})
    lanes = Lanes()
    ledger = Ledger(lim, lanes)
    admit(lanes, "one", "o1", "o2")
    admit(lanes, "slow", "s1", "s2")
    assert lim.try_take("one", 0) and lim.try_take("slow", 0)
    ledger.open(0, False)
    plan_step(lanes, ledger, 10)
    # "slow" (0.5 tok/s) is ready at 1.9 s; "one" at 0.1 s (5 tok/s) or 9.9 s.
    victims = list(throttled_victims(lanes, ledger))
    assert victims == (["o1", "o2", "s1", "s2"] if first == "one" else ["s1", "s2", "o1", "o2"])


def test_a_repeated_step_with_an_admission_counts_every_kept_payment():
    lanes, ledger, lim = parts()
    admit(lanes, "lots", "l1", "l2")
    lanes.track("w", "one")
    ledger.open(0, True)  # a repeated step: l1 and l2 paid for
    assert lim.take_up_to("lots", 0, 2) == 2
    assert ledger.charge("w")
    lanes.admit("w", False)  # admitted and sampled in the step
    order_before = [list(lane.decoding) for lane in lanes.order.values()]
    assert ledger.settle_repeat(["l1", "l2"], {"l1", "l2", "w"}, all_sampled=True) == 0
    assert ledger.ran == {"lots": 2, "one": 1}
    assert ledger.charged_tokens == {"lots": 2, "one": 1}
    assert [list(lane.decoding) for lane in lanes.order.values()] == order_before
    assert not ledger.all_prepaid_kept  # a charge besides: plan the next step
