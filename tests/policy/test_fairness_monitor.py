"""The per-report fairness of :class:`UserMonitor` (``report["fairness"]``), on a fake clock.

Reports come once a simulated second with the gate's cumulative charges, as
``adapter/operate.py`` sends them; the window is the twin's 10 s.
"""

from __future__ import annotations

import pytest

from vllm_output_rate.policy.monitor import FAIRNESS_KEYS, UserMonitor

S = 1_000_000_000
#: user -> (rate, ceil, weight); ceil None: no ceiling.
LIMITS = {
    "a": (5.0, None, 1.0),
    "b": (5.0, 100.0, 1.0),
    "heavy": (5.0, None, 2.0),
    "capped": (20.0, 20.0, 20.0),  # a hard cap: not a borrower
}


def rate_of(user):
    return LIMITS[user][0]


def limits_of(user):
    _rate, ceil, weight = LIMITS[user]
    return [ceil, weight, None, 0]


class Engine:
    """A monitor fed as the engine feeds it: cumulative charges, a report a second."""

    def __init__(self, monitor: UserMonitor | None = None) -> None:
        self.monitor = monitor or UserMonitor(max_users=10)
        self.charged: dict[str, int] = {}
        self.t = 0

    def run(self, seconds: int, per_second: dict, backlogged=lambda t, u: True) -> dict:
        """``seconds`` more reports; each user in ``per_second`` is charged that
        many tokens a second and has a request held for quota (counts'
        throttled) while ``backlogged(t, user)``.  Returns the last report's fairness."""
        fairness = {}
        for _ in range(seconds):
            self.t += 1
            for user, tokens in per_second.items():
                self.charged[user] = self.charged.get(user, 0) + tokens
            counts = {u: (1, 1, 0) for u in per_second if backlogged(self.t, u)}
            report = self.monitor.report(self.t * S, dict(self.charged), {}, counts, {}, rate_of,
                                         limits_of=limits_of)
            fairness = report["fairness"]
        return fairness


def run(seconds: int, per_second: dict, backlogged=lambda t, u: True) -> dict:
    return Engine().run(seconds, per_second, backlogged)


def test_report_carries_every_fairness_key_with_the_window():
    fairness = run(3, {"a": 10, "b": 10})
    assert set(fairness) == set(FAIRNESS_KEYS)
    assert fairness["window_s"] == 10.0


def test_equal_weighted_service_is_fair():
    # heavy has weight 2 and gets twice a's tokens: the same service per weight.
    fairness = run(15, {"a": 10, "b": 10, "heavy": 20})
    assert fairness["backlogged_users"] == 3
    assert fairness["jain_index"] == pytest.approx(1.0)
    assert fairness["service_gap_tokens"] == pytest.approx(0.0)


def test_a_user_served_at_twice_its_weighted_share_shows_the_gap():
    # a and b weight 1; b gets 20 tok/s, a 10: over the window b is ahead by
    # 10 tokens per report in it.
    fairness = run(30, {"a": 10, "b": 20})
    assert fairness["backlogged_users"] == 2
    # buckets of 1 s kept while any part lies in the 10 s window: 11 reports
    reports_in_window = 11
    assert fairness["service_gap_tokens"] == pytest.approx(10 * reports_in_window)
    assert fairness["jain_index"] == pytest.approx((10 + 20) ** 2 / (2 * (10**2 + 20**2)))


def test_weight_divides_the_service():
    # heavy (weight 2) gets 20 tok/s, a (weight 1) 20 tok/s: a is ahead per weight.
    fairness = run(30, {"a": 20, "heavy": 20})
    assert fairness["service_gap_tokens"] == pytest.approx((20 - 10) * 11)


def test_a_user_that_stops_being_backlogged_leaves_the_computation():
    # b is served unfairly, then goes idle at t = 20 (no request in counts).
    engine = Engine()
    fairness = engine.run(20, {"a": 10, "b": 30, "heavy": 20})
    assert fairness["backlogged_users"] == 3 and fairness["jain_index"] < 0.95
    fairness = engine.run(1, {"a": 10, "heavy": 20})
    assert fairness["backlogged_users"] == 2
    assert fairness["jain_index"] == pytest.approx(1.0)
    assert fairness["service_gap_tokens"] == pytest.approx(0.0)


def test_a_user_backlogged_for_part_of_the_window_counts_only_once_it_spans_it():
    def b_arrives_at_10(t, user):
        return user != "b" or t >= 10
    engine = Engine()
    fairness = engine.run(15, {"a": 10, "b": 10}, backlogged=b_arrives_at_10)
    assert fairness["backlogged_users"] == 1  # b's backlog began inside the window
    assert fairness["jain_index"] == 1.0 and fairness["service_gap_tokens"] == 0.0
    fairness = engine.run(10, {"a": 10, "b": 10}, backlogged=b_arrives_at_10)
    assert fairness["backlogged_users"] == 2


def test_fewer_than_two_backlogged_borrowers_reads_as_nobody_competed():
    fairness = run(15, {"a": 10})
    assert fairness == {"window_s": 10.0, "backlogged_users": 1, "jain_index": 1.0,
                        "service_gap_tokens": 0.0}
    fairness = run(15, {"a": 10}, backlogged=lambda t, u: False)
    assert fairness["backlogged_users"] == 0
    assert fairness["jain_index"] == 1.0 and fairness["service_gap_tokens"] == 0.0


def test_hard_capped_users_are_not_borrowers_and_are_left_out():
    fairness = run(15, {"a": 10, "b": 10, "capped": 20})
    assert fairness["backlogged_users"] == 2
    assert fairness["jain_index"] == pytest.approx(1.0)


def test_the_window_is_a_constructor_setting():
    engine = Engine(UserMonitor(max_users=10, fairness_window_s=3.0))
    fairness = engine.run(20, {"a": 10, "b": 20})
    assert fairness["window_s"] == 3.0
    # 0.3 s buckets, each kept while any of it lies in the 3 s window: the
    # reports at t = 17 (its bucket ends at 17.1 s) to 20
    assert fairness["service_gap_tokens"] == pytest.approx(10 * 4)
    with pytest.raises(ValueError):
        UserMonitor(max_users=10, fairness_window_s=0)


def test_no_limits_no_fairness():
    report = UserMonitor(max_users=10).report(S, {"a": 1}, {}, {"a": (1, 0, 0)}, {}, rate_of)
    assert "fairness" not in report


def test_weights_given_to_a_reading_are_not_kept():
    # users that came and went leave nothing in the window's weight table
    engine = Engine()
    engine.run(15, {"a": 10, "b": 10})
    assert engine.monitor.fairness._window._weights == {}


def test_a_holder_without_a_rate_or_weight_is_skipped_not_an_error():
    # The group monitor's rate_of is a dict's get: a group removed by a reload has none.
    monitor = UserMonitor(max_users=10)
    report = monitor.report(S, {"gone": 5, "g": 5}, {}, {"gone": (1, 1, 0), "g": (0, 0, 1)}, {},
                            {"g": 1.0}.get,
                            limits_of=lambda h: [None, 1.0, None, 0] if h == "g" else [5.0, 2.0, None, 0])
    assert report["fairness"]["backlogged_users"] == 1


def test_a_borrower_all_of_whose_requests_ran_is_not_backlogged():
    # b runs every request it has (active only): it got all it asked for, its
    # smaller service is its demand, not unfairness.  a is held for quota, c waits.
    monitor = UserMonitor(max_users=10)
    charged = {}
    for t in range(1, 16):
        for user, tokens in (("a", 30), ("b", 5), ("heavy", 60)):
            charged[user] = charged.get(user, 0) + tokens
        counts = {"a": (1, 1, 0), "b": (2, 0, 0), "heavy": (1, 0, 3)}
        fairness = monitor.report(t * S, dict(charged), {}, counts, {}, rate_of,
                                  limits_of=limits_of)["fairness"]
    assert fairness["backlogged_users"] == 2  # a and heavy (weight 2: 30 per weight each)
    assert fairness["jain_index"] == pytest.approx(1.0)
