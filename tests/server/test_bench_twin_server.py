"""``vllm-output-rate bench --scenario twin`` against a real engine (tiny model).

No server of its own: the module borrows ``test_prometheus_server``'s engine
from the session's server pool (limits from a file the engine re-reads live,
identity in the body, a shared store).  It writes the scenario's limits file
there, waits until the engine applied it, runs the scenario for 12 s and puts
the file back (waiting for that reload too).  When ``test_prometheus_server``
is not part of the session, this module stops the engine at its end.

Judged on the engine's own counters (``/metrics``), never on client receive
times: the table's figures must be the counters' own differences, every
capped user must stay within the documented bound over the run, and every
figure must name its clock.  How fast the engine served (a throughput, a
latency) is printed, never judged.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

import test_prometheus_server as prometheus_module
from vllm_output_rate.tools import bench, measure
from vllm_output_rate.tools.analysis import guarantee_bound

pytestmark = [pytest.mark.server, pytest.mark.redis]

LOAD_S = 12
WINDOW_S = 4
SCENARIO = ["--scenario", "twin", "--concurrency", "8", "--users", "40", "--length-scale", "0.1",
            "--capacity", "400", "--fairness-window", str(WINDOW_S), "--read-every", "0.5"]
CAPPED = {"cap-0": 2.0, "cap-1": 4.0, "cap-2": 8.0, "cap-3": 16.0}
RELOADS = "vllm:output_rate_limit_reloads_total"
#: Not a scenario user: its one-token requests make the idle engine step (and so reload).
PROBE_USER = "twin-probe"


@pytest.fixture(scope="module")
def engine(request, server_pool, tmp_path_factory, tiny_model_dir):
    key = prometheus_module.__name__
    setup = server_pool.get(key, lambda: prometheus_module.server_context(tmp_path_factory, tiny_model_dir))
    yield setup
    if not any(getattr(item, "module", None) is prometheus_module for item in request.session.items):
        server_pool.release(key)  # nobody else will


def _metrics(server) -> measure.Samples:
    return measure.parse_metrics(server.metrics())


def _write(path, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)  # atomic: the engine never reads half a file


def _apply_limits(server, path, text: str) -> None:
    """Write the limits file and wait until the engine counted the reload (an idle
    engine applies it at its next step: a one-token request every half second)."""
    before = measure.metric_sum(_metrics(server), RELOADS) or 0.0
    _write(path, text)
    body = {key: value for key, value in measure.stream_body(server.model, PROBE_USER, 1).items()
            if key not in ("stream", "stream_options")}
    deadline = time.monotonic() + 60
    while (measure.metric_sum(_metrics(server), RELOADS) or 0.0) <= before:
        assert time.monotonic() < deadline, "the engine did not reload the limits file"
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=30, trust_env=False)
        assert response.status_code == 200, response.text
        time.sleep(0.5)


def _wait_empty(server) -> measure.Samples:
    deadline = time.monotonic() + 60
    while True:
        samples = _metrics(server)
        busy = (measure.metric_sum(samples, measure.RUNNING_GAUGE) or 0) + (
            measure.metric_sum(samples, measure.WAITING_GAUGE) or 0)
        if not busy:
            time.sleep(1.5)  # the last per-user report reaches /metrics
            return _metrics(server)
        assert time.monotonic() < deadline, "engine did not drain"
        time.sleep(0.2)


def _delta(after, before, name: str, **labels) -> float:
    return (measure.metric_sum(after, name, **labels) or 0.0) - (measure.metric_sum(before, name, **labels) or 0.0)


def test_twin_scenario_prints_the_twins_table_from_the_engines_counters(engine, tmp_path, capsys):
    server, limits_path = engine["engine"], engine["limits"]
    original = limits_path.read_text()
    scenario_limits = tmp_path / "twin-limits.json"
    bench.main([*SCENARIO, "--duration", str(LOAD_S), "--limits-out", str(scenario_limits), "--dry-run"])
    try:
        _apply_limits(server, limits_path, scenario_limits.read_text())
        before = _wait_empty(server)
        t_before = time.monotonic()
        doc = bench.main(["--url", server.base_url, *SCENARIO, "--duration", str(LOAD_S),
                          "--json", str(tmp_path / "twin.json")])
        t_after = time.monotonic()
        after = _metrics(server)
    finally:
        _apply_limits(server, limits_path, original)
    out = capsys.readouterr().out
    print(out)
    figures = doc["figures"]
    assert json.loads((tmp_path / "twin.json").read_text())["figures"] == json.loads(json.dumps(figures))
    assert figures["settled"] and figures["shared_store"]
    assert figures["requests"]["sent"] > 0 and not figures["requests"]["http_error"], figures["requests"]

    # Every capped user has its row, with the counters' own figures, inside the bound.
    weight = 0.01
    for user, rate in CAPPED.items():
        row = figures["capped"][user]
        output = _delta(after, before, measure.CHARGED_TOKENS, user=user)
        prompt = _delta(after, before, bench.PROMPT_CHARGED, user=user)
        assert (row["output_tokens"], row["prompt_tokens_charged"]) == (output, prompt), user
        assert output > 0, user
        assert row["achieved_over_limit"] == pytest.approx((output + weight * prompt) / (rate * LOAD_S))
        # Independent of the bench's reads: the test's own clock around the whole run.
        bound = guarantee_bound(t_after - t_before, rate, shared_engines=1)
        assert output + weight * prompt <= bound, (user, output, prompt, bound)
        assert row["within_bound"], (user, row)
        assert f"| {user} | {rate:.1f} | {output:,.0f} |" in out, user
    worst = figures["capped_worst_ratio"]
    assert worst in [row["achieved_over_limit"] for row in figures["capped"].values()]

    # The group's row is its members' charges, as the engine's group series count them.
    group = figures["groups"]["research"]
    engine_group = (_delta(after, before, "vllm:output_rate_group_output_tokens_charged_total", group="research")
                    + weight * _delta(after, before, "vllm:output_rate_group_prompt_tokens_charged_total",
                                      group="research"))
    assert group["charged_tokens"] == pytest.approx(engine_group)

    # Throughput: generated tokens the engine counted, no more than over the whole run.
    generated = _delta(after, before, bench.GENERATION_TOKENS)
    # The figure is a quotient; multiplied back it can round one ulp above the count.
    assert 0 < figures["throughput_tok_s"] * figures["throughput_span_s"] <= generated * (1 + 1e-12)

    # One fairness row per window of the load, each a reading of policy/fairness.py's numbers.
    windows = figures["fairness_windows"]
    assert [w["end_s"] for w in windows] == [WINDOW_S * k for k in range(1, LOAD_S // WINDOW_S + 1)]
    for w in windows:
        assert 0 <= w["backlogged_borrowers"] <= 6
        if w["backlogged_borrowers"]:
            assert 1 / w["backlogged_borrowers"] - 1e-9 <= w["jain_weighted_all"] <= 1 + 1e-9
            assert w["gap_weighted_all_tokens"] >= 0
        assert f"| {w['end_s']:g} | {w['backlogged_borrowers']} |" in out

    # First tokens of the long tail, on the client's clock, and every column names its clock.
    first = figures["in_quota_first_token_ms"]
    assert first["requests"] > 0 and first["p50"] <= first["p99"]
    assert "[engine counters]" in out and "first token p50 / p99 ms, in quota [client clock]" in out
