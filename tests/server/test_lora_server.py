"""LoRA on a real ``vllm-output-rate serve --enable-lora`` (tiny model, two tiny adapters).

The adapters are random LoRA weights for the tiny Llama, written at the
start of the session (``tiny_model.write_tiny_lora``); the server starts in
the background then (``conftest.PRESTARTED``).  ``--max-loras 1``: a batch
holds one adapter, so a throttled user's request keeps the only adapter
slot and another adapter's requests must wait for it instead of joining the
batch (before the fix, vLLM's own ``max_loras`` assertion stopped the
engine).  Judged on the engine's own counters: tokens charged per user,
vLLM's ``lora_requests_info`` gauge (the adapters running at once), and
every request's full length.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest

from server_harness import running_server
from vllm_output_rate.tools import measure
from vllm_output_rate.tools.tiny_model import write_tiny_lora

pytestmark = pytest.mark.server

SLOW_RATE = 2.0
BURST_S = 0.1  # the default burst (policy's DEFAULT_BURST_NS)
ARGS = [
    "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "8",
    "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
    "--default-user-output-tokens-per-second", "200",
    "--user-output-tokens-per-second", json.dumps({"slow": SLOW_RATE}),
]


@contextlib.contextmanager
def server_context(tmp_path_factory, model_dir):
    work = tmp_path_factory.mktemp("lora")
    adapters = {name: write_tiny_lora(work / name, model_dir, seed=seed)
                for name, seed in (("ad1", 1), ("ad2", 2))}
    modules = [f"{name}={path}" for name, path in adapters.items()]
    log_dir = tmp_path_factory.mktemp("server-logs")
    with running_server([*ARGS, "--lora-modules", *modules], log_dir, "lora",
                        model=model_dir) as server:
        yield server


@pytest.fixture(scope="module")
def server(server_pool, tmp_path_factory, tiny_model_dir):
    yield server_pool.get(__name__, lambda: server_context(tmp_path_factory, tiny_model_dir))
    server_pool.release(__name__)


def charged(text: str, user: str) -> float:
    return measure.metric_sum(
        measure.parse_metrics(text), "vllm:output_rate_output_tokens_charged_total", user=user
    ) or 0.0


async def _complete_all(server, plan):
    """plan: (model, user, max_tokens) per request; returns completion_tokens per request."""
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:
        async def one(model, user, n):
            body = {"model": model, "prompt": "Hello there", "max_tokens": n, "ignore_eos": True,
                    "vllm_xargs": {"output_rate_user": user}}
            r = await client.post(f"{server.base_url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"]
        return await asyncio.gather(*(one(*p) for p in plan))


def _running_adapter_sets(text: str) -> set[str]:
    """Every ``running_lora_adapters`` label vLLM's gauge has shown."""
    samples = measure.parse_metrics(text).get("vllm:lora_requests_info", [])
    return {labels.get("running_lora_adapters", "") for labels, _ in samples}


def test_throttled_adapter_holds_its_slot_and_nothing_breaks(server):
    before = server.metrics()
    plan = [("ad1", "slow", 6)] + [("ad2", "fast", 20)] * 3 + [(server.model, "fast", 10)]
    start = time.monotonic()
    tokens = asyncio.run(_complete_all(server, plan))
    elapsed = time.monotonic() - start
    assert tokens == [n for _, _, n in plan]  # every request complete, none truncated
    time.sleep(1.5)  # the engine's stats reach /metrics about once a second
    after = server.metrics()
    assert httpx.get(f"{server.base_url}/health", timeout=10, trust_env=False).status_code == 200
    slow = charged(after, "slow") - charged(before, "slow")
    fast = charged(after, "fast") - charged(before, "fast")
    assert slow == 6 and fast == 70
    # The guarantee over the send->end envelope of all requests.
    assert slow <= (elapsed + BURST_S) * SLOW_RATE + 1
    # One adapter at a time, as --max-loras 1 says, in every stats report.
    sets = _running_adapter_sets(after)
    assert {"ad1", "ad2"} <= sets, sets
    assert all("," not in s for s in sets), sets
