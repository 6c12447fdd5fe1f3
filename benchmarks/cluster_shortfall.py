"""Why one user's rate over several real engines falls short: per-engine data.

Starts one redis-server and ``--engines`` real ``vllm-output-rate serve``
engines on the tiny model (side by side, 127.0.0.1, random ports, stopped by
PID at the end), like ``tests/server/test_cluster_server.py``, then runs phases one
after another (each ``--seconds`` long after a 3 s warm-up):

* ``test``: the heavy user (30 tok/s, 9 streams of 12-token requests) over
  every engine and a light user (limit 1000 tok/s, one stream of 64-token
  requests, no pause) on engine 0 -- the test's three-engine phase before
  the light user got its pause;
* ``nolight``: the heavy user alone;
* ``long``: the heavy user alone with 64-token requests (client gaps matter
  less);
* ``free`` / ``free_light``: a user limited only by the default 1000 tok/s
  with 9 streams over every engine (without / with the light user): the
  engines' capacity at that moment;
* ``two``: the heavy user with 8 streams on engines 0+1.

Per phase and user it prints the rate from the engines' own counters (admin
route, read every 0.5 s), the split between engines, throttled seconds, the
mean number of the user's requests active / throttled / waiting per engine,
the longest stretch an engine charged the user nothing, the client's gap
between a request's answer and the next request of the same stream; per
engine the store counters from ``/metrics`` (leased, returned, expired
tokens, answered and failed round trips, outages) and the CPU its processes
used (API server, engine core, worker; % of one core).  With ``--out PREFIX``
writes the raw samples to ``PREFIX.json`` (large: a diagnosis, not one of the
performance page's inputs).  Usage::

    python benchmarks/cluster_shortfall.py --out results/cluster_shortfall test nolight free_light
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time

import httpx

from vllm_output_rate.tools.redisproc import RedisProcess
from vllm_output_rate.tools.serverproc import ADMIN_ROUTE_ENV, DEFAULT_MODEL_DIR
from vllm_output_rate_harness import benchkit

SCHEMA = "vllm-output-rate-cluster-shortfall/1"
HEAVY = 30
LIMITS = {"heavy": HEAVY}
WARM_S = 3.0
SAMPLE_EVERY_S = 0.5
STORE_COUNTERS = ("leased_tokens", "returned_tokens", "expired_tokens", "round_trips",
                  "failed_round_trips", "outages")
METRIC = re.compile(r"^(vllm:output_rate_store_\w+)\{[^}]*\}\s+(\S+)")


def phases(engines: int) -> dict:
    """name -> {user: (streams, max_tokens, engine indexes)}"""
    every = list(range(engines))
    return {
        "test": {"heavy": (9, 12, every), "light": (1, 64, [0])},
        "nolight": {"heavy": (9, 12, every)},
        "long": {"heavy": (9, 64, every)},
        "free": {"free": (9, 12, every)},
        "free_light": {"free": (9, 12, every), "light": (1, 64, [0])},
        "two": {"heavy": (8, 12, [0, 1])},
    }


def store_counters(text: str) -> dict:
    out: dict = {}
    for line in text.splitlines():
        m = METRIC.match(line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


async def read_engines(client, servers) -> dict:
    async def one(server):
        users = await client.get(f"{server.base_url}/v1/output_rate/users", timeout=30)
        metrics = await client.get(f"{server.base_url}/metrics", timeout=30)
        return users.json()["users"], store_counters(metrics.text)

    sent = time.monotonic()
    got = await asyncio.gather(*(one(s) for s in servers))
    return {"sent": sent, "done": time.monotonic(), "users": [g[0] for g in got],
            "store": [g[1] for g in got]}


async def run_phase(servers, spec: dict, seconds: float) -> dict:
    rows: list = []
    stop_at = time.monotonic() + WARM_S + seconds
    async with httpx.AsyncClient(timeout=120, trust_env=False,
                                 limits=httpx.Limits(keepalive_expiry=2.0)) as client:

        async def stream(user, s, max_tokens, targets):
            while time.monotonic() < stop_at:
                index = targets[s % len(targets)]
                server = servers[index]
                body = {"model": server.model, "prompt": "The scheduler decides",
                        "max_tokens": max_tokens, "ignore_eos": True,
                        "vllm_xargs": {"output_rate_user": user}}
                sent = time.monotonic()
                try:
                    r = await client.post(f"{server.base_url}/v1/completions", json=body)
                    tokens = r.json()["usage"]["completion_tokens"]
                except Exception as exc:  # noqa: BLE001 -- reported
                    tokens = repr(exc)
                rows.append((user, s, index, sent, time.monotonic(), tokens))

        await read_engines(client, servers)  # a first read can take seconds: not a sample
        tasks = [asyncio.ensure_future(stream(u, s, mt, tg))
                 for u, (n, mt, tg) in spec.items() for s in range(n)]
        await asyncio.sleep(WARM_S)
        samples = []
        while time.monotonic() < stop_at:
            started = time.monotonic()
            samples.append(await read_engines(client, servers))
            await asyncio.sleep(max(0.0, SAMPLE_EVERY_S - (time.monotonic() - started)))
        samples.append(await read_engines(client, servers))
        await asyncio.gather(*tasks)
    return {"rows": rows, "samples": samples}


def field_of(sample, engine, user, key):
    return sample["users"][engine].get(user, {}).get(key, 0)


def report(name: str, res: dict, engines: int, cpu: dict, load: list) -> None:
    rows, samples = res["rows"], res["samples"]
    a, b = samples[0], samples[-1]
    window = (b["sent"] + b["done"]) / 2 - (a["sent"] + a["done"]) / 2
    widest, narrowest = b["done"] - a["sent"], b["sent"] - a["done"]
    print(f"\n=== {name}: {window:.1f} s between the reads' middles ({narrowest:.1f}-{widest:.1f} s), "
          f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    for user in sorted({r[0] for r in rows}):
        split = [field_of(b, i, user, "tokens_charged_total") - field_of(a, i, user, "tokens_charged_total")
                 for i in range(engines)]
        throttled = [round(field_of(b, i, user, "throttled_seconds_total")
                           - field_of(a, i, user, "throttled_seconds_total"), 1) for i in range(engines)]
        rate = sum(split) / window
        print(f"  {user}: {rate:.1f} tok/s ({rate / HEAVY:.2f} x 30; "
              f"{sum(split) / widest / HEAVY:.2f}-{sum(split) / narrowest / HEAVY:.2f} on the "
              f"widest / narrowest window) per engine {split}, throttled s {throttled}")
        for i in range(engines):
            means = [statistics.mean(field_of(s, i, user, k) for s in samples)
                     for k in ("active", "throttled", "waiting")]
            longest, since, prev = 0.0, None, None
            for s in samples:
                charged = field_of(s, i, user, "tokens_charged_total")
                if prev is not None and charged == prev:
                    since = s["sent"] if since is None else since
                    longest = max(longest, s["done"] - since)
                else:
                    since = None
                prev = charged
            print(f"    engine {i}: requests active {means[0]:.2f} throttled {means[1]:.2f} "
                  f"waiting {means[2]:.2f}; longest stretch without a charge {longest:.1f} s")
        by_stream: dict = {}
        for r in rows:
            if r[0] == user:
                by_stream.setdefault(r[1], []).append(r)
        gaps, latency = [], []
        for rs in by_stream.values():
            rs.sort(key=lambda r: r[3])
            gaps += [q[3] - p[4] for p, q in zip(rs, rs[1:])]
            latency += [r[4] - r[3] for r in rs]
        if gaps:
            gaps.sort()
            print(f"    client gap answer -> next request: median {gaps[len(gaps) // 2] * 1e3:.1f} ms, "
                  f"max {gaps[-1] * 1e3:.1f} ms; request time median {statistics.median(latency):.2f} s, "
                  f"max {max(latency):.2f} s; {len(latency)} requests")
        failed = [r for r in rows if r[0] == user and not isinstance(r[5], int)]
        if failed:
            print(f"    {len(failed)} requests failed, e.g. {failed[0]}")
    for i in range(engines):
        store = {k: b["store"][i].get(f"vllm:output_rate_store_{k}_total", 0)
                 - a["store"][i].get(f"vllm:output_rate_store_{k}_total", 0) for k in STORE_COUNTERS}
        used = ", ".join(f"{role} {benchkit.as_share(sec, cpu['wall_s'], 100, 0):.0f}"
                         for role, sec in cpu["servers"][i].items())
        print(f"  engine {i} store: " + ", ".join(f"{k} {v:.0f}" for k, v in store.items()))
        print(f"  engine {i} CPU % of one core: {used}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phases", nargs="*", default=["test", "nolight", "free_light"])
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--out", default=None, metavar="PREFIX", help="writes PREFIX.json (raw samples)")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    args = parser.parse_args()
    specs = phases(args.engines)
    unknown = [p for p in args.phases if p not in specs]
    if unknown:
        parser.error(f"unknown phases {unknown}; known: {sorted(specs)}")
    log_dir = benchkit.log_dir_for("cluster-shortfall", args.log_dir)
    doc = benchkit.start_report(SCHEMA, args)
    doc["phases"] = []
    with RedisProcess() as redis_srv:
        flags = ["--enforce-eager", "--disable-uvicorn-access-log", "--max-num-seqs", "16",
                 "--default-user-output-tokens-per-second", "1000",
                 "--user-output-tokens-per-second", json.dumps(LIMITS),
                 "--output-rate-store", redis_srv.url,
                 "--output-rate-expected-engines", str(args.engines),
                 "--output-rate-store-prefix", "cluster-shortfall",
                 "--output-rate-admin-open"]  # loopback engines; their counters are read
        doc["server_args"] = flags
        began = time.monotonic()
        with benchkit.running_engines([(f"engine{i}", flags) for i in range(args.engines)], log_dir,
                                      model=args.model, env=ADMIN_ROUTE_ENV, side_by_side=True) as servers:
            print(f"{args.engines} engines healthy after {time.monotonic() - began:.0f} s "
                  f"(logs in {log_dir})", flush=True)
            for name in args.phases:
                meter = benchkit.CpuMeter([server.pid for server in servers])
                meter.start()
                res = asyncio.run(run_phase(servers, specs[name], args.seconds))
                cpu = meter.stop()
                load = benchkit.loadavg()
                report(name, res, args.engines, cpu, load)
                sys.stdout.flush()
                doc["phases"].append({"phase": name, "load_average": load, "cpu": cpu, **res})
    if args.out:
        benchkit.write_outputs(benchkit.finish_report(doc), args.out)


if __name__ == "__main__":
    main()
