"""Groups of users (issue 25) on vLLM's real Scheduler and KV manager.

The harness fabricates each step's sampled tokens and a fake clock drives
every quota, so each assertion is exact: the group's bound over every window,
each user's own, a user without a group decided exactly as without groups,
no request lost or cut short, and the live reload, report, series and admin
rows of groups.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st

from vllm_output_rate_harness.scheduler_sim import MS, Harness, bound, max_in_window

S = 1_000_000_000
WINDOWS_S = (0.01, 0.1, 0.5, 1, 2, 5)


def limits(default, users, groups=None, **extra):
    section = {"default_user_output_tokens_per_second": default,
               "user_output_tokens_per_second": users, **extra}
    if groups is not None:
        section["groups"] = groups
    return section


def pair(rate=20, **extra):
    """Users a and b at their own ``rate``, both in group g; c alone at 20."""
    return {"a": {"rate": rate, "group": "g", **extra}, "b": {"rate": rate, "group": "g", **extra},
            "c": 20}


def group_times(h: Harness, *users: str) -> list[int]:
    return sorted(t for u in users for t in h.charges[u])


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_groups_users_are_held_to_its_rate_together_a_user_without_group_is_unaffected(async_):
    """a and b (20 tok/s each) in a group of 30 tok/s, c (20 tok/s) beside them."""
    def run(groups):
        users = pair() if groups else {"a": 20, "b": 20, "c": 20}
        h = Harness(limits(100, users, groups), max_num_seqs=16, async_=async_)
        for user in "abc":
            for _ in range(4):
                h.add(user, max_tokens=60)
        steps = h.run_until_done(10 * MS)
        return h, steps

    h, steps = run({"g": 30})
    both = group_times(h, "a", "b")
    for window_s in WINDOWS_S:
        window = int(window_s * S)
        assert max_in_window(both, window) <= bound(window_s, 30), window_s
        for user in "ab":
            assert max_in_window(h.charges[user], window) <= bound(window_s, 20)
    # Held, not starved: 480 tokens at the group's 30 tok/s, the two sharing it.
    span_s = (both[-1] - both[0]) / S
    assert 480 / 30 - 0.2 <= span_s <= 480 / 30 + 0.5, span_s
    half = both[len(both) // 2]
    assert abs(sum(t < half for t in h.charges["a"]) - sum(t < half for t in h.charges["b"])) <= 4
    # Nothing lost or cut short: every request finished with all its tokens.
    for record in h.records.values():
        assert record.finished and len(record.sample_times) == record.max_tokens
    h.check_resident_consistent()
    # c, in no group, samples exactly when it does without any group configured.
    plain, _ = run(None)
    for rid, record in h.records.items():
        if record.user == "c":
            assert record.sample_times == plain.records[rid].sample_times


GROUPS_NEVER_HIT = {
    "default_user_output_tokens_per_second": 1e9,
    "user_output_tokens_per_second": {"a": {"rate": 1e9, "group": "g"}, "b": {"rate": 1e9, "group": "g"}},
    "groups": {"g": 1e9},
}


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@hyp_settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_groups_never_reached_decide_exactly_as_stock_vllm(async_, data):
    """The differential test of test_stock_equivalence.py, with users a and b
    in a group whose limit is never reached (c in none)."""
    from test_stock_equivalence import first_difference, trace, workloads

    workload = data.draw(workloads("fcfs", True))
    stock = trace(workload, None, async_)
    ours = trace(workload, GROUPS_NEVER_HIT, async_)
    difference = first_difference(stock, ours)
    assert difference is None, difference


@pytest.mark.parametrize("user", ["a", "b"])
def test_either_user_alone_gets_its_own_rate(user):
    h = Harness(limits(100, pair(), {"g": 30}), max_num_seqs=16)
    for _ in range(4):
        h.add(user, max_tokens=2000)
    for _ in range(600):
        h.step(10 * MS)
    times = h.charges[user]
    assert 0.95 * 20 * 6 <= len(times) <= bound(6, 20)
    for window_s in WINDOWS_S:
        assert max_in_window(times, int(window_s * S)) <= bound(window_s, 20)


def distinct_prompt(seed: int, length: int) -> list[int]:
    """A prompt sharing no 16-token block with another seed's (no cache hits)."""
    return [100 + (seed * 7919 + i * 31) % 900 for i in range(length)]


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_prompt_flood_of_a_group_is_held_to_its_rate_plus_one_chunk(async_, long_context_model_dir):
    """Two users of a group of 100 tok/s each send 4,000-token prompts with
    max_tokens 1 at weight 0.5: output + 0.5 x prompt tokens of both stay
    within (W + 0.1) x 100 + 1 + ceil(0.5 x C) in every window."""
    budget = 512
    users = {"a": {"rate": 100, "group": "g"}, "b": {"rate": 100, "group": "g"}, "light": 1000}
    h = Harness(
        limits(100, users, {"g": 100}, input_token_weight=0.5), async_=async_,
        max_num_batched_tokens=budget, max_model_len=8192, num_blocks=4000,
        model_dir=long_context_model_dir,
    )
    h.add("light", prompt_len=8, max_tokens=250, request_id="light")
    for i in range(8):
        h.add("ab"[i % 2], max_tokens=1, prompt=distinct_prompt(i, 4000))
    sched = h.sched
    series = []
    for _ in range(400):
        now = h.clock.now_ns
        h.step(10 * MS)
        cost = sum(
            sched.output_rate_gate.ledger.charged_tokens.get(u, 0)
            + Fraction(1, 2) * sched.output_rate_prompt_cost.prompt_tokens.get(u, 0)
            for u in "ab"
        )
        series.append((now, cost))
    h.drain()
    extra = math.ceil(Fraction(1, 2) * budget)
    previous = [Fraction(0)] + [c for _, c in series[:-1]]
    for i, (t0, _) in enumerate(series):
        for t1, cumulative in series[i:]:
            window = Fraction(t1 - t0, S)
            assert cumulative - previous[i] <= (window + Fraction(1, 10)) * 100 + 1 + extra
    # Held, not starved: about the group's rate over 4 s, and the members
    # took turns (one chunk of 512 prompt tokens costs 2.5 s of the group's rate).
    assert series[-1][1] >= (Fraction(series[-1][0] - series[0][0], S) - 1) * 100
    assert all(sched.output_rate_prompt_cost.prompt_tokens.get(u, 0) >= 500 for u in "ab")
    assert len(h.records["light"].sample_times) == 250  # beside them, the light user ran


def test_borrowing_within_the_groups_ceiling():
    """a and b borrow (rate 5, no ceiling of their own) in a group of rate 10,
    ceil 30; d borrows beside them without a group.  Every token of the group
    stays within its ceiling, its guaranteed ones within its rate."""
    users = {"a": {"rate": 5, "ceil": None, "group": "g"},
             "b": {"rate": 5, "ceil": None, "group": "g"},
             "d": {"rate": 5, "ceil": None}}
    h = Harness(limits(100, users, {"g": {"rate": 10, "ceil": 30}}), max_num_seqs=16,
                max_num_active_seqs=8)
    for user in "abd":
        for _ in range(4):
            h.add(user, max_tokens=2000)
    for _ in range(600):
        h.step(10 * MS)
        h.check_resident_consistent()
    both = group_times(h, "a", "b")
    for window_s in WINDOWS_S:
        assert max_in_window(both, int(window_s * S)) <= bound(window_s, 30), window_s
    assert len(both) >= 0.95 * 30 * 6  # spare capacity: up to the group's ceiling
    assert abs(len(h.charges["a"]) - len(h.charges["b"])) <= 4
    assert len(h.charges["d"]) >= 0.95 * 600 * 4  # d's 4 streams run every step
    borrowing = h.sched.output_rate_gate.borrowing
    assert borrowing.borrowed_tokens["a"] > 0 and borrowing.borrowed_tokens["d"] > 0


def write_limits(path, users, groups=None):
    data = {"default_user_output_tokens_per_second": 1000, "user_output_tokens_per_second": users}
    if groups is not None:
        data["groups"] = groups
    path.write_text(json.dumps(data))


def bump_mtime(path, n):
    import os

    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + n * S))


def test_reload_changes_groups_live_and_their_series_and_admin_rows(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from vllm_output_rate.adapter.metrics import OutputRateExporter
    from vllm_output_rate.tools import measure

    path = tmp_path / "limits.json"
    write_limits(path, {"a": 20, "b": 20})
    h = Harness({"limits_file": str(path), "default_user_output_tokens_per_second": 7},
                max_num_seqs=16)
    sched = h.sched
    sched.output_rate_operate_clock = h.clock
    watcher = sched._operate.watcher
    watcher.stop()  # the test checks the file itself, at chosen fake-clock instants
    registry = CollectorRegistry()
    exporter = OutputRateExporter("tiny", registry)

    def scrape():
        exporter.observe(sched.output_rate_report(h.clock.now_ns))
        return measure.parse_metrics(generate_latest(registry).decode())

    def run(steps):
        start = h.clock.now_ns
        for _ in range(steps):
            h.step(10 * MS)
        return start, h.clock.now_ns

    for user in "ab":
        for _ in range(4):
            h.add(user, max_tokens=5000)
    start, end = run(300)
    assert sched.output_rate_groups is None and "groups" not in sched.output_rate_report(end)
    assert len(group_times(h, "a", "b")) >= 0.95 * 40 * 3  # 20 each, no group yet

    # A group of 15 tok/s for both: from the next step on, 15 together.
    write_limits(path, {"a": {"rate": 20, "group": "g"}, "b": {"rate": 20, "group": "g"}}, {"g": 15})
    bump_mtime(path, 1)
    assert watcher.check()
    start, end = run(500)
    assert sched.output_rate_reloads == 1
    both = [t for t in group_times(h, "a", "b") if t >= start]
    for window_s in (0.1, 1, 4):
        assert max_in_window(both, int(window_s * S)) <= bound(window_s, 15)
    assert len(both) >= 0.95 * 15 * 5 - 2
    metrics = scrape()
    charged = measure.metric_sum(metrics, "vllm:output_rate_group_output_tokens_charged_total", group="g")
    assert charged == sum(sched.output_rate_gate.ledger.charged_tokens[u] for u in "ab")
    assert measure.metric_sum(metrics, "vllm:output_rate_group_limit_tokens_per_second", group="g") == 15
    held = sum(measure.metric_sum(metrics, "vllm:output_rate_group_requests", group="g", state=state)
               for state in ("active", "throttled"))
    assert held == 8
    assert measure.metric_sum(metrics, "vllm:output_rate_user_group", user="a", group="g") == 1
    snap = sched.output_rate_users()
    row = snap["groups"]["g"]
    assert (row["rate"], row["ceil"], row["weight"], row["members"]) == (15, 15, 15, ["a", "b"])
    assert row["tokens_charged_total"] == charged
    assert row["active"] + row["throttled"] == 8
    assert snap["users"]["a"]["group"] == "g"
    json.dumps(snap)  # travels as a utility result

    # b leaves the group and the group's rate rises: b at its own 20 again, a at 20.
    write_limits(path, {"a": {"rate": 20, "group": "g"}, "b": 20}, {"g": 100})
    bump_mtime(path, 2)
    assert watcher.check()
    start, end = run(400)
    for user in "ab":
        late = [t for t in h.charges[user] if t >= start + S]
        assert 0.95 * 20 * 3 <= len(late) <= bound(3, 20), user
    metrics = scrape()
    assert measure.metric_sum(metrics, "vllm:output_rate_user_group", user="b") is None
    assert sched.output_rate_users()["groups"]["g"]["members"] == ["a"]

    # No groups any more: the gate pays users alone, the group's series go.
    write_limits(path, {"a": 20, "b": 20})
    bump_mtime(path, 3)
    assert watcher.check()
    run(10)
    assert sched.output_rate_groups is None and sched.output_rate_gate.limiter is sched.output_rate_limiter
    metrics = scrape()
    assert measure.metric_sum(metrics, "vllm:output_rate_group_output_tokens_charged_total") is None
    assert measure.metric_sum(metrics, "vllm:output_rate_user_group") is None
    assert sched.output_rate_users()["groups"] == {}
