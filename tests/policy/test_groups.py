"""Groups (:mod:`vllm_output_rate.policy.groups`) over the plain-Python gate.

The quotas are built by the factory from settings, as the scheduler builds
them (in memory); a step follows the adapter's protocol: ``plan`` ->
``borrow(plan, room)`` -> the sampled keys -> ``ledger.settle`` ->
``borrowing.settle``.  Time is a fake clock (integers); keys are strings.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gate_harness import MS, S, GateWorld, bound, max_in_window
from vllm_output_rate.factory import make_borrowing, make_group_quotas, make_limiter
from vllm_output_rate.policy.gate import StepGate
from vllm_output_rate.policy.groups import GroupCaps
from vllm_output_rate.policy.quota import payers
from vllm_output_rate.policy.prompt_cost import PromptCost
from vllm_output_rate.settings import OutputRateSettings

def make_settings(default, users, groups) -> OutputRateSettings:
    return OutputRateSettings.from_additional_config({"output_rate": {
        "default_user_output_tokens_per_second": default,
        "user_output_tokens_per_second": users,
        "groups": groups,
    }})


class World(GateWorld):
    """A gate over the factory's quotas for ``settings``, and what sampled when."""

    def __init__(self, settings: OutputRateSettings) -> None:
        self.settings = settings
        self.rate = make_limiter(settings)
        self.groups = make_group_quotas(settings)
        borrowing, limiter = make_borrowing(settings, self.rate, None, self.groups)
        super().__init__(StepGate(limiter), borrowing)

    def reload(self, settings: OutputRateSettings) -> None:
        """New limits, rebuilt as the scheduler rebuilds them on a reload."""
        self.settings = settings
        self.rate.update_rates(settings.default_rate, settings.user_rates)
        self.groups = make_group_quotas(settings, self.groups)
        borrowing, limiter = make_borrowing(settings, self.rate, self.borrowing, self.groups)
        self.gate.ledger.limiter = limiter
        self.gate.borrowing = self.borrowing = borrowing

    def of_group(self, group: str, kind: dict) -> list[int]:
        return [t for user, times in kind.items() if self.settings.group_of(user) == group for t in times]


def test_two_users_are_held_to_their_groups_rate_together_and_alone_to_their_own():
    s = make_settings(100, {"a": {"rate": 20, "group": "g"}, "b": {"rate": 20, "group": "g"},
                            "c": 20}, {"g": 30})
    w = World(s)
    assert w.borrowing is None  # hard caps everywhere: no borrowing
    for user in "abc":
        w.add(user, 4)
    for _ in range(500):
        w.step(16)
    pair = w.of_group("g", w.times)
    for window_s in (0.01, 0.1, 1, 4):
        window = int(window_s * S)
        assert max_in_window(pair, window) <= bound(window_s, 30), window_s
        assert max_in_window(w.times["c"], window) <= bound(window_s, 20)
    assert len(pair) >= 30 * 5 - 1 and len(w.times["c"]) >= 20 * 5 - 1
    assert abs(len(w.times["a"]) - len(w.times["b"])) <= 2  # neither starves
    alone = World(s)
    alone.add("a", 4)
    for _ in range(500):
        alone.step(16)
    assert 20 * 5 - 1 <= len(alone.times["a"]) <= bound(5, 20)


def test_cap_of_each_level():
    s = make_settings(1, {
        "hard": {"rate": 4, "group": "lend"},  # hard cap in a group with a ceiling
        "free": {"rate": 4, "ceil": None, "group": "capped"},  # no ceiling, hard-capped group
        "ceiled": {"rate": 4, "ceil": 8, "group": "lend"},
        "alone": {"rate": 4, "ceil": 8},
    }, {"lend": {"rate": 10, "ceil": 50}, "capped": 10})
    w = World(s)
    cap = w.borrowing.cap
    assert isinstance(cap, GroupCaps)
    levels = {user: list(payers(cap, user)) for user in
              ("hard", "free", "ceiled", "alone")}
    groups = w.groups
    assert levels["hard"] == [(w.rate, "hard"), (groups.ceiling, "lend")]
    assert levels["free"] == [(groups.rate, "capped")]
    assert levels["ceiled"] == [(w.borrowing.ceiling, "ceiled"), (groups.ceiling, "lend")]
    assert levels["alone"] == [(w.borrowing.ceiling, "alone")]
    table = w.borrowing.table
    assert all(table.borrows(u) for u in levels)  # either level may lend
    # A token borrowed by `hard` is paid on its own rate and on lend's ceiling.
    before = (w.rate.available("hard", w.now), groups.ceiling.available("lend", w.now))
    assert cap.take_up_to("hard", w.now, 1) == 1
    after = (w.rate.available("hard", w.now), groups.ceiling.available("lend", w.now))
    assert after == (before[0] - 1, before[1] - 1)
    # The group's rate is untouched (as a group never seen).
    assert groups.rate.available("lend", w.now) == groups.rate.available("capped", w.now)


@settings(max_examples=60, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from(["add", "abort", "drop", "step", "step"])),
        min_size=1, max_size=200,
    ),
    slots=st.integers(1, 12),
)
def test_every_bound_holds_at_both_levels_under_random_arrivals_aborts_and_lost_samples(events, slots):
    users = {
        "a": {"rate": 5, "ceil": None, "group": "g"},
        "b": {"rate": 20, "group": "g"},
        "c": {"rate": 3, "ceil": 12, "weight": 2, "group": "g"},
        "d": {"rate": 2, "ceil": 10},
        "e": 6,
    }
    s = make_settings(1, users, {"g": {"rate": 10, "ceil": 25}})
    w = World(s)
    names = list(users)
    live: dict[str, list[str]] = {n: [] for n in names}
    for index, action in events:
        user = names[index]
        if action == "add":
            live[user] += w.add(user, 3)
        elif action == "abort" and live[user]:
            w.gate.lanes.forget(live[user].pop(0))
        elif action == "drop":
            w.step(slots, drop=frozenset(live[user][:2]))
        else:
            w.step(slots)
    for window_s in (0.05, 0.1, 0.5, 1):
        window = int(window_s * S)
        # The group: every token within its ceiling, guaranteed ones within its rate.
        assert max_in_window(w.of_group("g", w.times), window) <= bound(window_s, 25)
        assert max_in_window(w.of_group("g", w.guaranteed), window) <= bound(window_s, 10)
        for user in names:
            rate, ceil, _ = s.limit_of(user)
            assert max_in_window(w.guaranteed.get(user, []), window) <= bound(window_s, rate)
            if ceil is not None:
                assert max_in_window(w.times.get(user, []), window) <= bound(window_s, ceil)


def _backlogged(users: dict, groups: dict, steps: int, slots: int = 8) -> dict[str, int]:
    w = World(make_settings(0.01, users, groups))
    for user in users:
        w.add(user, 8)
    for _ in range(steps):
        w.step(slots)
    return {u: len(w.times.get(u, [])) for u in users}


def test_spare_capacity_is_shared_by_group_weight_then_by_member_weight():
    free = {"rate": 0.01, "ceil": None}
    users = {
        "x1": {**free, "weight": 1, "group": "x"},
        "x2": {**free, "weight": 3, "group": "x"},
        "y1": {**free, "weight": 1, "group": "y"},
        "y2": {**free, "weight": 1, "group": "y"},
        "y3": {**free, "weight": 1, "group": "y"},
        "z": {**free, "weight": 2},
    }
    groups = {"x": {**free, "weight": 1}, "y": {**free, "weight": 3}}
    got = _backlogged(users, groups, 1000)
    total = sum(got.values())
    x, y = got["x1"] + got["x2"], got["y1"] + got["y2"] + got["y3"]
    # Top level: x : y : z = 1 : 3 : 2 (within one step's worth of slots).
    for share, weight in ((x, 1), (y, 3), (got["z"], 2)):
        assert abs(share - total * weight / 6) <= 8, got
    # Inside x by member weight 1 : 3, inside y evenly.
    assert abs(got["x1"] - x / 4) <= 8 and abs(got["x2"] - 3 * x / 4) <= 8, got
    assert max(got["y1"], got["y2"], got["y3"]) - min(got["y1"], got["y2"], got["y3"]) <= 8


def test_members_held_back_by_their_groups_cap_take_turns():
    """A group at its cap lets one member borrow now and then; the members'
    counters are kept meanwhile, so they take turns (not the first one listed)."""
    free = {"rate": 5, "ceil": None, "group": "g"}
    got = _backlogged({"a": free, "b": free, "c": {"rate": 5, "ceil": None}},
                      {"g": 30}, 600, slots=4)
    assert abs(got["a"] - got["b"]) <= 2, got
    assert got["a"] + got["b"] <= bound(6, 30)


def test_a_group_owes_at_most_one_chunk_of_prompt_cost():
    s = make_settings(100, {"a": {"rate": 100, "group": "g"}, "b": {"rate": 100, "group": "g"}},
                      {"g": 10})
    w = World(s)
    ledger = w.gate.ledger
    prompt = PromptCost(ledger, Fraction(1, 2))
    prompt.group_of = w.groups.of
    for user in "ab":
        w.gate.lanes.track(f"{user}-p", user)
    ledger.open(w.now, False)
    assert prompt.can_pay("a-p", "a")
    prompt.charge("a-p", "a", 0, 400, 400)  # 200 tokens: the group's burst, the rest debt
    assert prompt.debt["a"] > 100
    # b has quota of its own, but its group owes a chunk: b's chunk waits.
    assert w.rate.available("b", w.now) > 0
    assert not prompt.can_pay("b-p", "b")
    # Repaid at the group's rate (10 tok/s), step by step; then b may go.
    owed, start = prompt.debt["a"], w.now
    while True:
        w.now += 10 * MS
        ledger.open(w.now, False)
        prompt.repay(w.now)
        if prompt.can_pay("b-p", "b"):
            break
        ledger.refused.clear()
    assert not prompt.debt
    assert abs((w.now - start) / S - owed / 10) <= 0.2


def test_free_slots_go_to_groups_by_group_weight_then_to_members_by_weight():
    # Groups g (weight 1: a and b, weights 1 and 3) and h (weight 3: c), and
    # u without a group (weight 4); every queue is longer than the slots.
    s = make_settings(5, {"a": {"rate": 5, "ceil": None, "weight": 1, "group": "g"},
                          "b": {"rate": 5, "ceil": None, "weight": 3, "group": "g"},
                          "c": {"rate": 5, "ceil": None, "weight": 1, "group": "h"},
                          "u": {"rate": 5, "ceil": None, "weight": 4}},
                      {"g": {"rate": 5, "ceil": None, "weight": 1},
                       "h": {"rate": 5, "ceil": None, "weight": 3}})
    w = World(s)
    queued = {user: [10] * 40 for user in "abcu"}
    order = w.borrowing.admissions(queued, {}, 32)
    got = {user: order.count(user) for user in "abcu"}
    assert got == {"a": 1, "b": 3, "c": 12, "u": 16}
    # What a group's members already hold counts for the whole group: h
    # starts 120 / 3 = 40 ahead, so the level the slots fill to is 50, not 40.
    order = w.borrowing.admissions(queued, {"c": 120}, 28)
    got = {user: order.count(user) for user in "abcu"}
    assert (got["a"] + got["b"], got["c"], got["u"]) == (5, 3, 20), got


_FREE = {"rate": 0.01, "ceil": None}


@pytest.mark.parametrize(
    "move",
    [{"x": dict(_FREE)}, {"y": {**_FREE, "group": "A"}}],
    ids=["x-leaves-its-group", "y-joins-a-group"],
)
def test_a_user_moved_by_a_reload_enters_its_new_scope_as_a_returning_borrower(move):
    """x and w in group A, y alone, all backlogged borrowers of equal weight:
    2,000 steps build counters of very different sizes in the two scopes
    (a member's counts half its group's).  A reload that moves one user must
    not carry its old counter into the new scope (there it would be credit
    or debt banked elsewhere): it enters at the floor, and the next 400 steps
    are shared evenly, 1 : 1 : 1 (x, y and group A's w when x leaves; x, w
    and y inside A when y joins, A being the only top-level borrower)."""
    users = {"x": {**_FREE, "group": "A"}, "w": {**_FREE, "group": "A"}, "y": dict(_FREE)}
    w = World(make_settings(0.01, users, {"A": dict(_FREE)}))
    for user in users:
        w.add(user, 8)
    for _ in range(2000):
        w.step(4)
    before = dict(w.borrowing.borrowed_tokens)
    w.reload(make_settings(0.01, {**users, **move}, {"A": dict(_FREE)}))
    for _ in range(400):
        w.step(4)
    got = {u: w.borrowing.borrowed_tokens.get(u, 0) - before.get(u, 0) for u in users}
    assert sum(got.values()) == 400 * 4
    for user, tokens in got.items():
        assert abs(tokens - 400 * 4 / 3) <= 4, got  # one step's slots
