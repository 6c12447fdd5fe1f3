#!/usr/bin/env python
"""KV cache held by a throttled user must not block other users.

What
    One server on the tiny model with a deliberately small KV cache
    (``--num-gpu-blocks-override N``; the CPU build honours it, which the
    script checks from ``/metrics`` ``vllm:cache_config_info``) and
    ``--max-num-seqs 16 --max-num-active-seqs 8``.  User ``A`` is limited to
    5 tok/s; every other user gets 100000 tok/s (never hit).

    * ``A`` opens several long streams (default 7 x 300-token prompts,
      ``max_tokens`` 80).  Residency follows the rate (issue 32,
      ``policy/residency.py``): only max(1, floor(5 / p)) of them become
      resident (p = A's ``min_stream_tokens_per_second``, default 2: 2
      streams), the rest wait un-admitted holding no KV.  Without that rule
      (``--a-min-pace 0``) all seven stay resident, throttled, holding
      7 x ceil(300/128) = 21 of the 24 blocks (one of which vLLM keeps as its
      null block) when the CPU block size is 128.
    * ``B`` sends one streaming request (default 450 tokens + 16 generated =
      4 blocks); with all of A's streams resident that is more than is free,
      so admitting it would require evicting one of them.

    Measured: B's time to first token (TTFT, client side, from sending the
    request to the first streamed token) when B is **alone** (nothing else on
    the server) and **beside A** (pressure; KV usage from
    ``vllm:kv_cache_usage_perc`` just before B is sent).  Repeated ``--reps``
    times (default 20).  Reported for B: TTFT p50 / p90 / max and failures
    (no first token within ``--b-timeout``) per condition; for A: its tokens/s
    over each pressure trial against its limit, its resident requests over
    time (``vllm:output_rate_requests{user="A", state="active|throttled"}``,
    polled every ``--poll-s``; the engine refreshes it about once a second)
    against the bound floor(rate / p) + 1, its own first-token times (the
    price of waiting un-admitted; a stream still without a token when its
    trial ends is counted apart), and recompute per output token over the
    run.  Targets (issue 32): B beside A with **0 failures** and TTFT p90
    <= 2 x B alone's p90; A at >= 0.95 x its limit; A's resident requests
    within the bound at every sample.  A target is met only with 0 failures.
    Also per trial: requests running / waiting before and right after B,
    B's total latency.

    Evidence that B got in by evicting A (not by luck): in every trial one
    ``/metrics`` read right after B finished (A still running) gives requests
    running / waiting and KV usage; with eviction, one of A's streams is
    waiting and KV usage dropped by its blocks.  One extra, untimed pressure
    trial then leaves A running ``--diagnostic-linger`` seconds after B to
    check that the evicted stream comes back (nothing left waiting, every A
    stream gets tokens in rotation); a WARNING line is printed when it does
    not.  ``vllm:num_preemptions_total`` is reported
    too, but vLLM counts a preemption only when the preempted request's next
    output reaches the API server, so an evicted stream that is cancelled
    before resuming never shows up there.

How
    On this 2-core testbed the client-side TTFT is bimodal (~15 ms or
    ~50 ms in either condition): B's whole generation takes ~50 ms, and
    whether its first token reaches the client on its own or together with
    the rest depends on when the CPU-starved API server flushes the stream.
    Hence the medians over several repetitions, and B's total latency (last
    token) as a steadier second figure.

    Every prompt is a list of random token ids (exact length, and no two
    prompts share a prefix, so the prefix cache plays no part).  The two
    conditions alternate (alone, pressure, pressure, alone, ...), so the
    machine's load hits both alike.  A pressure trial starts A's streams,
    waits until the KV usage reaches what A's prompts need (or
    ``--hold-timeout``), sends B, and after B finishes cancels A's streams
    and waits for the server to drain (``num_requests_running`` = 0).  B
    waits at most ``--b-timeout`` seconds; a B that got no token by then
    counts as a failure (TTFT = the timeout, reported).  Load averages are
    recorded before/after and for every trial.

    If the override were not honoured (block count in ``/metrics`` differs),
    the run still happens and the mismatch is reported: KV would then be
    limited by ``VLLM_CPU_KVCACHE_SPACE`` (GiB) and ``--max-model-len``.

Usage::

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/kv_pressure.py

writes ``docs/benchmarks/kv_pressure.json`` and ``.png`` (``--out PREFIX`` elsewhere); about
60-90 s of startup plus a few seconds per trial, ~2 min by default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

from vllm_output_rate.policy.residency import DEFAULT_MIN_STREAM_TOKENS_PER_SECOND, residency_cap
from vllm_output_rate.settings import MIN_PACE_KEY
from vllm_output_rate.tools import measure
from vllm_output_rate.tools.render import figure_metadata, sibling_json
from vllm_output_rate.tools.measure import FINISHED, RequestRecord, metric_sum, percentile, run_request
from vllm_output_rate.tools.serverproc import DEFAULT_MODEL_DIR
from vllm_output_rate_harness import benchkit
from vllm_output_rate_harness.benchkit import RESULTS_DIR, fmt_load, loadavg, machine_line, table
from vllm_output_rate_harness.churn import SERVE_WITH_CHURN, churn_costs, churn_line, recompute_figures

benchkit.use_cpu_testbed_env()

SCHEMA = "vllm-output-rate-kv-pressure/2"
TARGET_RATIO = 2.0  # B beside A: TTFT p90 <= this x B alone's p90 (and the old median ratio)
TARGET_A_RATE = 0.95  # A's tokens/s over a pressure trial, as a fraction of its limit
USER_REQUESTS = "vllm:output_rate_requests"
ALONE, PRESSURE = "alone", "pressure"
USER_A, USER_B = "A", "B"


async def get_metrics(client: httpx.AsyncClient) -> dict:
    return await measure.fetch_metrics_async(client)


def gauges(m: dict) -> dict:
    return {
        "kv_cache_usage": metric_sum(m, "vllm:kv_cache_usage_perc"),
        "running": metric_sum(m, measure.RUNNING_GAUGE),
        "waiting": metric_sum(m, measure.WAITING_GAUGE),
        "preemptions": metric_sum(m, measure.PREEMPTIONS),
    }


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    # Ids 3.. avoid pad/bos/eos (0/1/2) of the tiny Llama.
    return [rng.randrange(3, vocab) for _ in range(length)]


def body(model: str, user: str, prompt: list[int], max_tokens: int) -> dict:
    return measure.stream_body(model, user, max_tokens, prompt)


def a_resident(m: dict) -> float | None:
    """A's resident requests (running or throttled, holding KV) per the engine's report."""
    parts = [metric_sum(m, USER_REQUESTS, user=USER_A, state=state) for state in ("active", "throttled")]
    return None if all(p is None for p in parts) else sum(p or 0 for p in parts)


async def poll_residency(client: httpx.AsyncClient, t0: float, period_s: float, out: list) -> None:
    """Append (t, A resident, KV usage) every ``period_s`` until cancelled."""
    while True:
        try:
            m = await get_metrics(client)
        except httpx.HTTPError:  # a slow /metrics read on a loaded machine: no sample
            m = {}
        out.append((round(time.monotonic() - t0, 3), a_resident(m), metric_sum(m, "vllm:kv_cache_usage_perc")))
        await asyncio.sleep(period_s)


async def wait_drained(client: httpx.AsyncClient, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        g = gauges(await get_metrics(client))
        if (g["running"] or 0) == 0 and (g["waiting"] or 0) == 0:
            return g
        if time.monotonic() > deadline:
            return g
        await asyncio.sleep(0.2)


async def run_b(client, model: str, prompt: list[int], args, t0: float) -> tuple[RequestRecord, bool]:
    record = RequestRecord(user=USER_B, stream=0, start=time.monotonic() - t0)
    task = asyncio.create_task(run_request(client, body(model, USER_B, prompt, args.b_max_tokens), record, t0))
    done, _ = await asyncio.wait({task}, timeout=args.b_timeout)
    timed_out = not done
    if timed_out:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return record, timed_out


async def trial(
    client, model: str, condition: str, rng: random.Random, args, info: dict, diagnostic: bool = False
) -> dict:
    result: dict = {"condition": condition, "load": loadavg()}
    t0 = time.monotonic()
    a_records: list[RequestRecord] = []
    a_tasks: list[asyncio.Task] = []
    residency: list = []  # (t, A resident, KV usage) while A runs
    poller = None
    if condition == PRESSURE:
        for i in range(args.a_streams):
            rec = RequestRecord(user=USER_A, stream=i, start=time.monotonic() - t0)
            a_records.append(rec)
            prompt = random_prompt(rng, args.a_prompt_tokens, info["vocab"])
            a_tasks.append(asyncio.create_task(
                run_request(client, body(model, USER_A, prompt, args.a_max_tokens), rec, t0)))
        poller = asyncio.create_task(poll_residency(client, t0, args.poll_s, residency))
        # Wait until A's admitted prompts are resident (KV usage reaches what
        # they need): as many as its residency cap lets in.
        want = info["a_blocks_expected"] / info["num_blocks"] * 0.999
        deadline = time.monotonic() + args.hold_timeout
        while True:
            try:
                g = gauges(await get_metrics(client))
            except httpx.HTTPError:  # retried until the hold timeout
                g = {"kv_cache_usage": None, "running": None}
            if (g["kv_cache_usage"] or 0) >= want and (g["running"] or 0) >= info["a_resident_expected"]:
                break
            if time.monotonic() > deadline:
                result["hold_timeout"] = True
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(args.hold_extra)  # let A's streams settle into throttling
    before = gauges(await get_metrics(client))
    result["before_b"] = before
    b_prompt = random_prompt(rng, args.b_prompt_tokens, info["vocab"])
    b, timed_out = await run_b(client, model, b_prompt, args, t0)
    # Read once right after B (A still running): with eviction, one of A's
    # streams is waiting and KV usage dropped by its blocks.
    after = gauges(await get_metrics(client))
    result["after_b"] = after
    result["preemptions_during_b"] = (
        None if after["preemptions"] is None or before["preemptions"] is None
        else after["preemptions"] - before["preemptions"]
    )
    result["b_timed_out"] = timed_out
    result["b_status"] = b.status
    result["b_error"] = b.error
    result["b_tokens"] = len(b.token_times)
    result["b_usage_ok"] = b.completion_tokens == len(b.token_times) if b.status == FINISHED else None
    result["ttft_s"] = (b.token_times[0] - b.start) if b.token_times else None
    result["ttft_or_timeout_s"] = result["ttft_s"] if result["ttft_s"] is not None else args.b_timeout
    result["b_latency_s"] = (b.token_times[-1] - b.start) if b.token_times else None
    if condition == PRESSURE and diagnostic:
        # Leave A running a little: the evicted stream must come back (it is
        # re-admitted when A has quota again) and nothing may stay waiting.
        counts_before = [len(r.token_times) for r in a_records]
        await asyncio.sleep(args.diagnostic_linger)
        result["after_linger"] = gauges(await get_metrics(client))
        result["a_streams_with_tokens_after_linger"] = sum(1 for r in a_records if r.token_times)
        gained = [len(r.token_times) - c for r, c in zip(a_records, counts_before)]
        result["a_tokens_gained_per_stream_during_linger"] = gained
        # With rotation, each of A's streams gets about rate / streams tok/s.
        result["a_streams_starved_during_linger"] = sum(1 for g in gained if g == 0)
    if condition == PRESSURE:
        if args.a_linger > 0 and not diagnostic:
            await asyncio.sleep(args.a_linger)  # A's rate and residency over a longer run
        still = sum(1 for t in a_tasks if not t.done())
        end = time.monotonic() - t0
        for t in a_tasks:
            t.cancel()
        await asyncio.gather(*a_tasks, return_exceptions=True)
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        result["a_streams_in_flight_at_b_end"] = still
        result["a_tokens"] = sum(len(r.token_times) for r in a_records)
        result["a_errors"] = [r.error for r in a_records if r.error and r.status != "cancelled"]
        result["a_tokens_per_s"] = round(result["a_tokens"] / (time.monotonic() - t0), 2)
        # From A's first token to the trial's end: the rate it was held to.
        firsts = [r.token_times[0] for r in a_records if r.token_times]
        if firsts and end > min(firsts):
            span = end - min(firsts)
            result["a_rate_span_s"] = round(span, 3)
            result["a_tokens_per_s_paced"] = round(result["a_tokens"] / span, 3)
        result["a_ttft_s"] = [round(r.token_times[0] - r.start, 4) for r in a_records if r.token_times]
        result["a_without_token"] = sum(1 for r in a_records if not r.token_times)
        result["a_resident_samples"] = residency
    result["finished_requests"] = (b.status == FINISHED) + sum(1 for r in a_records if r.status == FINISHED)
    result["drained"] = await wait_drained(client, 30)
    result["load_end"] = loadavg()
    return result


async def run_all(server, args, info: dict) -> list[dict]:
    rng = random.Random(args.seed)
    client = benchkit.async_http(server.base_url, connections=args.a_streams + 8)
    trials = []
    async with client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        # One untimed warm-up request (first-request overheads).
        await run_b(client, model, random_prompt(rng, args.b_prompt_tokens, info["vocab"]), args, time.monotonic())
        info["metrics_at_start"] = await get_metrics(client)
        info["preemptions_at_start"] = gauges(info["metrics_at_start"])["preemptions"]
        await wait_drained(client, 30)
        for rep in range(args.reps):
            order = (ALONE, PRESSURE) if rep % 2 == 0 else (PRESSURE, ALONE)
            for condition in order:
                r = await trial(client, model, condition, rng, args, info)
                r["rep"] = rep
                trials.append(r)
                ttft = "none" if r["ttft_s"] is None else f"{r['ttft_s'] * 1000:.0f} ms"
                print(f"  rep {rep} {condition:8s} B ttft {ttft:>8s}  KV before B "
                      f"{(r['before_b']['kv_cache_usage'] or 0) * 100:5.1f} %  running {r['before_b']['running']:.0f} "
                      f"waiting {r['before_b']['waiting']:.0f}  load {r['load']}", flush=True)
        # Untimed: one more pressure trial with a longer B while /metrics is polled.
        diag = await trial(client, model, PRESSURE, rng, args, info, diagnostic=True)
        print(f"  diagnostic pressure trial (untimed): after B {diag['after_b']}, "
              f"after {args.diagnostic_linger:g} s {diag.get('after_linger')}, "
              f"A tokens per stream meanwhile {diag.get('a_tokens_gained_per_stream_during_linger')}", flush=True)
        info["diagnostic"] = diag
    return trials


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def analyse(trials: list[dict], a_limit: float = 5.0, a_bound: int | None = None) -> dict:
    out: dict = {}
    for cond in (ALONE, PRESSURE):
        ts = [t for t in trials if t["condition"] == cond]
        vals = [t["ttft_or_timeout_s"] for t in ts]
        kv = [t["before_b"]["kv_cache_usage"] for t in ts if t["before_b"]["kv_cache_usage"] is not None]
        out[cond] = {
            "n": len(ts),
            "b_failures": sum(1 for t in ts if t["ttft_s"] is None or t["b_status"] != FINISHED),
            "ttft_median_s": statistics.median(vals) if vals else None,
            "ttft_p90_s": percentile(vals, 90),
            "ttft_min_s": min(vals) if vals else None,
            "ttft_max_s": max(vals) if vals else None,
            "kv_usage_before_b_median": statistics.median(kv) if kv else None,
            "preemptions_during_b_total": sum(t["preemptions_during_b"] or 0 for t in ts),
            "b_latency_median_s": statistics.median([t["b_latency_s"] for t in ts if t["b_latency_s"] is not None] or [math.nan]),
        }
    for cond in (ALONE, PRESSURE):
        out[cond]["ttft_p50_s"] = out[cond]["ttft_median_s"]
    ratio = None
    if out[ALONE]["ttft_median_s"] and out[PRESSURE]["ttft_median_s"] is not None:
        ratio = out[PRESSURE]["ttft_median_s"] / out[ALONE]["ttft_median_s"]
    out["ratio_median_ttft"] = ratio
    lat_a, lat_p = out[ALONE]["b_latency_median_s"], out[PRESSURE]["b_latency_median_s"]
    out["ratio_median_b_latency"] = (lat_p / lat_a) if lat_a and not math.isnan(lat_a) and not math.isnan(lat_p) else None
    out["target_ratio"] = TARGET_RATIO
    out["a"] = analyse_a(trials, a_limit, a_bound)
    p90_a, p90_p = out[ALONE]["ttft_p90_s"], out[PRESSURE]["ttft_p90_s"]
    failures = out[ALONE]["b_failures"] + out[PRESSURE]["b_failures"]
    checks = {
        "b_zero_failures": failures == 0,
        "b_p90_within_ratio_of_alone": None if not p90_a or p90_p is None else p90_p <= TARGET_RATIO * p90_a,
        "a_rate_at_limit": out["a"]["meets_rate"],
        "a_resident_within_bound": out["a"]["within_bound"],
    }
    out["targets"] = checks
    out["ratio_p90_ttft"] = None if not p90_a or p90_p is None else p90_p / p90_a
    # Met only with 0 failures, and every other check known and passed.
    out["meets_target"] = failures == 0 and all(v is True for v in checks.values())
    return out


def analyse_a(trials: list[dict], limit: float, bound: int | None) -> dict:
    """A's rate against its limit, its resident requests against the bound,
    and its own first-token times, over the pressure trials."""
    ts = [t for t in trials if t["condition"] == PRESSURE]
    rates = [t["a_tokens_per_s_paced"] for t in ts if t.get("a_tokens_per_s_paced") is not None]
    samples = [s for t in ts for s in t.get("a_resident_samples") or [] if s[1] is not None]
    resident = [s[1] for s in samples]
    ttfts = [x for t in ts for x in t.get("a_ttft_s") or []]
    worst_rate = min(rates) if rates else None
    return {
        "limit": limit,
        "bound": bound,
        "tokens_per_s_median": statistics.median(rates) if rates else None,
        "tokens_per_s_min": worst_rate,
        "rate_ratio_min": None if worst_rate is None else worst_rate / limit,
        "meets_rate": None if worst_rate is None else worst_rate >= TARGET_A_RATE * limit,
        "resident_samples": len(resident),
        "resident_max": max(resident) if resident else None,
        "resident_median": statistics.median(resident) if resident else None,
        "within_bound": None if not resident else (bound is None or max(resident) <= bound),
        "ttft_n": len(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_max_s": max(ttfts) if ttfts else None,
        "streams_without_token": sum(t.get("a_without_token", 0) for t in ts),
        "streams": sum(len(t.get("a_ttft_s") or []) + t.get("a_without_token", 0) for t in ts),
    }


def ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def report(doc: dict) -> str:
    info, a = doc["kv"], doc["analysis"]
    parts = [
        f"KV cache: {info['num_blocks']} blocks x {info['block_size']} tokens "
        f"(override requested {doc['config']['blocks']}: {'honoured' if info['override_honoured'] else 'NOT honoured'}); "
        f"A: {doc['config']['a_streams']} streams x {doc['config']['a_prompt_tokens']} prompt tokens "
        f"= {info['a_blocks_expected']} blocks expected, limit {doc['config']['a_rate']:g} tok/s; "
        f"B: {doc['config']['b_prompt_tokens']} prompt + {doc['config']['b_max_tokens']} tokens "
        f"= {info['b_blocks_needed']} blocks"
    ]
    rows = [
        [str(t["rep"]), t["condition"], ms(t["ttft_s"]), ms(t["b_latency_s"]),
         f"{(t['before_b']['kv_cache_usage'] or 0) * 100:.1f}",
         f"{t['before_b']['running']:.0f}/{t['before_b']['waiting']:.0f}",
         f"{t['after_b']['running']:.0f}/{t['after_b']['waiting']:.0f}",
         f"{(t['after_b']['kv_cache_usage'] or 0) * 100:.1f}",
         t["b_status"], fmt_load(t["load"])]
        for t in doc["trials"]
    ]
    parts.append(table(["rep", "condition", "B TTFT ms", "B latency ms", "KV % before B",
                        "running/waiting before B", "running/waiting after B", "KV % after B",
                        "B status", "load 1/5/15"], rows))
    parts.append("(after B = one /metrics read right after B finished, A still running; A's "
                 f"streams beyond its residency cap ({info.get('a_resident_expected')}) wait un-admitted)")
    diag = info.get("diagnostic")
    if diag and diag.get("after_linger"):
        d = diag["after_b"]
        parts.append(
            f"diagnostic pressure trial (untimed): KV before B "
            f"{(diag['before_b']['kv_cache_usage'] or 0) * 100:.1f} % with {diag['before_b']['running']:.0f} running; "
            f"right after B running {d['running']:.0f} / waiting {d['waiting']:.0f}, "
            f"KV {(d['kv_cache_usage'] or 0) * 100:.1f} %; B TTFT {ms(diag['ttft_s'])} ms; "
            f"{doc['config']['diagnostic_linger']:g} s after B: running {diag['after_linger']['running']}, "
            f"waiting {diag['after_linger']['waiting']}, KV {(diag['after_linger']['kv_cache_usage'] or 0) * 100:.1f} %, "
            f"A tokens per stream during those {doc['config']['diagnostic_linger']:g} s "
            f"{diag['a_tokens_gained_per_stream_during_linger']}, A errors {len(diag.get('a_errors') or [])}"
        )
        unadmitted = doc["config"]["a_streams"] - info.get("a_resident_expected", doc["config"]["a_streams"])
        if (diag["a_streams_starved_during_linger"] > unadmitted
                or (diag["after_linger"]["waiting"] or 0) > unadmitted):
            parts.append(
                f"WARNING: {diag['a_streams_starved_during_linger']} of A's streams got no token in "
                f"{doc['config']['diagnostic_linger']:g} s while its other streams did, and "
                f"{diag['after_linger']['waiting']:.0f} request(s) still waiting, more than the "
                f"{unadmitted} its residency cap keeps un-admitted"
            )
    parts.append(
        f"vllm:num_preemptions_total over the trials: {info.get('preemptions_at_start')} -> "
        f"{info.get('preemptions_at_end')} (counted by the API server when the preempted "
        "request's next output arrives, so aborted requests may never show up)"
    )
    srows = []
    for cond in (ALONE, PRESSURE):
        s = a[cond]
        srows.append([cond, str(s["n"]), ms(s["ttft_p50_s"]), ms(s["ttft_p90_s"]), ms(s["ttft_min_s"]),
                      ms(s["ttft_max_s"]), ms(s["b_latency_median_s"]), str(s["b_failures"]),
                      "-" if s["kv_usage_before_b_median"] is None else f"{s['kv_usage_before_b_median'] * 100:.1f}"])
    parts.append(table(["condition", "n", "TTFT p50 ms", "p90", "min", "max", "B latency median ms", "B failures",
                        "KV % before B (median)"], srows))
    aa = a.get("a")
    if aa:
        parts.append(
            f"A (limit {aa['limit']:g} tok/s, resident bound floor(rate / min pace) + 1 = {aa['bound']}): "
            f"tok/s over each pressure trial median {aa['tokens_per_s_median']} / min {aa['tokens_per_s_min']} "
            f"(target >= {TARGET_A_RATE:g} x limit); resident requests max {aa['resident_max']} / median "
            f"{aa['resident_median']} over {aa['resident_samples']} samples; first token p50 / p90 / max "
            f"{ms(aa['ttft_p50_s'])} / {ms(aa['ttft_p90_s'])} / {ms(aa['ttft_max_s'])} ms over "
            f"{aa['ttft_n']} streams, {aa['streams_without_token']} of {aa['streams']} streams had no token "
            f"when their trial ended (waiting un-admitted)")
    if a.get("targets"):
        checks = ", ".join(f"{k} {v}" for k, v in a["targets"].items())
        parts.append(f"targets: {checks} -> {'met' if a['meets_target'] else 'NOT met'} "
                     f"(met only with 0 failures)"
                     + (f"; TTFT p90 ratio beside A / alone = {a['ratio_p90_ttft']:.2f}"
                        if a.get("ratio_p90_ttft") is not None else ""))
    if a["ratio_median_ttft"] is not None:
        verdict = "meets" if a["meets_target"] else "MISSES"
        parts.append(f"median TTFT ratio pressure/alone = {a['ratio_median_ttft']:.2f} "
                     f"({verdict} target <= {TARGET_RATIO:g})"
                     + (f"; median B latency (all {doc['config']['b_max_tokens']} tokens) ratio "
                        f"{a['ratio_median_b_latency']:.2f}" if a.get("ratio_median_b_latency") else ""))
    if doc.get("churn"):
        parts.append(churn_line(doc["churn"]))
    parts.append(machine_line(doc))
    return "\n\n".join(parts)


def plot(doc: dict, path: Path, source: Path | None = None) -> None:
    """``source``: the JSON ``doc`` was read from (default: PATH with .json), whose digest the PNG carries."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, (cond, color) in enumerate(((ALONE, "C0"), (PRESSURE, "C3"))):
        vals = [t["ttft_or_timeout_s"] * 1000 for t in doc["trials"] if t["condition"] == cond]
        xs = [i + 0.06 * (j - len(vals) / 2) for j in range(len(vals))]
        ax.scatter(xs, vals, color=color, alpha=0.7)
        med = doc["analysis"][cond]["ttft_median_s"]
        if med is not None:
            ax.hlines(med * 1000, i - 0.3, i + 0.3, color=color, label=f"{cond} median {med * 1000:.0f} ms")
    alone = doc["analysis"][ALONE]["ttft_median_s"]
    if alone:
        ax.axhline(alone * 1000 * TARGET_RATIO, color="k", linestyle="--", linewidth=1,
                   label=f"target: {TARGET_RATIO:g} x alone median")
    ax.set_xticks([0, 1], ["B alone", f"B while A holds KV\n(median {(doc['analysis'][PRESSURE]['kv_usage_before_b_median'] or 0) * 100:.0f} % used)"])
    ax.set_ylabel("B time to first token (ms)")
    ax.set_ylim(bottom=0)
    ratio = doc["analysis"]["ratio_median_ttft"]
    ax.set_title("Unlimited user's TTFT under KV pressure from a throttled user"
                 + (f" - ratio {ratio:.2f}" if ratio is not None else ""))
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path), metadata=figure_metadata(source or sibling_json(path)))


def a_limit(args) -> float | dict:
    """A's entry of ``--user-output-tokens-per-second``: its rate, with its
    own minimum pace when one is asked for."""
    if args.a_min_pace is None:
        return args.a_rate
    return {"rate": args.a_rate, MIN_PACE_KEY: args.a_min_pace}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="TTFT of an unlimited user alone vs while a throttled user holds most KV blocks.")
    parser.add_argument("--out", default=str(RESULTS_DIR / "kv_pressure"), metavar="PREFIX",
                        help="writes PREFIX.json and PREFIX.png (default: %(default)s)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model path (default: tiny model)")
    parser.add_argument("--blocks", type=int, default=24, help="--num-gpu-blocks-override (default 24)")
    parser.add_argument("--a-rate", type=float, default=5.0, help="user A's limit, tok/s (default 5)")
    parser.add_argument("--a-streams", type=int, default=7, help="A's concurrent streams (default 7)")
    parser.add_argument("--a-prompt-tokens", type=int, default=300, help="A's prompt length (default 300)")
    parser.add_argument("--a-max-tokens", type=int, default=80, help="A's max_tokens (default 80)")
    parser.add_argument("--b-prompt-tokens", type=int, default=450, help="B's prompt length (default 450)")
    parser.add_argument("--b-max-tokens", type=int, default=16, help="B's max_tokens (default 16)")
    parser.add_argument("--diagnostic-linger", type=float, default=8.0,
                        help="seconds A keeps running after B in the diagnostic trial (default 8)")
    parser.add_argument("--b-timeout", type=float, default=30.0, help="seconds B may take (default 30)")
    parser.add_argument("--hold-timeout", type=float, default=20.0,
                        help="seconds to wait for A's streams to hold their blocks (default 20)")
    parser.add_argument("--hold-extra", type=float, default=1.0,
                        help="extra seconds after A holds its blocks, before B (default 1)")
    parser.add_argument("--reps", type=int, default=20, help="repetitions of each condition (default 20)")
    parser.add_argument("--a-min-pace", type=float, default=None,
                        help="A's min_stream_tokens_per_second (default: the plugin's default; 0: no "
                             "residency cap, all of A's streams resident as before issue 32)")
    parser.add_argument("--a-linger", type=float, default=2.0,
                        help="seconds A keeps running after B in each pressure trial, for its rate "
                             "and residency figures (default 2)")
    parser.add_argument("--poll-s", type=float, default=0.5,
                        help="period of the /metrics reads of A's resident requests (default 0.5)")
    parser.add_argument("--seed", type=int, default=0, help="random prompts' seed")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra vllm serve argument, repeatable")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    args = parser.parse_args(argv)

    log_dir = benchkit.log_dir_for("kv-pressure", args.log_dir)
    config = json.loads((Path(args.model) / "config.json").read_text())
    server_args = [
        "--num-gpu-blocks-override", str(args.blocks),
        "--max-num-seqs", "16",
        "--max-num-active-seqs", "8",
        "--default-user-output-tokens-per-second", "100000",
        "--user-output-tokens-per-second", json.dumps({USER_A: a_limit(args)}),
        *args.server_arg,
    ]
    doc = benchkit.start_report(SCHEMA, args, server_args)
    print(f"starting server: {shlex.join(server_args)}", flush=True)
    # INFO logs: the engine logs the KV cache size it allocated (cross-check).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    with benchkit.running_engines([("kv-pressure", server_args)], log_dir, model=args.model,
                                  command=SERVE_WITH_CHURN) as (server,):
        doc["startup_s"] = server.startup_s
        doc["server_log"] = str(server.log_path)
        log_text = server.log_path.read_text(errors="replace")
        logged = re.search(r"KV cache size: ([\d,]+) tokens", log_text)
        doc["logged_kv_cache_tokens"] = int(logged.group(1).replace(",", "")) if logged else None
        doc["logged_override"] = next(
            (line.split("]", 1)[-1].strip() for line in log_text.splitlines() if "num_gpu_blocks_override" in line),
            None,
        )
        m = measure.parse_metrics(server.metrics())
        cache_info = (m.get("vllm:cache_config_info") or [({}, 0)])[0][0]
        num_blocks = int(float(cache_info.get("num_gpu_blocks", args.blocks)))
        block_size = int(float(cache_info.get("block_size", 16)))
        pace = DEFAULT_MIN_STREAM_TOKENS_PER_SECOND if args.a_min_pace is None else args.a_min_pace
        cap = residency_cap(args.a_rate, pace)
        a_resident_expected = args.a_streams if cap is None else min(args.a_streams, cap)
        a_bound = None if cap is None else math.floor(args.a_rate / pace) + 1
        info = {
            "cache_config_info": cache_info,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "override_honoured": num_blocks == args.blocks,
            "vocab": int(config["vocab_size"]),
            # A request holds ceil(tokens / block_size) blocks; A's prompts
            # plus their first tokens, B's prompt plus all its tokens.
            "a_resident_expected": a_resident_expected,
            "a_resident_bound": a_bound,
            "a_blocks_expected": a_resident_expected * math.ceil((args.a_prompt_tokens + 1) / block_size),
            "b_blocks_needed": math.ceil((args.b_prompt_tokens + args.b_max_tokens) / block_size),
        }
        if doc["logged_kv_cache_tokens"] is not None:
            info["logged_blocks"] = doc["logged_kv_cache_tokens"] // block_size
            info["override_honoured"] = info["override_honoured"] and info["logged_blocks"] == args.blocks
        info["free_blocks_while_a_holds"] = num_blocks - 1 - info["a_blocks_expected"]  # -1: null block
        info["b_needs_eviction"] = info["b_blocks_needed"] > info["free_blocks_while_a_holds"]
        doc["kv"] = info
        print(f"server up in {doc['startup_s']:.0f} s; KV {info}", flush=True)
        doc["trials"] = asyncio.run(run_all(server, args, info))
        metrics_end = measure.parse_metrics(server.metrics())
        doc["kv"]["preemptions_at_end"] = gauges(metrics_end)["preemptions"]
        every_trial = doc["trials"] + [info["diagnostic"]]
        doc["churn"] = churn_costs(recompute_figures(info.pop("metrics_at_start"), metrics_end),
                                   sum(t.get("finished_requests", 0) for t in every_trial))
        doc["server_log_tail"] = server.log_tail(40)
    benchkit.finish_report(doc)
    doc["analysis"] = analyse(doc["trials"], args.a_rate, doc["kv"].get("a_resident_bound"))
    print("\n" + report(doc))
    benchkit.write_outputs(doc, args.out, plot=plot)
    failures = doc["analysis"][ALONE]["b_failures"] + doc["analysis"][PRESSURE]["b_failures"]
    return 1 if failures or not doc["analysis"]["meets_target"] else 0


if __name__ == "__main__":
    sys.exit(main())
