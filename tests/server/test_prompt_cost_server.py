"""Prompt cost on a real ``vllm-output-rate serve`` (tiny model).

One server with ``--output-rate-input-token-weight 0.5`` and a burst of
0.25 s (``--output-rate-burst-seconds``), started in the background when the
session begins (``conftest.PRESTARTED``).  A user floods it with distinct
long prompts and ``max_tokens`` 1 beside a light user; the flood is judged on
the engine's own counters against the bound ``(W + B) x N + 1 + ceil(w x C)``
(W: from the first request to the drained engine, a window that holds every
charge), not on any rate or latency.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from fractions import Fraction

import httpx
import pytest

from server_harness import ADMIN_ROUTE_ENV, ConnectionBackoff, running_server
from vllm_output_rate.tools import measure
from vllm_output_rate.tools.measure import ERROR_STATUSES, FINISHED, RequestRecord, run_request
from vllm_output_rate_harness import benchkit

pytestmark = pytest.mark.server

FLOOD_RATE = 100
WEIGHT = Fraction(1, 2)
CHUNK = 512  # --max-num-batched-tokens: the most prompt tokens one chunk computes
PROMPT_TOKENS = 500
BURST = Fraction(1, 4)  # s
SERVER_ARGS = [
    "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "16",
    "--max-num-batched-tokens", str(CHUNK), "--enable-chunked-prefill",
    "--default-user-output-tokens-per-second", str(FLOOD_RATE),
    "--user-output-tokens-per-second", '{"light": 100000}',
    "--output-rate-input-token-weight", "0.5",
    "--output-rate-burst-seconds", str(float(BURST)),
    "--output-rate-admin-open",
]


def server_context(tmp_path_factory, model_dir):
    """The module's server; conftest starts it when the session begins."""
    return running_server(SERVER_ARGS, tmp_path_factory.mktemp("server-logs"), "prompt-cost", model=model_dir,
                          env=ADMIN_ROUTE_ENV)


@pytest.fixture(scope="module")
def server(server_pool, tmp_path_factory, tiny_model_dir):
    yield server_pool.get(__name__, lambda: server_context(tmp_path_factory, tiny_model_dir))
    server_pool.release(__name__)


def charged(text: str, user: str) -> tuple[float, float]:
    m = measure.parse_metrics(text)
    return (
        measure.metric_sum(m, "vllm:output_rate_output_tokens_charged_total", user=user) or 0.0,
        measure.metric_sum(m, "vllm:output_rate_prompt_tokens_charged_total", user=user) or 0.0,
    )


async def _flood_beside_light(server, seconds: float):
    rng = random.Random(25)
    flood: list[RequestRecord] = []
    light: list[RequestRecord] = []
    stop = asyncio.Event()

    async def loop(client, model, user, prompt_len, max_tokens, records, t0):
        backoff = ConnectionBackoff()
        while not stop.is_set():
            record = RequestRecord(user=user, start=time.monotonic() - t0)
            records.append(record)
            # Random token ids: no two prompts share a cached block.
            prompt = [rng.randrange(3, 400) for _ in range(prompt_len)]
            await run_request(client, measure.stream_body(model, user, max_tokens, prompt), record, t0)
            if record.status in ERROR_STATUSES:
                await backoff.failed(server)
            else:
                backoff.succeeded()

    async with benchkit.async_http(server.base_url, connections=16) as client:
        t0 = time.monotonic()
        light_task = asyncio.create_task(loop(client, server.model, "light", 16, 32, light, t0))
        flood_tasks = [
            asyncio.create_task(loop(client, server.model, "flood", PROMPT_TOKENS, 1, flood, t0))
            for _ in range(6)
        ]
        await asyncio.sleep(seconds)
        stop.set()
        for task in flood_tasks:  # in flight: cancelled (their dispatched chunks stay charged)
            task.cancel()
        await asyncio.gather(*flood_tasks, return_exceptions=True)
        await light_task  # the light user's last request runs to its end
    return t0, flood, light


def test_prompt_flood_is_held_to_its_bound_beside_a_light_user(server):
    before = server.metrics()
    t0, flood, light = asyncio.run(_flood_beside_light(server, 6.0))
    deadline = time.monotonic() + 60
    while True:  # every charge happens before the engine is empty
        m = measure.parse_metrics(server.metrics())
        if not measure.metric_sum(m, measure.RUNNING_GAUGE) and not measure.metric_sum(m, measure.WAITING_GAUGE):
            break
        assert time.monotonic() < deadline, "engine did not drain"
        time.sleep(0.2)
    window_s = Fraction(time.monotonic() - t0).limit_denominator(10**6) + Fraction(1, 10**6)
    time.sleep(1.5)  # the per-user report reaches /metrics about once a second
    after = server.metrics()
    out0, prompt0 = charged(before, "flood")
    out1, prompt1 = charged(after, "flood")
    output, prompt = out1 - out0, prompt1 - prompt0
    cost = Fraction(output) + WEIGHT * Fraction(prompt)
    bound = (window_s + BURST) * FLOOD_RATE + 1 + math.ceil(WEIGHT * CHUNK)
    assert cost <= bound, (output, prompt, float(window_s))
    finished = [r for r in flood if r.status == FINISHED]
    # Every finished flood request paid for its whole prompt (no cache hits:
    # random prompts); cancelled ones at most for what they sent.
    assert prompt >= sum(r.prompt_tokens for r in finished)
    assert prompt <= len(flood) * PROMPT_TOKENS
    assert output >= len(finished)
    # The light user was served whole: no error, no truncation.
    assert light and all(r.status == FINISHED and r.completion_tokens == 32 == len(r.token_times) for r in light)
    assert charged(after, "light")[1] - charged(before, "light")[1] == 16 * len(light)


def test_the_burst_flag_reaches_the_engines_settings(server):
    answer = httpx.get(f"{server.base_url}/v1/output_rate/users", timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json()["burst_seconds"] == float(BURST)
