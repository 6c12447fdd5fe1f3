"""The benchmark harness: what every script in ``benchmarks/`` shares.

A real-server benchmark is always the same sequence, and each step lives
here once:

1. **Report head** (:func:`start_report`): schema, command line, start time,
   the machine (:func:`machine_facts`), load averages, the script's options.
2. **Servers** (:func:`running_engines`, or :func:`restartable_engines` for
   engines a benchmark stops and starts again): one or several
   ``vllm-output-rate serve`` processes on 127.0.0.1, each stopped by PID
   (its process group) on exit; a real Redis beside them through
   :class:`~vllm_output_rate.tools.redisproc.RedisProcess`, or
   :class:`RedisClusterProcess` for a three-node cluster.
3. **Load**: :func:`~vllm_output_rate.tools.measure.stream_body` (the one streaming request body
   every benchmark sends), :func:`async_http` (a client with no read timeout
   and no proxies), :func:`served_model`; tokens are counted by
   :func:`~vllm_output_rate.tools.measure.run_request`.
4. **CPU by role** (:class:`CpuMeter`): user + system seconds of each server's
   API server, engine core, model worker and other processes, of this client,
   and of everything else on the machine ("foreign"), over a window.
5. **Outputs** (:func:`finish_report`, :func:`write_outputs`): ``PREFIX.json``
   and, when the script draws one, ``PREFIX.png``; the performance page
   (``benchmarks/render_performance.py``) reads them from ``docs/benchmarks/``.

Server logs never go next to the outputs (those are committed): they go to
a temporary folder unless ``--log-dir`` says otherwise (:func:`log_dir_for`).

The report head, the servers, the processes by role and the client's CPU
(:func:`in_own_session`, :func:`raise_client_priority`) are the wheel's
:mod:`vllm_output_rate.tools.runkit` (``demo`` and ``demo-cluster`` use them
too); this module re-exports them, so a benchmark needs
only ``benchkit``.  It belongs to the unpublished harness distribution
(``harness/``), beside the tests and benchmarks, not to the wheel.

psutil is imported where it is used (it comes with vLLM).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from vllm_output_rate.tools.measure import parse_metrics
from vllm_output_rate.tools.redisproc import redis_binary
from vllm_output_rate.tools.runkit import (  # noqa: F401  (re-exported for the benchmarks)
    CLIENT_NICE,
    ROLES,
    StartedServer,
    finish_report,
    fmt_load,
    in_own_session,
    loadavg,
    machine_facts,
    raise_client_priority,
    role_of,
    running_engines,
    server_processes,
    start_report,
    worker_cpus,
)
from vllm_output_rate.tools.serverproc import (
    DEFAULT_MODEL_DIR,
    Server,
    engine_env,
    free_port,
    running_server,
)

#: Where the performance page's inputs live; every benchmark's ``--out`` defaults under it.
RESULTS_DIR = Path("docs/benchmarks")


def use_cpu_testbed_env() -> None:
    """The CPU testbed's vLLM settings, unless the caller set them already."""
    for name, value in (
        ("VLLM_TARGET_DEVICE", "cpu"),
        ("VLLM_CPU_KVCACHE_SPACE", "1"),
        ("HF_HUB_OFFLINE", "1"),
    ):
        os.environ.setdefault(name, value)


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def machine_line(doc: Mapping[str, Any]) -> str:
    """The closing line of a benchmark's text report."""
    m = doc["machine"]
    line = (
        f"machine: nproc={m['nproc']} cpu={m['cpu_model']} vllm={m['vllm']} torch={m['torch']}; "
        f"load avg before {fmt_load(doc.get('load_before'))}, after {fmt_load(doc.get('load_after'))}; "
        f"wall {doc.get('wall_s', 0):.0f} s"
    )
    if doc.get("startup_s") is not None:
        line += f" (startup {doc['startup_s']:.0f} s)"
    return line


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A right-aligned plain-text table for the terminal."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    out = ["  ".join(str(c).rjust(w) for c, w in zip(headers, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def output_path(prefix: str | os.PathLike, suffix: str) -> Path:
    """``PREFIX`` + ``suffix`` (``.json``, ``.png``, ``_store.json``...), folder created."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    return prefix.with_name(prefix.name + suffix)


def write_outputs(doc: Mapping[str, Any], prefix: str | os.PathLike, suffix: str = "",
                  plot: Callable[[Mapping[str, Any], Path], None] | None = None) -> list[Path]:
    """Write ``PREFIX{suffix}.json`` and, with ``plot``, ``PREFIX{suffix}.png``."""
    json_path = output_path(prefix, suffix + ".json")
    json_path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    written = [json_path]
    if plot is not None:
        png = output_path(prefix, suffix + ".png")
        plot(doc, png)
        written.append(png)
    print("wrote " + " and ".join(str(p) for p in written), flush=True)
    return written


def log_dir_for(name: str, given: str | None = None) -> Path:
    """Server logs: ``given`` or a fresh temporary folder (never beside the outputs)."""
    path = Path(given) if given else Path(tempfile.mkdtemp(prefix=f"{name}-logs-"))
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------


class RestartableEngine:
    """One engine of a cluster that a benchmark stops and starts again.

    Keeps its CPU binding (engine ``index`` of ``engines``, as
    :func:`running_engines` would give it) across starts; each start gets a
    port of its own.  ``starts`` counts the starts so far; :attr:`server` is
    ``None`` while the engine is down, which is what a client routing
    requests reads.  :meth:`stop` stops the process group by PID.
    """

    def __init__(self, index: int, engines: int, name: str, args: list[str], log_dir: Path,
                 model: str | os.PathLike = DEFAULT_MODEL_DIR, command: list[str] | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.index, self.name, self.args, self.log_dir = index, name, args, log_dir
        self.model, self.command = model, command
        self.env = engine_env(index, engines, env)
        self.starts = 0
        self.startup_s: list[float] = []
        self.server: Server | None = None
        self._manager: Any = None

    @property
    def base_url(self) -> str | None:
        server = self.server
        return None if server is None else server.base_url

    def start(self) -> "RestartableEngine":
        began = time.monotonic()
        manager = running_server(self.args, self.log_dir, f"{self.name}-start{self.starts}",
                                 model=self.model, command=self.command, env=self.env)
        server = manager.__enter__()
        self._manager, self.server = manager, server
        self.starts += 1
        self.startup_s.append(round(time.monotonic() - began, 1))
        return self

    def stop(self) -> None:
        manager, self._manager, self.server = self._manager, None, None
        if manager is not None:
            manager.__exit__(None, None, None)

    def kill(self) -> None:
        """SIGKILL to the whole process group at once (a crash: nothing drains)."""
        server = self.server
        self.server = None  # routed around from now on
        if server is not None and server.proc.poll() is None:
            try:
                os.killpg(server.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            server.proc.wait(timeout=30)
        self.stop()

    def log_text(self) -> str:
        """Every start's log."""
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob(f"{self.name}-start*.log")))


@contextlib.contextmanager
def restartable_engines(specs: Sequence[tuple[str, list[str]]], log_dir: Path,
                        model: str | os.PathLike = DEFAULT_MODEL_DIR, command: list[str] | None = None,
                        env: Mapping[str, str] | None = None) -> Iterator[list[RestartableEngine]]:
    """Like :func:`running_engines` side by side, each engine with its own
    CPUs, but each one can be stopped and started again; all are stopped on exit."""
    engines = [RestartableEngine(i, len(specs), name, args, log_dir, model, command, env)
               for i, (name, args) in enumerate(specs)]
    try:
        with ThreadPoolExecutor(len(engines)) as pool:
            for future in [pool.submit(engine.start) for engine in engines]:
                future.result()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


class RedisClusterProcess:
    """A real Redis Cluster: ``nodes`` cluster-enabled redis-server children on 127.0.0.1.

    Each node holds one contiguous slot range; no persistence; every child is
    stopped by its PID.  Needs redis-server >= 7.0 (or Valkey).
    """

    SLOTS = 16384

    def __init__(self, nodes: int = 3) -> None:
        binary = redis_binary()
        if binary is None:
            raise FileNotFoundError("no redis-server or valkey-server binary (make setup installs one)")
        version = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
        major = re.search(r"v=(\d+)\.", version)
        if major is None or int(major.group(1)) < 7:
            raise RuntimeError(f"cluster mode needs redis-server >= 7.0 or Valkey, found {version.strip()!r}")
        self.binary = binary
        self.dir = tempfile.TemporaryDirectory(prefix="redis-cluster-")
        self.ports = [(free_port(), free_port()) for _ in range(nodes)]  # (client, bus)
        self.procs: list[subprocess.Popen] = []

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0][0]}"

    def node(self, i: int):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.ports[i][0], socket_timeout=2)

    def _until(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if ready():
                    return
            except redis.ConnectionError:
                pass
            time.sleep(0.05)
        raise RuntimeError(what)

    def start(self) -> "RedisClusterProcess":
        n = len(self.ports)
        try:
            for port, bus in self.ports:
                self.procs.append(subprocess.Popen(
                    [self.binary, "--bind", "127.0.0.1", "--port", str(port), "--cluster-enabled", "yes",
                     "--cluster-port", str(bus), "--cluster-config-file", f"nodes-{port}.conf",
                     "--dir", self.dir.name, "--save", "", "--appendonly", "no", "--daemonize", "no",
                     "--loglevel", "warning"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            for i in range(n):
                self._until(lambda i=i: bool(self.node(i).ping()), 10, "redis-server did not answer")
            for i in range(n):
                self.node(i).execute_command("CLUSTER", "ADDSLOTSRANGE", i * self.SLOTS // n,
                                             (i + 1) * self.SLOTS // n - 1)
            for port, bus in self.ports[1:]:
                self.node(0).execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus)
            self._until(lambda: all(
                "cluster_state:ok" in self.node(i).execute_command("CLUSTER", "INFO").decode()
                and len(self.node(i).execute_command("CLUSTER", "SLOTS")) == n for i in range(n)),
                20, "the cluster did not form")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.procs = []
        self.dir.cleanup()

    def __enter__(self) -> "RedisClusterProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------


def async_http(base_url: str | None = None, connections: int = 64, read_timeout: float | None = None):
    """An ``httpx.AsyncClient`` for benchmarks: no proxies, no read timeout by default
    (a throttled stream may pause), room for ``connections`` streams."""
    import httpx

    kwargs: dict[str, Any] = {"base_url": base_url} if base_url else {}
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=read_timeout, write=10.0, pool=None),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        trust_env=False,
        **kwargs,
    )


class MetricsPoller:
    """Reads ``/metrics`` every ``interval_s`` in a thread of its own, so a busy client
    event loop cannot space the readings out.  Each reading is ``reading(samples)``,
    stamped (seconds since ``t0``) when its answer is in, so no counter runs ahead of
    its stamp.  Started and stopped by hand or as a context manager (no last read)."""

    def __init__(self, base_url: str, interval_s: float, reading: Callable[[dict], Any],
                 t0: float | None = None) -> None:
        import httpx

        self.client = httpx.Client(base_url=base_url, timeout=10.0, trust_env=False)
        self.interval_s = interval_s
        self.t0 = time.monotonic() if t0 is None else t0
        self.reading = reading
        self.readings: list[tuple[float, Any]] = []
        self.failed_reads = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="metrics-poller", daemon=True)

    def read(self) -> None:
        samples = parse_metrics(self.client.get("/metrics").text)
        self.readings.append((time.monotonic() - self.t0, self.reading(samples)))

    def _run(self) -> None:
        import httpx

        while not self.stopping.is_set():
            try:
                self.read()
            except httpx.HTTPError:
                # A busy API server dropped one read (seen under load): the
                # next one comes at the usual interval.
                self.failed_reads += 1
            self.stopping.wait(self.interval_s)

    def start(self) -> None:
        self.thread.start()

    def stop(self, last_read: bool = True) -> list[tuple[float, Any]]:
        """Stop polling (then one last reading, with ``last_read``); all readings."""
        self.stopping.set()
        self.thread.join()
        if last_read:
            self.read()
        self.client.close()
        return self.readings

    def __enter__(self) -> "MetricsPoller":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(last_read=False)


def served_model(base_url: str) -> str:
    """The id of the model the server at ``base_url`` serves."""
    import httpx

    return httpx.get(f"{base_url}/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]


# --------------------------------------------------------------------------
# CPU by role
# --------------------------------------------------------------------------


def cpu_seconds(procs: Sequence[Any]) -> float:
    """user + system CPU seconds of ``procs`` (gone processes count 0)."""
    import psutil

    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def busy_cpu_seconds() -> float:
    """Machine-wide non-idle CPU seconds so far, all cores."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class CpuMeter:
    """CPU used over a window by each server's roles, this client and the rest of the machine.

    The processes are looked up once (``server_pids``: each server's root);
    :meth:`start` and :meth:`stop` bracket the window; :meth:`stop` returns
    seconds per server and role plus ``client``, ``busy`` (the whole machine)
    and ``foreign`` (busy minus the servers and the client), and ``wall_s``.
    """

    def __init__(self, server_pids: Sequence[int]) -> None:
        import psutil

        self.processes = [server_processes(pid) for pid in server_pids]
        self.me = psutil.Process()
        self._start: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        return {
            "t": time.monotonic(),
            "roles": [{role: cpu_seconds(procs) for role, procs in roles.items()} for roles in self.processes],
            "client": cpu_seconds([self.me]),
            "busy": busy_cpu_seconds(),
        }

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> dict[str, Any]:
        if self._start is None:
            raise RuntimeError("CpuMeter.stop() before start()")
        end, begin = self._read(), self._start
        per_server = [{role: e[role] - b[role] for role in ROLES} for e, b in zip(end["roles"], begin["roles"])]
        servers = sum(sum(s.values()) for s in per_server)
        client = end["client"] - begin["client"]
        busy = end["busy"] - begin["busy"]
        return {
            "wall_s": end["t"] - begin["t"],
            "servers": per_server,
            "client": client,
            "busy": busy,
            "foreign": max(0.0, busy - servers - client),
        }


def as_share(seconds: float, wall_s: float, scale: float = 1.0, digits: int = 3) -> float:
    """CPU seconds over ``wall_s`` as cores (``scale`` 1) or % of a core (``scale`` 100)."""
    return round(scale * seconds / wall_s, digits) if wall_s > 0 else 0.0


# --------------------------------------------------------------------------
# Instruction counts (callgrind)
# --------------------------------------------------------------------------

_CALLGRIND_HELPER_C = r"""
#include <valgrind/callgrind.h>
void cg_begin(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
void cg_dump(const char *what) { CALLGRIND_DUMP_STATS_AT(what); }
"""
#: Empty toggle pairs a child dumps as ``calibrate``: what one toggle costs.
CALIBRATION_TOGGLES = 200


def build_callgrind_helper(workdir: Path) -> Path:
    """Compile callgrind's client requests into a library ctypes can call
    (``cg_begin``, ``cg_toggle``, ``cg_dump(name)``)."""
    import shutil

    missing = [tool for tool in ("valgrind", "gcc") if shutil.which(tool) is None]
    if missing or not Path("/usr/include/valgrind/callgrind.h").is_file():
        raise SystemExit(
            "instruction counts need valgrind (with its headers) and gcc; "
            f"missing: {', '.join(missing) or 'valgrind/callgrind.h'}"
        )
    source = workdir / "cgctl.c"
    source.write_text(_CALLGRIND_HELPER_C)
    library = workdir / "cgctl.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source)], check=True)
    return library


def callgrind_command(out_dir: Path) -> list[str]:
    """``valgrind`` with collection off until the child's ``cg_begin``."""
    return ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
            f"--callgrind-out-file={out_dir}/cg.out"]


def dumped_instructions(out_dir: Path, trigger: str) -> int:
    """Instructions of the dump a child made with ``cg_dump(trigger)``."""
    for path in out_dir.iterdir():
        text = path.read_text(errors="replace")
        if f"Client Request: {trigger}" not in text:
            continue
        for line in text.splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"no callgrind dump '{trigger}' in {out_dir}")


