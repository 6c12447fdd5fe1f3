#!/usr/bin/env python
"""A prompt flood beside a light user, with prompt tokens free and at a weight.

What
    One server on the tiny model, limits from a file: the default rate (the
    flooding user ``flood``) is ``--flood-rate`` output tok/s (default 20), the
    light user ``light`` has a rate it never reaches.  ``flood`` keeps
    ``--flood-streams`` requests in flight (default 8), each a distinct prompt
    of ``--flood-prompt-tokens`` random token ids (default 525, no shared
    prefix) with ``max_tokens`` 1: it is never throttled for output, so only
    the prompt cost can hold it.  ``light`` streams one request after another
    (16-token prompt, ``max_tokens`` 256).

    Three phases of ``--duration`` seconds on the same server: ``light``
    alone; ``light`` beside the flood with ``input_token_weight`` 0 (today's
    default: prompt tokens free); and beside the flood with the weight
    ``--weight`` (default 0.5), set by rewriting the limits file (the engine
    reloads it live).  Reported per phase: the light user's output tok/s
    (client count, from its phase start to the phase end) and its ratio to
    the alone phase; the flood's prompt tokens per second that reached the
    engine (client count of finished requests); and, from the engine's own
    counters, the flood's output and prompt tokens charged, checked against
    the bound ``(W + 0.1) x N + 1 + ceil(w x C)`` (C = ``--max-num-batched-tokens``,
    W = the phase from its first request to the counters' read).

    Why the light user's rate moves, per phase: engine steps per second
    (the count of vLLM's ``vllm:iteration_tokens_total`` histogram, one per
    step with output), the light user's tokens per step (vLLM's generated
    tokens less the flood's, over those steps), and CPU seconds per second
    by process (engine core, model worker, API server, this client, the rest
    of the machine).  The light user's rate is steps/s x tokens/step: the
    scheduler's share shows in the second factor, the machine in the first.

How
    Each phase cancels what is still in flight at its end and waits for the
    engine to drain before the counters are read.  The weighted phase starts
    only after ``vllm:output_rate_limit_reloads_total`` grew.  Figures are
    wall-clock rates on a shared 2-core machine: this is a benchmark, not a
    test; the page shows the machine's load averages.

Usage::

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/prompt_flood.py

writes ``docs/benchmarks/prompt_flood.json`` and ``.png`` (``--out PREFIX``
elsewhere); about 1 min of startup plus 3 x (duration + drain).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path

from vllm_output_rate.tools import measure
from vllm_output_rate.tools.render import figure_metadata, sibling_json
from vllm_output_rate.tools.measure import FINISHED, RequestRecord, metric_sum, run_request
from vllm_output_rate.tools.serverproc import DEFAULT_MODEL_DIR
from vllm_output_rate_harness import benchkit
from vllm_output_rate_harness.benchkit import RESULTS_DIR, fmt_load, loadavg, machine_line, table

benchkit.use_cpu_testbed_env()

SCHEMA = "vllm-output-rate-prompt-flood/1"
FLOOD, LIGHT = "flood", "light"
ALONE = "alone"
BURST_S = 0.1
PROMPT_CHARGED = "vllm:output_rate_prompt_tokens_charged_total"
OUTPUT_CHARGED = "vllm:output_rate_output_tokens_charged_total"
RELOADS = "vllm:output_rate_limit_reloads_total"
# vLLM's own per-step series: one histogram observation per engine step that
# produced output (the light user decodes in nearly every step), its sum the
# prompt positions computed plus tokens generated in those steps.
STEPS = "vllm:iteration_tokens_total_count"
STEP_TOKENS = "vllm:iteration_tokens_total_sum"
GENERATED = "vllm:generation_tokens_total"


def write_limits(path: Path, flood_rate: float, weight: float) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({
        "default_user_output_tokens_per_second": flood_rate,
        "user_output_tokens_per_second": {LIGHT: 100000},
        "input_token_weight": weight,
    }))
    os.replace(tmp, path)  # atomic: the engine never reads half a file


def counters(text: str) -> dict:
    m = measure.parse_metrics(text)
    return {
        "flood_prompt": metric_sum(m, PROMPT_CHARGED, user=FLOOD) or 0.0,
        "flood_output": metric_sum(m, OUTPUT_CHARGED, user=FLOOD) or 0.0,
        "reloads": metric_sum(m, RELOADS) or 0.0,
        "idle_steps": metric_sum(m, "vllm:output_rate_idle_steps_total") or 0.0,
        "light_output": metric_sum(m, OUTPUT_CHARGED, user=LIGHT) or 0.0,
        "steps": metric_sum(m, STEPS) or 0.0,
        "step_tokens": metric_sum(m, STEP_TOKENS) or 0.0,
        "generated": metric_sum(m, GENERATED) or 0.0,
        "running": metric_sum(m, measure.RUNNING_GAUGE) or 0.0,
        "waiting": metric_sum(m, measure.WAITING_GAUGE) or 0.0,
    }


async def read_counters(client) -> dict:
    return counters((await client.get("/metrics")).text)


async def wait_drained(client, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        c = await read_counters(client)
        if (c["running"] == 0 and c["waiting"] == 0) or time.monotonic() > deadline:
            return c
        await asyncio.sleep(0.2)


async def loop_requests(client, model, user, make_prompt, max_tokens, records, t0, stop):
    while not stop.is_set():
        record = RequestRecord(user=user, start=time.monotonic() - t0)
        records.append(record)
        await run_request(client, measure.stream_body(model, user, max_tokens, make_prompt()), record, t0)


async def phase(client, model, name: str, args, rng: random.Random, vocab: int, cpu) -> dict:
    before = await read_counters(client)
    cpu.start()
    t0 = time.monotonic()
    stop = asyncio.Event()
    light: list[RequestRecord] = []
    flood: list[RequestRecord] = []
    tasks = [asyncio.create_task(loop_requests(
        client, model, LIGHT, lambda: [rng.randrange(3, vocab) for _ in range(16)], 256, light, t0, stop))]
    if name != ALONE:
        for _ in range(args.flood_streams):
            tasks.append(asyncio.create_task(loop_requests(
                client, model, FLOOD,
                lambda: [rng.randrange(3, vocab) for _ in range(args.flood_prompt_tokens)],
                1, flood, t0, stop)))
    await asyncio.sleep(args.duration)
    # vLLM's step and token counters are updated as each step's output reaches
    # the API server: read them before anything is cancelled.
    at_end = await read_counters(client)
    used = cpu.stop()
    stop.set()
    end = time.monotonic() - t0
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await wait_drained(client)
    await asyncio.sleep(1.5)  # the engine's per-user report comes about once a second
    after = await read_counters(client)
    window_s = time.monotonic() - t0
    light_tokens = sum(1 for r in light for t in r.token_times if t <= end)
    flood_done = [r for r in flood if r.status == FINISHED]
    result = {
        "phase": name,
        "duration_s": round(end, 2),
        "load": loadavg(),
        "light_tokens": light_tokens,
        "light_tok_per_s": round(light_tokens / end, 2),
        "light_errors": [r.error for r in light if r.error and r.status != "cancelled"],
        "flood_requests_finished": len(flood_done),
        "flood_prompt_tokens_finished": sum(r.prompt_tokens or 0 for r in flood_done),
        "flood_errors": [r.error for r in flood if r.error and r.status != "cancelled"],
        "engine_window_s": round(window_s, 2),
        "flood_prompt_charged": after["flood_prompt"] - before["flood_prompt"],
        "flood_output_charged": after["flood_output"] - before["flood_output"],
        # Steps that ran nothing because every runnable request was throttled.
        "idle_steps": after["idle_steps"] - before["idle_steps"],
        "light_requests": len(light),
        **engine_figures(before, at_end, used, len(flood_done)),
    }
    result["flood_prompt_tok_per_s"] = round(result["flood_prompt_tokens_finished"] / end, 1)
    print(f"  {name:>10s}: light {result['light_tok_per_s']:7.1f} tok/s; flood finished "
          f"{len(flood_done)} requests, {result['flood_prompt_tok_per_s']:.0f} prompt tok/s; engine charged "
          f"{result['flood_prompt_charged']:.0f} prompt + {result['flood_output_charged']:.0f} output tokens; "
          f"{result['idle_steps']:.0f} idle steps, {len(light)} light requests; "
          f"{result['steps_per_s']:.0f} steps/s, light {result['light_tokens_per_step']:.2f} tok/step, "
          f"{result['step_ms']:.2f} ms/step; CPU cores: engine {result['cpu']['engine_core']:.2f} "
          f"worker {result['cpu']['worker']:.2f} api {result['cpu']['api_server']:.2f} "
          f"client {result['cpu']['client']:.2f} other {result['cpu']['foreign']:.2f}; "
          f"load {fmt_load(result['load'])}", flush=True)
    return result


def engine_figures(before: dict, after: dict, used: dict, flood_finished: int) -> dict:
    """Engine steps and where the CPU went, over the phase (counters read at its end).

    Rates are per second of the client's monotonic clock over the whole phase
    (never short windows of receive times); tokens per step are on the
    engine's own counters.  The light user's tokens: every generated token
    minus one per finished flood request (max_tokens 1).
    """
    wall = used["wall_s"]
    steps = after["steps"] - before["steps"]
    light = after["generated"] - before["generated"] - flood_finished
    roles = used["servers"][0]
    return {
        "engine_steps": steps,
        "steps_per_s": round(steps / wall, 1) if wall else 0.0,
        "step_ms": round(1000 * wall / steps, 3) if steps else None,
        "light_engine_tokens": light,
        "light_engine_tok_per_s": round(light / wall, 1) if wall else 0.0,
        "light_tokens_per_step": round(light / steps, 3) if steps else 0.0,
        "tokens_per_step": round((after["step_tokens"] - before["step_tokens"]) / steps, 1) if steps else 0.0,
        # CPU in cores (CPU seconds / wall seconds) by process role; "foreign"
        # is the rest of the machine (other tenants of the 2 cores).
        "cpu": {
            **{role: benchkit.as_share(roles[role], wall) for role in roles},
            "client": benchkit.as_share(used["client"], wall),
            "foreign": benchkit.as_share(used["foreign"], wall),
            "busy": benchkit.as_share(used["busy"], wall),
        },
        "engine_core_ms_per_step": round(1000 * roles["engine_core"] / steps, 3) if steps else None,
        "worker_ms_per_step": round(1000 * roles["worker"] / steps, 3) if steps else None,
    }


def bound_check(result: dict, weight: float, rate: float, chunk: int) -> dict:
    w = Fraction(str(weight))
    cost = result["flood_output_charged"] + w * Fraction(result["flood_prompt_charged"])
    bound = (Fraction(str(result["engine_window_s"])) + Fraction(1, 10)) * Fraction(str(rate)) + 1 + math.ceil(
        w * chunk)
    return {"rep": result["rep"], "cost": float(cost), "bound": float(bound), "within": cost <= bound}


async def set_weight(client, limits: Path, args, weight: float) -> None:
    """Rewrite the limits file and wait until the engine reloaded it."""
    reloads = (await read_counters(client))["reloads"]
    write_limits(limits, args.flood_rate, weight)
    deadline = time.monotonic() + 30
    while (await read_counters(client))["reloads"] <= reloads and time.monotonic() < deadline:
        await asyncio.sleep(0.3)


async def run_all(server, args, limits: Path, vocab: int) -> list[dict]:
    """``--reps`` rounds of the three phases, in turn (the machine's load hits all alike)."""
    rng = random.Random(args.seed)
    client = benchkit.async_http(server.base_url, connections=args.flood_streams + 8)
    cpu = benchkit.CpuMeter([server.pid])
    results = []
    async with client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        warm = RequestRecord(user=LIGHT)
        await run_request(client, measure.stream_body(model, LIGHT, 8, [5, 6, 7]), warm, time.monotonic())
        current = 0.0  # the server starts with weight 0
        for rep in range(args.reps):
            for name, weight in ((ALONE, None), ("weight 0", 0.0), (f"weight {args.weight:g}", args.weight)):
                if weight is not None and weight != current:
                    await set_weight(client, limits, args, weight)
                    current = weight
                result = await phase(client, model, name, args, rng, vocab, cpu)
                result["rep"], result["weight"] = rep, weight
                results.append(result)
    return results


def summarise(trials: list[dict], args) -> list[dict]:
    """Per phase: medians over the repetitions, and the bound checked in every trial.

    ``x_alone_per_round``: the light user's rate over its rate alone in the
    same round (the machine's load drifts between rounds more than within one).
    """
    alone_of = {t["rep"]: t["light_tok_per_s"] for t in trials if t["phase"] == ALONE}
    for t in trials:
        alone = alone_of.get(t["rep"])
        t["x_alone_same_round"] = round(t["light_tok_per_s"] / alone, 3) if alone else None
    out = []
    for name in dict.fromkeys(t["phase"] for t in trials):
        ts = [t for t in trials if t["phase"] == name]
        weight = ts[0]["weight"]
        checks = [] if weight is None else [
            bound_check(t, weight, args.flood_rate, args.max_num_batched_tokens) for t in ts]
        out.append({
            "phase": name,
            "weight": weight,
            "n": len(ts),
            "light_tok_per_s": statistics.median(t["light_tok_per_s"] for t in ts),
            "light_tok_per_s_all": [t["light_tok_per_s"] for t in ts],
            "flood_prompt_tok_per_s": statistics.median(t["flood_prompt_tok_per_s"] for t in ts),
            "flood_prompt_charged": statistics.median(t["flood_prompt_charged"] for t in ts),
            "flood_output_charged": statistics.median(t["flood_output_charged"] for t in ts),
            "x_alone_per_round": statistics.median(t["x_alone_same_round"] or 0 for t in ts),
            "steps_per_s": statistics.median(t["steps_per_s"] for t in ts),
            "light_tokens_per_step": statistics.median(t["light_tokens_per_step"] for t in ts),
            "light_engine_tok_per_s": statistics.median(t["light_engine_tok_per_s"] for t in ts),
            "tokens_per_step": statistics.median(t["tokens_per_step"] for t in ts),
            "engine_core_ms_per_step": statistics.median(t["engine_core_ms_per_step"] or 0 for t in ts),
            "cpu": {role: statistics.median(t["cpu"][role] for t in ts) for role in ts[0]["cpu"]},
            "worst_cost_over_bound": max((c["cost"] - c["bound"] for c in checks), default=None),
            "all_within_bound": all(c["within"] for c in checks) if checks else None,
            "checks": checks,
        })
    return out


def report(doc: dict) -> str:
    cfg = doc["config"]
    alone = doc["phases"][0]["light_tok_per_s"] or math.nan
    trial_rows = [
        [str(t["rep"]), t["phase"], f"{t['light_tok_per_s']:.1f}", str(t["flood_requests_finished"]),
         f"{t['flood_prompt_tok_per_s']:.0f}", f"{t['flood_prompt_charged']:.0f}",
         f"{t['flood_output_charged']:.0f}", f"{t['idle_steps']:.0f}", fmt_load(t["load"])]
        for t in doc["trials"]
    ]
    rows = [
        [p["phase"], str(p["n"]), f"{p['light_tok_per_s']:.1f}", f"{p['light_tok_per_s'] / alone:.2f}",
         f"{p['flood_prompt_tok_per_s']:.0f}",
         "-" if p["worst_cost_over_bound"] is None else f"{p['worst_cost_over_bound']:.0f}"]
        for p in doc["phases"]
    ]
    parts = [
        f"flood: {cfg['flood_streams']} streams of {cfg['flood_prompt_tokens']}-token prompts, max_tokens 1, "
        f"{cfg['flood_rate']:g} output tok/s; light: one stream, max_tokens 256, unlimited; "
        f"--max-num-batched-tokens {cfg['max_num_batched_tokens']}; {cfg['duration']:g} s per phase, "
        f"{cfg['reps']} rounds",
        table(["rep", "phase", "light tok/s", "flood done", "flood prompt tok/s", "prompt charged",
               "output charged", "idle steps", "load 1/5/15"], trial_rows),
        table(["phase", "runs", "light tok/s (median)", "x alone", "flood prompt tok/s (median)",
               "worst cost - bound (<= 0: held)"], rows),
        table(["phase", "steps/s", "light tok/step", "tokens/step", "engine-core ms CPU/step",
               "cores: engine", "worker", "api", "client", "rest of machine"],
              [[p["phase"], f"{p['steps_per_s']:.0f}", f"{p['light_tokens_per_step']:.2f}",
                f"{p['tokens_per_step']:.0f}", f"{p['engine_core_ms_per_step']:.2f}",
                *(f"{p['cpu'][role]:.2f}" for role in ("engine_core", "worker", "api_server", "client",
                                                        "foreign"))]
               for p in doc["phases"]]),
        machine_line(doc),
    ]
    return "\n\n".join(parts)


def plot(doc: dict, path: Path, source: Path | None = None) -> None:
    """``source``: the JSON ``doc`` was read from (default: PATH with .json), whose digest the PNG carries."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.2), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    names = [p["phase"] for p in doc["phases"]]
    light = [p["light_tok_per_s"] for p in doc["phases"]]
    bars = left.bar(names, light, color=["C0", "C3", "C2"])
    for bar, value, phase in zip(bars, light, doc["phases"]):
        x = bar.get_x() + bar.get_width() / 2
        left.annotate(f"{value:.0f}", (x, value), ha="center", va="bottom")
        runs = phase["light_tok_per_s_all"]
        left.scatter([x] * len(runs), runs, color="k", s=12, zorder=3)
    left.set_ylabel("light user's output tok/s (bar: median; dots: runs)")
    loads = [t["load"][0] for t in doc["trials"]]
    left.set_title(f"Light user beside the flood\n(1-min load {min(loads):.0f}-{max(loads):.0f} on "
                   f"{doc['machine']['nproc']} cores)", fontsize=10)
    flood = [p["flood_prompt_tok_per_s"] for p in doc["phases"][1:]]
    bars = right.bar(names[1:], flood, color=["C3", "C2"])
    for bar, value in zip(bars, flood):
        right.annotate(f"{value:.0f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    right.set_ylabel("flood's prompt tok/s (finished requests)")
    right.set_title(f"Flood at {doc['config']['flood_rate']:g} tok/s")
    fig.tight_layout()
    fig.savefig(path, metadata=figure_metadata(source or sibling_json(path)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--out", default=str(RESULTS_DIR / "prompt_flood"), help="output prefix")
    parser.add_argument("--weight", type=float, default=0.5, help="input_token_weight of the last phase")
    parser.add_argument("--flood-rate", type=float, default=20.0, help="the flood's output tok/s")
    parser.add_argument("--flood-streams", type=int, default=8)
    parser.add_argument("--flood-prompt-tokens", type=int, default=525)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the chunk size C (default 2048, vLLM's CPU default for a server)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--reps", type=int, default=3, help="rounds of the three phases")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    args = parser.parse_args(argv)

    log_dir = benchkit.log_dir_for("prompt-flood", args.log_dir)
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    limits = log_dir / "limits.json"
    write_limits(limits, args.flood_rate, 0)
    server_args = [
        "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "16",
        "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--enable-chunked-prefill",
        "--output-rate-limits-file", str(limits),
    ]
    doc = benchkit.start_report(SCHEMA, args, server_args)
    print(f"starting server: {shlex.join(server_args)}", flush=True)
    with benchkit.running_engines([("prompt-flood", server_args)], log_dir, model=args.model) as (server,):
        doc["startup_s"] = server.startup_s
        doc["trials"] = asyncio.run(run_all(server, args, limits, vocab))
    benchkit.finish_report(doc)
    doc["phases"] = summarise(doc["trials"], args)
    alone = doc["phases"][0]["light_tok_per_s"]
    doc["light_ratio"] = {p["phase"]: round(p["light_tok_per_s"] / alone, 3) if alone else None
                          for p in doc["phases"][1:]}
    print("\n" + report(doc))
    benchkit.write_outputs(doc, args.out, plot=plot)
    errors = sum(len(t["light_errors"]) + len(t["flood_errors"]) for t in doc["trials"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
