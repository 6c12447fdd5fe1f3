"""``--data-parallel-size 2`` with a store on a real ``vllm-output-rate serve`` (tiny model, CPU).

One server with two data-parallel ranks (two engine cores, each with its own
scheduler and leased limiter) and a real redis-server, started in the
background once the modules with servers of their own are done
(``conftest.PRESTARTED_LATE``) and run last.  One user's streams land on both
ranks; judged on the engines' own counters: both ranks served it, every
request ends whole, the charges add up to the tokens given, and the tokens
charged between two reads of the counters stay within the shared-store bound
for two engines over the widest window those reads can span.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import httpx
import pytest

from redis_harness import RedisServer
from server_harness import running_server
from vllm_output_rate.tools import measure
from vllm_output_rate.tools.analysis import guarantee_bound

pytestmark = [pytest.mark.server, pytest.mark.cluster]

RATE = 20
REQUESTS, MAX_TOKENS = 6, 40
ENGINES = 2


@contextlib.contextmanager
def server_context(tmp_path_factory, model_dir):
    log_dir = tmp_path_factory.mktemp("server-logs")
    redis_srv = RedisServer().start()
    args = [
        "--enforce-eager", "--max-model-len", "512",
        "--default-user-output-tokens-per-second", str(RATE),
        "--data-parallel-size", str(ENGINES),
        "--output-rate-store", redis_srv.url,
        "--output-rate-expected-engines", str(ENGINES),
    ]
    with contextlib.ExitStack() as stack:
        stack.callback(redis_srv.stop)
        yield stack.enter_context(running_server(args, log_dir, "dp", model=model_dir))


@pytest.fixture(scope="module")
def server(server_pool, tmp_path_factory, tiny_model_dir):
    yield server_pool.get(__name__, lambda: server_context(tmp_path_factory, tiny_model_dir))
    server_pool.release(__name__)


def _counters(server) -> dict:
    samples = measure.parse_metrics(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
    return {
        "charged": measure.metric_sum(samples, "vllm:output_rate_output_tokens_charged_total", user="u") or 0,
        "rank0": measure.metric_sum(samples, "vllm:generation_tokens_total", engine="0") or 0,
        "rank1": measure.metric_sum(samples, "vllm:generation_tokens_total", engine="1") or 0,
    }


def _complete(server, i: int) -> dict:
    body = {"model": server.model, "prompt": f"hello {i}", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "vllm_xargs": {"output_rate_user": "u"}}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_ranks_share_one_quota(server):
    read_before = time.monotonic()
    before = _counters(server)
    with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
        results = list(pool.map(lambda i: _complete(server, i), range(REQUESTS)))
    for result in results:
        assert result["usage"]["completion_tokens"] == MAX_TOKENS
        assert result["choices"][0]["finish_reason"] == "length"
    total = REQUESTS * MAX_TOKENS
    deadline = time.monotonic() + 30
    while (after := _counters(server))["charged"] - before["charged"] < total:
        assert time.monotonic() < deadline, after
        time.sleep(0.5)
    read_after = time.monotonic()
    charged = after["charged"] - before["charged"]
    # Exactly the tokens given (once 243 for 240 here: a rank's repeated step
    # counted an admission cut short of its sampling position as a stream
    # that sampled; test_data_parallel.py has it on a fake clock).
    assert charged == total, charged
    assert after["rank0"] > before["rank0"] and after["rank1"] > before["rank1"]
    # Every token was charged between the two reads: a window no wider than
    # the time between them (the bound of two engines sharing one store).
    window_s = read_after - read_before
    assert charged <= guarantee_bound(window_s, RATE, shared_engines=ENGINES)
