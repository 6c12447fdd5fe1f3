"""One user's quota shared through a REAL redis-server process.

Each test that claims sharing works runs lease limiters (each with its own
connection and lease thread, as separate engines would) against a
redis-server started here on 127.0.0.1 and a random port, stopped by PID.
Spend times are read in this process on one monotonic clock (no delivery
stalls), and checked against the documented bound of
:mod:`vllm_output_rate.stores.lease`.  What depends on how fast the machine
is (the rate reached, each engine's part, a restart within the debt) is
checked on a fake clock instead, with the script answering ``TIME`` from it
(``fake_store.redis_on_clock``); the wall-clock runs only wait for events,
with a generous timeout (:data:`LIVENESS_S`).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from fractions import Fraction

import pytest

from fake_store import Clock, redis_on_clock
from redis_harness import RedisServer
from test_lease import share_run
from vllm_output_rate.factory import make_limiter
from vllm_output_rate.policy.limiter import DEFAULT_BURST_NS, NS_PER_S
from vllm_output_rate.settings import OutputRateSettings
from vllm_output_rate.stores.backend import LOCAL, SHARED, LeaseAsk, LeaseConfig
from vllm_output_rate.stores.lease import LeasedOutputRateLimiter
from vllm_output_rate.stores.redis_store import (
    PASSWORD_ENV,
    RedisLeaseBackend,
    redact,
    user_key,
)

pytest.importorskip("redis")

MS = 1_000_000
S = NS_PER_S
CFG = LeaseConfig()
#: How long a test waits for something that must happen (an outage noticed,
#: a recovery): a timeout against hanging, not a figure under test.
LIVENESS_S = 10


@pytest.fixture(scope="module")
def server():
    srv = RedisServer().start()
    yield srv
    srv.stop()


_prefixes = iter(range(10**6))


@pytest.fixture
def prefix():
    return f"test{next(_prefixes)}-{time.monotonic_ns()}"


def engines(url, prefix, n, rate, **cfg):
    return [
        LeasedOutputRateLimiter(
            rate, {}, RedisLeaseBackend(url, prefix=prefix), config=LeaseConfig(**cfg)
        )
        for _ in range(n)
    ]


def run_engines(lims, user, seconds, stop_event=None, streams=8, step_s=0.004):
    """Each engine's 'scheduler' takes up to ``streams`` tokens every step."""
    spent: list[list[int]] = [[] for _ in lims]
    end = time.monotonic_ns() + int(seconds * S)

    def loop(i, lim):
        while time.monotonic_ns() < end:
            now = time.monotonic_ns()
            got = lim.take_up_to(user, now, streams)
            spent[i] += [now] * got
            time.sleep(step_s)

    threads = [threading.Thread(target=loop, args=(i, lim)) for i, lim in enumerate(lims)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return spent


def max_in_window(times: list[int], window_ns: int) -> int:
    times = sorted(times)
    return max(
        (bisect.bisect_right(times, t + window_ns) - i for i, t in enumerate(times)), default=0
    )


def bound(window_ns, rate, n_engines):
    return CFG.bound_tokens(window_ns, Fraction(rate), n_engines, DEFAULT_BURST_NS)


def test_script_is_gcra_on_the_server_clock(server, prefix):
    backend = RedisLeaseBackend(server.url, prefix=prefix)
    client = server.client()
    iv = 10 * MS  # 100 tok/s
    # Fresh user: 1 + 100 ms of burst = 11 tokens, then the debt is 110 ms.
    (g,) = backend.lease(100 * MS, [LeaseAsk("u", 50, 0, iv)])
    assert g.granted == 11 and g.wait_ns == 10 * MS
    state = client.hgetall(user_key(prefix, "u"))
    assert int(state[b"d"]) == 110 * MS
    assert 0 < client.pttl(user_key(prefix, "u")) <= 110 + 10_000
    # A slow user (1 tok/s): one token, then nothing for 0.9 s of server time.
    (g,) = backend.lease(100 * MS, [LeaseAsk("slow", 5, 0, S)])
    assert g.granted == 1 and g.wait_ns == 900 * MS
    (g,) = backend.lease(100 * MS, [LeaseAsk("slow", 5, 0, S)])
    assert g.granted == 0 and 800 * MS < g.wait_ns < 900 * MS
    # Hand back the token: the debt is gone, so one can be granted again at once.
    (g,) = backend.lease(100 * MS, [LeaseAsk("slow", 1, 1, S)])
    assert g.granted == 1
    # Hand back everything: the key goes away (== a user never seen).
    backend.lease(100 * MS, [LeaseAsk("u", 0, 100, iv)])
    assert not client.exists(user_key(prefix, "u"))
    # Batched: several users in one round trip, each its own key and slot tag.
    grants = backend.lease(100 * MS, [LeaseAsk(f"b{i}", 3, 0, iv) for i in range(50)])
    assert [g.granted for g in grants] == [3] * 50
    assert backend.commands == 6
    assert user_key(prefix, "b7") == f"{prefix}:user:{{b7}}"
    backend.close()


def test_three_engines_share_one_users_quota(server, prefix):
    rate = 40
    lims = engines(server.url, prefix, 3, rate)
    try:
        t0 = time.monotonic_ns()
        spent = run_engines(lims, "heavy", 6.0)
        elapsed = time.monotonic_ns() - t0
    finally:
        for lim in lims:
            lim.close()
    everything = sorted(t for per in spent for t in per)
    total = len(everything)
    # Not 3 x 40: within the bound of one quota of 40 tok/s, in every window.
    assert total <= bound(elapsed, rate, 3)
    for w in (S // 2, S, 2 * S):
        assert max_in_window(everything, w) <= bound(w, rate, 3), w
    assert all(spent), [len(p) for p in spent]  # every engine is served
    for lim in lims:
        assert lim.stats["outages"] == 0
        # About one round trip per 50 ms (jittered), not one per step.
        assert lim.stats["round_trips"] <= 6.0 * 20 * 1.5 + 10


def test_three_engines_reach_the_rate_and_share_it_on_a_fake_clock(server, prefix):
    """The real script told the time by a fake clock: three engines stepping every
    5 ms spend the whole rate of one quota between them, each about a third."""
    rate, seconds = 40, 20
    clock = Clock()
    backend = redis_on_clock(server.url, clock, prefix)
    spent: list[int] = []
    counts = share_run((50, 50, 50), [None] * 3, seconds=seconds, rate=rate, store=backend,
                       clock=clock, spent=spent)
    backend.close()
    total = sum(counts)
    assert 0.97 * rate * seconds <= total <= bound(seconds * S, rate, 3), counts
    for w in (S // 2, S, 2 * S):
        assert max_in_window(spent, w) <= bound(w, rate, 3), w
    assert min(counts) >= 0.3 * total, counts  # engines take turns being first


def test_redis_killed_then_restarted(prefix, caplog):
    srv = RedisServer().start()
    rate, n = 40, 2
    lims = engines(srv.url, prefix, n, rate, expected_engines=n)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_output_rate.stores.lease"):
            spent = run_engines(lims, "u", 1.5)
            assert all(lim.health.mode == SHARED for lim in lims)
            srv.stop()  # SIGKILL: an abrupt outage
            deadline = time.monotonic_ns() + LIVENESS_S * S
            while time.monotonic_ns() < deadline and not all(l.health.mode == LOCAL for l in lims):
                for lim in lims:
                    lim.take_up_to("u", time.monotonic_ns(), 1)
                time.sleep(0.01)
            assert all(lim.health.mode == LOCAL for lim in lims)
            # Local fallback: each engine serves, within rate / expected engines.
            local = run_engines(lims, "u", 3.0)
            for per in local:
                assert per
                span = max(per) - min(per)
                assert len(per) <= Fraction(span + DEFAULT_BURST_NS, S) * Fraction(rate, n) + 1
            srv.start()  # same port, empty (no persistence)
            deadline = time.monotonic_ns() + LIVENESS_S * S
            while time.monotonic_ns() < deadline and not all(l.health.mode == SHARED for l in lims):
                for lim in lims:
                    lim.take_up_to("u", time.monotonic_ns(), 1)
                time.sleep(0.01)
            assert all(lim.health.mode == SHARED for lim in lims)
            # Shared again: one quota for both engines, and it serves.
            after = run_engines(lims, "u", 2.0)
            assert 0 < sum(map(len, after)) <= bound(2 * S, rate, n)
        down = [r for r in caplog.records if "unreachable" in r.getMessage()]
        up = [r for r in caplog.records if "answers again" in r.getMessage()]
        assert len(down) == n and len(up) == n  # one line per engine per outage
        assert spent and all(lim.stats["outages"] == 1 for lim in lims)
    finally:
        for lim in lims:
            lim.close()
        srv.stop()


def test_engine_restart_gets_no_fresh_burst(server, prefix):
    # 1 tok/s, burst 100 ms: a fresh user gets 1 token at once, then owes 0.9 s
    # (on the script's clock, a fake one: 10 ms pass in all).
    rate = 1
    clock = Clock()
    first = LeasedOutputRateLimiter(
        rate, {}, redis_on_clock(server.url, clock, prefix), clock=clock, start=False
    )
    assert first.take_up_to("u", clock.now, 5) == 0  # short: the next round asks
    first.rounds.run(clock.now, only_new=True)
    assert first.take_up_to("u", clock.now, 5) == 1
    first.close()
    # The engine restarts: a new limiter, new connection, same store.
    clock.now += 5 * MS
    backend = redis_on_clock(server.url, clock, prefix)
    fresh = LeasedOutputRateLimiter(rate, {}, backend, clock=clock, start=False)
    fresh.want("u", clock.now)
    assert fresh.rounds.run(clock.now, only_new=True) == 0  # debt is still in Redis
    fresh.want("someone-else", clock.now)
    assert fresh.rounds.run(clock.now, only_new=True) == 1  # a new user: one lease
    # Asked directly for more than a lease: u still nothing, a new user its burst.
    clock.now += 5 * MS
    u, new = backend.lease(DEFAULT_BURST_NS, [LeaseAsk("u", 5, 0, S), LeaseAsk("new", 5, 0, S)])
    assert (u.granted, new.granted) == (0, 1)
    assert u.wait_ns == 900 * MS - 10 * MS
    fresh.close()


def test_password_from_env_is_used_and_never_shown(prefix, monkeypatch, caplog):
    srv = RedisServer(password="s3cret-pw").start()
    try:
        url_without = f"redis://127.0.0.1:{srv.port}/0"
        monkeypatch.setenv(PASSWORD_ENV, "s3cret-pw")
        backend = RedisLeaseBackend(url_without, prefix=prefix)
        (g,) = backend.lease(100 * MS, [LeaseAsk("u", 1, 0, 10 * MS)])
        assert g.granted == 1
        with_url = RedisLeaseBackend(srv.url, prefix=prefix)  # password in the URL
        assert "s3cret" not in with_url.describe() and "s3cret" not in redact(srv.url)
        assert with_url.describe() == f"redis://127.0.0.1:{srv.port}/0"
        lim = LeasedOutputRateLimiter(5, {}, with_url, start=False)
        srv.stop()
        with caplog.at_level(logging.WARNING):
            deadline = time.monotonic_ns() + LIVENESS_S * S
            while lim.health.mode != LOCAL and time.monotonic_ns() < deadline:
                lim.want("u", time.monotonic_ns())
                lim.rounds.run(time.monotonic_ns())
                time.sleep(0.05)
        assert lim.health.mode == LOCAL
        assert caplog.records and all("s3cret" not in r.getMessage() for r in caplog.records)
        lim.close()
        backend.close()
    finally:
        srv.stop()


def test_limits_mismatch_between_engines_is_logged(server, prefix, caplog):
    a = LeasedOutputRateLimiter(30, {"x": 5}, RedisLeaseBackend(server.url, prefix=prefix), start=False)
    b = LeasedOutputRateLimiter(30, {"x": 6}, RedisLeaseBackend(server.url, prefix=prefix), start=False)
    c = LeasedOutputRateLimiter(30, {"x": 5}, RedisLeaseBackend(server.url, prefix=prefix), start=False)
    with caplog.at_level(logging.WARNING):
        assert a.fingerprints.check(time.monotonic_ns(), a.rates) == []
        assert c.fingerprints.check(time.monotonic_ns(), c.rates) == []
        assert len(b.fingerprints.check(time.monotonic_ns(), b.rates)) == 2
    assert len([r for r in caplog.records if "limits differ" in r.getMessage()]) == 2
    for lim in (a, b, c):
        lim.close()


def test_make_limiter_with_a_store_url(server, prefix):
    settings = OutputRateSettings.from_additional_config(
        {
            "output_rate": {
                "default_user_output_tokens_per_second": 20,
                "user_output_tokens_per_second": {"a": 5},
                "store": {"url": server.url, "prefix": prefix, "fallback": "closed"},
            }
        }
    )
    lim = make_limiter(settings)
    try:
        assert isinstance(lim, LeasedOutputRateLimiter)
        assert lim.rate_of("a") == 5 and lim.rate_of("b") == 20
        assert lim.config.fallback == "closed" and lim.backend.prefix == prefix
        deadline = time.monotonic_ns() + LIVENESS_S * S
        got = 0
        while not got and time.monotonic_ns() < deadline:
            got = lim.take_up_to("a", time.monotonic_ns(), 1)
            time.sleep(0.002)
        assert got == 1
        assert server.client().exists(user_key(prefix, "a"))
    finally:
        lim.close()


def test_ceiling_is_shared_through_the_store_under_keys_of_its_own(server, prefix):
    """Issue 21: with a store, the ceiling quota is leased like the rate,
    under ``{prefix}:ceil:...`` so it never collides with the rate's keys."""
    from vllm_output_rate.factory import make_borrowing

    settings = OutputRateSettings.from_additional_config(
        {
            "output_rate": {
                "default_user_output_tokens_per_second": 20,
                "user_output_tokens_per_second": {"b": {"rate": 5, "ceil": 50}},
                "store": {"url": server.url, "prefix": prefix, "fallback": "closed"},
            }
        }
    )
    rate = make_limiter(settings)
    borrowing, limiter = make_borrowing(settings, rate)
    try:
        ceiling = borrowing.ceiling
        assert isinstance(ceiling, LeasedOutputRateLimiter)
        assert ceiling.backend.prefix == prefix + ":ceil" and ceiling.rate_of("b") == 50
        deadline = time.monotonic_ns() + LIVENESS_S * S
        got = 0
        while not got and time.monotonic_ns() < deadline:
            got = limiter.take_up_to("b", time.monotonic_ns(), 1)  # paid on both quotas
            time.sleep(0.002)
        assert got == 1
        client = server.client()
        assert client.exists(user_key(prefix, "b"))
        assert client.exists(user_key(prefix + ":ceil", "b"))
    finally:
        rate.close()
        borrowing.ceiling.close()


def test_store_mode_and_totals_reach_prometheus_and_follow_an_outage(prefix):
    """Real lease limiter + real Redis -> the engine's report -> the exporter's /metrics text.

    The report is built by the scheduler mixin's own ``output_rate_report``
    (on an object carrying only what that method reads; no vLLM), and fed to
    the exporter that vLLM's patched Prometheus logger uses, with its own
    registry.  Redis is then killed and restarted.
    """
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_output_rate.adapter.metrics import OutputRateExporter
    from vllm_output_rate.adapter.operate import OperateSchedulerMixin, OperateState
    from vllm_output_rate.policy.gate import StepGate
    from vllm_output_rate.policy.prompt_cost import PromptCost

    srv = RedisServer().start()
    settings = OutputRateSettings.from_additional_config(
        {"output_rate": {"default_user_output_tokens_per_second": 50,
                         "store": {"url": srv.url, "prefix": prefix, "expected_engines": 2}}}
    )
    lim = make_limiter(settings)  # its real lease thread

    class Engine(OperateSchedulerMixin):
        pass

    engine = object.__new__(Engine)  # only the report path, no scheduler behind it
    engine.output_rate_settings = settings
    engine.output_rate_limiter = lim
    engine.output_rate_gate = StepGate(lim)
    engine.output_rate_prompt_cost = PromptCost(engine.output_rate_gate.ledger, 0)
    engine.running, engine.waiting = [], []
    engine.output_rate_reloads = engine.output_rate_reload_failures = 0
    engine._operate = OperateState(settings.metrics_max_users)
    registry = CollectorRegistry()
    exporter = OutputRateExporter("tiny", registry)

    def scrape() -> dict:
        exporter.observe(engine.output_rate_report(time.monotonic_ns()))
        text = generate_latest(registry).decode()
        return {
            (s.name, s.labels.get("mode")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("vllm:output_rate_store_") and not s.name.endswith("_created")
        }

    def spend(seconds, until=lambda: False):
        got, end = 0, time.monotonic_ns() + int(seconds * S)
        while time.monotonic_ns() < end and not until():
            got += lim.take_up_to("u", time.monotonic_ns(), 2)
            time.sleep(0.005)
        return got

    try:
        spent = spend(0.6)
        first = scrape()
        assert first[("vllm:output_rate_store_mode", "shared")] == 1
        assert first[("vllm:output_rate_store_mode", "local")] == 0
        assert first[("vllm:output_rate_store_mode", "closed")] == 0
        assert first[("vllm:output_rate_store_outages_total", None)] == 0
        trips = first[("vllm:output_rate_store_round_trips_total", None)]
        assert trips >= 1
        assert first[("vllm:output_rate_store_commands_total", None)] >= trips
        assert first[("vllm:output_rate_store_leased_tokens_total", None)] >= spent > 0
        assert first[("vllm:output_rate_store_spent_tokens_total", None)] == spent
        assert lim.figures("u")["spent"] == spent and lim.figures("u")["leased"] >= spent
        srv.stop()
        spend(LIVENESS_S, until=lambda: lim.health.mode == LOCAL)
        assert lim.health.mode == LOCAL
        down = scrape()
        assert down[("vllm:output_rate_store_mode", "shared")] == 0
        assert down[("vllm:output_rate_store_mode", "local")] == 1
        assert down[("vllm:output_rate_store_outages_total", None)] == 1
        assert down[("vllm:output_rate_store_failed_round_trips_total", None)] >= 1
        assert down[("vllm:output_rate_store_round_trips_total", None)] >= trips
        srv.start()
        spend(LIVENESS_S, until=lambda: lim.health.mode == SHARED)
        spend(0.3)
        back = scrape()
        assert back[("vllm:output_rate_store_mode", "shared")] == 1
        assert back[("vllm:output_rate_store_mode", "local")] == 0
        assert back[("vllm:output_rate_store_outages_total", None)] == 1  # a counter: not reset
        assert back[("vllm:output_rate_store_round_trips_total", None)] > down[
            ("vllm:output_rate_store_round_trips_total", None)
        ]
        # Exported totals never run ahead of the limiter's own.
        figures = lim.figures()
        assert back[("vllm:output_rate_store_leased_tokens_total", None)] <= figures[
            "store_leased_tokens_total"
        ]
    finally:
        lim.close()
        srv.stop()
