"""The engine-counter checks of the multi-engine tools, on hand-made reads (no server)."""

from __future__ import annotations

import math

from vllm_output_rate.tools.analysis import guarantee_bound
from vllm_output_rate.tools.engine_counters import (
    CounterSample,
    Outage,
    cumulative,
    fallback_bound,
    longest_silence,
    widened_bound,
    worst_window,
)


def read(t: float, charged: list, starts: list | None = None) -> CounterSample:
    """A read taken from t to t + 0.01 s."""
    if starts is None:
        starts = [0 if c is not None else None for c in charged]
    return CounterSample(t, t + 0.01, charged, starts)


def test_cumulative_adds_a_restarted_engine_to_its_last_read():
    samples = [
        read(0, [{"u": 0}, {"u": 0}]),
        read(1, [{"u": 10}, {"u": 5}]),
        read(2, [{"u": 20}, None], [0, None]),  # engine 2 down
        read(3, [{"u": 30}, {"u": 2}], [0, 1]),  # ... started again, counting from 0
        read(4, [{"u": 40}, {"u": 9}], [0, 1]),
    ]
    assert cumulative(samples, "u") == [0, 15, 25, 37, 54]


def test_cumulative_survives_a_forgotten_user_and_a_missing_row():
    samples = [
        read(0, [{"u": 7}]),
        read(1, [{}]),  # no row: keeps the last read
        read(2, [{"u": 0}]),  # forgotten while idle: counts from 0 again
        read(3, [{"u": 4}]),
    ]
    assert cumulative(samples, "u") == [7, 7, 7, 11]


def test_cumulative_new_start_without_the_user_keeps_the_old_total():
    samples = [read(0, [{"u": 5}], [0]), read(1, [{}], [1]), read(2, [{"u": 3}], [1])]
    assert cumulative(samples, "u") == [5, 5, 8]


def test_widened_bound_is_the_shared_bound_without_an_outage():
    for a, b in ((0.0, 1.0), (3.0, 13.5)):
        assert widened_bound(a, b, 20.0, 2) == guarantee_bound(b - a, 20.0, shared_engines=2)


def test_widened_bound_adds_the_fallback_and_a_fresh_store_epoch():
    outage = Outage(kill_sent=10.0, killed=10.1, restarted=15.0, all_shared=16.0)
    rate, engines = 20.0, 2
    # Inside the first epoch only (a lease may be spent up to 0.3 s after the kill).
    assert widened_bound(0, 9, rate, engines, [outage]) == guarantee_bound(9, rate, shared_engines=2)
    # Across the whole outage: both epochs' shared bounds plus the fallback's.
    expected = (guarantee_bound(10.4, rate, shared_engines=2) + guarantee_bound(5.0, rate, shared_engines=2)
                + fallback_bound(6.0, rate, engines))
    assert math.isclose(widened_bound(0, 20, rate, engines, [outage]), expected)
    # Inside the outage: the fallback's bound (and the lifetime of the old leases).
    assert math.isclose(widened_bound(12, 14, rate, engines, [outage]), fallback_bound(2, rate, engines))


def test_worst_window_finds_the_tightest_pair_of_reads():
    samples = [read(t, [{"u": n}]) for t, n in ((0, 0), (1, 2), (2, 40), (3, 41))]
    totals = cumulative(samples, "u")
    worst = worst_window(samples, totals, lambda a, b: 10 * (b - a))
    assert worst.tokens == 38 and math.isclose(worst.window_s, 1.01)
    assert math.isclose(worst.excess, 38 - 10.1)
    # Windows longer than max_window_s are left out.
    assert worst_window(samples, totals, lambda a, b: 100 * (b - a), max_window_s=0.5) is None


def test_longest_silence_counts_only_unmoved_counters_between_reads():
    samples = [read(t, [{"u": n}, {"v": n2}]) for t, n, n2 in
               ((0, 0, 0), (1, 5, 0), (2, 5, 0), (3, 5, 1), (4, 6, 1), (8, 7, 2))]
    # Engine 1: no change between the reads at 1 and 3 (2 s less the reads' length);
    # the 4 s gap between the last two reads had a change, so it is no silence.
    assert math.isclose(longest_silence(samples, 0, 0, 10), 3 - 1.01)
    # Engine 2: unmoved from the read at 0 to the one at 2.
    assert math.isclose(longest_silence(samples, 1, 0, 10), 2 - 0.01)
    # A restart in between is no silence either.
    restarted = [read(0, [{"u": 0}], [0]), read(5, [{"u": 0}], [1])]
    assert longest_silence(restarted, 0, 0, 10) == 0.0


# -- demo-cluster's per-run figures ------------------------------------------------------


def test_demo_cluster_run_figures_judge_rate_and_silence_on_the_counters():
    from vllm_output_rate.tools.demo_cluster import counter_figures, runs_lines

    # Heavy charged 28 tok/s summed over two engines; engine 2 stays silent 2.5 s once.
    samples, heavy = [], [0, 0]
    for step in range(41):
        t = step * 0.25
        if not 6.0 <= t <= 8.5:
            heavy[1] += 3
        heavy[0] = round(28 * t) - heavy[1] if t > 0 else 0
        samples.append(read(t, [{"heavy": max(heavy[0], 0), "light": step}, {"heavy": heavy[1]}]))
    figures = counter_figures(samples, 0.0, 10.01, 30.0)
    assert 0.85 < figures["share_of_limit"] < 1.0
    # Unmoved from the read at 5.75 (done at 5.76) to the one sent at 8.5.
    assert math.isclose(figures["longest_silence_s"][1], 8.5 - 5.76)
    assert figures["longest_silence_s"][0] == 0.0
    assert not figures["meets_targets"]  # the silence is over 2 s
    run = {"started_at": "2026-01-01T00:00:00+00:00", "load_before": [1.0, 1.0, 1.0],
           "load_after": [2.0, 2.0, 2.0], "counters": figures}
    table = "\n".join(runs_lines([run, run], 30.0))
    assert table.count("**missed**") == 2 and "1.00/1.00/1.00 / 2.00/2.00/2.00" in table
