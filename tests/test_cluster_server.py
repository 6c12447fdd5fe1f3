"""Two real ``vllm-output-rate serve`` engines sharing one user's quota through a real Redis.

One module fixture starts a redis-server (127.0.0.1, random port) and two
engines on the tiny model (``--enforce-eager``) pointed at it; everything is
stopped by PID at the end.  The rate is judged on exact token counts
(``usage.completion_tokens`` of non-streamed requests) over a span of at least
20 s, from the first send to the last answer -- not on receive-time windows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest

from redis_harness import RedisServer
from server_harness import running_server

pytestmark = pytest.mark.server

HEAVY_RATE = 30
LEASE = 3  # ceil(0.1 s * 30 tok/s)
BURST_S, LIFETIME_S = 0.1, 0.15
ENGINES = 2


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, server_log_dir):
    redis_srv = RedisServer().start()
    args = [
        "--enforce-eager",
        "--max-num-seqs", "16",
        "--default-user-output-tokens-per-second", "1000",
        "--user-output-tokens-per-second", json.dumps({"heavy": HEAVY_RATE}),
        "--output-rate-store", redis_srv.url,
        "--output-rate-expected-engines", str(ENGINES),
        "--output-rate-store-prefix", "cluster-test",
    ]
    managers = [running_server(args, server_log_dir, f"engine{i}") for i in range(ENGINES)]
    servers: list = [None] * ENGINES
    errors: list = []

    def start(i):  # both engines start side by side
        try:
            servers[i] = managers[i].__enter__()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    with contextlib.ExitStack() as stack:
        stack.callback(redis_srv.stop)
        threads = [threading.Thread(target=start, args=(i,)) for i in range(ENGINES)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, srv in enumerate(servers):
            if srv is not None:
                stack.push(managers[i].__exit__)
        if errors:
            raise errors[0]
        yield redis_srv, servers


async def one_request(client, server, user, max_tokens):
    body = {
        "model": server.model,
        "prompt": "The scheduler decides",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "vllm_xargs": {"output_rate_user": user},
    }
    r = await client.post(f"{server.base_url}/v1/completions", json=body)
    r.raise_for_status()
    payload = r.json()
    return payload["usage"]["completion_tokens"], payload["choices"][0]["finish_reason"]


async def user_load(client, servers, user, streams, duration_s, max_tokens, log):
    """``streams`` loops, spread round-robin over ``servers``, until ``duration_s``."""
    end = time.monotonic() + duration_s

    async def loop(i):
        server = servers[i % len(servers)]
        while time.monotonic() < end:
            sent = time.monotonic()
            try:
                tokens, finish = await one_request(client, server, user, max_tokens)
            except Exception as exc:  # noqa: BLE001 -- recorded, asserted on below
                log.append((user, sent, time.monotonic(), None, repr(exc), server.base_url))
                continue
            log.append((user, sent, time.monotonic(), tokens, finish, server.base_url))

    await asyncio.gather(*(loop(i) for i in range(streams)))


def tokens_in(rows, t0, t1):
    """Tokens of ``rows`` produced in [t0, t1], each request's tokens spread
    evenly over its send..answer interval (requests are paced, a few s long)."""
    total = 0.0
    for _, sent, end, tokens, *_ in rows:
        overlap = min(end, t1) - max(sent, t0)
        if overlap > 0 and tokens:
            total += tokens * overlap / (end - sent)
    return total


def summary(log, user):
    rows = [r for r in log if r[0] == user]
    first = min(r[1] for r in rows)
    last = max(r[2] for r in rows)
    tokens = sum(r[3] or 0 for r in rows)
    return tokens, last - first, rows


def test_two_engines_share_one_users_quota(cluster):
    _, servers = cluster
    log: list = []

    warm, measured = 4.0, 20.0

    async def scenario():
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            await asyncio.gather(
                user_load(client, servers, "heavy", 8, warm + measured, 12, log),
                user_load(client, servers[:1], "light", 1, warm + measured, 64, log),
            )

    start = time.monotonic()
    asyncio.run(scenario())
    errors = [r for r in log if r[3] is None]
    assert not errors, errors[:3]
    assert all(r[3] == (12 if r[0] == "heavy" else 64) and r[4] == "length" for r in log)
    tokens, span, rows = summary(log, "heavy")
    rate = tokens / span
    # Not 2 x 30: the quota is shared.  Exact bound over the whole span
    # (documented: (W + burst + lifetime) * N + 1 + E * lease).
    assert tokens <= (span + BURST_S + LIFETIME_S) * HEAVY_RATE + 1 + ENGINES * LEASE
    # The rate over 20 s of steady load (after a warm-up): at most 1.05 x N (not
    # 2 x N).  The lower end is wide for this shared 2-core box (measured here
    # 0.92 x N with both engines, the client and Redis on two cores); the issue's
    # target of 0.9 is reported in README, not asserted.
    steady = tokens_in(rows, start + warm, start + warm + measured) / measured
    assert 0.6 * HEAVY_RATE <= steady <= 1.05 * HEAVY_RATE, (steady, tokens, span)
    # Both engines served the heavy user (so the bounds above are over a quota
    # spent on both).  How it splits between them is not promised: under outside
    # load one engine's lease rounds lag (a fresh-clone run with the CPU busy
    # split 504 / 48).
    per_engine = [sum(r[3] for r in rows if r[5] == srv.base_url) for srv in servers]
    assert min(per_engine) > 0, per_engine
    light_tokens, light_span, _ = summary(log, "light")
    # Not held back by heavy's quota (measured ~80 tok/s on the loaded 2-core box).
    assert light_tokens / light_span > 2 * HEAVY_RATE
    print(f"\nheavy over 2 engines: {steady:.1f} tok/s steady (limit {HEAVY_RATE}), "
          f"{tokens} tokens in {span:.1f} s, per engine {per_engine}; "
          f"light on one engine: {light_tokens / light_span:.0f} tok/s")


def test_redis_outage_mid_run_no_errors_and_back_to_shared(cluster):
    redis_srv, servers = cluster
    log: list = []

    async def outage():
        await asyncio.sleep(3.0)
        redis_srv.stop()
        await asyncio.sleep(4.0)
        redis_srv.start()

    async def scenario():
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            await asyncio.gather(
                user_load(client, servers, "heavy", 8, 12.0, 12, log),
                outage(),
            )

    asyncio.run(scenario())
    # No request failed or came back short while Redis was down and back.
    assert log and all(r[3] == 12 and r[4] == "length" for r in log), [
        r for r in log if r[3] != 12
    ][:3]
    for srv in servers:
        text = srv.log_path.read_text(errors="replace")
        # One line per outage and one when it ended (a stall of the loaded
        # 2-core box longer than 0.3 s can add an outage of its own).
        assert text.count("unreachable") >= 1, srv.log_tail()
        assert text.count("answers again") == text.count("unreachable"), srv.log_tail()
        assert "s3cret" not in text
    tokens, span, _ = summary(log, "heavy")
    # Local fallback at 30 / 2 per engine while down: never more than the
    # shared bound plus each engine's local bound over the whole span.
    assert tokens <= (span + 0.25) * HEAVY_RATE + 1 + ENGINES * LEASE + ENGINES * (
        (span + BURST_S) * HEAVY_RATE / ENGINES + 1
    )
