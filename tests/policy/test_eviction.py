"""The eviction policy on its own: the recompute budget and the fair-share rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from vllm_output_rate.policy.eviction import DEFAULT_RECOMPUTE_RATIO, EvictionBudget, evens_out


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
    """The bound README states: what evictions for waiting requests make the
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
