"""A real Prometheus scrapes a real engine under load: every dashboard query answers, an alert fires.

One module fixture starts a redis-server (the shared store), one
``vllm-output-rate serve`` of the tiny model with a limits file, and a
Prometheus (``tests/prometheus_harness.py``) scraping it every second with
``dashboards/vllm-output-rate.rules.yml`` loaded (evaluated every second);
all are stopped by PID at the end.

The limits are chosen so that every mechanism a dashboard panel shows runs:
``heavy`` (4 tok/s, 5 streams) is pinned at its limit and held at its
residency cap (max(1, 4 // 2) = 2 streams with KV, the rest wait);
``borrower`` (rate 5, ceil 60) borrows spare capacity in group ``team`` with
``member``; prompt tokens cost 0.1 of a token; the store gives leases.  The
load runs once enforced, then once after the limits file is reloaded into
shadow mode (``mode: shadow``), so the shadow series exist too.  Then every
panel query and template-variable query of ``dashboards/vllm-output-rate.json``
(``$model`` and ``$user`` as Grafana's "All": ``.*``) must return at least one
series from Prometheus' HTTP API, and every rule must evaluate without error.

Last, the limits file is broken, and the shipped alert
``VllmOutputRateLimitReloadFailed`` (the rule file as shipped: no ``for:``,
so no test variant is needed) must fire for this engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

import httpx
import pytest

from prometheus_harness import PromQLError, PrometheusServer, dashboard_queries
from redis_harness import RedisServer
from server_harness import ConnectionBackoff, engine_env, running_server, while_alive
from vllm_output_rate.tools import measure

pytestmark = [pytest.mark.server, pytest.mark.redis]

DEFAULT_RATE = 50
LIMITS = {
    "default_user_output_tokens_per_second": DEFAULT_RATE,
    "input_token_weight": 0.1,
    "min_stream_tokens_per_second": 2,
    "groups": {"team": {"rate": 40, "ceil": 80, "weight": 1}},
    "user_output_tokens_per_second": {
        "heavy": 4,
        "borrower": {"rate": 5, "ceil": 60, "weight": 2, "group": "team"},
        "member": {"rate": 20, "group": "team"},
    },
}
#: user -> concurrent streams (heavy has more streams than its residency cap of 2).
STREAMS = {"heavy": 5, "borrower": 3, "member": 1}
MAX_TOKENS = 24
LOAD_S = 20.0
RELOAD_ALERT = "VllmOutputRateLimitReloadFailed"
RELOAD_FAILURES = "vllm:output_rate_limit_reload_failures_total"


def write_limits(path, limits) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(limits if isinstance(limits, str) else json.dumps(limits))
    os.replace(tmp, path)  # atomic: the engine never reads half a file


@contextlib.contextmanager
def server_context(tmp_path_factory, model_dir):
    """The store, the engine and Prometheus (in that order); stopped in reverse."""
    work = tmp_path_factory.mktemp("prometheus-server")
    limits = work / "limits.json"
    write_limits(limits, LIMITS)
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(RedisServer())
        args = [
            "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16",
            "--disable-uvicorn-access-log",  # Prometheus scrapes every second
            "--output-rate-limits-file", str(limits),
            "--output-rate-store", store.url,
        ]
        engine = stack.enter_context(
            running_server(args, work / "logs", "engine", model=model_dir, env=engine_env(0, 1))
        )
        target = engine.base_url.removeprefix("http://")
        prometheus = stack.enter_context(PrometheusServer(work / "prometheus", [target]))
        yield {"engine": engine, "prometheus": prometheus, "limits": limits, "target": target}


@pytest.fixture(scope="module")
def setup(server_pool, tmp_path_factory, tiny_model_dir):
    yield server_pool.get(__name__, lambda: server_context(tmp_path_factory, tiny_model_dir))
    server_pool.release(__name__)


async def _streams(engine, duration_s: float) -> list[measure.RequestRecord]:
    """Every user's streams, one request after another, for ``duration_s``."""
    client = measure.openai_client(engine.base_url)
    records: list[measure.RequestRecord] = []
    t0 = time.monotonic()

    async def stream(user: str, slot: int) -> None:
        backoff = ConnectionBackoff()
        while True:
            record = measure.RequestRecord(user=user, stream=slot)
            records.append(record)
            await measure.stream_completion(client, measure.stream_body(engine.model, user, MAX_TOKENS),
                                            record, t0)
            if record.status in measure.ERROR_STATUSES:
                await backoff.failed(engine)
            else:
                backoff.succeeded()

    tasks = [asyncio.ensure_future(stream(user, slot)) for user, n in STREAMS.items() for slot in range(n)]
    try:
        await while_alive(asyncio.sleep(duration_s), lambda: [engine])
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records


def drive(engine, duration_s: float = LOAD_S) -> None:
    """Run the load; every request must have been served (or cut by the end of the load)."""
    records = asyncio.run(_streams(engine, duration_s))
    failed = [(r.user, r.status, r.http_status, r.error) for r in records if r.status in measure.ERROR_STATUSES]
    assert not failed, failed[:5]
    done = {user: sum(r.n_tokens for r in records if r.user == user) for user in STREAMS}
    assert all(done.values()), done  # each user got tokens: each one's mechanism ran


def engine_counter(prometheus, name: str, target: str) -> float:
    """``name``'s value for the engine, as Prometheus scraped it (0 before its first scrape)."""
    result = prometheus.query(f'sum({name}{{instance="{target}"}})')
    return float(result[0]["value"][1]) if result else 0.0


def wait_reload(engine, prometheus, target: str, series: str, before: float) -> None:
    """Until Prometheus has scraped ``series`` above ``before`` (a reload applied or
    rejected), sending a one-token request each second: an idle engine sends no stats,
    so its counters reach /metrics only with a step."""
    def grown() -> bool:
        body = {key: value for key, value in measure.stream_body(engine.model, "member", 1).items()
                if key not in ("stream", "stream_options")}
        response = httpx.post(f"{engine.base_url}/v1/completions", json=body, timeout=30, trust_env=False)
        assert response.status_code == 200, response.text
        return engine_counter(prometheus, series, target) > before

    prometheus.wait_for(f"{series} to grow past {before}", grown, timeout_s=60)


def test_every_dashboard_query_returns_series(setup):
    engine, prometheus, target = setup["engine"], setup["prometheus"], setup["target"]
    reloads = "vllm:output_rate_limit_reloads_total"
    drive(engine)
    # Shadow mode by a reload: the policy runs on the side, the shadow series appear.
    before = engine_counter(prometheus, reloads, target)
    failures_before = engine_counter(prometheus, RELOAD_FAILURES, target)
    write_limits(setup["limits"], {**LIMITS, "mode": "shadow"})
    # An idle engine sends no stats: its reload shows on /metrics with the load's steps.
    drive(engine)
    prometheus.wait_for(
        "the shadow-mode limits file to be applied or rejected",
        lambda: engine_counter(prometheus, reloads, target) > before
        or engine_counter(prometheus, RELOAD_FAILURES, target) > failures_before,
        timeout_s=30,
    )
    shadow_refused = engine_counter(prometheus, RELOAD_FAILURES, target) > failures_before
    time.sleep(3)  # a few scrapes after the load, for every rate() window
    assert prometheus.query(f'up{{instance="{target}"}}')[0]["value"][1] == "1"

    unanswered = []
    for query in dashboard_queries():
        try:
            if not prometheus.query(query.expr):
                unanswered.append(f"{query.where}: {query.expr}")
        except PromQLError as error:
            unanswered.append(f"{query.where}: {error}")
    assert not shadow_refused and not unanswered, (
        ("the engine rejected `mode: shadow` in the limits file; " if shadow_refused else "")
        + "queries with no series:\n" + "\n".join(unanswered))

    # The rules evaluate on real series: none errs, and the recording rules answer.
    broken = [(rule["name"], rule.get("lastError")) for rule in prometheus.rules() if rule["health"] != "ok"]
    assert not broken, broken
    for record in ("vllm_output_rate:ceiling_usage:ratio_rate1m",
                   "vllm_output_rate:cluster_ceiling_usage:ratio_rate1m"):
        assert prometheus.query(f'{record}{{user="heavy"}}'), record


def test_a_broken_limits_file_fires_the_reload_alert(setup):
    prometheus, target = setup["prometheus"], setup["target"]
    before = engine_counter(prometheus, RELOAD_FAILURES, target)
    if before == 0:  # no earlier failure: the alert must not be firing yet
        assert not prometheus.firing(RELOAD_ALERT), prometheus.firing(RELOAD_ALERT)
    write_limits(setup["limits"], "default_user_output_tokens_per_second: [not a rate")
    wait_reload(setup["engine"], prometheus, target, RELOAD_FAILURES, before)
    alerts = prometheus.wait_for(f"{RELOAD_ALERT} to fire", lambda: prometheus.firing(RELOAD_ALERT), timeout_s=60)
    assert [alert["labels"]["instance"] for alert in alerts] == [target]
    assert alerts[0]["labels"]["severity"] == "warning"
