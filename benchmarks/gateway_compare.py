#!/usr/bin/env python
"""The same load through a gateway limiter: stock vLLM, LiteLLM's proxy in front of stock vLLM, the plugin.

What
    One workload, three sides, one after another on the tiny model
    (127.0.0.1, every process stopped by PID at the end):

    * ``stock``: stock vLLM (``vllm-output-rate serve`` without rate flags:
      vLLM's own scheduler), nothing in front;
    * ``gateway``: LiteLLM's proxy in front of that same stock server, set up
      as a new user would: no database, per-key limits returned by its
      ``custom_auth`` hook (``tpm_limit`` = the tok/s limit x 60),
      ``token_rate_limit_type: output`` (:mod:`vllm_output_rate_harness.gateway`
      writes the hook and the config);
    * ``plugin``: a fresh server with the plugin, the heavy user at the same
      limit, everybody else at ``--default-limit``.

    Load (every side): user ``heavy`` keeps ``--heavy-streams`` (12) streams
    in flight, each re-issued as soon as it ends; user ``light`` has one
    stream and pauses ``--light-pause`` (1 s) after each answer.  Every
    request asks for ``--max-tokens`` (128) output tokens (``ignore_eos``).
    A request refused with 429 is retried by its stream after
    ``--retry-after`` (1 s); after ``--duration`` (60 s) every request still
    in flight is cancelled.  Limits: heavy ``--heavy-limit`` (30 tok/s),
    light ``--default-limit`` (1000 tok/s, never reached), the same on the
    gateway and on the plugin; stock has none.

    Per side and user: tok/s (tokens received in the run / its duration),
    the most tokens in any 10 s and 60 s window / (limit x window), 429s,
    requests answered (streamed to their end), and the light user's first
    token p50 / p99; a figure of the heavy user's tokens per second.

How (clocks)
    * Client receive times (all sides): tokens as this client received them,
      its own ``time.monotonic()``.  On this loaded 2-core machine streams
      stall (receive gaps of a second and more, then a bunch of tokens), so
      windows on this clock can overstate a paced rate, the shorter the
      more; the plugin's client figure beside its engine figure shows by
      how much, and the page says which clock each figure is on.
    * Engine counters (plugin only): the engine's own charged-token total
      per user (``GET /v1/output_rate/users``, read every
      ``--read-every`` s); a window's count is the growth between two reads
      that lie at most W apart, send of the first to answer of the second,
      so it never overstates (:func:`~vllm_output_rate_harness.gateway.counter_most_in_window`).
      Stock vLLM and the gateway have no per-user counter: their windows are
      on client receive times only.
    * First token: from just before the light user's request is sent to its
      first token received, client clock, the same pacing on every side
      (through the gateway it includes the proxy's hop).
    * Counting tokens: LiteLLM's stream drops the token ids vLLM sends with
      each chunk, so every request allows one token only
      (``allowed_token_ids``: the tokenizer's ``a``, one character), on every
      side, and a chunk's characters are its tokens; each finished request's
      count is checked against the server's ``usage.completion_tokens``
      (mismatches reported).

Dependencies
    The driver runs in the project's venv (vLLM and ``[tools]``).  The
    proxy does not: LiteLLM pins packages vLLM needs, so it lives in its own
    venv, built from the ``[compare]`` extra of ``pyproject.toml``
    (``litellm[proxy]``, pinned to the version this was run with), and runs
    as a child process from there, given by ``--gateway-bin``::

        make bench-gateway      # builds .venv-compare once, then runs this script

    or by hand::

        python3 -m venv .venv-compare && .venv-compare/bin/pip install '.[compare]'
        VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
            .venv/bin/python benchmarks/gateway_compare.py --gateway-bin .venv-compare/bin/litellm

Writes ``docs/benchmarks/gateway_compare.json`` and ``.png`` (``--out PREFIX``
elsewhere); two server startups, one proxy startup and three runs of
``--duration``; the JSON's ``wall_s`` says how long a run took.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from vllm_output_rate.tools import measure
from vllm_output_rate.tools.render import figure_metadata, sibling_json
from vllm_output_rate.tools.analysis import rate_series, time_to_first_token
from vllm_output_rate.tools.measure import ERROR_STATUSES, HTTP_ERROR, RequestRecord, percentile
from vllm_output_rate.tools.serverproc import ADMIN_ROUTE_ENV, DEFAULT_MODEL_DIR
from vllm_output_rate_harness import benchkit, gateway
from vllm_output_rate_harness.benchkit import RESULTS_DIR, fmt_load, loadavg, machine_line, table

benchkit.use_cpu_testbed_env()

SCHEMA = "vllm-output-rate-gateway-compare/1"
HEAVY, LIGHT = "heavy", "light"
STOCK, GATEWAY, PLUGIN = "stock", "gateway", "plugin"
SIDES = (STOCK, GATEWAY, PLUGIN)
SIDE_LABELS = {STOCK: "stock vLLM", GATEWAY: "LiteLLM TPM → stock vLLM", PLUGIN: "plugin"}
API_KEYS = {HEAVY: "key-heavy", LIGHT: "key-light"}
WINDOWS_S = (10.0, 60.0)
CLIENT, ENGINE = "client receive times", "engine counters"
#: The one token every request may produce: one character, so characters count tokens.
ONE_CHAR_TOKEN = "a"
ERROR_BACKOFF_S = 0.2
DRAIN_TIMEOUT_S = 60.0


# --------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------


def request_body(model: str, user: str, args: argparse.Namespace, token_id: int) -> dict:
    body = measure.stream_body(model, user, args.max_tokens)
    body["allowed_token_ids"] = [token_id]
    return body


async def stream_loop(client, body: dict, headers: dict | None, user: str, stream: int,
                      records: list[RequestRecord], t0: float, pause_s: float, args) -> None:
    while True:
        record = RequestRecord(user=user, stream=stream)
        records.append(record)
        await measure.stream_completion(client, body, record, t0, headers=headers, count_chars=True)
        if record.status == HTTP_ERROR and record.http_status == gateway.TOO_MANY_REQUESTS:
            await asyncio.sleep(args.retry_after)
        elif record.status in ERROR_STATUSES:
            await asyncio.sleep(ERROR_BACKOFF_S)
        elif pause_s:
            await asyncio.sleep(pause_s)


async def read_counters(base_url: str, reads: list, every_s: float, t0: float) -> None:
    """The plugin's per-user charged totals, read until cancelled."""
    async with benchkit.async_http(base_url, connections=2, read_timeout=30) as client:
        while True:
            sent = time.monotonic() - t0
            try:
                users = (await client.get("/v1/output_rate/users")).json()["users"]
                reads.append({"sent": sent, "done": time.monotonic() - t0,
                              "charged": {u: row["tokens_charged_total"] for u, row in users.items()}})
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            await asyncio.sleep(every_s)


async def run_load(base_url: str, model: str, args, token_id: int, through_gateway: bool,
                   counters_url: str | None) -> dict:
    records: list[RequestRecord] = []
    reads: list[dict] = []
    streams = {HEAVY: args.heavy_streams, LIGHT: 1}
    pauses = {HEAVY: 0.0, LIGHT: args.light_pause}
    async with benchkit.async_http(base_url, connections=sum(streams.values()) + 4) as client:
        warm = RequestRecord(user=LIGHT)  # untimed: first-request overheads (light key: no heavy quota spent)
        await measure.stream_completion(client, {**request_body(model, LIGHT, args, token_id), "max_tokens": 8},
                                        warm, time.monotonic(), count_chars=True,
                                        headers={"Authorization": f"Bearer {API_KEYS[LIGHT]}"} if through_gateway else None)
        load_before = loadavg()
        t0 = time.monotonic()
        tasks = []
        if counters_url:
            tasks.append(asyncio.create_task(read_counters(counters_url, reads, args.read_every, t0)))
        for user, count in streams.items():
            headers = {"Authorization": f"Bearer {API_KEYS[user]}"} if through_gateway else None
            body = request_body(model, user, args, token_id)
            tasks += [asyncio.create_task(stream_loop(client, body, headers, user, s, records, t0, pauses[user], args))
                      for s in range(count)]
        await asyncio.sleep(args.duration)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"records": records, "reads": reads, "load_before": load_before, "load_after": loadavg(),
            "warm_up": warm.status}


async def wait_drained(base_url: str) -> None:
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    async with benchkit.async_http(base_url, connections=1, read_timeout=10) as client:
        while time.monotonic() < deadline:
            g = measure.gauges(await measure.fetch_metrics_async(client))
            if not g[measure.RUNNING_GAUGE] and not g[measure.WAITING_GAUGE]:
                return
            await asyncio.sleep(0.5)


# --------------------------------------------------------------------------
# Analysis
# --------------------------------------------------------------------------


def user_figures(records: list[RequestRecord], reads: list[dict], user: str, limit: float,
                 duration_s: float) -> dict:
    mine = [r for r in records if r.user == user]
    times = sorted(t for r in mine for t in r.token_times if t <= duration_s)
    ttfts = [x for x in (time_to_first_token(r) for r in mine) if x is not None]
    finished = [r for r in mine if r.status == measure.FINISHED]
    windows = {}
    for w in WINDOWS_S:
        most = measure.max_in_window(times, w)
        row = {"client_max_tokens": most, "client_ratio": most / (limit * w)}
        engine = gateway.counter_most_in_window(
            [(r["sent"], r["done"], r["charged"].get(user, 0)) for r in reads], w) if reads else None
        if engine is not None:
            row.update(engine_max_tokens=engine, engine_ratio=engine / (limit * w))
        windows[f"{w:g}s"] = row
    engine_total = None
    if len(reads) >= 2:
        engine_total = reads[-1]["charged"].get(user, 0) - reads[0]["charged"].get(user, 0)
    return {
        "limit_tokens_per_s": limit,
        "tokens": len(times),
        "tokens_per_s": len(times) / duration_s,
        "engine_charged_tokens": engine_total,
        "windows": windows,
        "rejected_429": gateway.rejected(mine),
        "answered": gateway.answered(mine),
        "requests": len(mine),
        "other_errors": sum(1 for r in mine if r.status in ERROR_STATUSES) - gateway.rejected(mine),
        "cancelled_at_end": sum(1 for r in mine if r.status == measure.CANCELLED),
        "usage_mismatches": sum(1 for r in finished if not measure.usage_matches(r)),
        "first_token_p50_s": percentile(ttfts, 50),
        "first_token_p99_s": percentile(ttfts, 99),
        "first_tokens": len(ttfts),
        "window_clock": ENGINE if reads else CLIENT,
    }


def request_row(record: RequestRecord) -> dict:
    """One request without its per-token times (those would make the JSON megabytes)."""
    return {"user": record.user, "stream": record.stream, "start": round(record.start, 4),
            "end": None if record.end is None else round(record.end, 4), "status": record.status,
            "http_status": record.http_status, "tokens": record.n_tokens,
            "first_token": round(record.token_times[0], 4) if record.token_times else None,
            "completion_tokens": record.completion_tokens}


def engine_rate_series(reads: list[dict], user: str, seconds: int) -> list[float]:
    """Tokens the engine charged ``user`` in each whole second, the counter interpolated
    between reads (each read placed midway between its send and its answer)."""
    import numpy

    if len(reads) < 2:
        return []
    mids = [(r["sent"] + r["done"]) / 2 for r in reads]
    values = [r["charged"].get(user, 0) for r in reads]
    at = numpy.interp(range(seconds + 1), mids, values)
    return [round(float(b - a), 2) for a, b in zip(at, at[1:])]


def side_result(run: dict, args) -> dict:
    limits = {HEAVY: args.heavy_limit, LIGHT: args.default_limit}
    records, reads = run["records"], run["reads"]
    seconds = int(args.duration)
    return {
        "users": {user: user_figures(records, reads, user, limit, args.duration) for user, limit in limits.items()},
        "heavy_tokens_per_s_series": rate_series([r for r in records if r.user == HEAVY], 1.0,
                                                 args.duration).get(HEAVY, [])[:seconds],
        "heavy_engine_tokens_per_s_series": engine_rate_series(reads, HEAVY, seconds),
        "load_before": run["load_before"],
        "load_after": run["load_after"],
        "warm_up": run["warm_up"],
        "counter_reads": [{"sent": round(r["sent"], 4), "done": round(r["done"], 4), "charged": r["charged"]}
                          for r in reads],
        "requests": [request_row(r) for r in records],
    }


def report(doc: dict) -> str:
    rows = []
    for side in SIDES:
        result = doc["sides"].get(side)
        if result is None:
            continue
        for user in (HEAVY, LIGHT):
            u = result["users"][user]
            cells = [side, user, f"{u['tokens_per_s']:.1f}"]
            for w in WINDOWS_S:
                row = u["windows"][f"{w:g}s"]
                cell = f"{row['client_ratio']:.2f}"
                if "engine_ratio" in row:
                    cell = f"{row['engine_ratio']:.2f} (client {cell})"
                cells.append(cell)
            ms = lambda x: "-" if x is None else f"{1000 * x:.0f}"  # noqa: E731
            cells += [u["rejected_429"], u["answered"], ms(u["first_token_p50_s"]), ms(u["first_token_p99_s"]),
                      u["usage_mismatches"], f"{fmt_load(result['load_before'])}"]
            rows.append(cells)
    head = ["side", "user", "tok/s", "max 10 s / limit", "max 60 s / limit", "429s", "answered",
            "TTFT p50 ms", "TTFT p99 ms", "usage mismatches", "load before"]
    return table(head, rows) + "\n" + machine_line(doc)


def plot(doc: dict, path: Path, source: Path | None = None) -> None:
    """``source``: the JSON ``doc`` was read from (default: PATH with .json), whose digest the PNG carries."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    full, zoom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    limit = doc["config"]["heavy_limit"]
    for side, color in zip(SIDES, ("C7", "C3", "C0")):
        series = doc["sides"].get(side, {}).get("heavy_tokens_per_s_series")
        if not series:
            continue
        xs = [i + 0.5 for i in range(len(series))]
        for ax in (full, zoom):
            ax.step(xs, series, where="mid", color=color, label=f"{SIDE_LABELS[side]} (client)")
        engine = doc["sides"][side].get("heavy_engine_tokens_per_s_series")
        if engine:
            zoom.step([i + 0.5 for i in range(len(engine))], engine, where="mid", color="C2", linestyle=":",
                      label=f"{SIDE_LABELS[side]} (engine counter)")
    for ax in (full, zoom):
        ax.axhline(limit, color="k", linestyle="--", linewidth=1, label=f"limit {limit:g} tok/s")
        ax.set_ylabel("tok/s")
    zoom.set_ylim(0, limit * 4)
    zoom.set_xlabel("seconds since the load started (1 s bins; client: receive times, engine: charged tokens)")
    full.set_title(f"Heavy user ({doc['config']['heavy_streams']} streams, limit {limit:g} tok/s): "
                   "tokens received per second")
    zoom.set_title(f"the same, 0-{limit * 4:g} tok/s", fontsize="small")
    full.legend(fontsize="small", loc="upper right")
    zoom.legend(fontsize="x-small", loc="upper right")
    fig.tight_layout()
    fig.savefig(str(path), metadata=figure_metadata(source or sibling_json(path)))


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def server_args(args, plugin: bool) -> list[str]:
    common = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-active-seqs", str(args.max_num_active_seqs),
              "--max-model-len", "1024", "--enforce-eager"]
    if not plugin:
        return common
    return common + ["--default-user-output-tokens-per-second", f"{args.default_limit:g}",
                     "--user-output-tokens-per-second", json.dumps({HEAVY: args.heavy_limit}),
                     "--output-rate-admin-open"]  # loopback engine; its counters are read


def single_char_token(model_dir: Path) -> int:
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return int(vocab[ONE_CHAR_TOKEN])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(RESULTS_DIR / "gateway_compare"), metavar="PREFIX",
                   help="writes PREFIX.json and PREFIX.png (default: %(default)s)")
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--gateway-bin", default=".venv-compare/bin/litellm",
                   help="LiteLLM's proxy executable, in its own venv (default: %(default)s)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per side (default 60)")
    p.add_argument("--heavy-streams", type=int, default=12)
    p.add_argument("--heavy-limit", type=float, default=30.0, help="heavy user's limit, tok/s (default 30)")
    p.add_argument("--default-limit", type=float, default=1000.0,
                   help="every other user's limit (the light user's), tok/s (default 1000)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--light-pause", type=float, default=1.0, help="light user's pause after each answer, s")
    p.add_argument("--retry-after", type=float, default=1.0, help="wait before retrying a 429, s")
    p.add_argument("--read-every", type=float, default=0.25, help="engine counter reads (plugin), s")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-active-seqs", type=int, default=8)
    p.add_argument("--sides", default=",".join(SIDES), help="comma-separated subset of stock,gateway,plugin")
    p.add_argument("--log-dir", default=None, help="server and proxy logs (default: a temporary folder)")
    args = p.parse_args(argv)
    sides = [s for s in args.sides.split(",") if s]
    if GATEWAY in sides and not Path(args.gateway_bin).is_file():
        print(f"no LiteLLM proxy at {args.gateway_bin}: `make bench-gateway` builds .venv-compare "
              "(pip install '.[compare]' in its own venv)", file=sys.stderr)
        return 2
    model_dir = Path(args.model)
    token_id = single_char_token(model_dir)
    log_dir = benchkit.log_dir_for("gateway-compare", args.log_dir)
    doc = benchkit.start_report(SCHEMA, args, {STOCK: server_args(args, False), PLUGIN: server_args(args, True)})
    doc.update(heavy_user=HEAVY, light_user=LIGHT, allowed_token_id=token_id, sides={}, startups_s={},
               window_clocks={STOCK: CLIENT, GATEWAY: CLIENT, PLUGIN: ENGINE})

    def run_side(side: str, base_url: str, model: str, through_gateway: bool = False,
                 counters_url: str | None = None) -> None:
        print(f"[{side}] {args.duration:g} s of load; load avg {fmt_load(loadavg())}", flush=True)
        run = asyncio.run(run_load(base_url, model, args, token_id, through_gateway, counters_url))
        doc["sides"][side] = side_result(run, args)
        heavy = doc["sides"][side]["users"][HEAVY]
        print(f"[{side}] heavy {heavy['tokens_per_s']:.1f} tok/s, {heavy['rejected_429']} x 429, "
              f"load avg {fmt_load(run['load_after'])}", flush=True)

    if STOCK in sides or GATEWAY in sides:
        with benchkit.running_engines([(STOCK, server_args(args, False))], log_dir, model=args.model) as (server,):
            doc["startups_s"][STOCK] = server.startup_s
            model = benchkit.served_model(server.base_url)
            if STOCK in sides:
                run_side(STOCK, server.base_url, model)
                asyncio.run(wait_drained(server.base_url))
            if GATEWAY in sides:
                config = gateway.write_gateway_files(
                    log_dir / "gateway", {API_KEYS[u]: (u, lim) for u, lim in
                                          ((HEAVY, args.heavy_limit), (LIGHT, args.default_limit))},
                    server.base_url, model)
                proxy = gateway.GatewayProcess(args.gateway_bin, config, log_dir / "gateway.log")
                with proxy:
                    doc["startups_s"][GATEWAY] = proxy.startup_s
                    doc["gateway_config"] = gateway.gateway_config(server.base_url, model)
                    run_side(GATEWAY, proxy.base_url, model, through_gateway=True)
    if PLUGIN in sides:
        with benchkit.running_engines([(PLUGIN, server_args(args, True))], log_dir, model=args.model,
                                      env=ADMIN_ROUTE_ENV) as (server,):
            doc["startups_s"][PLUGIN] = server.startup_s
            run_side(PLUGIN, server.base_url, benchkit.served_model(server.base_url),
                     counters_url=server.base_url)
    doc["gateway_version"] = gateway_version(args.gateway_bin) if GATEWAY in sides else None
    benchkit.finish_report(doc)
    benchkit.write_outputs(doc, args.out, plot=plot)
    print("\n" + report(doc))
    return 0


def gateway_version(command: str) -> str | None:
    """The LiteLLM version installed next to ``command`` (its venv's pip metadata)."""
    python = Path(command).with_name("python")
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                             capture_output=True, text=True, timeout=60)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
