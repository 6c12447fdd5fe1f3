"""The shipped Prometheus rules and Grafana dashboard, checked with promtool.

* ``dashboards/vllm-output-rate.rules.yml`` is valid and its unit tests
  (``dashboards/tests/rules_test.yml``) pass; every alert has a case where it
  fires and one where it stays silent.
* Every expression of ``dashboards/vllm-output-rate.json`` parses: each is
  written as a recording rule of a scratch rule file, which ``promtool check
  rules`` parses with Prometheus' own PromQL parser.

Skipped without promtool (``make setup`` installs Debian's ``prometheus``
package).  That every dashboard query *answers* on a real engine is
``tests/server/test_prometheus_server.py``.
"""

from __future__ import annotations

import pytest
import yaml

from prometheus_harness import DASHBOARDS, RULE_TESTS, RULES, DashboardQuery, dashboard_queries, promtool


def test_rules_file_is_valid():
    done = promtool("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_rule_unit_tests_pass():
    # From dashboards/: the test file names the rules relative to itself.
    done = promtool("test", "rules", str(RULE_TESTS.relative_to(DASHBOARDS)), cwd=DASHBOARDS)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def _alert_names() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule]


def test_every_alert_fires_in_one_case_and_stays_silent_in_another():
    alerts = _alert_names()
    assert len(alerts) >= 6, alerts
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in test.get("alert_rule_test", [])]
    for name in alerts:
        outcomes = [bool(case.get("exp_alerts")) for case in cases if case["alertname"] == name]
        assert True in outcomes, f"{name}: no case where it fires"
        assert False in outcomes, f"{name}: no case where it stays silent"


def _check_as_rules(queries: list[DashboardQuery], tmp_path) -> str:
    """``promtool check rules`` on one recording rule per query; its output ('' when it passed)."""
    rules = [{"record": f"dashboard:query_{i}", "expr": query.expr} for i, query in enumerate(queries)]
    path = tmp_path / "dashboard-queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = promtool("check", "rules", str(path))
    return "" if done.returncode == 0 else done.stdout + done.stderr


def test_every_dashboard_query_parses(tmp_path):
    queries = dashboard_queries()
    # Every panel the issue asks for has its query (ceiling, weight, residency, store, shadow...).
    text = "\n".join(query.expr for query in queries)
    for series in ("ceil_tokens_per_second", "weight", "borrowed_tokens_total", "prompt_tokens_charged_total",
                   "group_output_tokens_charged_total", "store_mode", "evictions_total",
                   "residency_cap_requests", "residency_held_requests", "shadow_held_tokens_total",
                   "shadow_throttled_seconds_total", "shadow_borrowed_tokens_total",
                   "shadow_residency_held_requests", "vllm:output_rate_mode",
                   "fairness_jain_index", "fairness_service_gap_tokens", "fairness_backlogged_users"):
        assert series in text, f"no dashboard query reads {series}"
    assert "$" not in text, "a Grafana variable was left in a query"
    failed = _check_as_rules(queries, tmp_path)
    assert not failed, failed


@pytest.mark.parametrize("bad", [
    "sum by (user) (rate(vllm:output_rate_output_tokens_charged_total[1m])",  # unclosed
    "sum(rate(vllm:output_rate_idle_steps_total[$__rate_interval]))",  # a variable left in
])
def test_the_parse_check_catches_a_broken_query(bad, tmp_path):
    queries = [*dashboard_queries(), DashboardQuery("a broken one", bad)]
    assert _check_as_rules(queries, tmp_path)
