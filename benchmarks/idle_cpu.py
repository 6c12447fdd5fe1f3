#!/usr/bin/env python
"""CPU used by the server while every user is throttled, vs the same server idle.

What
    One ``vllm-output-rate serve`` process on the tiny model with the feature
    on (``--default-user-output-tokens-per-second 100
    --user-output-tokens-per-second '{"slow": 2}'``).  Two phases alternate on
    that one server:

    * ``idle``: no request at all;
    * ``throttled``: user ``slow`` keeps 8 streaming requests of 60 tokens in
      flight (``ignore_eos``).  At 2 tok/s for the user as a whole they cannot
      finish during the phase, so every resident request is out of quota
      nearly all the time: the engine should sleep, not spin.

    For each phase the CPU share (user + system seconds / wall seconds, 100 %
    = one core) of each server process is measured over ``--window`` seconds
    with psutil:

    * ``engine_core``: the child whose name contains ``EngineCore`` (the
      scheduler loop, where the limiter lives).  Target: <= 5 % of a core
      while throttled;
    * ``worker``: the model-runner process (``VLLM::Worker``);
    * ``api_server``: the HTTP front-end (the ``vllm-output-rate serve``
      process itself);
    * ``other``: any other descendant (e.g. multiprocessing helpers).

    Tokens received during each throttled window are counted (exactly, from
    ``token_ids``) to show the user was being served at its limit, not stalled.

Variants (issue 22: a throttled engine with a store costs no more than
without one)
    * ``--users N``: N throttled users (``slow-0`` ... ``slow-{N-1}``) instead
      of one, each at ``--rate / N`` tok/s with ``--streams`` streams of its
      own, so every variant serves the same tokens per second and differs
      only in how many users the limiter and the store keep track of;
    * ``--engines N``: N servers started side by side, each user's streams
      spread over them in turn;
    * ``--store``: a ``redis-server`` started here (127.0.0.1, a free port,
      stopped by PID; ``tools/redisproc.py``) and every server given
      ``--output-rate-store`` with ``--output-rate-expected-engines N``, so
      the engines share each user's quota through leases.

    With several servers or a store the CPU figures add up every server's
    processes (``server_total``; the store's ``redis-server`` is its own
    ``store`` row and counts in the total), and ``per_engine_total`` is that
    total over the engines: the figure the 15 % target is judged on.  Each
    window also reads the engines' own counters from ``/metrics``: steps that
    ran nothing (``vllm:output_rate_idle_steps_total``: engine wake-ups with
    every user throttled) and answered store round trips, per second.  The
    variants the issue names::

        idle_cpu.py --users 1                         # 1 user, 1 engine, no store
        idle_cpu.py --users 1 --store                 # 1 user, 1 engine, store
        idle_cpu.py --users 50 --streams 1 [--store]  # 50 users, 1 engine
        idle_cpu.py --users 1 --engines 2 --store     # 1 user, 2 engines
        idle_cpu.py --users 50 --streams 1 --engines 2 --store

Why the worker was busy while throttled, and what the plugin changes
    vLLM's worker reads the engine's commands from a shared-memory ring buffer
    (``vllm/distributed/device_communicators/shm_broadcast.py``,
    ``SpinCondition``).  Stock vLLM busy-polls that buffer (``sched_yield`` in
    a loop) until 1 s after the last message it read before falling back to
    a blocking zmq poll.  A user limited to 2 tok/s gets one step every
    ~0.5 s, so a stock worker never reaches its idle mode and spins close to a
    full core.  With the feature on, the plugin's ``worker.idle_spin`` patch
    (``adapter/worker_idle.py``) makes the worker spin only a few ms from the
    start of each wait and then sleep until the engine's write wakes it, and
    the engine loop blocks on its input queue for min(250 ms, next quota) when
    a step runs nothing.  Targets while throttled: engine core <= 5 % and the
    whole server process tree <= 15 % of one core.
    ``--worker-spin-ms off`` starts the server with
    ``VLLM_OUTPUT_RATE_WORKER_SPIN_MS=off`` (vLLM's own 1 s spin) for a
    before/after comparison.

How
    Start the server, wait ``--settle`` seconds, then ``--rounds`` rounds of
    [idle window, throttled window]: a throttled phase starts the streams,
    waits ``--settle`` seconds (admission, first tokens) before measuring, and
    cancels the streams afterwards (the server aborts them); the next idle
    window starts ``--settle`` seconds later, well after the worker's 1 s
    busy-poll has ended.  Alternating the phases lets the machine's load hit
    both alike.  Load averages are recorded before/after the whole run and
    for every window, plus the machine-wide CPU used by other processes
    ("foreign").

Usage::

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/idle_cpu.py

writes ``docs/benchmarks/idle_cpu.json`` and ``.png`` (``--out PREFIX`` elsewhere); about 60-90 s
of server startup plus rounds x (2 x window + 3 x settle), ~2.5 min by default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import psutil

from vllm_output_rate.tools import measure
from vllm_output_rate.tools.render import figure_metadata, sibling_json
from vllm_output_rate.tools.measure import RequestRecord, fetch_metrics_async, metric_sum, run_request
from vllm_output_rate.tools.redisproc import RedisProcess
from vllm_output_rate.tools.serverproc import DEFAULT_MODEL_DIR
from vllm_output_rate_harness import benchkit
from vllm_output_rate_harness.benchkit import RESULTS_DIR, ROLES, as_share, fmt_load, loadavg, machine_line, table

benchkit.use_cpu_testbed_env()

SCHEMA = "vllm-output-rate-idle-cpu/2"
TARGET_ENGINE_CORE_PERCENT = 5.0
TARGET_SERVER_TOTAL_PERCENT = 15.0
IDLE, THROTTLED = "idle", "throttled"
STORE = "store"  # the redis-server's row in the CPU figures
#: Engine counters read around each window (per second in the report).
COUNTERS = {
    "idle_steps": "vllm:output_rate_idle_steps_total",
    "store_round_trips": "vllm:output_rate_store_round_trips_total",
}


# --------------------------------------------------------------------------
# Server processes
# --------------------------------------------------------------------------


def describe(roles: dict[str, list[psutil.Process]]) -> dict[str, list[dict]]:
    out = {}
    for role, procs in roles.items():
        out[role] = []
        for p in procs:
            try:
                out[role].append({"pid": p.pid, "name": p.name(), "threads": p.num_threads()})
            except psutil.NoSuchProcess:
                pass
    return out


def thread_cpu(procs: list[psutil.Process]) -> dict[tuple[int, int], tuple[str, float]]:
    """CPU seconds per thread: (pid, tid) -> (thread name, seconds)."""
    out = {}
    for p in procs:
        try:
            threads = p.threads()
        except psutil.NoSuchProcess:
            continue
        for t in threads:
            try:
                with open(f"/proc/{p.pid}/task/{t.id}/comm") as f:
                    name = f.read().strip()
            except OSError:
                name = "?"
            out[(p.pid, t.id)] = (name, t.user_time + t.system_time)
    return out


async def engine_counters(clients) -> list[dict[str, float]]:
    """Each engine's :data:`COUNTERS` now (0 when absent, e.g. no store)."""
    samples = await asyncio.gather(*(fetch_metrics_async(c) for c in clients))
    return [{key: metric_sum(s, name) or 0.0 for key, name in COUNTERS.items()} for s in samples]


async def measure_window(meter: benchkit.CpuMeter, window_s: float, clients, store_proc) -> dict:
    """CPU share per role over ``window_s`` (async so streams keep flowing),
    summed over the servers, plus the store's process and the engines' counters."""
    load_start = loadavg()
    workers = [p for roles in meter.processes for p in roles["worker"]]
    worker_threads_before = thread_cpu(workers)
    counters_before = await engine_counters(clients)
    store_before = benchkit.cpu_seconds([store_proc]) if store_proc else 0.0
    meter.start()
    await asyncio.sleep(window_s)
    cpu = meter.stop()
    store_s = (benchkit.cpu_seconds([store_proc]) - store_before) if store_proc else 0.0
    counters_after = await engine_counters(clients)
    wall = cpu["wall_s"]
    worker_threads = sorted(
        ((name, round(100 * (sec - worker_threads_before.get(key, (name, 0.0))[1]) / wall, 2))
         for key, (name, sec) in thread_cpu(workers).items()),
        key=lambda item: -item[1],
    )
    used = {role: sum(server[role] for server in cpu["servers"]) for role in ROLES}
    used[STORE] = store_s
    total = sum(used.values())
    engines = len(cpu["servers"])
    return {
        "wall_s": round(wall, 3),
        "percent_of_core": {role: as_share(s, wall, 100, 2) for role, s in used.items()},
        "server_total_percent": as_share(total, wall, 100, 2),
        "per_engine_total_percent": as_share(total / engines, wall, 100, 2),
        "engine_servers_percent": [as_share(sum(server.values()), wall, 100, 2) for server in cpu["servers"]],
        # Engine counters over the window, per second, per engine.
        "per_s": {
            key: [round((a[key] - b[key]) / wall, 2) for a, b in zip(counters_after, counters_before)]
            for key in COUNTERS
        },
        "client_percent": as_share(cpu["client"], wall, 100, 2),
        # The store's process is not the client's: counted in neither foreign nor client.
        "foreign_percent": as_share(max(0.0, cpu["foreign"] - store_s), wall, 100, 2),
        "machine_busy_percent": as_share(cpu["busy"], wall, 100, 2),
        # Busiest model-worker threads (% of a core): where the worker's CPU goes.
        "worker_threads_top": worker_threads[:4],
        "load_start": load_start,
        "load_end": loadavg(),
    }


def users_of(args) -> list[str]:
    return [args.user] if args.users == 1 else [f"{args.user}-{i}" for i in range(args.users)]


# --------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------


async def run_rounds(servers, model: str, args, store_proc) -> list[dict]:
    meter = benchkit.CpuMeter([server.pid for server in servers])
    if not all(roles["engine_core"] for roles in meter.processes):
        raise RuntimeError("no child process whose name contains 'EngineCore'")
    windows: list[dict] = []
    users = users_of(args)
    streams = [(user, s) for user in users for s in range(args.streams)]
    per_server = -(-len(streams) // len(servers))
    clients = [benchkit.async_http(server.base_url, connections=per_server + 4) for server in servers]
    bodies = {user: measure.stream_body(model, user, args.max_tokens) for user in users}

    def line(w: dict) -> str:
        pc = w["percent_of_core"]
        text = (f"engine_core {pc['engine_core']:6.2f} %  worker {pc['worker']:6.2f} %  "
                f"api {pc['api_server']:6.2f} %  ")
        if store_proc:
            text += f"store {pc[STORE]:5.2f} %  "
        text += (f"per engine {w['per_engine_total_percent']:6.2f} %  "
                 f"idle steps/s {w['per_s']['idle_steps']}  ")
        if store_proc:
            text += f"round trips/s {w['per_s']['store_round_trips']}  "
        return text + f"load {w['load_start']}"

    try:
        await asyncio.sleep(args.settle)
        for rnd in range(args.rounds):
            # Idle: nothing in flight for at least --settle seconds.
            w = await measure_window(meter, args.window, clients, store_proc)
            w.update({"round": rnd, "phase": IDLE})
            windows.append(w)
            print(f"  round {rnd} idle      {line(w)}", flush=True)

            # Throttled: the users' streams are resident and out of quota.
            t0 = time.monotonic()
            records = [RequestRecord(user=user, stream=s, start=0.0) for user, s in streams]
            tasks = [
                asyncio.create_task(run_request(clients[i % len(clients)], bodies[r.user], r, t0))
                for i, r in enumerate(records)
            ]
            await asyncio.sleep(args.settle)
            t_start = time.monotonic() - t0
            w = await measure_window(meter, args.window, clients, store_proc)
            t_end = time.monotonic() - t0
            in_flight = sum(1 for task in tasks if not task.done())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            tokens_window = sum(1 for r in records for t in r.token_times if t_start <= t <= t_end)
            w.update(
                {
                    "round": rnd,
                    "phase": THROTTLED,
                    "streams": len(streams),
                    "streams_in_flight_at_end": in_flight,
                    "streams_with_first_token": sum(1 for r in records if r.token_times),
                    "tokens_total": sum(len(r.token_times) for r in records),
                    "tokens_in_window": tokens_window,
                    "tokens_per_s_in_window": round(tokens_window / (t_end - t_start), 3),
                    "limit_tokens_per_s": args.rate,
                    "errors": [r.error for r in records if r.error and r.status != "cancelled"],
                }
            )
            windows.append(w)
            print(f"  round {rnd} throttled {line(w)}  tokens {tokens_window} "
                  f"({w['tokens_per_s_in_window']:.2f}/s), in flight {in_flight}  "
                  f"worker threads {w['worker_threads_top'][:3]}", flush=True)
            await asyncio.sleep(args.settle)  # aborts processed, worker's busy-poll over
    finally:
        for client in clients:
            await client.aclose()
    return windows


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def analyse(windows: list[dict], engines: int = 1) -> dict:
    out: dict = {}

    def spread(values: list[float]) -> dict:
        return {
            "mean": statistics.fmean(values) if values else None,
            "min": min(values) if values else None,
            "max": max(values) if values else None,
            "values": values,
        }

    for phase in (IDLE, THROTTLED):
        ws = [w for w in windows if w["phase"] == phase]
        out[phase] = {}
        for key in (*ROLES, STORE, "server_total", "per_engine_total", "client", "foreign"):
            if key in ROLES or key == STORE:
                values = [w["percent_of_core"][key] for w in ws]
            else:
                values = [w[f"{key}_percent"] for w in ws]
            out[phase][key] = spread(values)
        # Engine counters per second, summed over the engines.
        for key in COUNTERS:
            out[phase][f"{key}_per_s"] = spread([sum(w["per_s"][key]) for w in ws])
    thr = out[THROTTLED]["engine_core"]
    out["engines"] = engines
    out["target_engine_core_percent"] = TARGET_ENGINE_CORE_PERCENT
    # With several engines the engine-core row is their sum: judged per engine.
    out["meets_target"] = None if thr["max"] is None else thr["mean"] / engines <= TARGET_ENGINE_CORE_PERCENT
    out["meets_target_every_window"] = (
        None if thr["max"] is None else thr["max"] / engines <= TARGET_ENGINE_CORE_PERCENT
    )
    tot = out[THROTTLED]["per_engine_total"]
    out["target_server_total_percent"] = TARGET_SERVER_TOTAL_PERCENT
    out["server_total_meets_target"] = None if tot["max"] is None else tot["mean"] <= TARGET_SERVER_TOTAL_PERCENT
    return out


def variant(config: dict) -> str:
    """One line naming the variant: users, rate, engines, store."""
    users = config.get("users", 1)
    who = config["user"] if users == 1 else f"{users} users ({config['user']}-*)"
    engines = config.get("engines", 1)
    return (f"{who} @ {config['rate'] / users:g} tok/s each, {config['streams']} streams each, "
            f"{engines} engine{'s' if engines > 1 else ''}, {'a Redis store' if config.get('store') else 'no store'}")


def report(doc: dict) -> str:
    a = doc["analysis"]
    rows = []
    keys = [*ROLES, *([STORE] if doc["config"].get("store") else []), "server_total", "per_engine_total",
            "client", "foreign"]
    for key in keys:
        cells = [key]
        for phase in (IDLE, THROTTLED):
            s = a[phase][key]
            cells.append("-" if s["mean"] is None else f"{s['mean']:.2f} ({s['min']:.2f}-{s['max']:.2f})")
        rows.append(cells)
    parts = [
        "CPU share, % of one core: mean (min-max) over windows",
        table(["process", "idle", "throttled"], rows),
        f"variant: {variant(doc['config'])}",
    ]
    crow = []
    for key in COUNTERS:
        cells = [f"{key} per s"]
        for phase in (IDLE, THROTTLED):
            s = a[phase][f"{key}_per_s"]
            cells.append("-" if s["mean"] is None else f"{s['mean']:.2f} ({s['min']:.2f}-{s['max']:.2f})")
        crow.append(cells)
    parts.append("Engine counters, summed over engines, per second: mean (min-max)\n"
                 + table(["counter", "idle", "throttled"], crow))
    wrows = [
        [str(w["round"]), w["phase"], f"{w['percent_of_core']['engine_core']:.2f}",
         f"{w['percent_of_core']['worker']:.2f}", f"{w['percent_of_core']['api_server']:.2f}",
         f"{w['percent_of_core'][STORE]:.2f}", f"{w['per_engine_total_percent']:.2f}",
         f"{sum(w['per_s']['idle_steps']):.1f}", f"{sum(w['per_s']['store_round_trips']):.1f}",
         f"{w['foreign_percent']:.0f}", str(w.get("tokens_in_window", "-")), fmt_load(w["load_start"])]
        for w in doc["windows"]
    ]
    parts.append(table(["round", "phase", "engine %", "worker %", "api %", "store %", "per engine %",
                        "idle steps/s", "round trips/s", "foreign %", "tokens", "load 1/5/15"], wrows))
    thr = a[THROTTLED]["engine_core"]
    if thr["mean"] is not None:
        verdict = "meets" if a["meets_target"] else "MISSES"
        engines = a.get("engines", 1)
        parts.append(
            f"engine core while throttled, per engine: mean {thr['mean'] / engines:.2f} %, "
            f"max {thr['max'] / engines:.2f} % of a core ({verdict} target <= {TARGET_ENGINE_CORE_PERCENT:g} %)"
        )
    tot = a[THROTTLED]["per_engine_total"]
    if tot["mean"] is not None:
        verdict = "meets" if a["server_total_meets_target"] else "MISSES"
        parts.append(
            f"whole server while throttled (per engine, the store's share included): mean {tot['mean']:.2f} %, "
            f"max {tot['max']:.2f} % of a core ({verdict} target <= {TARGET_SERVER_TOTAL_PERCENT:g} %); idle "
            f"{a[IDLE]['per_engine_total']['mean']:.2f} %; worker spin: {doc['config'].get('worker_spin_ms') or 'plugin default'}"
        )
    parts.append(machine_line(doc))
    return "\n\n".join(parts)


def plot(doc: dict, path: Path, source: Path | None = None) -> None:
    """``source``: the JSON ``doc`` was read from (default: PATH with .json), whose digest the PNG carries."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    a = doc["analysis"]
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    keys = ["engine_core", "worker", "api_server", "other", *([STORE] if doc["config"].get("store") else []),
            "server_total", "per_engine_total"]
    width = 0.38
    for offset, phase, color in ((-width / 2, IDLE, "C0"), (width / 2, THROTTLED, "C3")):
        means = [a[phase][k]["mean"] or 0.0 for k in keys]
        # Clamped: a mean equal to its min or max can differ from it by float rounding.
        lows = [max(0.0, m - (a[phase][k]["min"] or 0.0)) for m, k in zip(means, keys)]
        highs = [max(0.0, (a[phase][k]["max"] or 0.0) - m) for m, k in zip(means, keys)]
        xs = [i + offset for i in range(len(keys))]
        ax.bar(xs, means, width, color=color, label=phase, yerr=[lows, highs], capsize=3)
        for x, m in zip(xs, means):
            ax.annotate(f"{m:.1f}", (x, m), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
    ax.axhline(TARGET_ENGINE_CORE_PERCENT, color="k", linestyle="--", linewidth=1,
               label=f"engine-core target {TARGET_ENGINE_CORE_PERCENT:g} %")
    ax.axhline(TARGET_SERVER_TOTAL_PERCENT, color="k", linestyle=":", linewidth=1,
               label=f"whole-server target {TARGET_SERVER_TOTAL_PERCENT:g} %")
    ax.set_xticks(range(len(keys)), keys, fontsize="small")
    ax.set_ylabel("% of one core (mean, min-max)")
    ax.set_title(f"Server CPU: idle vs throttled\n{variant(doc['config'])}", fontsize="medium")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path), metadata=figure_metadata(source or sibling_json(path)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Per-process server CPU while every user is throttled vs idle.")
    parser.add_argument("--out", default=str(RESULTS_DIR / "idle_cpu"), metavar="PREFIX",
                        help="writes PREFIX.json and PREFIX.png (default: %(default)s)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model path (default: tiny model)")
    parser.add_argument("--user", default="slow",
                        help="the throttled user (default slow; with --users N: slow-0 ... slow-{N-1})")
    parser.add_argument("--rate", type=float, default=2.0,
                        help="tok/s of all throttled users together, split evenly (default 2)")
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams per user (default 8)")
    parser.add_argument("--users", type=int, default=1, help="throttled users (default 1)")
    parser.add_argument("--engines", type=int, default=1,
                        help="servers side by side, streams spread over them (default 1; without "
                             "--store each enforces the whole rate on its own)")
    parser.add_argument("--store", action="store_true",
                        help="start a redis-server and share the quota through it")
    parser.add_argument("--max-tokens", type=int, default=60, help="max_tokens per stream (default 60)")
    parser.add_argument("--window", type=float, default=5.0, help="measured seconds per phase (default 5)")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds before measuring a phase (default 3; keep > 1 s busy-poll)")
    parser.add_argument("--rounds", type=int, default=3, help="idle/throttled rounds (default 3)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra vllm serve argument, repeatable (e.g. --server-arg=--max-num-seqs=16)")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    parser.add_argument("--worker-spin-ms", default=None, metavar="MS|off",
                        help="sets VLLM_OUTPUT_RATE_WORKER_SPIN_MS for the server (default: unset, "
                             "the plugin's window; 'off': vLLM's own 1 s spin)")
    args = parser.parse_args(argv)
    if args.worker_spin_ms is not None:
        os.environ["VLLM_OUTPUT_RATE_WORKER_SPIN_MS"] = args.worker_spin_ms
    else:
        os.environ.pop("VLLM_OUTPUT_RATE_WORKER_SPIN_MS", None)
    if args.users < 1 or args.engines < 1 or args.streams < 1:
        parser.error("--users, --engines and --streams must be at least 1")
    per_user = args.rate / args.users
    if args.streams * args.max_tokens <= per_user * (args.settle + args.window) * 1.5:
        parser.error("streams x max_tokens too small: the streams would finish during the phase")

    log_dir = benchkit.log_dir_for("idle-cpu", args.log_dir)
    with contextlib.ExitStack() as stack:
        store_args: list[str] = []
        store_proc = None
        if args.store:
            redis_srv = stack.enter_context(RedisProcess())
            store_proc = psutil.Process(redis_srv.pid)
            store_args = ["--output-rate-store", redis_srv.url,
                          "--output-rate-expected-engines", str(args.engines),
                          "--output-rate-store-prefix", "idle-cpu"]
        server_args = [
            "--default-user-output-tokens-per-second", "100",
            "--user-output-tokens-per-second", json.dumps({user: per_user for user in users_of(args)}),
            *store_args,
            *args.server_arg,
        ]
        doc = benchkit.start_report(SCHEMA, args, server_args)
        print(f"starting {args.engines} server(s): {shlex.join(server_args)}", flush=True)
        specs = [(f"idle-cpu-{i}", server_args) for i in range(args.engines)]
        servers = stack.enter_context(
            benchkit.running_engines(specs, log_dir, model=args.model, side_by_side=True))
        doc["startup_s"] = max(server.startup_s for server in servers)
        doc["server_log"] = [str(server.log_path) for server in servers]
        doc["processes"] = [describe(benchkit.server_processes(server.pid)) for server in servers]
        for server, processes in zip(servers, doc["processes"]):
            print(f"server {server.name} up in {server.startup_s:.0f} s; processes: "
                  + ", ".join(f"{role}={[p['name'] for p in ps]}" for role, ps in processes.items()),
                  flush=True)
        model = benchkit.served_model(servers[0].base_url)
        doc["windows"] = asyncio.run(run_rounds(servers, model, args, store_proc))
        doc["server_log_tail"] = [server.log_tail(30) for server in servers]
    benchkit.finish_report(doc)
    doc["analysis"] = analyse(doc["windows"], args.engines)
    print("\n" + report(doc))
    benchkit.write_outputs(doc, args.out, plot=plot)
    errors = [e for w in doc["windows"] for e in w.get("errors", [])]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
