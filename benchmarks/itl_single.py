#!/usr/bin/env python
"""Single-stream inter-token latency: limits never hit vs the feature off.

What
    One client, one streaming completion at a time (``ignore_eos``,
    ``--max-tokens`` tokens each), against two servers on the same model:

    * ``stock``:  ``vllm-output-rate serve MODEL`` (plugin off: vLLM's own
      scheduler, engine loop and 1 s worker spin);
    * ``plugin``: the same plus ``--default-user-output-tokens-per-second
      100000`` (every token goes through the limiter and the shortened
      worker spin of ``adapter/worker_idle.py``; nobody is ever throttled).

    The figure is measured on the server, not on client receive times (a
    streaming client on this 2-core box stalls up to ~1 s under load and
    delivers tokens in bunches): requests run strictly one after another, and
    around each one the script reads ``vllm:inter_token_latency_seconds``
    ``_sum`` and ``_count`` from ``/metrics``.  Their deltas are that
    request's exact mean inter-token latency on the engine core's own output
    timestamps (vLLM stamps ``EngineCoreOutputs.timestamp`` in the engine
    process; the histogram's sum and count are not bucketed).  Per side the
    headline is the median over all requests of these per-request means
    ("ITL p50"), compared plugin / stock (target: within 3 %).  The client's
    own receive-gap p50 is reported beside it for reference only.

How
    Both servers are started first and stay up; then blocks of
    ``--requests`` requests alternate between them (S P, P S, S P, ...), so
    that the shared machine's load, which drifts by tens of percent within
    minutes here, hits both sides alike and only two server startups are
    paid.  The server not being measured is idle (a stock worker stops
    spinning 1 s after its last step; each block starts after a 1.5 s pause).
    The first ``--warmup-requests`` requests of every block are discarded.
    Per block: load averages and the CPU used by both servers' process trees
    and by other processes ("foreign"); compare them before trusting a small
    difference.  Servers are stopped by PID at the end.

Usage::

    VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        .venv/bin/python benchmarks/itl_single.py --out results/itl_single

writes ``results/itl_single.json``; two server startups (~1-2 min each) plus
``--blocks`` x 2 blocks of ~10-20 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import common  # noqa: E402  (benchmarks/common.py)

common.use_cpu_testbed_env()

import httpx  # noqa: E402
import psutil  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from common import fmt_load, loadavg, machine_line, start_report, table  # noqa: E402
from vllm_output_rate.tools.bench import DEFAULT_PROMPT, RequestRecord, run_request  # noqa: E402
from vllm_output_rate.tools.serverproc import DEFAULT_MODEL_DIR, running_server  # noqa: E402

SCHEMA = "vllm-output-rate-itl-single/1"
TARGET_RATIO = 1.03
ITL_METRIC = "vllm:inter_token_latency_seconds"
PLUGIN_ARGS = ["--default-user-output-tokens-per-second", "100000"]


def itl_totals(base_url: str) -> tuple[float, float]:
    """(sum seconds, count) of the server's inter-token latency histogram."""
    text = httpx.get(f"{base_url}/metrics", timeout=30, trust_env=False).text
    total, count = 0.0, 0.0
    for family in text_string_to_metric_families(text):
        if family.name != ITL_METRIC:
            continue
        for sample in family.samples:
            if sample.name == ITL_METRIC + "_sum":
                total += sample.value
            elif sample.name == ITL_METRIC + "_count":
                count += sample.value
    return total, count


def busy_cpu_seconds() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def tree_cpu_seconds(pid: int) -> float:
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return common.cpu_seconds(procs)


async def drive(base_url: str, model: str, args) -> list[dict]:
    body = {
        "model": model,
        "prompt": DEFAULT_PROMPT,
        "max_tokens": args.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "return_token_ids": True,
        "vllm_xargs": {"output_rate_user": "single"},
    }
    out = []
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(60.0), trust_env=False) as client:
        for i in range(args.warmup_requests + args.requests):
            s0, c0 = itl_totals(base_url)
            record = RequestRecord(user="single", stream=0, start=0.0)
            t0 = time.monotonic()
            await run_request(client, body, record, t0)
            await asyncio.sleep(0.05)  # let the front end record the last iteration
            s1, c1 = itl_totals(base_url)
            if record.error:
                raise RuntimeError(f"request failed: {record.error}")
            if i < args.warmup_requests:
                continue
            gaps = [b - a for a, b in zip(record.token_times, record.token_times[1:])]
            out.append({
                "tokens": record.n_tokens,
                "server_itl_count": c1 - c0,
                "server_itl_mean_ms": 1000 * (s1 - s0) / (c1 - c0) if c1 > c0 else None,
                "client_gap_p50_ms": 1000 * statistics.median(gaps) if gaps else None,
                "client_wall_s": (record.end or 0.0) - record.start,
            })
    return out


def measure_block(side: str, server, model: str, args, index: int) -> dict:
    time.sleep(1.5)  # the other server's worker (stock: 1 s spin) is idle by now
    load_start = loadavg()
    busy0, tree0, t0 = busy_cpu_seconds(), tree_cpu_seconds(server.pid), time.monotonic()
    requests = asyncio.run(drive(server.base_url, model, args))
    wall = time.monotonic() - t0
    tree = tree_cpu_seconds(server.pid) - tree0
    busy = busy_cpu_seconds() - busy0
    means = [r["server_itl_mean_ms"] for r in requests if r["server_itl_mean_ms"] is not None]
    client = [r["client_gap_p50_ms"] for r in requests if r["client_gap_p50_ms"] is not None]
    block = {
        "block": index,
        "side": side,
        "requests": requests,
        "server_itl_p50_ms": statistics.median(means),
        "client_gap_p50_ms": statistics.median(client) if client else None,
        "server_tree_percent": round(100 * tree / wall, 1),
        "foreign_percent": round(100 * max(0.0, busy - tree) / wall, 1),
        "load_start": load_start,
        "load_end": loadavg(),
    }
    print(f"  block {index:2d} {side:6s} server ITL p50 {block['server_itl_p50_ms']:.3f} ms  client gap p50 "
          f"{block['client_gap_p50_ms']:.3f} ms  server {block['server_tree_percent']:.0f} %  "
          f"foreign {block['foreign_percent']:.0f} %  load {fmt_load(load_start)}", flush=True)
    return block


def analyse(blocks: list[dict]) -> dict:
    """``blocks``: the measured blocks in order (pairs of one stock, one plugin)."""
    out: dict = {"target_ratio": TARGET_RATIO}
    for side in ("stock", "plugin"):
        mine = [r for r in blocks if r["side"] == side]
        means = [q["server_itl_mean_ms"] for r in mine for q in r["requests"]
                 if q["server_itl_mean_ms"] is not None]
        out[side] = {
            "blocks": len(mine),
            "requests": len(means),
            "server_itl_p50_ms": statistics.median(means) if means else None,
            "server_itl_block_p50s_ms": [r["server_itl_p50_ms"] for r in mine],
            "client_gap_p50s_ms": [r["client_gap_p50_ms"] for r in mine],
        }
    s, p = out["stock"]["server_itl_p50_ms"], out["plugin"]["server_itl_p50_ms"]
    out["ratio"] = p / s if s and p else None
    pairs = []
    for i in range(0, len(blocks) - 1, 2):
        a, b = blocks[i], blocks[i + 1]
        by = {a["side"]: a, b["side"]: b}
        if set(by) == {"stock", "plugin"}:
            pairs.append(by["plugin"]["server_itl_p50_ms"] / by["stock"]["server_itl_p50_ms"])
    out["pair_ratios"] = pairs
    out["meets_target"] = None if out["ratio"] is None else out["ratio"] <= TARGET_RATIO
    return out


def report(doc: dict) -> str:
    a = doc["analysis"]
    rows = [[str(i), r["side"], f"{r['server_itl_p50_ms']:.3f}", f"{r['client_gap_p50_ms']:.3f}",
             f"{r['server_tree_percent']:.0f}", f"{r['foreign_percent']:.0f}", fmt_load(r["load_start"])]
            for i, r in enumerate(doc["blocks"])]
    parts = [table(["block", "side", "server ITL p50 ms", "client gap p50 ms", "server %", "foreign %",
                    "load 1/5/15"], rows)]
    if a["ratio"] is not None:
        verdict = "meets" if a["meets_target"] else "MISSES"
        parts.append(
            f"server-side ITL p50 (median of per-request means): stock {a['stock']['server_itl_p50_ms']:.3f} ms, "
            f"plugin {a['plugin']['server_itl_p50_ms']:.3f} ms; ratio {a['ratio']:.3f} "
            f"({verdict} target <= {TARGET_RATIO}); per pair: "
            + ", ".join(f"{x:.3f}" for x in a["pair_ratios"]))
    parts.append(machine_line(doc))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.json")
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR), help="model path (default: tiny model)")
    parser.add_argument("--blocks", type=int, default=4,
                        help="block pairs, one stock and one plugin block each (default 4)")
    parser.add_argument("--requests", type=int, default=12, help="measured requests per block (default 12)")
    parser.add_argument("--warmup-requests", type=int, default=2, help="discarded per block (default 2)")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default 128)")
    parser.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                        help="extra vllm serve argument for both sides, repeatable")
    parser.add_argument("--time-budget", type=float, default=900.0,
                        help="seconds; no new run starts after this (default 900)")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = out.parent / f"{out.name}-logs"
    doc = start_report(SCHEMA, args, PLUGIN_ARGS)
    t_begin = time.monotonic()
    blocks: list[dict] = []
    skipped = 0
    with contextlib.ExitStack() as stack:
        servers = {}
        for side in ("stock", "plugin"):
            server_args = [*(PLUGIN_ARGS if side == "plugin" else []), *args.server_arg]
            t0 = time.monotonic()
            servers[side] = stack.enter_context(
                running_server(server_args, log_dir, name=f"itl-{side}", model=args.model))
            doc[f"{side}_startup_s"] = round(time.monotonic() - t0, 1)
            doc[f"{side}_server_args"] = server_args
            print(f"{side} server up in {doc[f'{side}_startup_s']:.0f} s", flush=True)
        model = httpx.get(f"{servers['stock'].base_url}/v1/models", timeout=10,
                          trust_env=False).json()["data"][0]["id"]
        for server in servers.values():
            itl_totals(server.base_url)  # the first /metrics request is slow
        for pair in range(args.blocks):
            if time.monotonic() - t_begin > args.time_budget:
                skipped += 1
                continue
            for side in (("stock", "plugin") if pair % 2 == 0 else ("plugin", "stock")):
                blocks.append(measure_block(side, servers[side], model, args, len(blocks)))
    doc["blocks"] = blocks
    doc["skipped_block_pairs"] = skipped
    doc["load_after"] = loadavg()
    doc["wall_s"] = time.monotonic() - t_begin
    doc["analysis"] = analyse(blocks)
    print("\n" + report(doc))
    json_path = out.with_name(out.name + ".json")
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"\nwrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
