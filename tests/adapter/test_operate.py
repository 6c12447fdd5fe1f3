"""Scheduler-side operation on vLLM's real scheduler (fake clock, no model).

* a limits file re-read mid-stream: a lowered and a raised rate take effect
  at once, the guarantee holds for the new rate from the change on (every
  dispatch is checked against a shadow limiter switched at the same instant),
  unchanged users keep their quota state, a bad file changes nothing;
* the per-user report behind /metrics and the admin snapshot.
"""

from __future__ import annotations

import json

import pytest

from vllm_output_rate.policy.monitor import OTHER_USERS
from vllm_output_rate_harness.scheduler_sim import MS, Harness, max_in_window

S = 1000 * MS


def write_limits(path, default, users):
    path.write_text(json.dumps({
        "default_user_output_tokens_per_second": default,
        "user_output_tokens_per_second": users,
    }))


def bump_mtime(path, n):
    import os

    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + n * 1_000_000_000))


def make_harness(tmp_path, users, **kwargs):
    path = tmp_path / "limits.json"
    write_limits(path, 1000, users)
    # The default given next to the file only seeds the harness's shadow limiter:
    # the file wins.
    h = Harness({"limits_file": str(path), "default_user_output_tokens_per_second": 7},
                max_num_seqs=16, **kwargs)
    assert h.sched.output_rate_settings.default_rate == 1000
    watcher = h.sched._operate.watcher
    assert watcher is not None
    watcher.stop()  # the test checks the file itself, at chosen fake-clock instants
    h.shadow.update_rates(1000, users)
    return h, path, watcher


def reload(h, path, watcher, default, users, bump):
    write_limits(path, default, users)
    bump_mtime(path, bump)
    assert watcher.check()
    h.shadow.update_rates(default, users)  # the shadow switches at the same instant


def charges_between(h, user, start, end):
    return [t for t in h.charges[user] if start <= t < end]


@pytest.mark.parametrize("async_", [False, True])
def test_lowered_then_raised_mid_stream(tmp_path, async_):
    h, path, watcher = make_harness(tmp_path, {"u": 100, "steady": 20}, async_=async_)
    for _ in range(4):
        h.add("u", max_tokens=5000)
    h.add("steady", max_tokens=5000)
    for _ in range(200):  # 2 s at 100 tok/s
        h.step(10 * MS)
    t0 = h.clock.now_ns
    assert len(charges_between(h, "u", t0 - S, t0)) >= 90

    reload(h, path, watcher, 1000, {"u": 10, "steady": 20}, bump=1)
    # The next schedule() call applies it.  The shadow limiter switched at
    # the same instant and only saw real samples: equal state for every user
    # means unchanged users kept theirs exactly and the changed one was
    # carried over as update_rates() promises.
    h.step(10 * MS)
    assert h.sched.output_rate_settings.user_rates["u"] == 10
    h.check_limiter_exact()
    for _ in range(599):  # 6 s at 10 tok/s
        h.step(10 * MS)
    t1 = h.clock.now_ns
    after = charges_between(h, "u", t0, t1)
    # The guarantee for the new rate from the change on, on every window
    # (the shadow limiter also asserted each dispatch).
    for window_s in (1, 2, 5):
        assert max_in_window(after, window_s * S) <= (window_s + 0.1) * 10 + 1
    late = charges_between(h, "u", t0 + S, t1)
    assert 0.9 * 10 * 5 <= len(late) <= 1.05 * 10 * 5 + 1

    reload(h, path, watcher, 1000, {"u": 50, "steady": 20}, bump=2)
    for _ in range(300):
        h.step(10 * MS)
    t2 = h.clock.now_ns
    raised = charges_between(h, "u", t1 + S, t2)
    assert 0.9 * 50 * 2 <= len(raised) <= (2 + 0.1) * 50 + 1
    assert max_in_window(charges_between(h, "u", t1, t2), S) <= 1.1 * 50 + 1
    # The steady user ran at its own rate throughout.
    steady = charges_between(h, "steady", t0 - S, t2)
    assert max_in_window(steady, S) <= 1.1 * 20 + 1
    assert h.sched.output_rate_reloads == 2
    assert h.sched.output_rate_reload_failures == 0
    h.check_limiter_exact()


def test_bad_file_is_rejected_whole_and_old_limits_stay(tmp_path):
    h, path, watcher = make_harness(tmp_path, {"u": 20})
    h.add("u", max_tokens=500)
    for _ in range(50):
        h.step(10 * MS)
    # One bad rate among good ones: nothing of the file is applied.
    path.write_text(json.dumps({
        "default_user_output_tokens_per_second": 5,
        "user_output_tokens_per_second": {"u": 1, "w": -3},
    }))
    bump_mtime(path, 1)
    assert watcher.check()
    path.write_text("{not json")
    bump_mtime(path, 2)
    assert watcher.check()
    for _ in range(300):
        h.step(10 * MS)
    assert h.sched.output_rate_reload_failures == 2
    assert h.sched.output_rate_reloads == 0
    assert h.sched.output_rate_settings.user_rates == {"u": 20}
    assert h.sched.output_rate_settings.default_rate == 1000
    recent = charges_between(h, "u", h.clock.now_ns - 2 * S, h.clock.now_ns)
    assert 0.9 * 40 <= len(recent) <= 2.1 * 20 + 1
    report = h.sched.output_rate_report(h.clock.now_ns)
    assert report["engine"]["reload_failures_total"] == 2


def test_unchanged_file_is_not_reloaded(tmp_path):
    h, path, watcher = make_harness(tmp_path, {"u": 20})
    assert not watcher.check()
    h.step()
    assert h.sched.output_rate_reloads == 0


def test_report_and_admin_snapshot(tmp_path):
    h, path, watcher = make_harness(tmp_path, {"slow": 10})
    h.sched.output_rate_operate_clock = h.clock
    for _ in range(3):
        h.add("slow", max_tokens=10_000)
    h.add("free", max_tokens=10_000)
    for _ in range(300):
        h.step(10 * MS)
    gate = h.sched.output_rate_gate
    now = h.clock.now_ns
    report = h.sched.output_rate_report(now)
    users = report["users"]
    assert set(users) == {"slow", "free", OTHER_USERS}
    # First report: the increments are everything charged so far.
    assert users["slow"][0] == len(h.charges["slow"]) == gate.ledger.charged_tokens["slow"]
    assert users["free"][0] == len(h.charges["free"])
    assert users["slow"][5] == 10 and users["free"][5] == 1000
    assert users["slow"][1] > 0  # throttled seconds
    active, throttled, waiting = users["slow"][2:5]
    assert active + throttled == 3 and waiting == 0
    for _ in range(100):
        h.step(10 * MS)
    second = h.sched.output_rate_report(h.clock.now_ns)["users"]
    assert second["slow"][0] == len(h.charges["slow"]) - users["slow"][0]

    snap = h.sched.output_rate_users()
    row = snap["users"]["slow"]
    assert row["rate"] == 10 and row["configured"]
    assert row["tokens_charged_total"] == len(h.charges["slow"])
    # About 10 s of history at 10 tok/s (the run is 4 s long: all of it).
    assert row["tokens_last_10s"] == len(charges_between(h, "slow", h.clock.now_ns - 10 * S, h.clock.now_ns + 1))
    assert row["ready_in_s"] <= 0.1 + 1e-9
    assert snap["users"]["free"]["configured"] is False
    json.dumps(snap)  # travels as a utility result


def test_idle_users_are_forgotten_so_engine_state_stays_bounded(tmp_path):
    """1,000 one-off names: after they go idle the per-user totals shrink back."""
    h, path, watcher = make_harness(tmp_path, {"slow": 10})
    gate = h.sched.output_rate_gate
    h.sched.output_rate_operate_clock = h.clock
    for i in range(1000):
        h.add(f"one-off-{i}", max_tokens=2)
    h.add("slow", max_tokens=100_000)
    for _ in range(400):
        h.step(10 * MS)
    first = h.sched.output_rate_report(h.clock.now_ns)
    assert len(gate.ledger.charged_tokens) == 1001
    assert sum(row[0] for row in first["users"].values()) == 2 * 1000 + len(h.charges["slow"])
    # 31 s later (slow still streaming): the one-off users are dropped.
    for _ in range(31):
        h.clock.advance(1000 * MS)
        h.step(1 * MS)
        h.sched.output_rate_report(h.clock.now_ns)
    assert set(gate.ledger.charged_tokens) == {"slow"}
    # What is left: the labelled series (at most K, dropped after 5 idle minutes) and slow.
    assert h.sched._operate.monitor.tracked() <= h.sched.output_rate_settings.metrics_max_users + 5
    # A forgotten user who comes back counts from zero, once.
    h.add("one-off-7", max_tokens=3)
    for _ in range(50):
        h.step(10 * MS)
    rep = h.sched.output_rate_report(h.clock.now_ns)
    total_other = rep["users"][OTHER_USERS][0] + sum(
        row[0] for user, row in rep["users"].items() if user.startswith("one-off"))
    assert total_other == 3
