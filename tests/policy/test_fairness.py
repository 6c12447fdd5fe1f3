"""Jain's index and the weighted service gap over a sliding window."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_output_rate.policy.fairness import FairnessWindow, jain_index, largest_gap

S = 1_000_000_000
services = st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=50)


@given(st.integers(min_value=1, max_value=10**6), st.integers(min_value=1, max_value=200))
def test_equal_service_is_perfectly_fair(tokens, n):
    assert jain_index([tokens] * n) == pytest.approx(1.0)
    assert largest_gap([tokens] * n) == 0


@given(st.integers(min_value=1, max_value=10**6), st.integers(min_value=1, max_value=200))
def test_one_user_taking_everything_scores_one_over_n(tokens, n):
    assert jain_index([tokens] + [0] * (n - 1)) == pytest.approx(1.0 / n)
    assert largest_gap([tokens] + [0] * (n - 1)) == (tokens if n > 1 else 0)


@given(services, st.integers(min_value=1, max_value=1000))
def test_index_is_scale_invariant_and_gap_scales(values, factor):
    assert jain_index([v * factor for v in values]) == pytest.approx(jain_index(values))
    assert largest_gap([v * factor for v in values]) == largest_gap(values) * factor


@given(services)
def test_index_lies_between_one_over_n_and_one(values):
    j = jain_index(values)
    assert 1.0 / len(values) - 1e-12 <= j <= 1.0 + 1e-12


def test_nobody_is_no_reading():
    assert jain_index([]) is None
    assert largest_gap([]) is None


def backlogged_window(served: dict, weights: dict | None = None, idle: set = frozenset()) -> FairnessWindow:
    """Ten steps of 100 ms: everyone in ``served`` backlogged except ``idle``
    (backlogged in none but the first step), each served evenly."""
    w = FairnessWindow(10 * S)
    for user, weight in (weights or {}).items():
        w.set_weight(user, weight)
    for step in range(10):
        now = step * S // 10
        w.observe([u for u in served if u not in idle or step == 0], now)
        for user, tokens in served.items():
            w.serve(user, tokens // 10, now)
    return w


def test_service_is_divided_by_weight():
    w = backlogged_window({"a": 300, "b": 100}, weights={"a": 3, "b": 1})
    r = w.reading(S)
    assert r.backlogged_users == 2
    assert r.jain == pytest.approx(1.0)
    assert r.gap_tokens == pytest.approx(0.0)
    # the same service without the weights is unfair
    r = backlogged_window({"a": 300, "b": 100}).reading(S)
    assert r.jain == pytest.approx((400**2) / (2 * (300**2 + 100**2)))
    assert r.gap_tokens == pytest.approx(200)


def test_users_not_backlogged_throughout_are_left_out():
    r = backlogged_window({"a": 100, "b": 100, "idle": 0}, idle={"idle"}).reading(S)
    assert r.backlogged_users == 2
    assert set(r.weighted_service) == {"a", "b"}
    assert r.jain == pytest.approx(1.0)


def test_a_user_seen_backlogged_in_every_observation_counts_even_unserved():
    r = backlogged_window({"a": 100, "starved": 0}).reading(S)
    assert r.weighted_service == {"a": 100, "starved": 0}
    assert r.jain == pytest.approx(0.5)
    assert r.gap_tokens == 100


def test_the_window_forgets():
    w = FairnessWindow(10 * S)
    w.observe(["a", "b"], 0)
    w.serve("a", 1000, 0)  # an old burst for a
    for step in range(1, 200):
        now = step * S // 10
        w.observe(["a", "b"], now)
        w.serve("a", 5, now)
        w.serve("b", 5, now)
    r = w.reading(199 * S // 10)
    assert r.jain == pytest.approx(1.0)
    assert r.gap_tokens == 0
    # a backlog gap older than the window no longer excludes anyone either
    w2 = FairnessWindow(10 * S)
    w2.observe(["a"], 0)  # b idle only at the start
    for step in range(1, 10):
        w2.observe(["a", "b"], step * S // 10)
    assert w2.reading(S).backlogged_users == 1
    for step in range(10, 200):
        w2.observe(["a", "b"], step * S // 10)
    assert w2.reading(199 * S // 10).backlogged_users == 2


@given(
    st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 100), st.integers(0, 30 * S)),
             max_size=60),
)
def test_reading_counts_exactly_the_service_inside_the_window(events):
    w = FairnessWindow(10 * S, buckets=10)
    events = sorted(events, key=lambda e: e[2])
    for user, tokens, t in events:
        w.observe("abcd", t)
        w.serve(user, tokens, t)
    end = events[-1][2] if events else 0
    r = w.reading(end)
    bucket = w.bucket_ns
    start = end - 10 * S
    # a bucket is kept while any of it lies inside the window
    expected = {u: 0 for u in "abcd"}
    for user, tokens, t in events:
        if (t - t % bucket) + bucket > start:
            expected[user] += tokens
    if events:
        assert r.weighted_service == expected
        assert math.isclose(r.gap_tokens, max(expected.values()) - min(expected.values()))
