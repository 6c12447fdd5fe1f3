"""Real ``vllm-output-rate serve`` processes for tests (one set per test module).

Thin test-side names over :mod:`vllm_output_rate.tools.serverproc`, with the
tiny model of this checkout as the default model.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from pathlib import Path
from typing import Any, Callable, ContextManager

from vllm_output_rate.tools import serverproc
from vllm_output_rate.tools.serverproc import (  # noqa: F401
    ADMIN_ROUTE_ENV,
    ConnectionBackoff,
    Server,
    ServerDied,
    while_alive,
    engine_env,
    free_port,
    run_cli,
    server_env,
)

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL_DIR = Path(os.environ.get("TINY_MODEL_DIR", REPO / "models" / "tiny-llama"))
CLI = serverproc.CLI


def running_server(args: list[str], log_dir: Path, name: str = "server", **kwargs):
    """Start ``vllm-output-rate serve <tiny model> ARGS`` and wait until healthy."""
    kwargs.setdefault("model", TINY_MODEL_DIR)
    return serverproc.running_server(args, log_dir, name, **kwargs)


class ServerPool:
    """Servers started ahead of the modules that use them, so startups overlap.

    A server takes ~30 s to start, mostly on one core (vLLM's API server,
    engine core and model worker each import vLLM in turn).  Started in
    background threads when the session begins, the servers of the modules
    named in ``conftest.PRESTARTED`` come up while the model-free tests run;
    a module's fixture then takes its server with :meth:`get` (waiting if it
    is still starting) and stops it with :meth:`release` when the module ends.

    A *context* is a zero-argument callable returning a context manager whose
    ``__enter__`` starts the server(s) and returns what the module's tests use.
    """

    def __init__(self) -> None:
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=4, thread_name_prefix="server-pool"
        )
        self._lock = threading.Lock()
        self._starting: dict[str, concurrent.futures.Future] = {}

    def prestart(self, key: str, context: Callable[[], ContextManager[Any]]) -> None:
        """Begin starting ``key`` in the background (no-op if already begun)."""
        with self._lock:
            if key not in self._starting:
                self._starting[key] = self._executor.submit(_enter, context)

    def get(self, key: str, context: Callable[[], ContextManager[Any]]) -> Any:
        """What ``key``'s context entered with; starts it now if nobody did."""
        self.prestart(key, context)
        _, value = self._starting[key].result()
        return value

    def servers(self, key: str) -> list[Server]:
        """The servers ``key``'s context holds now (none while it is starting or failed)."""
        with self._lock:
            future = self._starting.get(key)
        if future is None or not future.done() or future.exception() is not None:
            return []
        return servers_in(future.result()[1])

    def release(self, key: str) -> None:
        """Stop ``key``'s server(s) (by PID, through its context manager)."""
        with self._lock:
            future = self._starting.pop(key, None)
        if future is None:
            return
        try:
            manager, _ = future.result()
        except BaseException:  # noqa: BLE001  (the start failed: nothing to stop)
            return
        manager.__exit__(None, None, None)

    def close(self) -> None:
        """Stop everything still up, including starts nobody asked for."""
        for key in list(self._starting):
            self.release(key)
        self._executor.shutdown(wait=True)


def servers_in(value: Any, depth: int = 3) -> list[Server]:
    """The :class:`Server` objects a server context handed out: the value
    itself, the items of a tuple, list or dict, or an object's ``server``
    attribute (an engine that can be restarted holds ``None`` while it is down)."""
    if isinstance(value, Server):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [server for item in value for server in servers_in(item, depth - 1)]
    inner = getattr(value, "server", None)
    return servers_in(inner, depth - 1) if inner is not None else []


def _enter(context: Callable[[], ContextManager[Any]]) -> tuple[ContextManager[Any], Any]:
    manager = context()
    return manager, manager.__enter__()
