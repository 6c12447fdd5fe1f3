"""Start and stop a ``vllm-output-rate serve`` process (tests, demo, benchmarks).

The server listens on 127.0.0.1 only, runs in its own process group and is
stopped by PID (the whole group) when the context exits.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

import httpx

DEFAULT_MODEL_DIR = Path(os.environ.get("TINY_MODEL_DIR", "models/tiny-llama"))
CLI = Path(sys.executable).with_name("vllm-output-rate")
#: The default command: ``vllm-output-rate serve``.
SERVE = [str(CLI), "serve"]
STARTUP_TIMEOUT_S = 300
#: ``env`` for :func:`running_server` that also loads the admin route
#: (``GET /v1/output_rate/users``): vLLM loads an endpoint plugin only when
#: ``VLLM_PLUGINS`` names it.
ADMIN_ROUTE_ENV = {"VLLM_PLUGINS": "output_rate,output_rate_admin"}


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to ``bind(0)`` and outgoing connections."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on, for a server this process starts.

    Chosen below the kernel's ephemeral range: a port from ``bind(0)`` is free only
    until it is released, and while a server starts, vLLM's own sockets (ZMQ, RPC)
    and every outgoing connection take ephemeral ports and can take that one.  Never
    the same port twice in one process, so servers started side by side differ.
    """
    floor = min(_ephemeral_floor(), 65536)
    low = max(1024, floor - 12000)
    with _handed_out_lock:
        for _ in range(200):
            port = random.randrange(low, floor)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: vLLM's CPU backend reads the model worker's OpenMP CPU list from this variable.
CPU_BINDING_VAR = "VLLM_CPU_OMP_THREADS_BIND"


def _cpu_list_text(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"`` (the CPU list syntax vLLM parses)."""
    parts: list[str] = []
    run_start = previous = None
    for cpu in [*cpus, None]:
        if cpu is not None and previous is not None and cpu == previous + 1:
            previous = cpu
            continue
        if run_start is not None:
            parts.append(str(run_start) if run_start == previous else f"{run_start}-{previous}")
        run_start = previous = cpu
    return ",".join(parts)


def engine_cpu_binding(index: int, engines: int, cpus: Sequence[int] | None = None) -> str:
    """The CPUs engine ``index`` of ``engines`` on this machine binds its model worker to.

    vLLM's ``auto`` binding picks the same CPUs for every engine (one NUMA
    node, its last core kept free), so engines started side by side all run
    their model on one core while the others idle.  With at least as many
    engines as CPUs, engine ``i`` gets CPU ``i mod n``; with more CPUs, each
    engine gets its own contiguous slice (the first ``n mod engines`` one CPU
    more).  ``cpus`` defaults to the CPUs this process may run on.
    """
    if not 0 <= index < engines:
        raise ValueError(f"engine index {index} is not within 0..{engines - 1}")
    allowed = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if not allowed:
        raise ValueError("no CPU to bind to")
    if engines >= len(allowed):
        return str(allowed[index % len(allowed)])
    share, extra = divmod(len(allowed), engines)
    start = index * share + min(index, extra)
    return _cpu_list_text(allowed[start:start + share + (1 if index < extra else 0)])


def engine_env(
    index: int,
    engines: int,
    env: Mapping[str, str] | None = None,
    environ: Mapping[str, str] = os.environ,
    cpus: Sequence[int] | None = None,
) -> dict[str, str]:
    """``env`` plus engine ``index``'s own CPU binding, for :func:`running_server`.

    A binding already named in ``env`` or in ``environ`` (the operator's
    environment, which the server inherits) is kept: it is someone's choice.
    A lone engine keeps vLLM's own binding.  One CPU list per engine assumes
    one model worker per engine (no tensor or pipeline parallelism).
    """
    extra = dict(env or {})
    if engines > 1 and CPU_BINDING_VAR not in extra and CPU_BINDING_VAR not in environ:
        extra[CPU_BINDING_VAR] = engine_cpu_binding(index, engines, cpus)
    return extra


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def tail_lines(path: Path, n: int) -> str:
    """The last ``n`` lines of a child's log file ("" while it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


#: Log lines that say why a vLLM server went down (the first one found is
#: quoted in :class:`ServerDied`'s first line, which is what a test summary shows).
_CAUSES = ("died unexpectedly", "EngineDeadError", "fatal error", "Traceback")


def _clipped(line: str, width: int = 300) -> str:
    return line if len(line) <= width else line[:width] + " [...]"


def _first_cause(log_path: Path) -> str:
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for cause in _CAUSES:
        for line in lines:
            if cause in line:
                return f" ({_clipped(line.strip(), 200)})"
    return ""


class ServerDied(RuntimeError):
    """A server that was healthy has exited; the message carries its log tail."""


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
        return tail_lines(self.log_path, n)

    def check_alive(self) -> None:
        """Raise :class:`ServerDied` (with the log tail) if the process has exited.

        vLLM's API server exits when its engine dies (a model worker killed by
        a signal included), so the process is the one thing to watch.
        """
        code = self.proc.poll()
        if code is not None:
            raise ServerDied(
                f"server {self.log_path.stem} (pid {self.pid}) exited with code {code}"
                f"{_first_cause(self.log_path)}; the last lines of {self.log_path}:\n"
                + "\n".join(_clipped(line) for line in self.log_tail(40).splitlines())
            )

    def metrics(self) -> str:
        """The raw ``/metrics`` text (parse it with ``measure.parse_metrics``)."""
        return httpx.get(f"{self.base_url}/metrics", timeout=10, trust_env=False).text


class ConnectionBackoff:
    """What a client load loop does after a failed request to ``server``.

    A dead server refuses connections at once: a loop that retries straight
    away spins (and, on an event loop, starves every other task).  Each
    failure in a row doubles the pause, from ``first_s`` up to ``cap_s``; a
    success resets it.  Once the server's process has exited the loop stops
    with :class:`ServerDied` instead of retrying.
    """

    def __init__(self, first_s: float = 0.05, cap_s: float = 1.0) -> None:
        self.first_s = first_s
        self.cap_s = cap_s
        self.pause_s = first_s

    def succeeded(self) -> None:
        self.pause_s = self.first_s

    def _next_pause(self, server: "Server | None") -> float:
        if server is not None:
            server.check_alive()
        pause, self.pause_s = self.pause_s, min(self.cap_s, self.pause_s * 2)
        return pause

    async def failed(self, server: "Server | None") -> None:
        """After a failed request: raise if ``server`` died, else pause (``None``: no server to check)."""
        await asyncio.sleep(self._next_pause(server))

    def failed_sync(self, server: "Server | None") -> None:
        """:meth:`failed` for a loop in a thread."""
        time.sleep(self._next_pause(server))


_T = TypeVar("_T")


async def while_alive(
    work: Awaitable[_T], servers: Callable[[], Iterable["Server"]], period_s: float = 0.5
) -> _T:
    """Await ``work``, checking every ``period_s`` that each of ``servers()`` is alive.

    When one has died, ``work`` is cancelled and :class:`ServerDied` raised at
    once, instead of waiting out whatever the scenario waits for.
    ``servers`` is called at each check, so a server stopped on purpose (and
    no longer listed) is not taken for a dead one.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=period_s)
            if done:
                return task.result()
            for server in servers():
                server.check_alive()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a child started with ``start_new_session``: SIGTERM to its process group, then SIGKILL."""
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

    ``command`` replaces ``vllm-output-rate serve`` (e.g. the harness's ``churn.SERVE_WITH_CHURN``);
    ``env`` adds to (or overrides) this process's environment for the server only.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # A port picked here can still be taken before the server binds it; only then,
    # and only when the caller left the port to us, start again on another one.
    attempts = 1 if port else 3
    for attempt in range(attempts):
        server = _spawn(args, log_dir, name, model, port or free_port(), command, env)
        try:
            _wait_healthy(server)
        except _PortTaken:
            if attempt + 1 == attempts:
                raise RuntimeError(f"server could not bind its port:\n{server.log_tail()}") from None
            continue
        except BaseException:
            stop_group(server.proc)
            raise
        break
    try:
        yield server
    finally:
        stop_group(server.proc)


class _PortTaken(Exception):
    """The server exited at startup because its port was in use."""


def _spawn(args, log_dir: Path, name: str, model, port: int, command, env) -> Server:
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
    return Server(proc, f"http://127.0.0.1:{port}", log_path, str(model))


def _wait_healthy(server: Server) -> None:
    try:
        wait_healthy(server.proc, f"{server.base_url}/health", server.log_tail, timeout_s=STARTUP_TIMEOUT_S)
    except ExitedDuringStartup:
        if "Address already in use" in server.log_tail(30):
            raise _PortTaken() from None
        raise


class ExitedDuringStartup(RuntimeError):
    """The process ended before its health check answered."""


def wait_healthy(
    proc: subprocess.Popen,
    health_url: str,
    log_tail: Callable[[], str],
    *,
    what: str = "server",
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> None:
    """Poll ``health_url`` once a second until it answers 200.

    Raises :class:`ExitedDuringStartup` if ``proc`` ends first and RuntimeError
    after ``timeout_s``; both messages name ``what`` and carry ``log_tail()``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ExitedDuringStartup(f"{what} exited with {proc.returncode} during startup:\n{log_tail()}")
        try:
            if httpx.get(health_url, timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not healthy after {timeout_s:g} s:\n{log_tail()}")
        time.sleep(1)


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
