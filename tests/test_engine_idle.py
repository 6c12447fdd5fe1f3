"""A real server whose only work is throttled must not spin its engine loop.

When every runnable request is out of quota, the engine core waits on its
input queue (woken by new requests and aborts) instead of polling every
millisecond.  CPU use is compared with the same server's idle level, with
wide margins; no timing threshold here is tighter than a few hundred ms.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import psutil
import pytest

from server_harness import running_server
from vllm_output_rate.tools import measure

pytestmark = pytest.mark.server

SLOW_RATE = 2  # tok/s: the throttled user's whole quota


def engine_core_processes(server_pid: int) -> list[psutil.Process]:
    """The engine-core process: the loop this plugin changes.

    Not the model worker: vLLM's shared-memory queue busy-polls for 1 s after
    every message it reads, so any server that runs a step at least once a
    second (as a throttled user at 2 tok/s makes it do) keeps its worker
    spinning, with or without this plugin.
    """
    procs = [
        p for p in psutil.Process(server_pid).children(recursive=True)
        if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())
    ]
    assert procs, "no engine-core process found"
    return procs


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def core_share(procs: list[psutil.Process], seconds: float) -> float:
    """Average share of one core used by ``procs`` over ``seconds``."""
    before = cpu_seconds(procs)
    time.sleep(seconds)
    return (cpu_seconds(procs) - before) / seconds


@pytest.fixture(scope="module")
def server(tiny_model_dir, server_log_dir):
    args = [
        "--default-user-output-tokens-per-second", "500",
        "--user-output-tokens-per-second", json.dumps({"slow": SLOW_RATE}),
        "--max-num-seqs", "16",
        "--max-model-len", "512",
        "--enable-per-request-metrics",
    ]
    with running_server(args, server_log_dir, "idle") as srv:
        yield srv


async def _stream(client, model: str, user: str, max_tokens: int) -> measure.RequestRecord:
    body = {
        "model": model,
        "prompt": "hello there",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
        "vllm_xargs": {"output_rate_user": user},
    }
    record = measure.RequestRecord(user=user)
    return await measure.stream_completion(client, body, record, time.monotonic())


def test_throttled_only_engine_does_not_spin_and_others_are_served_at_once(server):
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    procs = engine_core_processes(server.pid)
    time.sleep(2)
    idle = core_share(procs, 3.0)

    async def scenario():
        async with measure.openai_client(server.base_url, timeout=120) as client:
            slow = [asyncio.create_task(_stream(client, model, "slow", 40)) for _ in range(8)]
            await asyncio.sleep(2.0)  # the burst is long spent: every stream is throttled
            throttled = await asyncio.to_thread(core_share, procs, 3.0)
            fast = await _stream(client, model, "fast", 20)
            for task in slow:
                task.cancel()
            await asyncio.gather(*slow, return_exceptions=True)
            return throttled, fast

    throttled, fast = asyncio.run(scenario())
    assert fast.status == measure.FINISHED and fast.n_tokens == 20, fast
    fast_ttft = fast.server_first_token_s
    print(f"idle {idle:.3f} cores, throttled-only {throttled:.3f} cores, fast first token "
          f"{fast_ttft:.3f}s after arrival (server clock; client saw "
          f"{fast.token_times[0] - fast.start:.3f}s)")
    # Stock vLLM polls every 1 ms here (a large share of a core); we wait on
    # the input queue with timeouts of at most 250 ms (gate.MAX_IDLE_WAIT_NS).
    assert throttled <= idle + 0.10, (idle, throttled)
    # A new request wakes the engine at once (judged on the server's own
    # timestamps: client receive times stall on this machine).
    assert fast_ttft < 1.0
