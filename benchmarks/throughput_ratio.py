#!/usr/bin/env python
"""End-to-end throughput: limits configured but never hit vs the feature off.

What
    The same closed-loop workload (default 8 users x 3 streaming completions
    each, ``max_tokens`` 128, ``ignore_eos``, each stream re-issued as soon as
    it finishes) runs against two servers on the *bench* model
    (``make bench-model``: 8 layers, hidden 512):

    * ``stock``:  ``vllm-output-rate serve MODEL --max-num-seqs 16``
      (no ``--default-user-output-tokens-per-second``: the plugin is off and
      vLLM runs its stock scheduler class and loop);
    * ``plugin``: the same plus ``--default-user-output-tokens-per-second
      100000`` (every request goes through the limiter, nobody is ever
      throttled).

    24 streams for 16 slots keep a waiting queue, so every step runs a full
    batch and the figure is the engine's capacity.  Why not the tiny model:
    its forward pass takes ~1 ms, so on 2 cores the HTTP front end, the
    client and the spinning engine/worker processes fight for CPU and the
    throughput swings by tens of percent between identical stock runs (seen:
    794-2102 tok/s; batches of 1-7 tokens per step although 16 streams were
    open).  With the bench model a step takes ~10 ms and batches stay full.

    Reported per run: total output tokens/s, i.e. the tokens received by the
    client during the measurement window divided by its length.  Per side:
    mean, stdev, min, max.  Headline: ratio of means plugin / stock (target
    >= 0.98).  Also the per-pair ratios, their median and geometric mean
    (paired estimates that cancel load drifting slowly between pairs), and
    output tokens per engine step (how full the batches were).

How
    Two servers on a 2-core machine cannot both *work* well at once, but an
    idle one costs ~1 % of a core.  By default both servers start once and
    stay up, and the runs alternate between them (only the measured one has
    traffic; each run starts 1.5 s after the other's ended, when a stock
    worker has stopped spinning); both are stopped by PID at the end.  With
    ``--fresh-servers`` each run instead starts a server, drives it, and stops
    it before the next one starts (slower: a startup per run).  Runs come in
    pairs (stock, plugin) and the order alternates from pair to pair (S P,
    P S, S P, ...) so that drift in the machine's load hits both sides alike.  In each run the workload starts, the first
    ``--warmup`` seconds are discarded, and the next ``--duration`` seconds
    are measured without stopping the streams in between (steady state); the
    streams still in flight at the end are cancelled.  The server's first
    /metrics request (slow) is made before the workload starts.

    Tokens are counted exactly: every streamed chunk carries ``token_ids``
    (``"return_token_ids": true``).  For requests that finished inside a run,
    the server's ``usage.completion_tokens`` must equal the tokens received.

    The machine is shared, so every run records the load averages before and
    after, and the CPU seconds used during the measurement window by the
    server's process tree (split into engine core, worker, API server), by
    this client, and by everything else ("foreign", from ``/proc/stat`` via
    psutil).  A run with a lot of foreign CPU is noisier; compare the spread
    before trusting the ratio.

Secondary figures, to tell plugin overhead from noise:

    * server-side throughput: the delta of ``vllm:generation_tokens_total``
      (``/metrics``) over the same window, independent of when the client
      happened to read its sockets;
    * engine-core CPU milliseconds per 100 output tokens: the scheduler
      loop's cost per token, where the plugin's work happens.  On 2 cores
      the server is CPU-bound (engine core + spinning worker + API server +
      client > 2 cores), so extra engine-core CPU turns into lost tokens;
    * tokens received per 1-s bin (JSON ``tokens_per_1s_bin``): shows stalls
      (seconds with ~0 tokens happen on both sides on this shared machine).

Bounded in time: ``--time-budget`` (default 900 s) is checked before each
run; runs that would not fit are skipped (reported as such).  A server
starts in about 45-60 s on an idle machine (more under load); the default 4
pairs take about 6 minutes on live servers (about 10 with
``--fresh-servers``).

Usage::

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/throughput_ratio.py

writes ``docs/benchmarks/throughput_ratio.json`` and ``.png`` (``--out PREFIX`` elsewhere).
Exit status 0 whether or not the target is met (it is a measurement);
1 when a run failed (server did not start, request errors).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from vllm_output_rate.tools import measure
from vllm_output_rate.tools.measure import DEFAULT_PROMPT, FINISHED, RequestRecord, percentile, run_request
from vllm_output_rate_harness import benchkit
from vllm_output_rate_harness.benchkit import (
    RESULTS_DIR,
    as_share,
    fmt_load,
    loadavg,
    machine_line,
    table,
)

benchkit.use_cpu_testbed_env()

BENCH_MODEL_DIR = Path(os.environ.get("BENCH_MODEL_DIR", "models/bench-llama"))
SCHEMA = "vllm-output-rate-throughput-ratio/1"
TARGET_RATIO = 0.98
STOCK, PLUGIN = "stock", "plugin"

_COUNTERS = {
    "generated_tokens": "vllm:generation_tokens_total",
    "engine_steps": "vllm:iteration_tokens_total_count",
}


def server_counters(base_url: str) -> dict[str, float | None]:
    """Server-side counters from /metrics: tokens generated and engine steps run."""
    try:
        samples = measure.fetch_metrics(base_url, timeout=30)
    except Exception:  # noqa: BLE001 -- a failed read leaves the window without server figures
        return dict.fromkeys(_COUNTERS)
    return {key: measure.metric_sum(samples, name) for key, name in _COUNTERS.items()}


# --------------------------------------------------------------------------
# Workload
# --------------------------------------------------------------------------


async def drive(
    base_url: str,
    model: str,
    users: int,
    streams: int,
    max_tokens: int,
    prompt: str,
    warmup_s: float,
    duration_s: float,
    on_measure_start,
    on_measure_end,
) -> tuple[list[RequestRecord], float, float]:
    """Closed loop for warmup + duration; returns (records, t_start, t_end).

    Record times are seconds since the first requests were sent;
    ``on_measure_start``/``on_measure_end`` are called at the window's edges
    (to snapshot CPU counters) and the window's actual edges are returned.
    """
    total = users * streams
    client = benchkit.async_http(base_url, connections=total + 4)
    records: list[RequestRecord] = []
    async with client:
        t0 = time.monotonic()

        async def loop(user: str, stream: int) -> None:
            body = measure.stream_body(model, user, max_tokens, prompt)
            while True:
                record = RequestRecord(user=user, stream=stream, start=time.monotonic() - t0)
                records.append(record)
                await run_request(client, body, record, t0)
                if record.status != FINISHED:
                    await asyncio.sleep(0.2)  # do not hammer a broken server

        tasks = [
            asyncio.create_task(loop(f"user{u}", s))
            for u in range(users)
            for s in range(streams)
        ]
        await asyncio.sleep(max(0.0, t0 + warmup_s - time.monotonic()))
        t_start = time.monotonic() - t0
        on_measure_start()
        await asyncio.sleep(max(0.0, t0 + warmup_s + duration_s - time.monotonic()))
        t_end = time.monotonic() - t0
        on_measure_end()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return records, t_start, t_end


def measure_run(side: str, args, server_args: list[str], log_dir: Path, server=None) -> dict:
    """One measured run: on ``server`` if given (live mode), else on a fresh one."""
    run: dict = {"side": side, "server_args": server_args, "load_before": loadavg()}
    started = time.monotonic()
    run["started_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    with contextlib.ExitStack() as stack:
        if server is None:
            (server,) = stack.enter_context(benchkit.running_engines(
                [(f"throughput-{side}", server_args)], log_dir, model=args.model))
        else:
            time.sleep(1.5)  # the other live server's worker has stopped spinning
        run["startup_s"] = server.startup_s
        run["server_pid"] = server.pid
        model = benchkit.served_model(server.base_url)
        # The first /metrics request of a server takes seconds (seen: 4 s) and
        # stalls the front end; make it here, not at the window's start.
        server_counters(server.base_url)
        meter = benchkit.CpuMeter([server.pid])
        snap: dict = {}

        def at_start() -> None:
            snap["counters"] = server_counters(server.base_url)
            snap["t"] = time.monotonic()
            snap["load"] = loadavg()
            meter.start()

        def at_end() -> None:
            cpu = meter.stop()
            wall = time.monotonic() - snap["t"]
            counters = server_counters(server.base_url)
            delta = {
                key: None if counters[key] is None or snap["counters"][key] is None
                else counters[key] - snap["counters"][key]
                for key in counters
            }
            run["server_generated_tokens_in_window"] = delta["generated_tokens"]
            # Output tokens per engine step: how full the batches were (the
            # workload keeps more streams open than --max-num-seqs, so an
            # engine-bound run stays near max-num-seqs).
            run["tokens_per_engine_step"] = (
                delta["generated_tokens"] / delta["engine_steps"]
                if delta["generated_tokens"] is not None and delta["engine_steps"] else None
            )
            run["server_tokens_per_s"] = (
                None if run["server_generated_tokens_in_window"] is None
                else run["server_generated_tokens_in_window"] / wall
            )
            roles = cpu["servers"][0]
            run["cpu_during_window"] = {
                "wall_s": round(cpu["wall_s"], 3),
                "server_cores": as_share(sum(roles.values()), cpu["wall_s"]),
                "client_cores": as_share(cpu["client"], cpu["wall_s"]),
                "foreign_cores": as_share(cpu["foreign"], cpu["wall_s"]),
                "machine_busy_cores": as_share(cpu["busy"], cpu["wall_s"]),
                "server_cores_by_process": {role: as_share(s, cpu["wall_s"]) for role, s in roles.items()},
            }
            run["load_window_start"] = snap["load"]
            run["load_window_end"] = loadavg()

        records, t_start, t_end = asyncio.run(
            drive(
                server.base_url, model, args.users, args.streams, args.max_tokens,
                args.prompt, args.warmup, args.duration, at_start, at_end,
            )
        )
        log_text = server.log_path.read_text(errors="replace")
        run["server_log"] = str(server.log_path)
        run["scheduler_cls_warning"] = next(
            (line.split("]", 1)[-1].strip()[:120] for line in log_text.splitlines()
             if "Using custom scheduler class" in line),
            None,
        )
    run["load_after"] = loadavg()
    window = t_end - t_start
    tokens = sum(1 for r in records for t in r.token_times if t_start <= t <= t_end)
    finished = [r for r in records if r.status == FINISHED]
    # Tokens per 1-s bin over warmup + window: shows drift within a run.
    bins = [0] * (int(math.ceil(t_end)) + 1)
    for r in records:
        for t in r.token_times:
            if 0 <= t <= t_end:
                bins[int(t)] += 1
    run["tokens_per_1s_bin"] = bins[: int(t_end)]
    errors = [r for r in records if r.status not in (FINISHED, "cancelled", "running")]
    cpu = run["cpu_during_window"]
    engine_cpu_s = cpu["server_cores_by_process"]["engine_core"] * cpu["wall_s"]
    run["engine_core_cpu_ms_per_100_tokens"] = (engine_cpu_s * 1000 / tokens * 100) if tokens else None
    run.update(
        {
            "window_s": round(window, 3),
            "tokens_in_window": tokens,
            "tokens_per_s": tokens / window,
            "requests_sent": len(records),
            "requests_finished": len(finished),
            "finished_wrong_length": sum(1 for r in finished if len(r.token_times) != args.max_tokens),
            "usage_mismatches": sum(1 for r in finished if r.completion_tokens != len(r.token_times)),
            "errors": len(errors),
            "first_error": errors[0].error if errors else None,
            "ttft_p50_s": percentile(
                [r.token_times[0] - r.start for r in records if r.token_times and r.start >= t_start], 50
            ),
            "wall_s": round(time.monotonic() - started, 1),
        }
    )
    return run


# --------------------------------------------------------------------------
# Statistics and output
# --------------------------------------------------------------------------


def side_stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "cv_percent": (statistics.stdev(values) / statistics.fmean(values) * 100) if len(values) > 1 else 0.0,
    }


def analyse(runs: list[dict]) -> dict:
    ok = [r for r in runs if "tokens_per_s" in r]
    by_side = {side: [r["tokens_per_s"] for r in ok if r["side"] == side] for side in (STOCK, PLUGIN)}
    stats = {side: side_stats(v) for side, v in by_side.items()}
    ratio = None
    if stats[STOCK].get("n") and stats[PLUGIN].get("n"):
        ratio = stats[PLUGIN]["mean"] / stats[STOCK]["mean"]
    pair_ratios = []
    for pair in sorted({r["pair"] for r in ok}):
        sides = {r["side"]: r["tokens_per_s"] for r in ok if r["pair"] == pair}
        if STOCK in sides and PLUGIN in sides:
            pair_ratios.append(sides[PLUGIN] / sides[STOCK])
    geo = math.exp(statistics.fmean(math.log(x) for x in pair_ratios)) if pair_ratios else None
    server_side = {
        side: side_stats([r["server_tokens_per_s"] for r in ok if r["side"] == side and r.get("server_tokens_per_s")])
        for side in (STOCK, PLUGIN)
    }
    engine_cost = {
        side: side_stats([r["engine_core_cpu_ms_per_100_tokens"] for r in ok
                          if r["side"] == side and r.get("engine_core_cpu_ms_per_100_tokens")])
        for side in (STOCK, PLUGIN)
    }
    # Output tokens per CPU-second of the server's process tree: what a token
    # costs, independent of how much CPU share the shared machine left us.
    per_cpu = {
        side: side_stats([r["tokens_per_s"] / r["cpu_during_window"]["server_cores"] for r in ok
                          if r["side"] == side and r["cpu_during_window"]["server_cores"] > 0])
        for side in (STOCK, PLUGIN)
    }
    cores = {
        side: side_stats([r["cpu_during_window"]["server_cores"] for r in ok if r["side"] == side])
        for side in (STOCK, PLUGIN)
    }
    server_ratio = None
    if server_side[STOCK].get("n") and server_side[PLUGIN].get("n"):
        server_ratio = server_side[PLUGIN]["mean"] / server_side[STOCK]["mean"]
    return {
        "per_side_server_metric": server_side,
        "tokens_per_server_cpu_s": per_cpu,
        "tokens_per_server_cpu_s_ratio": (per_cpu[PLUGIN]["mean"] / per_cpu[STOCK]["mean"]
                                          if per_cpu[STOCK].get("n") and per_cpu[PLUGIN].get("n") else None),
        "server_cores": cores,
        "engine_core_cpu_ms_per_100_tokens": engine_cost,
        "server_metric_ratio_of_means": server_ratio,
        "pair_ratio_median": statistics.median(pair_ratios) if pair_ratios else None,
        "per_side": stats,
        "ratio_of_means": ratio,
        "pair_ratios": pair_ratios,
        "pair_ratio_geomean": geo,
        "target_ratio": TARGET_RATIO,
        "meets_target": None if ratio is None else ratio >= TARGET_RATIO,
    }


def report(doc: dict) -> str:
    rows = []
    for r in doc["runs"]:
        if "tokens_per_s" not in r:
            rows.append([str(r["index"]), str(r["pair"]), r["side"], "skipped/failed", "", "", "", "", "", "", "", "", ""])
            continue
        cpu = r["cpu_during_window"]
        rows.append(
            [
                str(r["index"]),
                str(r["pair"]),
                r["side"],
                f"{r['tokens_per_s']:.1f}",
                "-" if r.get("tokens_per_engine_step") is None else f"{r['tokens_per_engine_step']:.1f}",
                str(r["tokens_in_window"]),
                f"{r['window_s']:.1f}",
                f"{r['requests_finished']}/{r['requests_sent']}",
                f"{r['usage_mismatches']}/{r['errors']}",
                f"{cpu['server_cores']:.2f}/{cpu['client_cores']:.2f}/{cpu['foreign_cores']:.2f}",
                "{engine_core:.2f}/{worker:.2f}/{api_server:.2f}".format(**cpu["server_cores_by_process"]),
                fmt_load(r["load_before"]),
                f"{r['startup_s']:.0f}",
            ]
        )
    parts = [
        table(
            ["run", "pair", "side", "tok/s", "tok/step", "tokens", "window s", "finished/sent",
             "usage!=/errors", "cores srv/client/foreign", "cores engine/worker/api",
             "load before (1/5/15)", "startup s"],
            rows,
        )
    ]
    a = doc["analysis"]
    srows = []
    for side in (STOCK, PLUGIN):
        s = a["per_side"][side]
        if not s.get("n"):
            srows.append([side, "0", "-", "-", "-", "-", "-"])
            continue
        srows.append(
            [side, str(s["n"]), f"{s['mean']:.1f}", f"{s['stdev']:.1f}", f"{s['min']:.1f}",
             f"{s['max']:.1f}", f"{s['cv_percent']:.1f}"]
        )
    parts.append(table(["side", "runs", "mean tok/s", "stdev", "min", "max", "CV %"], srows))
    if a["ratio_of_means"] is not None:
        verdict = "meets" if a["meets_target"] else "MISSES"
        parts.append(
            f"ratio of means plugin/stock = {a['ratio_of_means']:.3f} "
            f"({verdict} target >= {TARGET_RATIO}); per-pair ratios "
            + ", ".join(f"{x:.3f}" for x in a["pair_ratios"])
            + (f"; median {a['pair_ratio_median']:.3f}" if a["pair_ratio_median"] else "")
            + (f"; geometric mean {a['pair_ratio_geomean']:.3f}" if a["pair_ratio_geomean"] else "")
        )
    ec = a.get("engine_core_cpu_ms_per_100_tokens") or {}
    if ec.get(STOCK, {}).get("n") and ec.get(PLUGIN, {}).get("n"):
        parts.append(
            "engine-core CPU per 100 output tokens (ms): "
            f"stock {ec[STOCK]['mean']:.2f} ({ec[STOCK]['min']:.2f}-{ec[STOCK]['max']:.2f}), "
            f"plugin {ec[PLUGIN]['mean']:.2f} ({ec[PLUGIN]['min']:.2f}-{ec[PLUGIN]['max']:.2f}), "
            f"plugin/stock {ec[PLUGIN]['mean'] / ec[STOCK]['mean']:.3f}"
        )
    if a.get("tokens_per_server_cpu_s_ratio") is not None:
        pc, sc = a["tokens_per_server_cpu_s"], a["server_cores"]
        parts.append(
            "output tokens per CPU-second of the server process tree: "
            f"stock {pc[STOCK]['mean']:.0f}, plugin {pc[PLUGIN]['mean']:.0f}, "
            f"ratio {a['tokens_per_server_cpu_s_ratio']:.3f}; CPU the server got (cores): "
            f"stock {sc[STOCK]['mean']:.2f}, plugin {sc[PLUGIN]['mean']:.2f}"
        )
    if a.get("server_metric_ratio_of_means") is not None:
        ss = a["per_side_server_metric"]
        parts.append(
            "server-side count (vllm:generation_tokens_total over the same window): "
            f"stock {ss[STOCK]['mean']:.1f} tok/s (min {ss[STOCK]['min']:.1f}, max {ss[STOCK]['max']:.1f}), "
            f"plugin {ss[PLUGIN]['mean']:.1f} tok/s (min {ss[PLUGIN]['min']:.1f}, max {ss[PLUGIN]['max']:.1f}), "
            f"ratio {a['server_metric_ratio_of_means']:.3f}"
        )
    parts.append(machine_line(doc))
    return "\n\n".join(parts)


def plot(doc: dict, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = [r for r in doc["runs"] if "tokens_per_s" in r]
    fig = Figure(figsize=(9, 4.8), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = {STOCK: "C0", PLUGIN: "C1"}
    xs = [r["index"] for r in runs]
    ax.bar(xs, [r["tokens_per_s"] for r in runs], color=[colors[r["side"]] for r in runs])
    for side in (STOCK, PLUGIN):
        s = doc["analysis"]["per_side"][side]
        if s.get("n"):
            ax.axhline(s["mean"], color=colors[side], linestyle="--", linewidth=1,
                       label=f"{side} mean {s['mean']:.1f} tok/s (n={s['n']})")
    ax.set_xticks(xs, [f"{r['index']}\n{r['side']}" for r in runs])
    ax.set_ylabel("output tokens/s (all users)")
    ratio = doc["analysis"]["ratio_of_means"]
    ax.set_title(
        "Throughput, limits never hit vs feature off"
        + (f" - ratio {ratio:.3f}" if ratio is not None else "")
    )
    ax2 = ax.twinx()
    ax2.plot(xs, [r["cpu_during_window"]["foreign_cores"] for r in runs], "k.:",
             label="foreign CPU during window (cores)")
    ax2.set_ylabel("foreign CPU (cores)")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path))


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def run_all(args, server_args: dict, log_dir: Path, doc: dict, t_begin: float) -> bool:
    """Run the alternating pairs into ``doc["runs"]``; True when a run failed."""
    failed = False
    est_run_s = None  # learned from the first run
    index = 0
    with contextlib.ExitStack() as stack:  # live servers are stopped (by PID) on exit
        live: dict = {}
        if not args.fresh_servers:
            # Both servers start once and stay up; runs alternate between them.
            print(f"starting the stock and plugin servers (load {fmt_load(loadavg())})", flush=True)
            servers = stack.enter_context(benchkit.running_engines(
                [(f"throughput-{side}", server_args[side]) for side in (STOCK, PLUGIN)],
                log_dir, model=args.model))
            for side, server in zip((STOCK, PLUGIN), servers):
                live[side] = server
                server_counters(server.base_url)  # first /metrics request is slow
                print(f"  {side} up in {server.startup_s:.0f} s", flush=True)
        for pair in range(args.pairs):
            order = (STOCK, PLUGIN) if pair % 2 == 0 else (PLUGIN, STOCK)
            for side in order:
                index += 1
                elapsed = time.monotonic() - t_begin
                guess = est_run_s if est_run_s is not None else (
                    90 if args.fresh_servers else 5) + args.warmup + args.duration
                if elapsed + guess > args.time_budget:
                    print(f"[{elapsed:5.0f}s] run {index} ({side}) skipped: time budget", flush=True)
                    doc["runs"].append({"index": index, "pair": pair, "side": side, "skipped": "time budget"})
                    continue
                print(f"[{elapsed:5.0f}s] run {index} pair {pair} {side}: "
                      f"{'starting server' if args.fresh_servers else 'measuring'} "
                      f"(load {fmt_load(loadavg())})", flush=True)
                try:
                    run = measure_run(side, args, server_args[side], log_dir, live.get(side))
                except Exception as exc:  # keep going: report what was measured
                    failed = True
                    print(f"  run {index} failed: {type(exc).__name__}: {str(exc)[-2000:]}", flush=True)
                    doc["runs"].append({"index": index, "pair": pair, "side": side,
                                        "error": f"{type(exc).__name__}: {exc}"[-4000:]})
                    continue
                run.update({"index": index, "pair": pair})
                doc["runs"].append(run)
                est_run_s = max(est_run_s or 0.0, run["wall_s"] + 5)
                if run["errors"] or run["usage_mismatches"] or run["finished_wrong_length"]:
                    failed = True
                print(f"  {side}: {run['tokens_per_s']:.1f} tok/s ({run['tokens_in_window']} tokens in "
                      f"{run['window_s']:.1f} s), startup {run['startup_s']:.0f} s, errors {run['errors']}, "
                      f"foreign CPU {run['cpu_during_window']['foreign_cores']:.2f} cores", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Throughput with limits configured but never hit vs the feature off "
        "(runs alternating between a stock and a plugin server).",
    )
    parser.add_argument("--out", default=str(RESULTS_DIR / "throughput_ratio"), metavar="PREFIX",
                        help="writes PREFIX.json and PREFIX.png (default: %(default)s)")
    parser.add_argument("--model", default=str(BENCH_MODEL_DIR),
                        help=f"model path (default: {BENCH_MODEL_DIR}, written by `make bench-model`)")
    parser.add_argument("--pairs", type=int, default=4, help="stock/plugin run pairs (default 4)")
    parser.add_argument("--users", type=int, default=8, help="users (default 8)")
    parser.add_argument("--streams", type=int, default=3,
                        help="concurrent streams per user (default 3: 24 streams for 16 slots)")
    parser.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default 128)")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds of workload discarded first (default 4)")
    parser.add_argument("--duration", type=float, default=18.0, help="measured seconds per run (default 18)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="vLLM --max-num-seqs (default 16)")
    parser.add_argument("--limit", type=float, default=100000.0,
                        help="plugin side's --default-user-output-tokens-per-second (default 100000)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt of every request")
    parser.add_argument("--time-budget", type=float, default=900.0,
                        help="seconds; a run is skipped when it would not fit (default 900)")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    parser.add_argument("--fresh-servers", action="store_true",
                        help="start a fresh server for every run (default: start both once and "
                             "alternate runs between the two live servers)")
    args = parser.parse_args(argv)
    if not Path(args.model, "config.json").is_file():
        parser.error(f"no model at {args.model}; `make bench-model` writes the default one")

    log_dir = benchkit.log_dir_for("throughput-ratio", args.log_dir)
    shared = ["--max-num-seqs", str(args.max_num_seqs)]
    server_args = {
        STOCK: shared,
        PLUGIN: shared + ["--default-user-output-tokens-per-second", f"{args.limit:g}"],
    }
    doc = benchkit.start_report(SCHEMA, args, server_args)
    t_begin = time.monotonic()
    doc["runs"] = []
    doc["mode"] = "fresh servers" if args.fresh_servers else "live servers"
    failed = run_all(args, server_args, log_dir, doc, t_begin)
    benchkit.finish_report(doc)
    doc["analysis"] = analyse(doc["runs"])
    print("\n" + report(doc))
    measured = any("tokens_per_s" in r for r in doc["runs"])
    benchkit.write_outputs(doc, args.out, plot=plot if measured else None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
