"""The gateway comparison's pure parts (``vllm_output_rate_harness.gateway``): the
``custom_auth`` hook and config it writes for LiteLLM's proxy, 429 and answer
counts over a request log with retries, and windows over engine counter reads.
No LiteLLM and no server: the hook is loaded from the written file with a
stand-in for LiteLLM's ``UserAPIKeyAuth``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import types

import pytest

from vllm_output_rate.tools.measure import CANCELLED, FINISHED, HTTP_ERROR, RequestRecord, max_in_window
from vllm_output_rate_harness import gateway

KEYS = {"key-heavy": ("heavy", 30.0), "key-light": ("light", 1000.0)}


class FakeUserAPIKeyAuth:
    def __init__(self, **fields):
        self.fields = fields


@pytest.fixture
def hook(tmp_path, monkeypatch):
    """The hook module exactly as written for the proxy, importable without LiteLLM."""
    config = gateway.write_gateway_files(tmp_path, KEYS, "http://127.0.0.1:9", "models/tiny-llama")
    types_module = types.ModuleType("litellm.proxy._types")
    types_module.UserAPIKeyAuth = FakeUserAPIKeyAuth
    for name in ("litellm", "litellm.proxy"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "litellm.proxy._types", types_module)
    spec = importlib.util.spec_from_file_location(gateway.HOOK_MODULE, config.parent / f"{gateway.HOOK_MODULE}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hook_gives_each_key_its_user_and_tokens_per_minute(hook):
    auth = asyncio.run(getattr(hook, gateway.HOOK_FUNCTION)(request=None, api_key="key-heavy"))
    assert auth.fields == {"api_key": "key-heavy", "user_id": "heavy", "tpm_limit": 1800}
    assert hook.limits_for("Bearer key-light") == ("light", 60000)
    assert hook.limits_for("bearer  key-light ") == ("light", 60000)


def test_hook_refuses_an_unknown_or_missing_key(hook):
    for key in ("key-other", "", None, "Bearer "):
        assert hook.limits_for(key) is None
    with pytest.raises(ValueError):
        asyncio.run(getattr(hook, gateway.HOOK_FUNCTION)(request=None, api_key="key-other"))


def test_a_fractional_rate_never_becomes_more_tokens_per_minute():
    assert gateway.tokens_per_minute(30) == 1800
    assert gateway.tokens_per_minute(0.51) == 30  # 30.6 per minute: 30 whole tokens, never 31


def test_config_points_the_hook_and_output_tokens_at_the_upstream(tmp_path):
    config = gateway.write_gateway_files(tmp_path, KEYS, "http://127.0.0.1:8123/", "models/tiny-llama")
    data = json.loads(config.read_text())  # JSON is YAML: LiteLLM reads it as such
    assert data["general_settings"] == {"custom_auth": "gateway_auth.user_api_key_auth",
                                        "token_rate_limit_type": "output"}
    (entry,) = data["model_list"]
    assert entry["model_name"] == "models/tiny-llama"
    assert entry["litellm_params"]["model"] == "hosted_vllm/models/tiny-llama"
    assert entry["litellm_params"]["api_base"] == "http://127.0.0.1:8123/v1"
    assert (tmp_path / "gateway_auth.py").is_file()
    assert "database_url" not in config.read_text()


def refused(start: float) -> RequestRecord:
    return RequestRecord(user="heavy", start=start, end=start + 0.01, status=HTTP_ERROR, http_status=429)


def answer(start: float, times: list[float]) -> RequestRecord:
    return RequestRecord(user="heavy", start=start, token_times=times, end=times[-1], status=FINISHED,
                         http_status=200, completion_tokens=len(times))


def test_429s_retried_after_a_second_each_count_and_carry_no_tokens():
    # One stream: a burst answered at once, then refused three times a second apart,
    # then answered again; another request cut at the end of the run.
    log = [answer(0.0, [0.1, 0.1, 0.2, 0.2]), refused(0.3), refused(1.3), refused(2.3),
           answer(3.3, [3.4, 3.5, 9.0]),
           RequestRecord(user="heavy", start=9.1, token_times=[9.5], end=10.0, status=CANCELLED),
           RequestRecord(user="heavy", start=9.2, end=9.3, status=HTTP_ERROR, http_status=500)]
    assert gateway.rejected(log) == 3
    assert gateway.answered(log) == 2
    times = [t for r in log for t in r.token_times]
    assert max_in_window(times, 1.0) == 4  # the burst; refusals add nothing
    assert max_in_window(times, 10.0) == 8


def test_counter_windows_only_count_reads_surely_within_the_window():
    # (sent, done, cumulative charged): a read took 0.1 s to answer.
    reads = [(0.0, 0.1, 0), (1.0, 1.1, 30), (2.0, 2.1, 60), (5.0, 5.1, 150), (10.0, 10.1, 300)]
    # 1.0 -> 2.1 spans 1.1 s: does not fit 1 s; no pair does.
    assert gateway.counter_most_in_window(reads, 1.0) is None
    assert gateway.counter_most_in_window(reads, 1.1) == 30
    # 0.0 -> 10.1 does not fit 10 s; 1.0 -> 10.1 does.
    assert gateway.counter_most_in_window(reads, 10.0) == 270
    assert gateway.counter_most_in_window(reads, 10.1) == 300
    assert gateway.counter_most_in_window(reads[:1], 60.0) is None
