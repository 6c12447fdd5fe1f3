"""``vllm-output-rate demo-cluster``: one user's quota shared by two engines through Redis.

Starts one real ``redis-server`` and ``--engines`` (default 2) engines on the
tiny model, all on 127.0.0.1, every engine with ``--output-rate-store`` pointed
at that Redis and its model worker bound to its own CPUs (vLLM would put them
all on one core; an explicit ``VLLM_CPU_OMP_THREADS_BIND`` is kept).  Then
runs the bench over all engines for ``--duration`` seconds: a heavy user
(default 8 streams of 40-token answers, limited to 30 tok/s) whose streams
are dealt round-robin over the engines, so its load lands on every engine,
beside a light user (one stream of 200-token answers, under a 1000 tok/s
default it never reaches) on the first engine.  Everything is stopped by PID
at the end.

Prints the bench's per-user and per-engine tables and a Markdown block (the
performance page's), and writes ``OUT.json`` (the bench document plus the setup) and
``OUT.png`` (each user's rate summed over engines; the heavy user's tokens
per engine and summed, against the bound across engines).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from vllm_output_rate.tools import bench, runkit, serverproc
from vllm_output_rate.tools.analysis import UserSummary, bound_terms
from vllm_output_rate.tools.engine_counters import CounterReader, CounterSample, cumulative, longest_silence
from vllm_output_rate.tools.measure import RequestRecord
from vllm_output_rate.tools.redisproc import RedisProcess
from vllm_output_rate.tools.render import markdown_table, num, plot_engines, plot_label, tightest

SCHEMA = "vllm-output-rate-demo-cluster/1"
HEAVY, LIGHT = "heavy", "light"
PREFIX = "demo-cluster"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-output-rate demo-cluster", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(serverproc.DEFAULT_MODEL_DIR))
    p.add_argument("--engines", type=int, default=2, help="engines sharing the Redis (default 2)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load")
    p.add_argument("--heavy-streams", type=int, default=8)
    p.add_argument("--heavy-max-tokens", type=int, default=40)
    p.add_argument("--light-max-tokens", type=int, default=200)
    p.add_argument("--heavy-limit", type=float, default=30.0)
    p.add_argument("--default-limit", type=float, default=1000.0,
                   help="limit of every other user (the light user): high, so it is not throttled")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-active-seqs", type=int, default=8)
    p.add_argument("--runs", type=int, default=1,
                   help="consecutive runs, each with a fresh Redis and fresh engines; the tables and "
                        "figure show the last, the targets are judged on each (default 1)")
    p.add_argument("--out", default="results/demo-cluster", help="prefix of the .json/.png outputs (logs next to them)")
    p.add_argument("--render-only", action="store_true",
                   help="start nothing: redraw OUT.png and print the tables from an earlier OUT.json")
    return p


def draw_cluster(document: Mapping[str, Any], png: Path) -> None:
    """The run's figure, from the raw requests of its document."""
    plot_engines(bench.records_from_document(document), bench.limits_from_document(document), png,
                 title=f"One quota over {len(document['config']['urls'])} engines sharing one Redis "
                       f"({document['config']['model']})",
                 load_end_s=document["config"]["duration_s"])


def render_outputs(document: Mapping[str, Any], out: Path) -> Path:
    """Draw ``OUT.png`` from a run's document and print the Markdown block."""
    png = out.with_name(out.name + ".png")
    draw_cluster(document, png)
    print()
    print(markdown(document))
    return png


def engine_args(args: argparse.Namespace, store_url: str) -> list[str]:
    return [
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-active-seqs", str(args.max_num_active_seqs),
        "--max-model-len", "1024",
        "--enforce-eager",  # short startup; scheduling is the same
        "--enable-per-request-metrics",  # server-side token times: the bench's stall measure
        "--default-user-output-tokens-per-second", f"{args.default_limit:g}",
        "--user-output-tokens-per-second", json.dumps({HEAVY: args.heavy_limit}),
        "--output-rate-store", store_url,
        "--output-rate-expected-engines", str(args.engines),
        "--output-rate-store-prefix", PREFIX,
        # The admin route is closed without a key; these engines listen on
        # 127.0.0.1 only and the demo reads its counters.
        "--output-rate-admin-open",
    ]


def bench_argv(args: argparse.Namespace, urls: list[str]) -> list[str]:
    argv: list[str] = []
    for url in urls:
        argv += ["--url", url]
    return argv + [
        "--user", f"{HEAVY}:{args.heavy_streams}:{args.heavy_max_tokens}",
        "--user", f"{LIGHT}:1:{args.light_max_tokens}",
        "--duration", f"{args.duration:g}",
        "--limit", f"{HEAVY}={args.heavy_limit:g}",
        "--default-limit", f"{args.default_limit:g}",
        "--no-progress",
    ]


def engine_names(urls: list[str]) -> dict[str, str]:
    return {url: f"engine {i + 1}" for i, url in enumerate(urls)}


CLUSTER_HEADERS = [
    "user", "streams", "limit tok/s", "engines", "tokens received per engine", "tokens (sum)",
    "charged on the engines (sum of /metrics)", "tok/s under load", "tok/s incl. drain", "share",
    "guarantee", "tightest check",
]


def rate_under_load(records: list[RequestRecord], user: str, load_end_s: float) -> float | None:
    """Tokens received from the user's first token until the bench stopped
    issuing requests, per second of that span (all its streams in flight)."""
    times = sorted(t for r in records if r.user == user for t in r.token_times)
    if not times or times[0] >= load_end_s:
        return None
    return sum(1 for t in times if t <= load_end_s) / (load_end_s - times[0])


def with_rates_under_load(document: Mapping[str, Any]) -> dict[str, Any]:
    """``document`` with each user's :func:`rate_under_load` kept in ``cluster``,
    so that :func:`markdown` works once the raw requests are dropped."""
    records = bench.records_from_document(document)
    if not records:
        return dict(document)
    rates = {s["user"]: rate_under_load(records, s["user"], document["config"]["duration_s"])
             for s in document["summary"]}
    return {**document, "cluster": {**document.get("cluster", {}), "rate_under_load": rates}}


def cluster_rows(summaries: list[UserSummary], urls: list[str],
                 under_load: Mapping[str, float | None]) -> list[list[str]]:
    names = engine_names(urls)
    rows = []
    for s in summaries:
        per_engine = " + ".join(f"{s.tokens_by_engine[u]} ({names.get(u, u)})"
                                for u in urls if u in s.tokens_by_engine)
        rows.append([
            plot_label(s.user), str(s.streams),
            "-" if s.limit_tokens_per_s is None else f"{s.limit_tokens_per_s:g}",
            str(s.engines), per_engine or "-", str(s.tokens), num(s.server_charged_tokens, 0),
            num(under_load.get(s.user)), num(s.tokens_per_s),
            "-" if s.share is None else f"{100 * s.share:.1f} %",
            s.guarantee, tightest(s),
        ])
    return rows


def headline(summaries: list[UserSummary], urls: list[str], under_load: Mapping[str, float | None]) -> str:
    by_user = {s.user: s for s in summaries}
    parts = []
    heavy = by_user.get(HEAVY)
    heavy_rate = under_load.get(HEAVY)
    if heavy is not None and heavy_rate and heavy.limit_tokens_per_s:
        split = " / ".join(str(heavy.tokens_by_engine[u]) for u in urls if u in heavy.tokens_by_engine)
        parts.append(
            f"`{HEAVY}` ({heavy.streams} streams over {heavy.engines} engines) received "
            f"{heavy_rate:.1f} tok/s summed over the engines while the load ran (limit "
            f"{heavy.limit_tokens_per_s:g} tok/s; separate limiters would allow "
            f"{heavy.engines * heavy.limit_tokens_per_s:g}); its tokens split {split} between the engines")
    light, light_rate = by_user.get(LIGHT), under_load.get(LIGHT)
    if light is not None and light_rate:
        names = engine_names(urls)
        where = ", ".join(names.get(u, u) for u in light.tokens_by_engine)
        parts.append(f"`{LIGHT}` (1 stream, {where}) got {light_rate:.0f} tok/s")
    return "; ".join(parts) + "."


def markdown(document: Mapping[str, Any], dated: bool = True) -> str:
    """The run's block: headline, table, the bound; ``dated`` False leaves the date out."""
    if document.get("requests"):
        document = with_rates_under_load(document)
    summaries = [UserSummary.from_dict(s) for s in document["summary"]]
    urls = document["config"]["urls"]
    under_load = document["cluster"].get("rate_under_load", {})
    heavy_limit = document["cluster"]["heavy_limit"]
    slack_s, extra = bound_terms(heavy_limit, document["config"]["burst_s"], len(urls))
    date = f" · {document['started_at']}" if dated else ""
    lines = [
        f"Command: `{document['cluster']['command']}`{date} · "
        f"{document['config']['duration_s']:g} s of load · client loop lag max "
        f"{(document['client'].get('loop_lag_max_s') or 0) * 1000:.0f} ms",
        "",
        headline(summaries, urls, under_load),
        "",
        markdown_table(CLUSTER_HEADERS, cluster_rows(summaries, urls, under_load)),
        "",
        f"Bound for `{HEAVY}` across {len(urls)} engines: (W + {slack_s:g}) × {heavy_limit:g} + 1 + "
        f"{extra:g} tokens in any window of W s.",
    ]
    placement = worker_placement(document["cluster"].get("worker_cpus"), urls)
    if placement:
        lines += ["", placement]
    runs = document["cluster"].get("runs") or []
    if runs:
        lines += ["", f"The tables above show run {len(runs)} of {len(runs)}.", "", *runs_lines(runs, heavy_limit)]
    return "\n".join(lines)


#: Targets judged per run on the engines' counters (issue 22).
TARGET_SHARE = 0.9
TARGET_SILENCE_S = 2.0
#: Reads of the engines' counters while the load runs, and the start of the
#: load left out of the rate (every stream has its first tokens by then).
READ_EVERY_S = 0.25
RATE_WARMUP_S = 3.0


def counter_figures(samples: list[CounterSample], load_from: float, load_to: float,
                    heavy_limit: float) -> dict[str, Any]:
    """One run's figures on the engines' own counters: the heavy user's
    charged rate summed over the engines (between the reads closest to
    ``load_from + RATE_WARMUP_S`` and ``load_to``, over the time between the
    middles of the two reads) and each engine's longest sure silence while
    the load ran."""
    inside = [s for s in samples if s.sent >= load_from + RATE_WARMUP_S and s.done <= load_to
              and all(c is not None for c in s.charged)]
    out: dict[str, Any] = {"reads": len(samples), "load_s": round(load_to - load_from, 2)}
    if len(inside) >= 2:
        a, b = inside[0], inside[-1]
        totals = cumulative([a, b], HEAVY)
        window = (b.sent + b.done) / 2 - (a.sent + a.done) / 2
        rate = (totals[1] - totals[0]) / window
        out.update({"heavy_charged_tokens": totals[1] - totals[0], "rate_window_s": round(window, 2),
                    "heavy_charged_rate": round(rate, 2), "share_of_limit": round(rate / heavy_limit, 3)})
    engines = len(samples[0].charged) if samples else 0
    out["longest_silence_s"] = [round(longest_silence(samples, i, load_from, load_to), 2)
                                for i in range(engines)]
    gaps = [b.sent - a.sent for a, b in zip(samples, samples[1:]) if load_from <= a.sent <= load_to]
    out["longest_read_gap_s"] = round(max(gaps), 2) if gaps else None
    out["meets_targets"] = bool(
        out.get("share_of_limit") is not None and out["share_of_limit"] >= TARGET_SHARE
        and max(out["longest_silence_s"], default=0.0) <= TARGET_SILENCE_S)
    return out


def runs_lines(runs: list[Mapping[str, Any]], heavy_limit: float) -> list[str]:
    """The per-run table of the targets (engines' counters)."""
    if not runs:
        return []
    lines = [
        f"Each of {len(runs)} consecutive runs (fresh Redis and engines each), judged on the engines' own "
        f"counters (admin route read every {READ_EVERY_S:g} s): `{HEAVY}`'s charged tokens summed over the "
        f"engines from {RATE_WARMUP_S:g} s into the load to its end (target ≥ {TARGET_SHARE:g} × "
        f"{heavy_limit:g} tok/s), and each engine's longest time with no token charged while the load ran "
        f"(target ≤ {TARGET_SILENCE_S:g} s).",
        "",
        "| run | started (UTC) | load avg before / after | heavy charged tok/s | of the limit | "
        "longest engine silence s | longest gap between reads s | targets |",
        "| ---: | --- | --- | ---: | ---: | --- | ---: | --- |",
    ]
    for i, run in enumerate(runs, 1):
        c = run["counters"]
        rate, share = c.get("heavy_charged_rate"), c.get("share_of_limit")
        lines.append(
            f"| {i} | {run['started_at']} | {runkit.fmt_load(run['load_before'])} / "
            f"{runkit.fmt_load(run['load_after'])} | {num(rate)} | "
            f"{'-' if share is None else format(share, '.2f')} | "
            f"{' / '.join(f'{x:.2f}' for x in c['longest_silence_s'])} | {num(c.get('longest_read_gap_s'))} | "
            f"{'met' if c['meets_targets'] else '**missed**'} |")
    return lines


def worker_placement(worker_cpus: Mapping[str, Any] | None, urls: list[str]) -> str:
    """Where each engine's model worker ran, as read once the engines were up
    (runs recorded before the engines had their own CPUs carry none)."""
    if not worker_cpus:
        return ""
    names = engine_names(urls)
    where = "; ".join(
        f"{names[url]}: CPU {','.join(str(cpu) for cpus in worker_cpus[url] for cpu in cpus) or '?'}"
        for url in urls if worker_cpus.get(url) is not None)
    return f"Model workers: {where}." if where else ""


def run_figures(document: Mapping[str, Any]) -> dict[str, Any]:
    """What the per-run table keeps of one run."""
    cluster = document["cluster"]
    return {"started_at": cluster["started_at"], "load_before": cluster["load_before"],
            "load_after": cluster["load_after"], "counters": cluster["counters"],
            "worker_cpus": cluster["worker_cpus"]}


def run_once(args: argparse.Namespace, argv: list[str], out: Path) -> dict[str, Any]:
    """One run: a fresh redis-server and engines, the bench, the engines' counters."""
    started_at = runkit.start_report(SCHEMA)  # prints the machine and the load
    with RedisProcess() as redis_srv:
        print(f"redis-server on 127.0.0.1:{redis_srv.port} (pid {redis_srv.pid})", flush=True)
        server_args = engine_args(args, redis_srv.url)
        print(f"starting {args.engines} engines: vllm-output-rate serve {args.model} "
              f"{shlex.join(server_args)}", flush=True)
        names = [f"demo-cluster-engine{i + 1}" for i in range(args.engines)]
        # The admin route: the engines' own per-user counters, read while the bench runs.
        with runkit.running_engines([(name, server_args) for name in names], out.parent,
                                      model=args.model, side_by_side=True,
                                      env=serverproc.ADMIN_ROUTE_ENV) as servers:
            urls = [srv.base_url for srv in servers]
            worker_cpus = {srv.base_url: runkit.worker_cpus(srv.pid) for srv in servers}
            print("engines ready: " + ", ".join(
                f"{srv.base_url} (pid {srv.pid}, model worker on CPUs {worker_cpus[srv.base_url]})"
                for srv in servers) + f"; bench for {args.duration:g} s", flush=True)
            reader = CounterReader(lambda: [(url, 0) for url in urls], period_s=READ_EVERY_S).start()
            load_from = time.monotonic()
            try:
                document = bench.main(bench_argv(args, urls))
            finally:
                samples = reader.stop()
            outages = {srv.base_url: srv.log_path.read_text(errors="replace").count("unreachable")
                       for srv in servers}
        print("engines stopped", flush=True)
    print("redis-server stopped", flush=True)
    head = runkit.finish_report(started_at)
    document = dict(document)
    document["schema_cluster"] = SCHEMA
    document["machine"] = runkit.machine_facts()
    document["cluster"] = {
        "command": shlex.join(["vllm-output-rate", "demo-cluster", *argv]),
        "engines": args.engines,
        "engine_args": server_args,
        "cpu_bindings": {srv.base_url: srv.cpu_binding for srv in servers},
        "worker_cpus": worker_cpus,
        "heavy_user": HEAVY, "light_user": LIGHT, "heavy_limit": args.heavy_limit,
        "store_outages_logged": outages,
        "started_at": head["started_at"], "load_before": head["load_before"], "load_after": head["load_after"],
        "counters": counter_figures(samples, load_from, load_from + args.duration, args.heavy_limit),
        "counter_read_failures": reader.failed_reads,
    }
    return document


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.engines < 1 or args.runs < 1:
        raise SystemExit("vllm-output-rate demo-cluster: error: --engines and --runs must be >= 1")
    out = Path(args.out)
    if args.render_only:
        document = json.loads(out.with_name(out.name + ".json").read_text())
        print(f"wrote {render_outputs(document, out)}")
        return document
    out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    for run in range(1, args.runs + 1):
        if args.runs > 1:
            print(f"\n== run {run} of {args.runs} ==", flush=True)
        document = run_once(args, argv, out)
        runs.append(run_figures(document))
        c = runs[-1]["counters"]
        print(f"run {run}: {HEAVY} charged {num(c.get('heavy_charged_rate'))} tok/s on the engines "
              f"({num(c.get('share_of_limit'), 2)} of the limit), longest engine silence "
              f"{c['longest_silence_s']} s, load avg {runkit.fmt_load(runs[-1]['load_before'])} -> "
              f"{runkit.fmt_load(runs[-1]['load_after'])}: "
              f"{'targets met' if c['meets_targets'] else 'TARGETS MISSED'}", flush=True)
    document["cluster"]["runs"] = runs
    document = with_rates_under_load(document)
    path = out.with_name(out.name + ".json")
    path.write_text(json.dumps(document, indent=1) + "\n")
    png = render_outputs(document, out)
    print(f"\nwrote {path} and {png}")
    return document


if __name__ == "__main__":
    main()
