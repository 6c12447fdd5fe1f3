"""Per-user reports (:mod:`vllm_output_rate.policy.monitor`) and their Prometheus export.

No engine: reports are fed with the cumulative dicts the gate keeps, and
exported into a private Prometheus registry.  The patches that carry a
report (its stats field, the Prometheus logger, the admin utility) are
checked on vLLM's own classes.
"""

from __future__ import annotations

import gc
import random
import tracemalloc

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from vllm_output_rate.adapter.metrics import OutputRateExporter
from vllm_output_rate.policy.monitor import (
    ACTIVE, BORROWED, CHARGED, LIMIT, OTHER_USERS, PROMPT, THROTTLED, THROTTLED_S, WAITING, ChargeHistory,
    UserMonitor,
)

S = 1_000_000_000
CONFIGURED = {"alice": 10.0, "bob": 20.0}


def rate_of(user):
    return CONFIGURED.get(user, 100.0)


def series(registry, name):
    """{labels tuple: value} of one metric family's samples."""
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def test_increments_add_up_to_totals_and_others_are_summed():
    mon = UserMonitor(max_users=1)
    charged = {"alice": 5, "carol": 7, "dave": 3}
    counts = {"alice": (1, 2, 0), "carol": (1, 0, 0), "dave": (0, 1, 4)}
    rep = mon.report(S, charged, {"alice": S // 2}, counts, CONFIGURED, rate_of)
    users = rep["users"]
    # Configured users always; one more (the busiest: carol); dave under __other__.
    assert set(users) == {"alice", "bob", "carol", OTHER_USERS}
    assert users["alice"][CHARGED] == 5 and users["alice"][THROTTLED_S] == 0.5
    assert users["alice"][ACTIVE:WAITING + 1] == [1, 2, 0]
    assert users["alice"][LIMIT] == 10.0 and users["carol"][LIMIT] == 100.0
    assert users["bob"][CHARGED] == 0 and users["bob"][LIMIT] == 20.0
    assert users[OTHER_USERS][CHARGED] == 3
    assert users[OTHER_USERS][THROTTLED] == 1 and users[OTHER_USERS][WAITING] == 4
    assert users[OTHER_USERS][LIMIT] is None
    rep2 = mon.report(2 * S, {"alice": 9, "carol": 7, "dave": 10}, {"alice": S}, {}, CONFIGURED, rate_of)
    assert rep2["users"]["alice"][CHARGED] == 4
    assert rep2["users"]["alice"][THROTTLED_S] == 0.5
    assert rep2["users"]["carol"][CHARGED] == 0
    assert rep2["users"][OTHER_USERS][CHARGED] == 7
    # A user the gate forgot (telling the monitor) and saw again starts from
    # 0: its new total counts whole.
    mon.forget(["alice"])
    rep3 = mon.report(3 * S, {"alice": 2}, {}, {}, CONFIGURED, rate_of)
    assert rep3["users"]["alice"][CHARGED] == 2


def test_a_total_that_goes_down_is_not_a_restart_and_is_never_counted_twice():
    """Only :meth:`UserMonitor.forget` restarts a user's count.  A total that
    went down otherwise (a refund after the total was read) counts nothing,
    and afterwards only growth beyond the highest total reported counts: the
    sum of the increments never exceeds the highest total seen."""
    mon = UserMonitor(max_users=4)
    published = 0
    for t, total in enumerate((1_000_000, 999_997, 999_999, 1_000_005), start=1):
        rep = mon.report(t * S, {"carol": total}, {}, {}, CONFIGURED, rate_of,
                         prompt_charged={"carol": total}, borrowed={"carol": total})
        row = rep["users"]["carol"]
        assert row[CHARGED] >= 0 and row[PROMPT] == row[CHARGED] and row[BORROWED] == row[CHARGED]
        published += row[CHARGED]
        assert published == max(1_000_000, total), (t, total, published)


def test_engine_totals_become_increments_and_gauges_pass_through():
    mon = UserMonitor(max_users=0)
    first = mon.report(S, {}, {}, {}, {}, rate_of, {"idle_steps_total": 5, "throttled_requests": 3})
    second = mon.report(2 * S, {}, {}, {}, {}, rate_of, {"idle_steps_total": 8, "throttled_requests": 1})
    assert first["engine"] == {"idle_steps_total": 5, "throttled_requests": 3}
    assert second["engine"] == {"idle_steps_total": 3, "throttled_requests": 1}


def test_idle_labelled_users_are_dropped_and_their_slot_reused():
    mon = UserMonitor(max_users=1, idle_evict_s=10)
    rep = mon.report(S, {"x": 1}, {}, {}, {}, rate_of)
    assert "x" in rep["users"]
    rep = mon.report(5 * S, {"x": 1, "y": 4}, {}, {}, {}, rate_of)
    assert "y" not in rep["users"] and rep["users"][OTHER_USERS][CHARGED] == 4
    rep = mon.report(12 * S, {"x": 1, "y": 4}, {}, {}, {}, rate_of)
    assert rep["removed"] == ["x"]
    rep = mon.report(13 * S, {"y": 6}, {}, {}, {}, rate_of)
    assert "y" in rep["users"] and rep["users"]["y"][CHARGED] == 2


def test_flood_of_invented_names_keeps_series_bounded_and_memory_flat():
    """10,000 invented names: series stay at configured + K + __other__."""
    k = 20
    mon = UserMonitor(max_users=k, idle_evict_s=30)
    registry = CollectorRegistry()
    exporter = OutputRateExporter("m", registry=registry)
    rng = random.Random(7)
    names = [f"invented-{i}" for i in range(10_000)]
    per_round = 200
    total_charged = 0
    exported_before = None
    sizes = []
    for rnd in range(50):
        # The gate forgets idle users, so each report sees only recent ones.
        batch = names[(rnd * per_round) % len(names):][:per_round]
        charged = {name: rng.randint(1, 30) for name in batch}
        charged.update({"alice": 10 * (rnd + 1)})
        total_charged += sum(v for n, v in charged.items() if n != "alice") + 10
        counts = {name: (1, 0, 0) for name in batch[:50]}
        report = mon.report(rnd * S, charged, {}, counts, CONFIGURED, rate_of)
        assert len(report["users"]) <= len(CONFIGURED) + k + 1
        exporter.observe(report)
        if rnd == 10:
            gc.collect()
            tracemalloc.start()
            exported_before = tracemalloc.take_snapshot()
        if rnd >= 10:
            sizes.append(mon.tracked())
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(exported_before, "filename"))
    charged_series = series(registry, "vllm:output_rate_output_tokens_charged_total")
    users = {dict(labels)["user"] for labels in charged_series}
    assert len(users) <= len(CONFIGURED) + k + 1
    assert OTHER_USERS in users and "alice" in users and "bob" in users
    # Nothing is lost: every charged token is in some series.
    assert sum(charged_series.values()) >= total_charged - 30 * per_round  # removed series drop theirs
    assert max(sizes) <= 2 * per_round + k + 2
    # 40 rounds of 200 fresh names each: bounded state, so well under 1 MB of growth.
    assert grown < 1_000_000, grown
    text = generate_latest(registry).decode()
    assert text.count('vllm:output_rate_requests{') <= 3 * (len(CONFIGURED) + k + 1)


def test_exporter_series_and_removal():
    registry = CollectorRegistry()
    exporter = OutputRateExporter("tiny", registry=registry)
    exporter.observe({
        "users": {"alice": [5, 0.25, 1, 2, 3, 10.0], OTHER_USERS: [1, 0.0, 0, 0, 0, None]},
        "removed": [],
        "engine": {"throttled_requests": 2, "idle_steps_total": 4, "reloads_total": 1,
                   "reload_failures_total": 0, "evictions_total": 3,
                   "eviction_recompute_tokens_total": 120},
    })
    exporter.observe({"users": {"alice": [2, 0.0, 0, 0, 0, 10.0]}, "removed": [], "engine": {}})
    charged = series(registry, "vllm:output_rate_output_tokens_charged_total")
    assert charged[(("model_name", "tiny"), ("user", "alice"))] == 7
    assert charged[(("model_name", "tiny"), ("user", OTHER_USERS))] == 1
    req = series(registry, "vllm:output_rate_requests")
    assert req[(("model_name", "tiny"), ("state", "throttled"), ("user", "alice"))] == 0
    limit = series(registry, "vllm:output_rate_limit_tokens_per_second")
    assert list(limit.values()) == [10.0]
    assert series(registry, "vllm:output_rate_idle_steps_total") == {(("model_name", "tiny"),): 4}
    assert series(registry, "vllm:output_rate_limit_reloads_total") == {(("model_name", "tiny"),): 1}
    assert series(registry, "vllm:output_rate_limit_reload_failures_total") == {(("model_name", "tiny"),): 0}
    assert series(registry, "vllm:output_rate_evictions_total") == {(("model_name", "tiny"),): 3}
    assert series(registry, "vllm:output_rate_eviction_recompute_tokens_total") == {
        (("model_name", "tiny"),): 120}
    exporter.observe({"users": {}, "removed": ["alice"], "engine": {}})
    assert not any(dict(l)["user"] == "alice" for l in series(registry, "vllm:output_rate_output_tokens_charged_total"))


def test_prompt_tokens_charged_are_reported_and_exported_with_the_same_cap():
    mon = UserMonitor(max_users=1)
    registry = CollectorRegistry()
    exporter = OutputRateExporter("tiny", registry=registry)
    name = "vllm:output_rate_prompt_tokens_charged_total"
    rep = mon.report(S, {}, {}, {}, CONFIGURED, rate_of, prompt_charged={"alice": 400, "carol": 90, "dave": 10})
    users = rep["users"]
    assert users["alice"][PROMPT] == 400 and users["bob"][PROMPT] == 0
    # One labelled user beyond the configured ones; the rest under __other__.
    assert len(users) == len(CONFIGURED) + 1 + 1
    assert users[OTHER_USERS][PROMPT] + sum(
        row[PROMPT] for user, row in users.items() if user not in CONFIGURED and user != OTHER_USERS
    ) == 100
    exporter.observe(rep)
    rep = mon.report(2 * S, {}, {}, {}, CONFIGURED, rate_of, prompt_charged={"alice": 1000, "carol": 90, "dave": 10})
    assert rep["users"]["alice"][PROMPT] == 600
    exporter.observe(rep)
    exported = {dict(labels)["user"]: value for labels, value in series(registry, name).items()}
    assert exported["alice"] == 1000 and "bob" not in exported  # no series before a prompt charge
    assert len(exported) <= len(CONFIGURED) + 1 + 1
    exporter.observe({"users": {}, "removed": ["alice"], "engine": {}})
    assert "alice" not in {dict(labels)["user"] for labels in series(registry, name)}


def test_each_group_series_has_its_user_twins_type_and_labels_with_group_for_user():
    registry = CollectorRegistry()
    exporter = OutputRateExporter("tiny", registry=registry)
    row = [3, 0.5, 1, 2, 0, 10.0, 4, 1]
    exporter.observe({"users": {"alice": row}, "removed": [], "groups": {"g": row}, "groups_removed": [],
                      "user_groups": {"alice": "g"}, "engine": {}})
    families = {family.name: family for family in registry.collect()}

    def label_names(family, holder_label):
        return {tuple(sorted("holder" if k == holder_label else k for k in s.labels)) for s in family.samples}

    twins = ("output_tokens_charged", "prompt_tokens_charged", "borrowed_tokens", "requests",
             "limit_tokens_per_second")
    for twin in twins:
        user = families[f"vllm:output_rate_{twin}"]
        group = families[f"vllm:output_rate_group_{twin}"]
        assert group.type == user.type, twin
        assert label_names(group, "group") == label_names(user, "user"), twin
        assert "user" in user.documentation and "group" in group.documentation, twin
    assert "vllm:output_rate_group_throttled_seconds" not in families  # users only


def test_exporter_sums_the_gauges_of_several_engines():
    """Data-parallel ranks report to one logger: request gauges and the
    engine-wide throttled count are the ranks' sum, counters add up, and a
    user one rank dropped keeps its series while another rank has it."""
    registry = CollectorRegistry()
    exporter = OutputRateExporter("tiny", registry=registry)
    exporter.observe({"users": {"alice": [3, 0.0, 2, 1, 0, 10.0]}, "removed": [],
                      "engine": {"throttled_requests": 1}}, 0)
    exporter.observe({"users": {"alice": [4, 0.0, 1, 2, 5, 10.0]}, "removed": [],
                      "engine": {"throttled_requests": 2}}, 1)
    exporter.observe({"users": {"alice": [1, 0.0, 1, 1, 0, 10.0]}, "removed": [],
                      "engine": {"throttled_requests": 1}}, 0)
    key = (("model_name", "tiny"), ("state", "{}"), ("user", "alice"))
    req = series(registry, "vllm:output_rate_requests")
    got = {state: req[tuple((k, v.format(state) if k == "state" else v) for k, v in key)]
           for state in ("active", "throttled", "waiting")}
    assert got == {"active": 2, "throttled": 3, "waiting": 5}
    assert series(registry, "vllm:output_rate_throttled_requests") == {(("model_name", "tiny"),): 3}
    charged = series(registry, "vllm:output_rate_output_tokens_charged_total")
    assert charged[(("model_name", "tiny"), ("user", "alice"))] == 8
    exporter.observe({"users": {}, "removed": ["alice"], "engine": {}}, 1)
    req = series(registry, "vllm:output_rate_requests")
    assert req[(("model_name", "tiny"), ("state", "waiting"), ("user", "alice"))] == 0
    assert req[(("model_name", "tiny"), ("state", "active"), ("user", "alice"))] == 1
    exporter.observe({"users": {}, "removed": ["alice"], "engine": {}}, 0)
    assert not any(dict(l)["user"] == "alice" for l in series(registry, "vllm:output_rate_requests"))


def test_charge_history_window():
    hist = ChargeHistory(window_s=10)
    for t in range(0, 30):
        hist.record(t * S, {"u": 5 * t})
    # At t=29 s, u has 145; 10 s ago (t=19) it had 95.
    assert hist.tokens_in_window(29 * S, {"u": 145}, ["u", "v"]) == {"u": 50, "v": 0}
    assert len(hist._points) <= 12
    young = ChargeHistory(window_s=10)
    young.record(0, {"u": 0})
    young.record(3 * S, {"u": 30})
    assert young.tokens_in_window(4 * S, {"u": 40}, ["u"]) == {"u": 40}


#: One report with every kind of row: users, groups, limits, shadow, store.
FULL_REPORT = {
    "users": {"u": [1, 1.0, 1, 1, 1, 5.0, 1, 1]}, "removed": [], "mode": "shadow",
    "limits": {"u": [10.0, 5.0, 2, 1]}, "shadow": {"u": [3, 0.5, 2, 1]},
    "groups": {"g": [1, 0.0, 1, 1, 1, 5.0, 1, 1]}, "groups_removed": [],
    "group_limits": {"g": [None, 2.0, None, 0]}, "group_shadow": {"g": [1, 0.25, 1, 0]},
    "user_groups": {"u": "g"},
    "engine": {"throttled_requests": 1, "idle_steps_total": 1, "reloads_total": 1,
               "reload_failures_total": 1, "evictions_total": 1,
               "eviction_recompute_tokens_total": 1, "store_mode": 0,
               "store_outages_total": 1, "store_round_trips_total": 1,
               "store_failed_round_trips_total": 1, "store_commands_total": 1,
               "store_leased_tokens_total": 1, "store_spent_tokens_total": 1,
               "store_returned_tokens_total": 1, "store_expired_tokens_total": 1},
    "fairness": {"window_s": 10.0, "backlogged_users": 2, "jain_index": 0.9, "service_gap_tokens": 40.0},
}


def test_fairness_gauges_are_per_engine_with_vllms_engine_label():
    """Each data-parallel engine its own fairness series (an index is not a
    sum); a report without fairness leaves them as they were."""
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    exporter = OutputRateExporter("m", registry=registry)
    exporter.observe(FULL_REPORT, engine_idx=0)
    exporter.observe({**FULL_REPORT, "fairness": {
        "window_s": 10.0, "backlogged_users": 0, "jain_index": 1.0, "service_gap_tokens": 0.0}}, engine_idx=1)
    exporter.observe({"users": {}, "removed": [], "engine": {}}, engine_idx=0)
    got = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.startswith("vllm:output_rate_fairness_"):
                assert set(s.labels) == {"model_name", "engine"}, s
                got[(s.name.removeprefix("vllm:output_rate_fairness_"), s.labels["engine"])] = s.value
    assert got == {
        ("window_seconds", "0"): 10.0, ("window_seconds", "1"): 10.0,
        ("backlogged_users", "0"): 2, ("backlogged_users", "1"): 0,
        ("jain_index", "0"): 0.9, ("jain_index", "1"): 1.0,
        ("service_gap_tokens", "0"): 40.0, ("service_gap_tokens", "1"): 0.0,
    }


def test_limits_and_shadow_rows_are_exported_under_their_documented_names():
    """Ceiling (+Inf: none), weight, residency cap and held per user; ceiling
    and weight per group; the shadow counters and gauges; the mode."""
    from prometheus_client.parser import text_string_to_metric_families

    registry = CollectorRegistry()
    exporter = OutputRateExporter("m", registry=registry)
    exporter.observe(FULL_REPORT)
    exporter.observe({**FULL_REPORT, "mode": "enforce", "shadow": {"u": [4, 0.5, 0, 0]},
                      "limits": {"u": [None, 5.0, None, 3]}})
    got = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            key = s.labels.get("user") or s.labels.get("group") or s.labels.get("mode")
            got[(s.name, key)] = s.value
    assert got[("vllm:output_rate_ceil_tokens_per_second", "u")] == float("inf")
    assert got[("vllm:output_rate_weight", "u")] == 5.0
    assert got[("vllm:output_rate_residency_cap_requests", "u")] == float("inf")
    assert got[("vllm:output_rate_residency_held_requests", "u")] == 3
    assert got[("vllm:output_rate_group_ceil_tokens_per_second", "g")] == float("inf")
    assert got[("vllm:output_rate_group_weight", "g")] == 2.0
    assert got[("vllm:output_rate_shadow_held_tokens_total", "u")] == 7
    assert got[("vllm:output_rate_shadow_throttled_seconds_total", "u")] == 1.0
    assert got[("vllm:output_rate_shadow_borrowed_tokens_total", "u")] == 2
    assert got[("vllm:output_rate_shadow_residency_held_requests", "u")] == 0
    assert got[("vllm:output_rate_group_shadow_held_tokens_total", "g")] == 2
    assert got[("vllm:output_rate_group_shadow_throttled_seconds_total", "g")] == 0.5
    assert got[("vllm:output_rate_mode", "enforce")] == 1
    assert got[("vllm:output_rate_mode", "shadow")] == 0
    exporter.observe({**FULL_REPORT, "removed": ["u"], "users": {}})
    names = {s.name for family in registry.collect() for s in family.samples if s.labels.get("user") == "u"}
    assert not any("ceil" in n or "shadow" in n or "residency" in n for n in names), names


def test_dashboard_queries_use_exported_series():
    """Every series the Grafana dashboard queries is one vLLM or the exporter defines."""
    import json
    import re
    from pathlib import Path

    registry = CollectorRegistry()
    exporter = OutputRateExporter("m", registry=registry)
    exporter.observe(FULL_REPORT)
    exported = {s.name for family in registry.collect() for s in family.samples}
    dashboard = json.loads((Path(__file__).parents[2] / "dashboards" / "vllm-output-rate.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = {name for e in exprs for name in re.findall(r"vllm:[a-z_]+", e)}
    ours = {n for n in used if n.startswith("vllm:output_rate_")}
    assert ours and ours <= exported, ours - exported
    assert used - ours <= {"vllm:num_requests_running", "vllm:num_requests_waiting"}


# -- the patches that carry the report (metrics.scheduler_stats, metrics.prometheus,
# engine_core.admin_utility), installed as vLLM's plugin loader does ------------------


def _registered():
    import vllm_output_rate

    vllm_output_rate.register()


REPORT = {"users": {"u": [3, 0.5, 1, 0, 0, 5.0]}, "removed": [], "engine": {}}


def test_stats_field_survives_vllms_msgpack_path():
    _registered()
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_output_rate.adapter.metrics import STATS_FIELD

    assert getattr(SchedulerStats(), STATS_FIELD) is None  # vLLM's own stats: no report
    stats = SchedulerStats()
    setattr(stats, STATS_FIELD, REPORT)
    frames = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(frames)
    assert getattr(decoded.scheduler_stats, STATS_FIELD) == REPORT


def test_prometheus_record_exports_the_report_with_one_exporter_per_logger(monkeypatch):
    from types import SimpleNamespace

    from vllm_output_rate.adapter import metrics

    registry = CollectorRegistry()
    made = []

    def exporter(model_name):
        made.append(model_name)
        return OutputRateExporter(model_name, registry=registry)

    monkeypatch.setattr(metrics, "OutputRateExporter", exporter)
    seen = []
    record = metrics._make_record(lambda self, stats, *a, **kw: seen.append(stats))
    logger = SimpleNamespace(vllm_config=SimpleNamespace(
        model_config=SimpleNamespace(served_model_name="tiny")))
    with_report = SimpleNamespace(output_rate=REPORT)
    record(logger, with_report, None)
    record(logger, with_report, None)
    record(logger, SimpleNamespace(output_rate=None), None)  # a stats message without a report
    record(logger, None, None)  # vLLM records iteration stats alone too
    assert len(seen) == 4  # vLLM's own record ran every time
    assert made == ["tiny"]
    charged = registry.get_sample_value(
        "vllm:output_rate_output_tokens_charged_total", {"model_name": "tiny", "user": "u"})
    assert charged == 6


def test_engine_core_utility_returns_the_schedulers_report():
    _registered()
    from types import SimpleNamespace

    from vllm.v1.engine.core import EngineCore

    from vllm_output_rate.adapter.admin import UTILITY

    utility = getattr(EngineCore, UTILITY)
    ours = SimpleNamespace(scheduler=SimpleNamespace(output_rate_users=lambda: {"users": {}}))
    assert utility(ours) == {"users": {}}
    stock = SimpleNamespace(scheduler=SimpleNamespace())  # feature off: vLLM's scheduler
    assert utility(stock) is None
