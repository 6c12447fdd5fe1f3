"""A gateway limiter in front of stock vLLM, for ``benchmarks/gateway_compare.py``.

The gateway is LiteLLM's proxy, configured as a new user would: no
database, one model entry pointing at the vLLM server, per-key token limits
returned by a ``custom_auth`` hook (``tpm_limit``, tokens per minute), and
``token_rate_limit_type: output`` so that only output tokens count.  LiteLLM
is never imported here: it lives in its own venv (``make bench-gateway``
builds it) and runs as a child process on 127.0.0.1.

Pure parts (tested in ``tests/tools/test_gateway.py``):

* :func:`hook_source` / :func:`write_gateway_files`: the ``custom_auth``
  module and the proxy's config file;
* :func:`rejected`, :func:`answered`: a user's 429s and answered requests
  from the client's request log (a 429 is its own record: the retry is a new
  request);
* :func:`counter_most_in_window`: the most an engine-side cumulative counter
  grew between two reads at most W seconds apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from vllm_output_rate.tools.measure import FINISHED, HTTP_ERROR, RequestRecord
from vllm_output_rate.tools.serverproc import free_port, stop_group, tail_lines, wait_healthy

#: The HTTP status of a request the gateway refused for lack of quota.
TOO_MANY_REQUESTS = 429
HOOK_MODULE = "gateway_auth"
HOOK_FUNCTION = "user_api_key_auth"
STARTUP_TIMEOUT_S = 300

_HOOK_TEMPLATE = '''"""custom_auth hook for LiteLLM's proxy, written by vllm_output_rate_harness.gateway.

Maps each API key to its user and that user's output-token limit in tokens
per minute (LiteLLM's ``tpm_limit``).
"""

KEYS = {keys}


def limits_for(api_key):
    """(user, tpm_limit) of ``api_key`` (with or without "Bearer "), or None."""
    key = (api_key or "").strip()
    if key.lower().startswith("bearer "):
        key = key[len("bearer "):].strip()
    entry = KEYS.get(key)
    return None if entry is None else (entry["user"], entry["tpm_limit"])


async def {function}(request, api_key):
    from litellm.proxy._types import UserAPIKeyAuth

    found = limits_for(api_key)
    if found is None:
        raise ValueError("unknown API key")
    user, tpm_limit = found
    return UserAPIKeyAuth(api_key=api_key, user_id=user, tpm_limit=tpm_limit)
'''


def tokens_per_minute(rate: float) -> int:
    """A tok/s limit as LiteLLM's whole tokens per minute (never above the rate)."""
    return int(rate * 60)


def hook_source(keys: Mapping[str, tuple[str, float]]) -> str:
    """The ``custom_auth`` module for ``keys``: api key -> (user, tok/s limit)."""
    table = {key: {"user": user, "tpm_limit": tokens_per_minute(rate)} for key, (user, rate) in keys.items()}
    return _HOOK_TEMPLATE.format(keys=json.dumps(table, indent=4, sort_keys=True), function=HOOK_FUNCTION)


def gateway_config(upstream_base_url: str, model: str) -> dict[str, Any]:
    """The proxy's config: ``model`` served by the vLLM server at ``upstream_base_url``."""
    return {
        "model_list": [{
            "model_name": model,
            "litellm_params": {"model": f"hosted_vllm/{model}", "api_base": upstream_base_url.rstrip("/") + "/v1",
                               "api_key": "unused"},
        }],
        "general_settings": {
            "custom_auth": f"{HOOK_MODULE}.{HOOK_FUNCTION}",
            "token_rate_limit_type": "output",
        },
    }


def write_gateway_files(folder: str | os.PathLike, keys: Mapping[str, tuple[str, float]],
                        upstream_base_url: str, model: str) -> Path:
    """Write the hook module and the config (JSON, which is YAML) into ``folder``;
    returns the config's path (LiteLLM finds the hook beside it)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{HOOK_MODULE}.py").write_text(hook_source(keys))
    config = folder / "config.yaml"
    config.write_text(json.dumps(gateway_config(upstream_base_url, model), indent=1) + "\n")
    return config


class GatewayProcess:
    """LiteLLM's proxy as a child process on 127.0.0.1, stopped by PID (its process group).

    ``command`` is the proxy's executable (``.venv-compare/bin/litellm``).  The
    master key LiteLLM insists on is random per run and used by nobody: the
    ``custom_auth`` hook decides every request.
    """

    def __init__(self, command: str | os.PathLike, config: Path, log_path: Path) -> None:
        self.command = os.path.abspath(command)  # the proxy runs in the config's folder
        self.config = config
        self.log_path = log_path
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "GatewayProcess":
        env = {**os.environ, "LITELLM_MASTER_KEY": "sk-" + os.urandom(24).hex(),
               # no network here: the bundled model price map, no telemetry
               "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False"}
        began = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.command, "--config", str(self.config), "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.config.parent, start_new_session=True)
        try:
            wait_healthy(self.proc, f"{self.base_url}/health/liveliness", self.log_tail,
                         what="the gateway", timeout_s=STARTUP_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.monotonic() - began, 1)
        return self

    def log_tail(self, n: int = 40) -> str:
        return tail_lines(self.log_path, n)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)

    def __enter__(self) -> "GatewayProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------
# Request logs and engine counters
# --------------------------------------------------------------------------


def rejected(records: Sequence[RequestRecord]) -> int:
    """Requests refused with 429 (each retry that was refused again counts again)."""
    return sum(1 for r in records if r.status == HTTP_ERROR and r.http_status == TOO_MANY_REQUESTS)


def answered(records: Sequence[RequestRecord]) -> int:
    """Requests that streamed to their end."""
    return sum(1 for r in records if r.status == FINISHED)


def counter_most_in_window(reads: Sequence[tuple[float, float, float]], window_s: float) -> float | None:
    """Most a cumulative counter grew in at most ``window_s`` seconds.

    ``reads`` are ``(sent, done, value)``: the counter was read somewhere
    between ``sent`` and ``done``.  Only pairs of reads with ``done`` of the
    later minus ``sent`` of the earlier at most ``window_s`` count, so the
    growth surely happened within a window of that length: the result never
    overstates the true maximum, and approaches it as reads get denser.
    None when no two reads are that close.
    """
    ordered = sorted(reads)
    best: float | None = None
    for j, (_, done_j, value_j) in enumerate(ordered):
        for sent_i, _, value_i in ordered[:j]:
            if done_j - sent_i <= window_s:
                grown = value_j - value_i
                best = grown if best is None or grown > best else best
    return best
