"""The fair-share benchmark's figures: service per window from counter readings,
backlog coverage, and VTC's service difference (pure functions of
``tools/analysis.py``; no server, no clock)."""

from __future__ import annotations

import pytest

from benchmark_scripts import load_benchmark
from vllm_output_rate.tools.analysis import counter_windows, covers, service_difference, spread_service


def test_counter_windows_reads_each_edge_from_the_nearest_reading():
    readings = [
        (0.2, {"a": 0, "b": 0}),
        (4.9, {"a": 40, "b": 10}),
        (10.4, {"a": 100, "b": 30}),
        (15.0, {"a": 150, "b": 80}),
        (19.8, {"a": 170, "b": 200}),
    ]
    # Edges 0, 10, 20 -> readings at 0.2, 10.4, 19.8: both users' windows span the same readings.
    assert counter_windows(readings, 10.0, 2) == {"a": [100, 70], "b": [30, 170]}


def test_counter_windows_without_a_reading_near_an_edge_is_not_measured():
    readings = [(0.1, {"a": 0}), (9.8, {"a": 50}), (24.0, {"a": 90}), (30.2, {"a": 120})]
    # Edge 20 is 4 s from its nearest reading: windows 1 and 2 are unknown.
    assert counter_windows(readings, 10.0, 3, max_skew_s=2.0) == {"a": [50, None, None]}
    assert counter_windows(readings, 10.0, 3) == {"a": [50, 40, 30]}


def test_service_difference_skips_unmeasured_windows():
    service = {"A": [0, None, 100], "B": [0, 50, 160]}
    result = service_difference(service, {"A": 1, "B": 1}, {"A": [True] * 3, "B": [True] * 3})
    assert result["per_window"] == [0, None, 60] and result["windows_counted"] == 1


def test_counter_windows_order_free_and_missing_series_count_zero():
    readings = [(10.0, {"a": 5, "b": 7}), (0.0, {"a": 1})]
    assert counter_windows(readings, 10.0, 1) == {"a": [4], "b": [7]}
    assert counter_windows([], 10.0, 3) == {}


def test_covers_needs_the_union_without_gaps():
    assert covers([(0, 4), (3, 8), (7.5, 12)], 1, 10)
    assert not covers([(0, 4), (5, 12)], 1, 10)  # gap 4..5
    assert not covers([(2, 12)], 1, 10)  # starts late
    assert not covers([(0, 9)], 1, 10)  # ends early
    assert covers([(0, 10)], 0, 10)  # closed interval: touching the end is enough
    assert not covers([], 0, 1)


def test_service_difference_equal_weights_skips_warmup():
    service = {"A": [500, 100, 120], "B": [0, 200, 140]}
    backlogged = {"A": [True, True, True], "B": [True, True, True]}
    result = service_difference(service, {"A": 1, "B": 1}, backlogged)
    assert result["per_window"] == [500, 100, 20]
    assert result["max"] == 100 and result["mean"] == 60 and result["windows_counted"] == 2
    # Window 1: shares 1/3 and 2/3 against 1/2 each.
    assert result["share_deviation_per_window"][1] == pytest.approx(1 / 3)
    assert result["max_share_deviation"] == pytest.approx(1 / 3)


def test_service_difference_normalises_by_weight():
    weights = {"W1": 1, "W2": 2, "W3": 3, "W4": 4}
    exact = {u: [0, 100 * w] for u, w in weights.items()}
    backlogged = {u: [True, True] for u in weights}
    result = service_difference(exact, weights, backlogged)
    assert result["max"] == 0 and result["max_share_deviation"] == pytest.approx(0)
    # FCFS-like equal service: W1 gets 2.5x its weight share, W4 0.625x.
    equal = {u: [0, 250] for u in weights}
    result = service_difference(equal, weights, backlogged)
    assert result["max"] == pytest.approx(250 - 62.5)
    assert result["max_share_deviation"] == pytest.approx(1.5)


def test_service_difference_counts_backlogged_users_only():
    service = {"A": [0, 300, 300], "B": [0, 10, 100], "C": [0, 290, 310]}
    backlogged = {"A": [True, True, True], "B": [True, False, True], "C": [True, True, False]}
    result = service_difference(service, {"A": 1, "B": 1, "C": 1}, backlogged)
    # Window 1: A and C (B had nothing waiting); window 2: A and B.
    assert result["per_window"][1:] == [10, 200]
    # Fewer than two backlogged users: no figure for that window.
    lone = service_difference(service, {"A": 1, "B": 1}, {"A": [True] * 3, "B": [False] * 3})
    assert lone["max"] is None and lone["mean"] is None and lone["windows_counted"] == 0


def test_spread_service_spreads_each_request_over_its_span():
    spans = [
        ("a", 5.0, 15.0, 100),  # half in window 0, half in window 1
        ("a", 12.0, 12.0, 7),  # a point: all in window 1
        ("b", 25.0, 35.0, 40),  # half beyond the horizon: left out
        ("b", -5.0, 5.0, 10),  # half before 0: left out
    ]
    result = spread_service(spans, 10.0, 3)
    assert result["a"] == pytest.approx([50, 57, 0])
    assert result["b"] == pytest.approx([5, 0, 20])
    assert spread_service([], 10.0, 2) == {}


def test_lone_borrower_rounds_alternate_their_order_and_pool_their_counts():
    fs = load_benchmark("fair_share")

    def phase(tokens, steps):
        return fs.solo_figures({
            "tokens": tokens, "seconds": 10.0, "steps": steps, "user_charged_tokens": tokens,
            "user_borrowed_tokens": 0.0, "cpu_s": {"engine_core": 1.0}, "foreign_core_s": 0.0,
            "cpu_wall_s": 10.0, "streams": 12, "rate": 10.0, "load_before": [0, 0, 0],
            "load_after": [1, 1, 1], "drained": True})

    # A machine slowing down over the run: each phase makes fewer tokens than the last.
    speeds = iter([1000, 900, 800, 700])
    order = []

    def run(user):
        order.append(user)
        tokens = next(speeds)
        return phase(tokens, tokens // 4)

    borrower, unlimited, rounds = fs.solo_rounds(run, 2)
    assert order == [fs.SOLO, fs.UNLIMITED, fs.UNLIMITED, fs.SOLO]
    # Pooled, the drift falls on both alike: 1000 + 700 against 900 + 800.
    assert borrower["tokens"] == 1700 and unlimited["tokens"] == 1700
    assert borrower["tok_s"] == unlimited["tok_s"] == 85.0 and borrower["phases"] == 2
    assert borrower["cpu_ms_per_step"] == {"engine_core": round(1000 * 2.0 / (250 + 175), 3)}
    assert [r["ratio"] for r in rounds] == [round(1000 / 900, 3), round(700 / 800, 3)]
    with pytest.raises(SystemExit):
        fs.parse_args(["--solo-rounds", "0"])
