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
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import psutil

from vllm_output_rate.tools import benchkit, measure
from vllm_output_rate.tools.benchkit import RESULTS_DIR, ROLES, as_share, fmt_load, loadavg, machine_line, table
from vllm_output_rate.tools.measure import RequestRecord, run_request
from vllm_output_rate.tools.serverproc import DEFAULT_MODEL_DIR

benchkit.use_cpu_testbed_env()

SCHEMA = "vllm-output-rate-idle-cpu/1"
TARGET_ENGINE_CORE_PERCENT = 5.0
TARGET_SERVER_TOTAL_PERCENT = 15.0
IDLE, THROTTLED = "idle", "throttled"


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


async def measure_window(meter: benchkit.CpuMeter, window_s: float) -> dict:
    """CPU share per role over ``window_s`` (async so streams keep flowing)."""
    load_start = loadavg()
    workers = meter.processes[0]["worker"]
    worker_threads_before = thread_cpu(workers)
    meter.start()
    await asyncio.sleep(window_s)
    cpu = meter.stop()
    wall = cpu["wall_s"]
    worker_threads = sorted(
        ((name, round(100 * (sec - worker_threads_before.get(key, (name, 0.0))[1]) / wall, 2))
         for key, (name, sec) in thread_cpu(workers).items()),
        key=lambda item: -item[1],
    )
    used = cpu["servers"][0]
    return {
        "wall_s": round(wall, 3),
        "percent_of_core": {role: as_share(s, wall, 100, 2) for role, s in used.items()},
        "server_total_percent": as_share(sum(used.values()), wall, 100, 2),
        "client_percent": as_share(cpu["client"], wall, 100, 2),
        "foreign_percent": as_share(cpu["foreign"], wall, 100, 2),
        "machine_busy_percent": as_share(cpu["busy"], wall, 100, 2),
        # Busiest model-worker threads (% of a core): where the worker's CPU goes.
        "worker_threads_top": worker_threads[:4],
        "load_start": load_start,
        "load_end": loadavg(),
    }


# --------------------------------------------------------------------------
# Phases
# --------------------------------------------------------------------------


async def run_rounds(server, model: str, args) -> list[dict]:
    meter = benchkit.CpuMeter([server.pid])
    if not meter.processes[0]["engine_core"]:
        raise RuntimeError("no child process whose name contains 'EngineCore'")
    windows: list[dict] = []
    client = benchkit.async_http(server.base_url, connections=args.streams + 4)
    body = measure.stream_body(model, args.user, args.max_tokens)
    async with client:
        await asyncio.sleep(args.settle)
        for rnd in range(args.rounds):
            # Idle: nothing in flight for at least --settle seconds.
            w = await measure_window(meter, args.window)
            w.update({"round": rnd, "phase": IDLE})
            windows.append(w)
            print(f"  round {rnd} idle      engine_core {w['percent_of_core']['engine_core']:6.2f} %  "
                  f"worker {w['percent_of_core']['worker']:6.2f} %  api {w['percent_of_core']['api_server']:6.2f} %  "
                  f"load {w['load_start']}", flush=True)

            # Throttled: the user's streams are resident and out of quota.
            t0 = time.monotonic()
            records = [RequestRecord(user=args.user, stream=i, start=0.0) for i in range(args.streams)]
            tasks = [asyncio.create_task(run_request(client, body, r, t0)) for r in records]
            await asyncio.sleep(args.settle)
            t_start = time.monotonic() - t0
            w = await measure_window(meter, args.window)
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
                    "streams": args.streams,
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
            print(f"  round {rnd} throttled engine_core {w['percent_of_core']['engine_core']:6.2f} %  "
                  f"worker {w['percent_of_core']['worker']:6.2f} %  api {w['percent_of_core']['api_server']:6.2f} %  "
                  f"tokens {tokens_window} ({w['tokens_per_s_in_window']:.2f}/s), in flight {in_flight}  "
                  f"load {w['load_start']}  worker threads {w['worker_threads_top'][:3]}", flush=True)
            await asyncio.sleep(args.settle)  # aborts processed, worker's busy-poll over
    return windows


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def analyse(windows: list[dict]) -> dict:
    out: dict = {}
    for phase in (IDLE, THROTTLED):
        ws = [w for w in windows if w["phase"] == phase]
        out[phase] = {}
        for key in (*ROLES, "server_total", "client", "foreign"):
            if key in ROLES:
                values = [w["percent_of_core"][key] for w in ws]
            else:
                values = [w[f"{key}_percent"] for w in ws]
            out[phase][key] = {
                "mean": statistics.fmean(values) if values else None,
                "min": min(values) if values else None,
                "max": max(values) if values else None,
                "values": values,
            }
    thr = out[THROTTLED]["engine_core"]
    out["target_engine_core_percent"] = TARGET_ENGINE_CORE_PERCENT
    out["meets_target"] = None if thr["max"] is None else thr["mean"] <= TARGET_ENGINE_CORE_PERCENT
    out["meets_target_every_window"] = None if thr["max"] is None else thr["max"] <= TARGET_ENGINE_CORE_PERCENT
    tot = out[THROTTLED]["server_total"]
    out["target_server_total_percent"] = TARGET_SERVER_TOTAL_PERCENT
    out["server_total_meets_target"] = None if tot["max"] is None else tot["mean"] <= TARGET_SERVER_TOTAL_PERCENT
    return out


def report(doc: dict) -> str:
    a = doc["analysis"]
    rows = []
    for key in (*ROLES, "server_total", "client", "foreign"):
        cells = [key]
        for phase in (IDLE, THROTTLED):
            s = a[phase][key]
            cells.append("-" if s["mean"] is None else f"{s['mean']:.2f} ({s['min']:.2f}-{s['max']:.2f})")
        rows.append(cells)
    parts = [
        "CPU share, % of one core: mean (min-max) over windows",
        table(["process", "idle", f"throttled ({doc['config']['user']} @ {doc['config']['rate']:g} tok/s)"], rows),
    ]
    wrows = [
        [str(w["round"]), w["phase"], f"{w['percent_of_core']['engine_core']:.2f}",
         f"{w['percent_of_core']['worker']:.2f}", f"{w['percent_of_core']['api_server']:.2f}",
         f"{w['foreign_percent']:.0f}", str(w.get("tokens_in_window", "-")), fmt_load(w["load_start"])]
        for w in doc["windows"]
    ]
    parts.append(table(["round", "phase", "engine %", "worker %", "api %", "foreign %", "tokens", "load 1/5/15"], wrows))
    thr = a[THROTTLED]["engine_core"]
    if thr["mean"] is not None:
        verdict = "meets" if a["meets_target"] else "MISSES"
        parts.append(
            f"engine core while throttled: mean {thr['mean']:.2f} %, max {thr['max']:.2f} % of a core "
            f"({verdict} target <= {TARGET_ENGINE_CORE_PERCENT:g} %)"
        )
    tot = a[THROTTLED]["server_total"]
    if tot["mean"] is not None:
        verdict = "meets" if a["server_total_meets_target"] else "MISSES"
        parts.append(
            f"whole server while throttled: mean {tot['mean']:.2f} %, max {tot['max']:.2f} % of a core "
            f"({verdict} target <= {TARGET_SERVER_TOTAL_PERCENT:g} %); idle server "
            f"{a[IDLE]['server_total']['mean']:.2f} %; worker spin: {doc['config'].get('worker_spin_ms') or 'plugin default'}"
        )
    parts.append(machine_line(doc))
    return "\n\n".join(parts)


def plot(doc: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    a = doc["analysis"]
    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    keys = ["engine_core", "worker", "api_server", "other", "server_total"]
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
    ax.set_xticks(range(len(keys)), keys)
    ax.set_ylabel("% of one core (mean, min-max)")
    ax.set_title(f"Server CPU: idle vs user '{doc['config']['user']}' throttled "
                 f"({doc['config']['streams']} streams, {doc['config']['rate']:g} tok/s)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Per-process server CPU while every user is throttled vs idle.")
    parser.add_argument("--out", default=str(RESULTS_DIR / "idle_cpu"), metavar="PREFIX",
                        help="writes PREFIX.json and PREFIX.png (default: %(default)s)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model path (default: tiny model)")
    parser.add_argument("--user", default="slow", help="the throttled user (default slow)")
    parser.add_argument("--rate", type=float, default=2.0, help="its limit, tok/s (default 2)")
    parser.add_argument("--streams", type=int, default=8, help="its concurrent streams (default 8)")
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
    if args.streams * args.max_tokens <= args.rate * (args.settle + args.window) * 1.5:
        parser.error("streams x max_tokens too small: the streams would finish during the phase")

    log_dir = benchkit.log_dir_for("idle-cpu", args.log_dir)
    server_args = [
        "--default-user-output-tokens-per-second", "100",
        "--user-output-tokens-per-second", json.dumps({args.user: args.rate}),
        *args.server_arg,
    ]
    doc = benchkit.start_report(SCHEMA, args, server_args)
    print(f"starting server: {shlex.join(server_args)}", flush=True)
    with benchkit.running_engines([("idle-cpu", server_args)], log_dir, model=args.model) as (server,):
        doc["startup_s"] = server.startup_s
        doc["server_log"] = str(server.log_path)
        doc["processes"] = describe(benchkit.server_processes(server.pid))
        print(f"server up in {doc['startup_s']:.0f} s; processes: "
              + ", ".join(f"{role}={[p['name'] for p in ps]}" for role, ps in doc["processes"].items()),
              flush=True)
        model = benchkit.served_model(server.base_url)
        doc["windows"] = asyncio.run(run_rounds(server, model, args))
        doc["server_log_tail"] = server.log_tail(30)
    benchkit.finish_report(doc)
    doc["analysis"] = analyse(doc["windows"])
    print("\n" + report(doc))
    benchkit.write_outputs(doc, args.out, plot=plot)
    errors = [e for w in doc["windows"] for e in w.get("errors", [])]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
