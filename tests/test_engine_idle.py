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
    ]
    with running_server(args, server_log_dir, "idle") as srv:
        yield srv


async def _stream(client, url: str, model: str, user: str, max_tokens: int, sink: list):
    body = {
        "model": model,
        "prompt": "hello there",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "vllm_xargs": {"output_rate_user": user},
    }
    start = time.monotonic()
    first = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                first = time.monotonic() - start
    sink.append(first)


def test_throttled_only_engine_does_not_spin_and_others_are_served_at_once(server):
    model = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["id"]
    procs = engine_core_processes(server.pid)
    time.sleep(2)
    idle = core_share(procs, 3.0)

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as client:
            slow_first: list = []
            slow = [
                asyncio.create_task(_stream(client, server.base_url, model, "slow", 40, slow_first))
                for _ in range(8)
            ]
            await asyncio.sleep(2.0)  # the burst is long spent: every stream is throttled
            throttled = await asyncio.to_thread(core_share, procs, 3.0)
            fast_first: list = []
            await _stream(client, server.base_url, model, "fast", 20, fast_first)
            for task in slow:
                task.cancel()
            await asyncio.gather(*slow, return_exceptions=True)
            return throttled, fast_first[0]

    throttled, fast_ttft = asyncio.run(scenario())
    print(f"idle {idle:.3f} cores, throttled-only {throttled:.3f} cores, fast TTFT {fast_ttft:.3f}s")
    # Stock vLLM polls every 1 ms here (a large share of a core); we wait on
    # the input queue with at most 50 ms timeouts.
    assert throttled <= idle + 0.10, (idle, throttled)
    # A new request wakes the engine at once.
    assert fast_ttft < 1.0
