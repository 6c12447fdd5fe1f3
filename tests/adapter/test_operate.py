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


# -- the audit trail (issue 45 item 4) ------------------------------------------------


def audit_of(h):
    return h.sched.output_rate_users()["audit"]


def test_a_reload_records_each_changed_key_from_and_to_with_the_digest(tmp_path, caplog):
    import hashlib
    import logging

    h, path, watcher = make_harness(tmp_path, {"u": 20, "v": 5})
    h.sched._operate.audit.wall_clock = lambda: 1_800_000_000.25
    start = audit_of(h)
    assert [e["outcome"] for e in start] == ["started"]
    first_digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert start[0]["digest"] == first_digest
    with caplog.at_level(logging.INFO, logger="vllm_output_rate.adapter.operate"):
        reload(h, path, watcher, 1000, {"u": 10, "w": 7}, bump=1)
        h.step()
    entry = audit_of(h)[-1]
    assert entry["outcome"] == "applied"
    assert entry["digest"] == hashlib.sha256(path.read_bytes()).hexdigest() != first_digest
    assert entry["previous_digest"] == first_digest
    assert entry["time"] == "2027-01-15T08:00:00.250Z"
    assert entry["changes"] == [
        {"key": "user_output_tokens_per_second.u", "from": 20, "to": 10},
        {"key": "user_output_tokens_per_second.v", "from": 5, "to": None},
        {"key": "user_output_tokens_per_second.w", "from": None, "to": 7},
    ]
    # One structured line per change, each a whole JSON object.
    lines = [r.getMessage() for r in caplog.records if "limits audit" in r.getMessage()]
    assert len(lines) == 3
    parsed = [json.loads(line.split("limits audit ", 1)[1]) for line in lines]
    assert [(p["key"], p["from"], p["to"]) for p in parsed] == [
        (c["key"], c["from"], c["to"]) for c in entry["changes"]]
    assert all(p["digest"] == entry["digest"] for p in parsed)
    assert h.sched.output_rate_users()["limits_digest"] == entry["digest"]


def test_an_unchanged_reload_is_recorded_with_no_change(tmp_path):
    h, path, watcher = make_harness(tmp_path, {"u": 20})
    digest = audit_of(h)[0]["digest"]
    write_limits(path, 1000, {"u": 20})  # the same limits, rewritten
    bump_mtime(path, 1)
    assert watcher.check()
    h.step()
    entry = audit_of(h)[-1]
    assert entry["outcome"] == "applied" and entry["changes"] == []
    assert entry["digest"] == entry["previous_digest"] == digest


def test_a_weight_that_does_nothing_is_warned_about_at_start_and_on_reload(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="vllm_output_rate.adapter.operate"):
        h, path, watcher = make_harness(tmp_path, {"u": 20})
        assert not [r for r in caplog.records if "weight does nothing" in r.getMessage()]
        write_limits(path, 1000, {"u": {"rate": 20, "weight": 3}})  # the same hard cap of 20
        bump_mtime(path, 1)
        assert watcher.check()
        h.step()
    warned = [r.getMessage() for r in caplog.records if "weight does nothing" in r.getMessage()]
    assert len(warned) == 1 and "user 'u' (weight 3)" in warned[0]
    assert h.sched.output_rate_reloads == 1  # applied all the same: a hard cap of 20
    # A file of many such users: one line, the first ten named.
    caplog.clear()
    many = {f"u{i:02d}": {"rate": 20, "weight": 3} for i in range(25)}
    with caplog.at_level(logging.WARNING, logger="vllm_output_rate.adapter.operate"):
        write_limits(path, 1000, many)
        bump_mtime(path, 2)
        assert watcher.check()
        h.step()
    warned = [r.getMessage() for r in caplog.records if "weight does nothing" in r.getMessage()]
    assert len(warned) == 1 and warned[0].count("(weight 3)") == 10 and warned[0].endswith(" and 15 more")


def test_a_failed_reload_records_why_and_the_version_still_in_force(tmp_path, caplog):
    import logging

    h, path, watcher = make_harness(tmp_path, {"u": 20})
    digest = audit_of(h)[0]["digest"]
    path.write_text("{not json")
    bump_mtime(path, 1)
    with caplog.at_level(logging.ERROR, logger="vllm_output_rate.adapter.operate"):
        assert watcher.check()
    h.step()
    entry = audit_of(h)[-1]
    assert entry["outcome"] == "rejected"
    assert "cannot parse" in entry["reason"]
    assert entry["digest"] == digest and entry["changes"] == []
    assert h.sched.output_rate_users()["limits_digest"] == digest
    lines = [r.getMessage() for r in caplog.records if "limits audit" in r.getMessage()]
    assert len(lines) == 1 and json.loads(lines[0].split("limits audit ", 1)[1])["outcome"] == "rejected"


def test_the_audit_keeps_the_last_n_records(tmp_path):
    from vllm_output_rate.adapter.operate import AUDIT_KEEP

    h, path, watcher = make_harness(tmp_path, {"u": 20})
    for i in range(AUDIT_KEEP + 5):
        reload(h, path, watcher, 1000, {"u": 20 + i % 2}, bump=i + 1)
        h.step()
    entries = audit_of(h)
    assert len(entries) == AUDIT_KEEP
    assert all(e["outcome"] == "applied" for e in entries)  # the start record went first
    last = 20 + (AUDIT_KEEP + 4) % 2
    assert entries[-1]["changes"] == [
        {"key": "user_output_tokens_per_second.u", "from": 41 - last, "to": last}]


# -- what an operator needs to read a borrower (issue 45 item 3) ---------------------


def test_ceiling_weight_and_residency_in_the_report_and_the_admin_route(tmp_path):
    """A user at 4 tok/s holds at most 2 requests (the default pace 2): of
    its 5, 3 wait, held by the cap; a borrower shows its ceiling and weight,
    one without a ceiling no ceiling and no cap."""
    h, path, watcher = make_harness(tmp_path, {"capped": 4})
    h.shadow = None  # borrowers run beyond their rates
    write_limits(path, 1000, {"capped": 4, "b": {"rate": 5, "ceil": 50, "weight": 3},
                              "open": {"rate": 5, "ceil": None}})
    bump_mtime(path, 1)
    assert watcher.check()
    for _ in range(5):
        h.add("capped", max_tokens=10_000)
    h.add("b", max_tokens=10_000)
    for _ in range(20):
        h.step(10 * MS)
    report = h.sched.output_rate_report(h.clock.now_ns)
    assert report["limits"]["capped"] == [4, 4, 2, 3]
    assert report["limits"]["b"] == [50, 3, 25, 0]
    assert report["limits"]["open"] == [None, 5, None, 0]
    assert "shadow" not in report and report["mode"] == "enforce"
    users = h.sched.output_rate_users()["users"]
    assert users["capped"]["residency_cap"] == 2 and users["capped"]["residency_held"] == 3
    assert users["capped"]["waiting"] == 3
    assert users["b"]["ceil"] == 50 and users["b"]["weight"] == 3
    assert users["open"]["residency_cap"] is None


def test_the_startup_burst_stays_through_a_reload_and_the_admin_answer_names_it(tmp_path):
    path = tmp_path / "limits.json"
    write_limits(path, 1000, {"u": 20})
    h = Harness({"limits_file": str(path), "default_user_output_tokens_per_second": 7,
                 "burst_seconds": 0.25}, max_num_seqs=16)
    watcher = h.sched._operate.watcher
    watcher.stop()
    assert h.sched.output_rate_users()["burst_seconds"] == 0.25
    write_limits(path, 1000, {"u": 10})
    bump_mtime(path, 1)
    assert watcher.check()
    h.step()
    assert audit_of(h)[-1]["outcome"] == "applied"
    assert h.sched.output_rate_settings.user_rates["u"] == 10
    assert h.sched.output_rate_users()["burst_seconds"] == 0.25
    assert h.sched.output_rate_limiter.burst_ns == 250_000_000
