"""Shadow mode on vLLM's real scheduler (fake clock, no model).

* with limits that bind, shadow mode decides exactly as stock vLLM, step for
  step (the stock-equivalence trace of ``test_stock_equivalence``);
* its counters equal an independent GCRA count of the tokens stock vLLM
  gave (a user at twice its rate shows half of its tokens held);
* shadow -> enforce -> shadow by limits-file reload, without a restart.
"""

from __future__ import annotations

import json
import os
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from test_stock_equivalence import first_difference, trace, workloads
from vllm_output_rate.adapter.metrics import OutputRateExporter
from vllm_output_rate.adapter.shadow import ShadowAsyncScheduler, ShadowScheduler
from vllm_output_rate.policy.monitor import SHADOW_BORROWED, SHADOW_HELD
from vllm_output_rate_harness.scheduler_sim import MS, Harness, max_in_window

S = 1000 * MS
#: Limits that bind on the generated workloads: every user at a few tok/s,
#: one borrower in a group with a ceiling.
BINDING = {
    "default_user_output_tokens_per_second": 5,
    "user_output_tokens_per_second": {"a": 3, "b": {"rate": 2, "ceil": 4, "group": "g"}},
    "groups": {"g": {"rate": 3, "ceil": 6}},
    "mode": "shadow",
}
SHADOW_CASES = [
    ("fcfs", True, False), ("fcfs", True, True), ("fcfs", False, False), ("priority", True, True),
]


def shadow_cls(async_):
    return ShadowAsyncScheduler if async_ else ShadowScheduler


@pytest.mark.parametrize(
    "policy,chunked,async_", SHADOW_CASES,
    ids=[f"{p}-{'chunked' if c else 'whole'}-{'async' if a else 'sync'}" for p, c, a in SHADOW_CASES],
)
def test_shadow_mode_with_binding_limits_decides_like_stock(policy, chunked, async_):
    @settings(max_examples=6, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(workloads(policy, chunked))
    def check(workload):
        stock = trace(workload, None, async_)
        shadow = trace(workload, BINDING, async_, scheduler_cls=shadow_cls(async_))
        difference = first_difference(stock, shadow)
        assert difference is None, difference
        # The same limits enforced do bind on some workload (else this test
        # could not fail): checked below on a fixed one.

    check()


def test_the_binding_limits_do_bind_when_enforced():
    """The limits above change decisions when enforced (the shadow test is not vacuous)."""
    def run(limits, cls=None):
        h = Harness(limits, max_num_seqs=8, scheduler_cls=cls)
        h.shadow = None
        for user in ("a", "b", "c"):
            h.add(user, max_tokens=60)
        return [sorted(h.step(10 * MS).num_scheduled_tokens.items()) for _ in range(40)]

    stock = run(None)
    assert run(BINDING, ShadowScheduler) == stock
    assert run({**BINDING, "mode": "enforce"}, ShadowScheduler) != stock


def gcra_count(times_ns, rate, burst_ns=100 * MS):
    """An independent GCRA over sample times: (conforming, non-conforming);
    a non-conforming token does not move the TAT."""
    interval = Fraction(10**9) / Fraction(rate)
    tat = None
    ok = held = 0
    for t in times_ns:
        base = t if tat is None or tat < t else tat
        if base - t <= burst_ns:
            tat = base + interval
            ok += 1
        else:
            held += 1
    return ok, held


def gcra_pair(times_ns, rate, ceil, burst_ns=100 * MS):
    """Independent borrower count: each token offered to the ceiling, then the rate."""
    ceil_tat = rate_tat = None
    borrowed = held = 0
    for t in times_ns:
        base = t if ceil_tat is None or ceil_tat < t else ceil_tat
        if base - t > burst_ns:
            held += 1
            continue
        ceil_tat = base + Fraction(10**9) / ceil
        base = t if rate_tat is None or rate_tat < t else rate_tat
        if base - t <= burst_ns:
            rate_tat = base + Fraction(10**9) / rate
        else:
            borrowed += 1
    return borrowed, held


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_user_at_twice_its_rate_shows_half_its_tokens_held(async_):
    """One stream, one token per 10 ms step (100 tok/s) at a rate of 50: the
    shadow counter holds exactly what an independent GCRA refuses, about
    half; a borrower (rate 25, ceil 50) borrows and holds exactly what two
    independent GCRAs give; nothing else changes a decision."""
    limits = {
        "default_user_output_tokens_per_second": 1000,
        "user_output_tokens_per_second": {"u": 50, "b": {"rate": 25, "ceil": 50}},
        "mode": "shadow",
    }
    h = Harness(limits, async_=async_, scheduler_cls=shadow_cls(async_))
    h.shadow = None
    h.sched.output_rate_operate_clock = h.clock
    h.add("u", max_tokens=900)
    h.add("b", max_tokens=900)
    h.add("free", max_tokens=900)
    for _ in range(400):
        h.step(10 * MS)
    counter = h.sched.output_rate_shadow
    u_times, b_times = h.charges["u"], h.charges["b"]
    assert len(u_times) >= 390
    ok, held = gcra_count(u_times, 50)
    assert counter.users.held["u"] == held
    assert abs(held - len(u_times) / 2) <= 0.1 * 50 + 1  # at most the burst away from half
    borrowed, b_held = gcra_pair(b_times, 25, 50)
    assert counter.users.borrowed["b"] == borrowed and counter.users.held["b"] == b_held
    assert abs(borrowed - len(b_times) / 4) <= 0.1 * 50 + 1
    assert "free" not in counter.users.held
    # Throttled: each step that held a token counts until the next step
    # (10 ms, less than what one held token takes to pay back, 20 ms).
    held_steps = _steps_over(u_times, 50)
    assert counter.users.throttled_ns["u"] == 10 * MS * len([t for t in held_steps if t < u_times[-1]])
    # Stock gave the tokens: charged counts them all.
    report = h.sched.output_rate_report(h.clock.now_ns)
    assert report["users"]["u"][0] == len(u_times)
    assert report["shadow"]["u"][SHADOW_HELD] == held
    assert report["shadow"]["b"][SHADOW_BORROWED] == borrowed
    assert report["mode"] == "shadow"
    registry = CollectorRegistry()
    exporter = OutputRateExporter("m", registry)
    exporter.observe(report)
    values = {
        (s.name, s.labels.get("user"), s.labels.get("mode")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
    }
    assert values[("vllm:output_rate_shadow_held_tokens_total", "u", None)] == held
    assert values[("vllm:output_rate_shadow_borrowed_tokens_total", "b", None)] == borrowed
    assert values[("vllm:output_rate_shadow_throttled_seconds_total", "u", None)] == pytest.approx(
        counter.users.throttled_ns["u"] / S)
    assert values[("vllm:output_rate_mode", None, "shadow")] == 1
    assert values[("vllm:output_rate_mode", None, "enforce")] == 0
    admin = h.sched.output_rate_users()
    assert admin["mode"] == "shadow"
    assert admin["users"]["u"]["shadow"]["held_tokens_total"] == held


def _steps_over(times, rate, burst_ns=100 * MS):
    """Sample times the independent GCRA refused."""
    interval = Fraction(10**9) / Fraction(rate)
    tat, out = None, []
    for t in times:
        base = t if tat is None or tat < t else tat
        if base - t <= burst_ns:
            tat = base + interval
        else:
            out.append(t)
    return out


def test_residency_cap_would_have_kept_requests_waiting():
    """A user at 4 tok/s (cap 2 at the default pace of 2) with 5 resident
    requests under stock: 3 would have waited."""
    limits = {"default_user_output_tokens_per_second": 1000,
              "user_output_tokens_per_second": {"u": 4}, "mode": "shadow"}
    h = Harness(limits, scheduler_cls=ShadowScheduler)
    h.shadow = None
    for _ in range(5):
        h.add("u", max_tokens=500)
    for _ in range(5):
        h.step(10 * MS)
    report = h.sched.output_rate_report(h.clock.now_ns)
    assert report["shadow"]["u"][3] == 3
    assert report["limits"]["u"][2] == 2  # the cap itself
    assert h.sched.output_rate_users()["users"]["u"]["shadow"]["residency_held"] == 3


def write(path, mode, rate):
    path.write_text(json.dumps({"default_user_output_tokens_per_second": 1000,
                                "user_output_tokens_per_second": {"u": rate}, "mode": mode}))


def bump(path, n):
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + n * 10**9))


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_shadow_enforce_shadow_by_reload(tmp_path, async_):
    path = tmp_path / "limits.json"
    write(path, "shadow", 20)
    h = Harness({"limits_file": str(path), "default_user_output_tokens_per_second": 1},
                async_=async_, scheduler_cls=shadow_cls(async_))
    h.shadow = None
    watcher = h.sched._operate.watcher
    watcher.stop()
    for _ in range(2):
        h.add("u", max_tokens=5000)
    for _ in range(100):  # 1 s, stock: two streams, 200 tok/s
        h.step(10 * MS)
    t0 = h.clock.now_ns
    assert len([t for t in h.charges["u"] if t >= t0 - S]) >= 190
    held_before = h.sched.output_rate_shadow.users.held["u"]
    assert held_before > 100

    write(path, "enforce", 20)
    bump(path, 1)
    assert watcher.check()
    for _ in range(300):
        h.step(10 * MS)
    t1 = h.clock.now_ns
    enforced = [t for t in h.charges["u"] if t0 <= t < t1]
    assert h.sched.output_rate_settings.mode == "enforce"
    for window_s in (1, 2):
        assert max_in_window(enforced, window_s * S) <= (window_s + 0.1) * 20 + 1 + 2  # + in flight
    assert h.sched.output_rate_shadow.users.held["u"] == held_before  # not fed while enforcing
    h.check_resident_consistent()

    write(path, "shadow", 20)
    bump(path, 2)
    assert watcher.check()
    for _ in range(100):
        h.step(10 * MS)
    again = [t for t in h.charges["u"] if t >= t1 + 10 * MS]
    assert len(again) >= 190
    assert h.sched.output_rate_shadow.users.held["u"] > held_before + 100
    assert h.sched.output_rate_reloads == 2
    changes = [c for e in h.sched.output_rate_users()["audit"] for c in e["changes"]]
    assert {"key": "mode", "from": "shadow", "to": "enforce"} in changes
    assert {"key": "mode", "from": "enforce", "to": "shadow"} in changes
    h.run_until_done()
    h.check_resident_consistent()


def test_the_mode_flag_lands_in_the_section_and_selects_the_shadow_scheduler(tmp_path):
    import argparse
    import types

    from vllm_output_rate.adapter import patches
    from vllm_output_rate.settings import OutputRateConfigError

    parser = argparse.ArgumentParser()
    patches.add_output_rate_args(parser)
    args = parser.parse_args(["--default-user-output-tokens-per-second", "5",
                              "--output-rate-mode", "shadow"])
    engine_args = types.SimpleNamespace(additional_config=None)
    patches.merge_cli_into_engine_args(engine_args, args)
    assert engine_args.additional_config["output_rate"]["mode"] == "shadow"
    with pytest.raises(SystemExit):
        parser.parse_args(["--default-user-output-tokens-per-second", "5",
                           "--output-rate-mode", "dry-run"])
    with pytest.raises(OutputRateConfigError, match="--output-rate-mode needs the feature on"):
        patches.merge_cli_into_engine_args(
            types.SimpleNamespace(additional_config=None),
            parser.parse_args(["--output-rate-mode", "shadow"]))
    # Shadow mode, or a limits file (its reload may switch): the shadow
    # scheduler; enforce without a file: the plugin's own, unchanged.
    shadowing = Harness({**BINDING}, scheduler_cls=ShadowScheduler)
    assert shadowing.config.scheduler_config.scheduler_cls == patches.SHADOW_SCHEDULER_CLS
    path = tmp_path / "limits.json"
    write(path, "enforce", 20)
    filed = Harness({"limits_file": str(path)}, scheduler_cls=ShadowScheduler)
    assert filed.config.scheduler_config.scheduler_cls == patches.SHADOW_SCHEDULER_CLS
    plain = Harness({"default_user_output_tokens_per_second": 5})
    assert plain.config.scheduler_config.scheduler_cls == patches.SCHEDULER_CLS
