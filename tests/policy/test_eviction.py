"""The eviction policy on its own: the recompute budget, the fair-share rule
and the victim choice (:class:`Displacement`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from vllm_output_rate.policy.displacement import Displacement, fits_in_free_kv
from vllm_output_rate.policy.eviction import DEFAULT_RECOMPUTE_RATIO, EvictionBudget, evens_out
from vllm_output_rate.policy.gate import StepGate
from vllm_output_rate.policy.limiter import OutputRateLimiter


def test_budget_starts_full_and_refuses_what_it_cannot_pay():
    budget = EvictionBudget(burst_tokens=100)
    assert budget.ratio == DEFAULT_RECOMPUTE_RATIO
    assert budget.affords(100) and not budget.affords(101)
    budget.spend(60)
    assert budget.affords(40) and not budget.affords(41)
    budget.earn(100)  # 0.25 x 100 output tokens
    assert budget.affords(65) and not budget.affords(66)
    assert budget.spent_tokens == 60 and budget.earned_tokens == 25


def test_budget_pays_into_debt_and_then_refuses_until_paid_back():
    budget = EvictionBudget(burst_tokens=10, ratio=1.0)
    budget.spend(30)  # an eviction for a running request: paid regardless
    assert budget.available == -20 and budget.forced_tokens == 30
    assert not budget.affords(0 + 1)
    budget.earn(21)
    assert budget.affords(1) and not budget.affords(2)


def test_budget_never_holds_more_than_its_burst():
    budget = EvictionBudget(burst_tokens=50, ratio=1.0)
    budget.earn(10_000)
    assert budget.available == 50
    budget.earn(-5)  # nothing to credit
    assert budget.available == 50


@pytest.mark.parametrize("burst, ratio", [(-1, 0.25), (10, -0.1)])
def test_budget_rejects_negative_settings(burst, ratio):
    with pytest.raises(ValueError):
        EvictionBudget(burst_tokens=burst, ratio=ratio)


@settings(max_examples=200, derandomize=True)
@given(
    burst=st.integers(0, 2000),
    ratio=st.sampled_from([0.0, 0.1, 0.25, 1.0]),
    events=st.lists(
        st.tuples(st.sampled_from(["earn", "for-waiting", "for-running"]), st.integers(0, 800)),
        max_size=60,
    ),
)
def test_evictions_for_waiting_never_exceed_burst_plus_ratio_times_scheduled(burst, ratio, events):
    """The bound docs/design.md states: what evictions for waiting requests make the
    engine recompute <= burst + ratio x requests scheduled, whatever the
    evictions for running requests took."""
    budget = EvictionBudget(burst_tokens=burst, ratio=ratio)
    scheduled = 0
    for_waiting = 0
    for kind, tokens in events:
        if kind == "earn":
            budget.earn(tokens)
            scheduled += tokens
        elif kind == "for-running":
            budget.spend(tokens)
        elif budget.affords(tokens):
            budget.spend(tokens)
            for_waiting += tokens
            assert budget.available >= 0
        assert for_waiting <= burst + ratio * scheduled + 1e-9
        assert budget.earned_tokens <= ratio * scheduled + 1e-9


def test_equal_rates_need_a_difference_of_two_requests():
    assert not evens_out(1, 10, 0, 10)
    assert evens_out(2, 10, 0, 10)
    assert not evens_out(3, 10, 2, 10)
    assert evens_out(4, 10, 2, 10)


def test_a_faster_user_deserves_more_requests():
    assert evens_out(1, 5, 0, 1000)  # one stream at 5 tok/s vs a newcomer at 1000
    assert not evens_out(3, 1000, 0, 5)  # the other way round


@settings(max_examples=300, derandomize=True)
@given(
    counts=st.lists(st.integers(0, 6), min_size=2, max_size=6),
    rates=st.lists(st.sampled_from([1, 5, 10, 30, 100, 1000]), min_size=6, max_size=6),
    moves=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=80),
)
def test_moves_that_even_out_cannot_cycle(counts, rates, moves):
    """Each allowed move lowers sum(count**2 / rate), so no sequence of moves
    returns to an allocation it left."""
    counts = list(counts)
    rates = rates[: len(counts)]

    def potential() -> float:
        return sum(c * c / r for c, r in zip(counts, rates))

    seen = {tuple(counts)}
    for src, dst in moves:
        src, dst = src % len(counts), dst % len(counts)
        if src == dst or counts[src] == 0:
            continue
        if not evens_out(counts[src], rates[src], counts[dst], rates[dst]):
            continue
        before = potential()
        counts[src] -= 1
        counts[dst] += 1
        assert potential() < before
        assert tuple(counts) not in seen
        seen.add(tuple(counts))


# ---------------------------------------------------------------------------
# Displacement: who gives way, for whom (keys are strings, data plain dicts)
# ---------------------------------------------------------------------------

MS = 1_000_000
# With the default 100 ms burst: "slow" (0.5 tok/s) has 1 token when idle,
# "one" (5 tok/s) 1, everybody else (1000 tok/s) 101.
RATES = {"slow": 0.5, "one": 5}


def displacement(*, budget_tokens=1000, priorities=None, held=None, stuck=()):
    """A gate over a real limiter with ``slow`` throttled: s1..s3 resident,
    its one token spent, so the plan leaves its streams hidden and short."""
    gate = StepGate(OutputRateLimiter(1000, RATES))
    for key in ("s1", "s2", "s3"):
        gate.lanes.track(key, "slow")
        gate.lanes.admit(key, False)
    assert gate.limiter.try_take("slow", 0)
    evicted: set = set()
    held = held or {}
    part = Displacement(
        gate.lanes,
        gate.ledger,
        EvictionBudget(burst_tokens=budget_tokens),
        evicted,
        tokens_held=lambda key: held.get(key, 10),
        priority_of=None if priorities is None else priorities.__getitem__,
        can_release=lambda key: key not in stuck,
    )
    return gate, part, evicted


def start(gate, slots=10):
    plan = gate.plan(0, slots)
    assert plan.throttled and gate.ledger.short == ["slow"]
    return plan


def add(gate, user, key, resident=False):
    gate.lanes.track(key, user)
    if resident:
        gate.lanes.admit(key, False)


def test_a_running_request_takes_kv_from_the_least_recently_served_throttled_stream():
    gate, part, _ = displacement()
    add(gate, "fast", "f1", resident=True)
    start(gate)
    assert part.victim_for("f1", waiting=False) == "s1"
    gate.lanes.release("s1")  # the caller evicted it
    assert part.victim_for("f1", waiting=False) == "s2"


def test_a_step_that_hides_nothing_has_no_victim():
    """Every resident request offered (the throttled user's streams all
    borrowed): no victim for any requester.  The scheduler adapter relies on
    it to talk to vLLM's own KV cache manager in such a step."""
    gate, part, _ = displacement()
    add(gate, "fast", "f1", resident=True)
    add(gate, "other", "o1")  # waiting, nothing of its user resident
    plan = start(gate)
    assert plan.hidden == 3 and part.victim_for("f1", waiting=False) == "s1"
    gate.ledger.pay_borrowed(["s1", "s2", "s3"])  # what StepGate.borrow records
    assert part.victim_for("f1", waiting=False) is None
    assert part.victim_for("o1", waiting=True) is None


def test_no_victim_for_a_requester_who_cannot_pay_or_of_its_own_user():
    gate, part, _ = displacement()
    add(gate, "slow", "s4")
    start(gate)
    assert part.victim_for("s4", waiting=True) is None  # out of quota itself
    assert part.victim_for("s1", waiting=False) is None  # never one stream for another


def test_asking_whether_a_requester_could_pay_refuses_nobody():
    # Issue 31's charge-path machine (``idle``; chunked prefill, prompt cost,
    # a tight KV cache): a waiting request's prompt chunk took its user's
    # last token, then found no KV; the victim search's question refused the
    # user, who, with the chunk refunded at settle, was "ready now": an
    # engine with nothing to run was told to wait 0 and stepped empty.
    gate, part, _ = displacement()
    add(gate, "one", "o1")
    start(gate)
    assert gate.limiter.try_take("one", 0)  # its prompt chunk took the last token
    assert part.victim_for("o1", waiting=True) is None
    assert "one" not in gate.ledger.refused and "one" not in gate.ledger.blocked
    assert not gate.ledger.charge("o1")  # charged for real, it is refused


def test_asked_as_if_paid_a_requester_out_of_quota_names_who_would_give_way():
    """For the idle wait: who would give way once the requester's quota
    returns (StepPolicy shortens the wait to then); asking evicts nothing."""
    gate, part, evicted = displacement()
    add(gate, "one", "o1")
    start(gate)
    assert gate.limiter.try_take("one", 0)  # its quota spent
    assert part.victim_for("o1", waiting=True) is None
    assert part.victim_for("o1", waiting=True, paid=True) == "s1"
    assert not evicted and gate.lanes.resident_count("slow") == 3


def test_an_evicted_request_and_a_served_users_waiting_request_take_free_room_only():
    gate, part, evicted = displacement()
    add(gate, "fast", "f1", resident=True)
    add(gate, "fast", "f2")
    add(gate, "other", "o1")
    start(gate)
    assert part.victim_for("f2", waiting=True) is None  # fast holds a resident stream
    evicted.add("o1")
    assert part.victim_for("o1", waiting=True) is None  # no eviction chains
    evicted.clear()
    assert part.victim_for("o1", waiting=True) == "s1"


def test_a_waiting_request_evicts_only_to_even_out_shares_and_within_budget():
    gate, part, _ = displacement(budget_tokens=50, held={"s1": 60})
    add(gate, "fast", "f1")
    start(gate)
    # slow holds 3 slots at 0.5 tok/s, fast none: s1's recompute (60 tokens)
    # is over the budget, s2's (10) is not.
    assert part.victim_for("f1", waiting=True) == "s2"
    gate2, part2, _ = displacement()
    add(gate2, "one", "o1")
    gate2.lanes.release("s2")
    gate2.lanes.release("s3")
    start(gate2)
    # One resident slow stream per 0.5 tok/s against none of one's at 5 tok/s:
    # (1 - 0.5) x 5 > (0 + 0.5) x 0.5, so it evens out.
    assert part2.victim_for("o1", waiting=True) == "s1"
    assert not evens_out(1, 5, 0, 0.5)  # the other way round it would not


def test_priorities_spare_more_important_victims():
    prio = {"s1": 0, "s2": 2, "s3": 1, "f1": 1, "f2": 1}
    gate, part, _ = displacement(priorities=prio)
    add(gate, "fast", "f1", resident=True)
    add(gate, "fast2", "f2")
    start(gate)
    assert part.victim_for("f1", waiting=False) == "s2"  # s1 is more important
    assert part.victim_for("f1", waiting=False, least_important=2) == "s2"
    assert part.victim_for("f2", waiting=True, least_important=3) == "s2"  # ignored for waiting
    gate.lanes.release("s2")
    assert part.victim_for("f1", waiting=False) == "s3"  # same priority: it goes
    assert part.victim_for("f1", waiting=False, least_important=2) is None


def test_a_victim_whose_kv_cannot_be_released_is_passed_over():
    gate, part, _ = displacement(stuck={"s1", "s2"})
    add(gate, "fast", "f1", resident=True)
    start(gate)
    assert part.victim_for("f1", waiting=False) == "s3"


def evictions(gate, part, waiting, free_slots=0, active_cap=10, slots=10):
    plan = start(gate, slots)
    hidden = plan.hidden
    evicted_now: list = []

    def evict(key):
        evicted_now.append(key)
        gate.lanes.release(key)

    donors = part.free_slots_for(iter(waiting), plan, free_slots, active_cap, evict)
    assert plan.hidden == hidden - len(evicted_now)
    return evicted_now, donors


def test_a_slot_is_freed_for_each_waiting_request_that_can_run_while_room_lasts():
    gate, part, _ = displacement()
    for key in ("a1", "b1", "b2"):
        add(gate, key[0], key)
    evicted_now, donors = evictions(gate, part, ["a1", "b1", "b2"])
    # Users with no resident request: each eviction evens out the shares.
    assert evicted_now == ["s1", "s2", "s3"] and donors == {"slow"}
    gate, part, _ = displacement()
    for key in ("a1", "b1", "b2"):
        add(gate, key[0], key)
    evicted_now, _ = evictions(gate, part, ["a1", "b1", "b2"], active_cap=2)
    assert evicted_now == ["s1", "s2"]  # the active cap runs two of them


def test_no_slot_is_freed_with_a_free_slot_or_no_room_under_the_active_cap():
    for free_slots, active_cap in ((1, 10), (0, 0)):
        gate, part, _ = displacement()
        add(gate, "a", "a1")
        assert evictions(gate, part, ["a1"], free_slots, active_cap) == ([], set())


def test_a_user_is_promised_no_more_slots_than_its_quota_pays_for():
    gate, part, _ = displacement()
    add(gate, "one", "o1")
    add(gate, "one", "o2")  # "one" has a single token
    evicted_now, _ = evictions(gate, part, ["o1", "o2"])
    assert evicted_now == ["s1"]


def test_an_evicted_request_comes_back_only_into_free_kv_with_room_to_grow():
    # 33 tokens + the next one need 3 blocks of 16; 2 running requests one each.
    assert fits_in_free_kv(33, 16, running=2, free_blocks=5)
    assert not fits_in_free_kv(33, 16, running=2, free_blocks=4)
    assert fits_in_free_kv(31, 16, running=0, free_blocks=2)
