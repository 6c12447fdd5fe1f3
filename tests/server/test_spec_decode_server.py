"""ngram speculative decoding on a real ``vllm-output-rate serve`` (tiny model, CPU).

One server, started in the background when the session begins
(``conftest.PRESTARTED``), with ngram drafting (3 drafts per step).  The tiny
model's greedy output repeats itself, so the drafter proposes drafts and the
model accepts some and rejects others.  Judged on the engine's own counters:
drafts were scheduled and some rejected, every request ends with all its
tokens, and what stays charged to each user is exactly what it was given
(the CPU build schedules synchronously, where charges settle exactly): the
rejected drafts were refunded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import time

import httpx
import pytest

from server_harness import engine_env, running_server
from vllm_output_rate.tools import measure

pytestmark = pytest.mark.server

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
ARGS = [
    "--enforce-eager", "--max-model-len", "512",
    "--default-user-output-tokens-per-second", "20",
    "--user-output-tokens-per-second", json.dumps({"fast": 100000}),
    "--speculative-config", json.dumps(NGRAM),
]


@contextlib.contextmanager
def server_context(tmp_path_factory, model_dir):
    log_dir = tmp_path_factory.mktemp("server-logs")
    with running_server(ARGS, log_dir, "spec", model=model_dir, env=engine_env(0, 1)) as server:
        yield server


@pytest.fixture(scope="module")
def server(server_pool, tmp_path_factory, tiny_model_dir):
    yield server_pool.get(__name__, lambda: server_context(tmp_path_factory, tiny_model_dir))
    server_pool.release(__name__)


def _counters(server) -> dict:
    samples = measure.parse_metrics(httpx.get(f"{server.base_url}/metrics", timeout=30).text)
    return {
        "drafts": measure.metric_sum(samples, "vllm:spec_decode_num_draft_tokens_total") or 0,
        "accepted": measure.metric_sum(samples, "vllm:spec_decode_num_accepted_tokens_total") or 0,
        "fast": measure.metric_sum(samples, "vllm:output_rate_output_tokens_charged_total", user="fast") or 0,
        "slow": measure.metric_sum(samples, "vllm:output_rate_output_tokens_charged_total", user="slow") or 0,
    }


def _complete(server, user: str, max_tokens: int) -> dict:
    body = {"model": server.model, "prompt": "a b c a b c a b c", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "vllm_xargs": {"output_rate_user": user}}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def test_rejected_drafts_are_refunded_and_nothing_is_truncated(server):
    before = _counters(server)
    jobs = [("fast", 60), ("fast", 60), ("fast", 60), ("slow", 30)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: _complete(server, *job), jobs))
    for (user, max_tokens), result in zip(jobs, results):
        assert result["usage"]["completion_tokens"] == max_tokens, user
        assert result["choices"][0]["finish_reason"] == "length", user
    after = _wait(server, before)
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    assert drafts > 0 and accepted < drafts, (drafts, accepted)
    assert after["fast"] - before["fast"] == 180
    assert after["slow"] - before["slow"] == 30


def _wait(server, before, timeout=30.0):
    """The counters once both users' tokens are in (stats reach /metrics
    about once a second), plus one more interval for any late charge."""
    deadline = time.monotonic() + timeout
    while True:
        counters = _counters(server)
        done = counters["fast"] - before["fast"] >= 180 and counters["slow"] - before["slow"] >= 30
        if done or time.monotonic() > deadline:
            time.sleep(2.5)  # one more stats interval: a late extra charge would show
            return _counters(server)
        time.sleep(0.5)
