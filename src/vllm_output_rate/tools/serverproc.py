"""Start and stop a ``vllm-output-rate serve`` process (tests, demo, benchmarks).

The server listens on 127.0.0.1 only, runs in its own process group and is
stopped by PID (the whole group) when the context exits.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

import httpx

DEFAULT_MODEL_DIR = Path(os.environ.get("TINY_MODEL_DIR", "models/tiny-llama"))
CLI = Path(sys.executable).with_name("vllm-output-rate")
#: The default command: ``vllm-output-rate serve``.
SERVE = [str(CLI), "serve"]
#: ``vllm-output-rate serve`` plus the churn counters (see tools/churn.py).
SERVE_WITH_CHURN = [sys.executable, "-m", "vllm_output_rate.tools.churn"]
STARTUP_TIMEOUT_S = 300
#: ``env`` for :func:`running_server` that also loads the admin route
#: (``GET /v1/output_rate/users``): vLLM loads an endpoint plugin only when
#: ``VLLM_PLUGINS`` names it.
ADMIN_ROUTE_ENV = {"VLLM_PLUGINS": "output_rate,output_rate_admin"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


class Server:
    def __init__(self, proc: subprocess.Popen, base_url: str, log_path: Path, model: str):
        self.proc = proc
        self.base_url = base_url
        self.log_path = log_path
        self.model = model

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def metrics(self) -> str:
        """The raw ``/metrics`` text (parse it with ``measure.parse_metrics``)."""
        return httpx.get(f"{self.base_url}/metrics", timeout=10, trust_env=False).text


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@contextmanager
def running_server(
    args: list[str],
    log_dir: Path,
    name: str = "server",
    model: str | os.PathLike = DEFAULT_MODEL_DIR,
    port: int | None = None,
    command: list[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Iterator[Server]:
    """Start ``vllm-output-rate serve MODEL ARGS`` and wait until healthy.

    ``command`` replaces ``vllm-output-rate serve`` (e.g. :data:`SERVE_WITH_CHURN`);
    ``env`` adds to (or overrides) this process's environment for the server only.
    """
    port = port or free_port()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}-{port}.log"
    cmd = [*(command or SERVE), str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**server_env(), **(env or {})},
            start_new_session=True,  # own process group: stop it and its children by PID
        )
    server = Server(proc, f"http://127.0.0.1:{port}", log_path, str(model))
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {proc.returncode} during startup:\n{server.log_tail()}"
                )
            try:
                if httpx.get(f"{server.base_url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}")
            time.sleep(1)
        yield server
    finally:
        _stop(proc)


def run_cli(
    args: list[str], timeout: float = 240, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``vllm-output-rate ARGS`` to completion (for startup-refusal tests);
    ``env`` adds to (or overrides) the server environment."""
    return subprocess.run(
        [str(CLI), *args],
        capture_output=True,
        text=True,
        env={**server_env(), **(env or {})},
        timeout=timeout,
        start_new_session=True,
    )
