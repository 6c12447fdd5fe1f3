"""``vllm-output-rate bench``: drive many users against a server, check each rate.

Usage::

    vllm-output-rate bench --url http://127.0.0.1:8000 \\
        --user user-a:4 --user user-b:2:100 --user -:2 \\
        --duration 30 --limit user-a=20 --default-limit 100 \\
        --json results/bench.json --plot results/bench.png

``--user NAME:STREAMS[:MAX_TOKENS]`` keeps STREAMS streaming completions in
flight for user NAME (each re-issued as soon as it finishes) until
``--duration`` ends; MAX_TOKENS defaults to 200.  The reserved NAME ``-``
means *no identity*: those requests carry no ``vllm_xargs`` field, so the
server files them under the shared anonymous user (``__anonymous__``).  A name
is split from the right, so it may contain ``:`` as long as it does not end
in ``:NUMBER``.

The server does not report limits, so ``--limit NAME=RATE`` (``-`` again for
the anonymous user) and ``--default-limit RATE`` tell the bench what to check
against; users with no known limit are reported but not checked ("n/a").

Several engines: ``--url`` may be given more than once (the engines of one
deployment, normally sharing a quota store through ``--output-rate-store``).
The streams are dealt out round-robin over the URLs in the order the users
are given, continuing from user to user (``--user a:4 --user b:1`` over two
URLs: a's streams go to URLs 1, 2, 1, 2, b's to URL 1), so a user with at
least as many streams as there are engines loads every engine.  Every
figure and the verdict count a user's tokens summed over all engines; the
verdict then uses the bound across engines sharing a store (``--shared-store``
asks for it with a single URL too; see :mod:`.analysis`).  The plugin's
per-user counter ``vllm:output_rate_output_tokens_charged_total`` is read
from every engine's ``/metrics`` before and after the run; the report shows
the difference per engine and summed (server-side charged tokens) next to
what the client received.

Layers: :mod:`.measure` (streaming client, window convention, Prometheus),
:mod:`.analysis` (per-user figures and the guarantee verdict, documented
there), :mod:`.render` (tables and figures); this module drives the run and
is the command line.

The GPU twin's workload (``--scenario twin``, issue 44): the users of
:mod:`.workload` -- four hard-capped heavy users, six weighted borrowers (two
with ceilings), a group of two, and a Pareto long tail of 50 tok/s users
sending open-loop requests -- scaled by ``--concurrency`` R and ``--users``::

    vllm-output-rate bench --scenario twin --concurrency 256 --users 10000 \\
        --limits-out twin-limits.json --dry-run      # write the limits, print the serve flags
    vllm-output-rate bench --scenario twin --concurrency 256 --users 10000 \\
        --url http://127.0.0.1:8000 --duration 60 --json twin.json

prints the twin's table (``benchmarks/gpu_twin.py``) for this one engine:
throughput, every capped user's charged tokens over its limit, the group's,
Jain's index and the largest weighted service gap among backlogged borrowers
per window -- all on the engine's ``/metrics`` counters -- and the long
tail's first-token p50/p99 on the client's clock.  See the section at the end
of this module.

``--json OUT.json`` writes one object: ``schema``, ``command``, ``started_at``
(UTC), ``config``, ``wall_s``, ``client`` (event-loop lag of the bench
itself), ``totals``, ``summary`` (one :class:`UserSummary` per user) and
``requests`` (one :class:`RequestRecord` per request, with the ``url`` it
went to), and ``server`` (charged tokens per engine and user from
``/metrics``, when the engines export them).
:func:`summarize_document` redoes the analysis from it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from vllm_output_rate.settings import ANONYMOUS_USER, USER_ARG
from vllm_output_rate.tools.analysis import (
    BURST_S,
    DEFAULT_WINDOWS_S,
    UserSummary,
    guarantee_bound,
    loop_lag_summary,
    summarize,
    totals,
)
from vllm_output_rate.tools.measure import (
    CANCELLED,
    CHARGED_TOKENS,
    DEFAULT_PROMPT,
    ERROR,
    ERROR_STATUSES,
    FINISHED,
    HTTP_ERROR,
    RUNNING,
    RUNNING_GAUGE,
    WAITING_GAUGE,
    RequestRecord,
    metric_sum,
    openai_client,
    parse_metrics,
    per_label,
    percentile,
    stream_body,
    stream_completion,
    watch_loop_lag,
)
from vllm_output_rate.tools.render import format_report, plot_run

PROG = "vllm-output-rate bench"
SCHEMA = "vllm-output-rate-bench/3"
DEFAULT_URL = "http://127.0.0.1:8000"
#: After the run, /metrics is read until two readings this far apart agree
#: (the engine reports its per-user counters about once a second, and at
#: once when it empties), for at most METRICS_SETTLE_MAX_S.
METRICS_SETTLE_S = 0.5
METRICS_SETTLE_MAX_S = 4.0

#: The CLI name that selects the anonymous user (no ``vllm_xargs`` sent).
ANONYMOUS_CLI_NAME = "-"
DEFAULT_MAX_TOKENS = 200
DEFAULT_GRACE_S = 30.0
#: Pause after a failed request so a broken server is not hammered in a tight loop.
ERROR_BACKOFF_S = 0.2
#: The bench's own event loop stalled this long or longer: its streams were not kept in
#: flight, so what it measured may be the client's pace, not the server's.  On a 2-core
#: machine beside a busy engine a 25-stream bench stalled up to 3 s; run from a session at
#: a higher priority, 46 ms.
CLIENT_LAG_WARNING_S = 0.5


@dataclass(frozen=True)
class UserSpec:
    """One ``--user NAME:STREAMS[:MAX_TOKENS]``."""

    user: str  # rate-limit identity (ANONYMOUS_USER for "-")
    streams: int
    max_tokens: int = DEFAULT_MAX_TOKENS

    @property
    def sends_identity(self) -> bool:
        return self.user != ANONYMOUS_USER


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


class BenchError(Exception):
    """A problem that ends the bench with a one-line message."""


def parse_user_spec(text: str) -> UserSpec:
    """``NAME:STREAMS[:MAX_TOKENS]``; NAME ``-`` is the anonymous user."""
    parts = text.split(":")

    def is_count(s: str) -> bool:
        return s.isdigit()

    if len(parts) >= 3 and is_count(parts[-1]) and is_count(parts[-2]):
        name, streams, max_tokens = ":".join(parts[:-2]), int(parts[-2]), int(parts[-1])
    elif len(parts) >= 2 and is_count(parts[-1]):
        name, streams, max_tokens = ":".join(parts[:-1]), int(parts[-1]), DEFAULT_MAX_TOKENS
    else:
        raise argparse.ArgumentTypeError(
            f"expected NAME:STREAMS[:MAX_TOKENS], got {text!r}"
        )
    if not name:
        raise argparse.ArgumentTypeError(f"empty user name in {text!r}")
    if streams < 1 or max_tokens < 1:
        raise argparse.ArgumentTypeError(f"STREAMS and MAX_TOKENS must be >= 1 in {text!r}")
    user = ANONYMOUS_USER if name == ANONYMOUS_CLI_NAME else name
    return UserSpec(user=user, streams=streams, max_tokens=max_tokens)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value


def parse_limit(text: str) -> tuple[str, float]:
    """``NAME=RATE``; NAME ``-`` is the anonymous user."""
    name, sep, rate = text.rpartition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=RATE, got {text!r}")
    user = ANONYMOUS_USER if name == ANONYMOUS_CLI_NAME else name
    return user, _positive_float(rate)


def parse_windows(text: str) -> tuple[float, ...]:
    return tuple(_positive_float(part) for part in text.split(",") if part.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Keep streaming completions in flight for several users and report "
            "each user's output rate, share, the rate-limit guarantee (judged on "
            "data receive stalls cannot inflate), TTFT and inter-token gaps."
        ),
        epilog=(
            f"NAME '{ANONYMOUS_CLI_NAME}' (in --user and --limit) is the anonymous "
            f"user: its requests carry no vllm_xargs.{USER_ARG} and share the "
            f"server's {ANONYMOUS_USER!r} quota."
        ),
    )
    parser.add_argument(
        "--url", dest="urls", action="append", metavar="URL",
        help=f"server base URL (default {DEFAULT_URL}); repeat it for several engines: each "
        "user's streams are spread over them round-robin",
    )
    parser.add_argument(
        "--shared-store", action="store_true",
        help="judge against the bound across engines sharing a quota store (the default "
        "with several --url)",
    )
    parser.add_argument(
        "--user",
        dest="users_given",
        action="append",
        type=parse_user_spec,
        metavar="NAME:STREAMS[:MAX_TOKENS]",
        help=f"a user and its concurrent streams (MAX_TOKENS default {DEFAULT_MAX_TOKENS}); repeatable",
    )
    parser.add_argument(
        "--duration", type=_positive_float, metavar="SECONDS",
        help="how long to keep issuing requests (required)",
    )
    parser.add_argument(
        "--grace", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
        help="after --duration, wait this long for in-flight requests, then cancel them "
        f"(default {DEFAULT_GRACE_S:g})",
    )
    parser.add_argument("--model", help="model name (default: first id of GET /v1/models)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text of every request")
    parser.add_argument(
        "--limit", dest="limits", action="append", type=parse_limit, default=[],
        metavar="NAME=RATE", help="the server's limit of NAME in tok/s, to check against; repeatable",
    )
    parser.add_argument(
        "--default-limit", type=_positive_float, metavar="RATE",
        help="limit of users without --limit, to check against",
    )
    parser.add_argument(
        "--windows", type=parse_windows, default=DEFAULT_WINDOWS_S, metavar="W1,W2,...",
        help="window lengths in seconds for the guarantee check (default 1,2,5; "
        "the full active span is always checked too)",
    )
    parser.add_argument("--json", dest="json_path", metavar="OUT.json", help="write raw data and summary")
    parser.add_argument("--plot", dest="plot_path", metavar="OUT.png", help="draw output rate over time and cumulative tokens per user")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it is also off when stdout is not a terminal)")
    add_twin_arguments(parser)
    return parser


@dataclass
class BenchConfig:
    urls: list[str]
    users: list[UserSpec]
    duration_s: float
    grace_s: float = DEFAULT_GRACE_S
    model: str | None = None
    prompt: str = DEFAULT_PROMPT
    progress: bool = False
    shared_store: bool = False

    @property
    def url(self) -> str:
        """The first engine's URL."""
        return self.urls[0]


def assign_urls(users: Sequence[UserSpec], urls: Sequence[str]) -> dict[tuple[str, int], str]:
    """(user, stream) -> URL: streams dealt out round-robin over ``urls``, in
    user order, the count running on from one user to the next."""
    out: dict[tuple[str, int], str] = {}
    k = 0
    for spec in users:
        for stream in range(spec.streams):
            out[(spec.user, stream)] = urls[k % len(urls)]
            k += 1
    return out


def request_body(config: BenchConfig, model: str, spec: UserSpec) -> dict[str, Any]:
    return stream_body(model, spec.user if spec.sends_identity else None, spec.max_tokens, config.prompt)


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


async def stream_worker(client: Any, config: BenchConfig, model: str, spec: UserSpec, stream: int,
                        records: list[RequestRecord], t0: float, deadline: float,
                        url: str | None = None) -> None:
    """Keep one request of ``spec`` in flight until the deadline (on ``client``,
    the engine at ``url``)."""
    body = request_body(config, model, spec)
    while time.monotonic() < deadline:
        record = RequestRecord(user=spec.user, stream=stream, start=time.monotonic() - t0, url=url)
        records.append(record)  # visible to the progress bar, kept even if cancelled
        await stream_completion(client, body, record, t0)
        if record.status in ERROR_STATUSES:
            await asyncio.sleep(ERROR_BACKOFF_S)


async def discover_model(client: Any, url: str, model: str | None) -> str:
    """Check the server answers and pick the model; BenchError otherwise."""
    import openai

    try:
        models = await client.models.list()
    except openai.APIConnectionError as exc:
        raise BenchError(f"cannot reach server at {url}: {type(exc).__name__}: {exc}") from None
    except openai.APIStatusError as exc:
        if model is not None:
            return model  # any HTTP answer proves the server is there
        raise BenchError(f"GET {url}/v1/models returned HTTP {exc.status_code}") from None
    if model is not None:
        return model
    if not models.data:
        raise BenchError(f"GET {url}/v1/models listed no model; pass --model")
    return models.data[0].id


async def discover_models(clients: Mapping[str, Any], model: str | None) -> str:
    """:func:`discover_model` on every engine; they must serve the same model."""
    found = {url: await discover_model(client, url, model) for url, client in clients.items()}
    names = set(found.values())
    if len(names) > 1:
        raise BenchError("the engines serve different models: "
                         + ", ".join(f"{url} {name}" for url, name in found.items()) + "; pass --model")
    return names.pop()


Charged = dict[str, dict[str, float]]  # url -> user -> charged tokens


async def read_charged(urls: Sequence[str]) -> dict[str, dict[str, float] | None]:
    """Each engine's per-user charged-token counter; None where ``/metrics``
    cannot be read.  An engine without the series (plugin off, no user yet)
    gives an empty dict."""
    import httpx

    out: dict[str, dict[str, float] | None] = {}
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as http:
        for url in urls:
            try:
                response = await http.get(url.rstrip("/") + "/metrics")
                out[url] = (per_label(parse_metrics(response.text), CHARGED_TOKENS, "user")
                            if response.status_code == 200 else None)
            except Exception:  # noqa: BLE001 -- any failure: no server-side figure
                out[url] = None
    return out


async def read_charged_settled(urls: Sequence[str]) -> dict[str, dict[str, float] | None]:
    """:func:`read_charged` once the counters stopped moving (or after
    METRICS_SETTLE_MAX_S): the engine reports them about once a second."""
    deadline = time.monotonic() + METRICS_SETTLE_MAX_S
    reading = await read_charged(urls)
    while time.monotonic() < deadline and any(v for v in reading.values()):
        await asyncio.sleep(METRICS_SETTLE_S)
        again = await read_charged(urls)
        if again == reading:
            break
        reading = again
    return reading


def charged_delta(before: Mapping[str, Mapping[str, float] | None],
                  after: Mapping[str, Mapping[str, float] | None]) -> Charged:
    """Per engine and user, what the counter grew by during the run.  Engines
    unreadable at either end, or without the series at the end, are left out."""
    out: Charged = {}
    for url, now in after.items():
        then = before.get(url)
        if now is None or then is None or not now:
            continue
        out[url] = {user: value - then.get(user, 0.0) for user, value in now.items()}
    return out


class Progress:
    """tqdm bar over the run's duration, with live token/request counts."""

    def __init__(self, enabled: bool, duration_s: float):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=round(duration_s, 1), unit="s", desc="running",
                            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f}s {postfix}")

    def update(self, elapsed: float, records: Sequence[RequestRecord], draining: bool) -> None:
        if self.bar is None:
            return
        tokens = sum(r.n_tokens for r in records)
        in_flight = sum(1 for r in records if r.status == RUNNING)
        errors = sum(1 for r in records if r.status in ERROR_STATUSES)
        if draining:
            self.bar.set_description("draining", refresh=False)
        self.bar.n = min(round(elapsed, 1), self.bar.total)
        self.bar.set_postfix_str(f"tokens={tokens} in_flight={in_flight} errors={errors}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class RunOutcome:
    model: str
    started_at: str  # wall clock, ISO 8601 UTC
    wall_s: float  # whole run including drain
    records: list[RequestRecord]
    loop_lag_s: list[float] = field(default_factory=list)  # see measure.watch_loop_lag
    server_charged: Charged = field(default_factory=dict)  # see charged_delta


async def run_bench(config: BenchConfig) -> RunOutcome:
    """Drive all users for ``config.duration_s``; return what was recorded."""
    placement = assign_urls(config.users, config.urls)
    per_url = {url: sum(1 for u in placement.values() if u == url) for url in config.urls}
    clients = {url: openai_client(url, max_connections=per_url[url] + 4) for url in config.urls}
    async with contextlib.AsyncExitStack() as stack:
        for client in clients.values():
            await stack.enter_async_context(client)
        model = await discover_models(clients, config.model)
        charged_before = await read_charged(config.urls)
        records: list[RequestRecord] = []
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        t0 = time.monotonic()
        deadline = t0 + config.duration_s
        workers = []
        for spec in config.users:
            for stream in range(spec.streams):
                url = placement[(spec.user, stream)]
                workers.append(asyncio.create_task(stream_worker(
                    clients[url], config, model, spec, stream, records, t0, deadline, url)))
        loop_lag: list[float] = []
        lag_watcher = asyncio.create_task(watch_loop_lag(loop_lag))
        progress = Progress(config.progress, config.duration_s)
        try:
            grace_end = deadline + max(config.grace_s, 0.0)
            pending = set(workers)
            while pending:
                now = time.monotonic()
                if now >= grace_end:
                    break
                _, pending = await asyncio.wait(pending, timeout=min(0.25, grace_end - now))
                progress.update(time.monotonic() - t0, records, draining=time.monotonic() >= deadline)
            for task in pending:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            lag_watcher.cancel()
            progress.close()
        wall_s = time.monotonic() - t0
        charged = charged_delta(charged_before, await read_charged_settled(config.urls))
    for record in records:
        if record.status == RUNNING:  # cancelled before its request began
            record.status = CANCELLED
    return RunOutcome(model, started_at, wall_s, records, loop_lag, charged)


# --------------------------------------------------------------------------
# Output and main
# --------------------------------------------------------------------------


def result_document(argv: Sequence[str], config: BenchConfig, limits: Mapping[str, float],
                    default_limit: float | None, windows_s: Sequence[float], outcome: RunOutcome,
                    summaries: Sequence[UserSummary]) -> dict[str, Any]:
    """Everything needed to redo the analysis, plus the summary."""
    return {
        "schema": SCHEMA,
        "command": shlex.join(["vllm-output-rate", "bench", *argv]),
        "started_at": outcome.started_at,
        "config": {
            "url": config.url,
            "urls": list(config.urls),
            "shared_store": config.shared_store,
            "model": outcome.model,
            "prompt": config.prompt,
            "duration_s": config.duration_s,
            "grace_s": config.grace_s,
            "users": [asdict(spec) for spec in config.users],
            "limits": dict(limits),
            "default_limit": default_limit,
            "burst_s": BURST_S,
            "windows_s": list(windows_s),
            "time_origin": "seconds since the first requests were issued (time.monotonic)",
        },
        "wall_s": outcome.wall_s,
        "client": loop_lag_summary(outcome.loop_lag_s),
        "totals": totals(outcome.records),
        "summary": [s.to_dict() for s in summaries],
        "requests": [r.to_dict() for r in outcome.records],
        "server": {
            "charged_tokens": outcome.server_charged,
            "source": f"{CHARGED_TOKENS} per engine and user: reading after the run minus before",
        },
    }


def records_from_document(document: Mapping[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r) for r in document.get("requests", [])]


def limits_from_document(document: Mapping[str, Any]) -> dict[str, float | None]:
    """Each user's limit as the run checked it."""
    return {s["user"]: s.get("limit_tokens_per_s") for s in document.get("summary", [])}


def summarize_document(document: Mapping[str, Any]) -> list[UserSummary]:
    """Redo the analysis from a ``--json`` file's raw data."""
    config = document["config"]
    return summarize(
        records_from_document(document),
        config.get("limits") or {},
        config.get("default_limit"),
        {u["user"]: u["streams"] for u in config.get("users", [])},
        config.get("windows_s") or DEFAULT_WINDOWS_S,
        config.get("burst_s", BURST_S),
        (document.get("client") or {}).get("loop_lag_max_s") or 0.0,
        bool(config.get("shared_store", False)),
        (document.get("server") or {}).get("charged_tokens") or {},
    )


def _fail(message: str, code: int = 1) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def attach_anonymous_values(argv: Sequence[str]) -> list[str]:
    """Rewrite ``--user -:2`` as ``--user=-:2`` (and the same for ``--limit -=5``).

    argparse takes a value starting with "-" for an option and then complains
    that ``--user`` has no argument; the attached form is unambiguous.
    """
    out: list[str] = []
    args = iter(argv)
    for arg in args:
        if arg in ("--user", "--limit"):
            value = next(args, None)
            if value is not None and value.startswith(ANONYMOUS_CLI_NAME):
                out.append(f"{arg}={value}")
                continue
            out.append(arg)
            if value is not None:
                out.append(value)
            continue
        out.append(arg)
    return out


def client_lag_warning(lag_max_s: float | None) -> str | None:
    """What to tell the operator when the bench itself stalled (None: it did not)."""
    if lag_max_s is None or lag_max_s < CLIENT_LAG_WARNING_S:
        return None
    return (
        f"this client stalled for up to {lag_max_s:.1f} s (its event loop was not run): it did "
        "not keep its streams in flight, so each user's tok/s and share may be the client's "
        "pace, not the server's. Run the bench on another machine, or with more CPU (on "
        "Linux with autogroups: a session of its own with `nice -n -10` and -10 in "
        "/proc/self/autogroup)."
    )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the bench; returns the result document (also written with ``--json``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(attach_anonymous_values(argv))
    if args.scenario == "twin":
        if args.users_given:
            parser.error("--user and --scenario twin exclude each other (the scenario brings its users)")
        return twin_main(args, argv)
    if not args.users_given:
        parser.error("the following arguments are required: --user (or --scenario twin)")
    if args.duration is None:
        parser.error("the following arguments are required: --duration")
    users: list[UserSpec] = args.users_given
    seen = [spec.user for spec in users]
    duplicates = sorted({u for u in seen if seen.count(u) > 1})
    if duplicates:
        parser.error(f"user given more than once: {', '.join(duplicates)}")
    limits = dict(args.limits)
    urls = list(dict.fromkeys(u.rstrip("/") for u in (args.urls or [DEFAULT_URL])))
    if len(urls) < len(args.urls or [DEFAULT_URL]):
        parser.error("the same --url given more than once")
    config = BenchConfig(
        urls=urls, users=users, duration_s=args.duration, grace_s=args.grace,
        model=args.model, prompt=args.prompt,
        progress=not args.no_progress and sys.stdout.isatty(),
        shared_store=args.shared_store or len(urls) > 1,
    )
    try:
        outcome = asyncio.run(run_bench(config))
    except BenchError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted", 130)

    lag = loop_lag_summary(outcome.loop_lag_s)
    streams = {spec.user: spec.streams for spec in users}
    summaries = summarize(outcome.records, limits, args.default_limit, streams, args.windows,
                          BURST_S, lag["loop_lag_max_s"] or 0.0, config.shared_store,
                          outcome.server_charged)
    count = totals(outcome.records)
    print(
        f"{' '.join(config.urls)}  model={outcome.model}  duration={config.duration_s:g}s  "
        f"wall={outcome.wall_s:.1f}s  requests={count['requests']}  "
        f"finished={count['finished']}  cancelled={count['cancelled']}  "
        f"errors={count['errors']}  tokens={count['tokens']}"
    )
    print(format_report(summaries, BURST_S))
    if lag["loop_lag_max_s"] is not None:
        print(f"client event-loop lag: p99 {lag['loop_lag_p99_s'] * 1000:.0f} ms, "
              f"max {lag['loop_lag_max_s'] * 1000:.0f} ms")
    warning = client_lag_warning(lag["loop_lag_max_s"])
    if warning:
        print(f"\nwarning: {warning}")
    errors = [r for r in outcome.records if r.error]
    if errors:
        print(f"\nfirst error: [{errors[0].user}] {errors[0].error}")

    document = result_document(argv, config, limits, args.default_limit, args.windows, outcome, summaries)
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {path}")
    if args.plot_path:
        path = Path(args.plot_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_run(outcome.records, {s.user: s.limit_tokens_per_s for s in summaries}, path,
                 title=f"Output tokens per user ({outcome.model})")
        print(f"wrote {path}")
    return document


# --------------------------------------------------------------------------
# Scenario "twin": the GPU twin's workload against a real server
# --------------------------------------------------------------------------
#
# ``--scenario twin`` drives the users of :mod:`.workload` (the twin's heavy
# capped users, weighted borrowers, a group and a Pareto long tail) and prints
# the twin's figures, each with its clock:
#
# * **engine counters**: what the engine's ``/metrics`` says it charged and
#   generated, read from a thread every ``--read-every`` seconds.  The engine
#   publishes its per-user counters about once a second, so a read may be up
#   to ~1 s old; after the load the counters are read until the engine is
#   empty and they stopped moving, so totals are complete.  Rates divide them
#   by seconds of the client's clock (the load's duration, or the time
#   between two reads): client *receive* times never enter them.
# * **client clock**: first-token times (send to first token received), which
#   include the client's own stalls; the engine's own figure is shown beside
#   them when the server sends per-request metrics.

TWIN_SCHEMA = "vllm-output-rate-bench-twin/1"
SCENARIOS = ("twin",)
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_CHARGED = "vllm:output_rate_prompt_tokens_charged_total"
USER_REQUESTS = "vllm:output_rate_requests"
BACKLOG_STATES = ("throttled", "waiting")
USER_LIMIT = "vllm:output_rate_limit_tokens_per_second"
STORE_MODE_SERIES = "vllm:output_rate_store_mode"
#: The series a twin read keeps (the rest of /metrics is skipped before parsing).
TWIN_SERIES = frozenset({CHARGED_TOKENS, PROMPT_CHARGED, USER_REQUESTS, USER_LIMIT, GENERATION_TOKENS,
                         STORE_MODE_SERIES, "vllm:num_requests_running", "vllm:num_requests_waiting"})
#: Prompt token ids are drawn from this range: inside the tiny model's vocabulary
#: (689) and every real one, above the special tokens.
PROMPT_ID_RANGE = (10, 680)
DEFAULT_CONCURRENCY = 256
DEFAULT_TWIN_USERS = 10_000
DEFAULT_FAIRNESS_WINDOW_S = 10.0
DEFAULT_READ_EVERY_S = 1.0
#: After the load: read until the engine is empty and its counters stopped moving, at most this long.
SETTLE_MAX_S = 20.0
ENGINE = "engine counters"
CLIENT = "client clock"


def add_twin_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "scenario twin", "the GPU twin's workload (benchmarks/gpu_twin.py) against a real server; "
        "start the server with the limits file --limits-out writes")
    group.add_argument("--scenario", choices=SCENARIOS, help="run a built-in workload instead of --user streams")
    group.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, metavar="R",
                       help=f"running requests the engine is sized for: streams and rates scale with it "
                       f"(default {DEFAULT_CONCURRENCY})")
    group.add_argument("--users", type=int, default=DEFAULT_TWIN_USERS, metavar="N",
                       help="configured users in all, twelve named ones and a long tail "
                       f"(default {DEFAULT_TWIN_USERS:,})")
    group.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    group.add_argument("--capacity", type=_positive_float, metavar="TOK_S",
                       help="the engine's output tokens per second, which sets the long tail's arrival rate "
                       "(default: R requests every 20 ms)")
    group.add_argument("--light-share", type=float, default=0.10, metavar="F",
                       help="the long tail's share of --capacity (default 0.10)")
    group.add_argument("--length-scale", type=_positive_float, default=1.0, metavar="F",
                       help="multiply every prompt and output length (default 1; 0.1 fits a 512-token model)")
    group.add_argument("--kv-pressure", action="store_true",
                       help="heavy users send 384-512 prompt and 1,000-1,500 output tokens (times --length-scale)")
    group.add_argument("--burst-seconds", type=_positive_float, metavar="SECONDS",
                       help="the serve command's --output-rate-burst-seconds: at least the engine's longest "
                       "step (default: the plugin's, 0.1 s; a GPU at hundreds of running requests wants "
                       "about 0.3 s)")
    group.add_argument("--tail-only", action="store_true",
                       help="send only the long tail's requests (the same ones): the baseline its "
                       "first-token times are compared with")
    group.add_argument("--fairness-window", type=_positive_float, default=DEFAULT_FAIRNESS_WINDOW_S,
                       metavar="SECONDS",
                       help=f"window of Jain's index and the service gap (default {DEFAULT_FAIRNESS_WINDOW_S:g})")
    group.add_argument("--read-every", type=_positive_float, default=DEFAULT_READ_EVERY_S, metavar="SECONDS",
                       help=f"read the engine's /metrics this often (default {DEFAULT_READ_EVERY_S:g})")
    group.add_argument("--limits-out", metavar="FILE", help="write the scenario's limits file here ('-': print it)")
    group.add_argument("--dry-run", action="store_true",
                       help="write --limits-out, print the workload and the serve flags, send nothing")


def twin_workload(args: argparse.Namespace, duration_s: float):
    from vllm_output_rate.tools.workload import build_twin_workload

    try:
        workload = build_twin_workload(
            args.concurrency, users=args.users, duration_s=duration_s, seed=args.seed,
            capacity_tok_s=args.capacity, light_share=args.light_share, length_scale=args.length_scale,
            kv_pressure=args.kv_pressure, burst_s=args.burst_seconds)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    if args.tail_only:  # the twin's "alone": the same long-tail requests, nobody else sending
        workload.streams, workload.capped, workload.borrowers = {}, {}, {}
    return workload


def describe_workload(workload, duration_s: float) -> str:
    light_users = len(workload.in_quota)
    per_user: dict[str, int] = {}
    for _, user, _, _ in workload.arrivals:
        per_user[user] = per_user.get(user, 0) + 1
    busiest = max(per_user.values(), default=0)
    return (f"twin workload (seed {workload.seed}, R={workload.concurrency}): "
            f"{len(workload.users):,} configured users; "
            f"{workload.stream_count} closed-loop streams of {len(workload.streams)} heavy users; "
            f"{len(workload.arrivals)} open-loop requests in {duration_s:g} s from {light_users} of the long tail "
            f"(the busiest sends {busiest})")


# -- reading the engine ------------------------------------------------------------


@dataclass
class EngineRead:
    """One read of ``/metrics`` (times: ``time.monotonic()`` just before and after)."""

    sent: float
    done: float
    output: dict[str, float]  # user -> output tokens charged
    prompt: dict[str, float]  # user -> prompt tokens charged (before the weight)
    backlog: dict[str, float]  # user -> requests held for quota or waiting
    limits: dict[str, float]  # user -> configured rate
    generated: float  # vllm:generation_tokens_total
    in_engine: float  # requests running + waiting
    shared_store: bool

    def charged(self, user: str, weight: float) -> float:
        return self.output.get(user, 0.0) + weight * self.prompt.get(user, 0.0)


def engine_read(text: str, sent: float, done: float) -> EngineRead:
    """The figures of one ``/metrics`` text the twin scenario uses."""
    kept = []
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in TWIN_SERIES:
            kept.append(line)
    samples = parse_metrics("\n".join(kept) + "\n")
    # Backlogged as the engine's own fairness gauges count it: a request held
    # for quota or waiting.  A borrower whose requests all ran got what it asked.
    backlog: dict[str, float] = {}
    for labels, value in samples.get(USER_REQUESTS, []):
        if "user" in labels and labels.get("state") in BACKLOG_STATES:
            backlog[labels["user"]] = backlog.get(labels["user"], 0.0) + value
    return EngineRead(
        sent, done,
        output=per_label(samples, CHARGED_TOKENS, "user"),
        prompt=per_label(samples, PROMPT_CHARGED, "user"),
        backlog=backlog,
        limits={u: v for u, v in per_label(samples, USER_LIMIT, "user").items()},
        generated=metric_sum(samples, GENERATION_TOKENS) or 0.0,
        in_engine=(metric_sum(samples, RUNNING_GAUGE) or 0.0) + (metric_sum(samples, WAITING_GAUGE) or 0.0),
        shared_store=STORE_MODE_SERIES in samples,
    )


class MetricsReader:
    """Reads one engine's ``/metrics`` every ``period_s`` from a thread of its
    own (parsing a large ``/metrics`` must not stall the streams' event loop)."""

    def __init__(self, url: str, period_s: float) -> None:
        import httpx

        self.url = url.rstrip("/") + "/metrics"
        self.period_s = period_s
        self.reads: list[EngineRead] = []
        self.failed = 0
        self._http = httpx.Client(timeout=30.0, trust_env=False)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read_now(self) -> EngineRead | None:
        with self._lock:
            sent = time.monotonic()
            try:
                response = self._http.get(self.url)
                response.raise_for_status()
                text = response.text
            except Exception:  # noqa: BLE001 -- a missed read is counted, the next one tries again
                self.failed += 1
                return None
            read = engine_read(text, sent, time.monotonic())
            self.reads.append(read)
            return read

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.read_now()

    def start(self) -> "MetricsReader":
        self._thread = threading.Thread(target=self._loop, name="twin-metrics", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        self.stop()
        self._http.close()


def limit_mismatches(read: EngineRead, workload) -> list[str]:
    """Users whose rate the engine exports and the scenario's limits file disagrees with."""
    out = []
    for user, entry in workload.limits["user_output_tokens_per_second"].items():
        if user in read.limits:
            rate = entry["rate"] if isinstance(entry, dict) else entry
            if not math.isclose(read.limits[user], rate, rel_tol=1e-6):
                out.append(f"{user}: {read.limits[user]:g} tok/s on the engine, {rate:g} in the scenario")
    return out


# -- the run ---------------------------------------------------------------------


@dataclass
class TwinRun:
    model: str
    t0: float  # time.monotonic() when the load began
    load_s: float
    reads: list[EngineRead]  # the first before the load, the last once the engine was empty
    records: list[RequestRecord]  # times in seconds since t0
    loop_lag_s: list[float]
    settled: bool  # the engine was empty and its counters still at the last read


def _prompt(rng, length: int) -> list[int]:
    lo, hi = PROMPT_ID_RANGE
    return [rng.randrange(lo, hi) for _ in range(length)]  # random ids: no shared prefix blocks


async def _closed_stream(client: Any, model: str, user: str, stream: int, jobs: Sequence[Any], seed: int,
                         records: list[RequestRecord], t0: float) -> None:
    """One heavy user's stream: its jobs one after another (from the start again
    when they run out) until cancelled."""
    import random

    rng = random.Random(f"{seed}/{user}/{stream}")
    index = 0
    while True:
        job = jobs[index % len(jobs)]
        index += 1
        if job.think_s:
            await asyncio.sleep(job.think_s)
        record = RequestRecord(user=user, stream=stream)
        records.append(record)
        await stream_completion(client, stream_body(model, user, job.max_tokens, _prompt(rng, job.prompt_len)),
                                record, t0)
        if record.status in ERROR_STATUSES:
            await asyncio.sleep(ERROR_BACKOFF_S)


async def _open_loop(client: Any, model: str, arrivals: Sequence[tuple[float, str, int, int]], seed: int,
                     records: list[RequestRecord], t0: float, sent: list[asyncio.Task]) -> None:
    """The long tail: each request at its own time, whatever the engine does."""
    import random

    rng = random.Random(f"{seed}/open-loop")
    for at, user, prompt_len, max_tokens in arrivals:
        delay = t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        record = RequestRecord(user=user, stream=-1)
        records.append(record)
        body = stream_body(model, user, max_tokens, _prompt(rng, prompt_len))
        sent.append(asyncio.create_task(stream_completion(client, body, record, t0)))


async def run_twin(url: str, workload: Any, duration_s: float, model: str | None = None,
                   read_every_s: float = DEFAULT_READ_EVERY_S, settle_max_s: float = SETTLE_MAX_S) -> TwinRun:
    """Drive ``workload`` against the engine at ``url`` for ``duration_s``; every
    request still in flight then is cancelled (the twin stops counting there too)."""
    # A connection for every request that may be in flight at once: an open-loop request
    # waiting for a free connection would add the client's wait to its first-token time.
    connections = workload.stream_count + len(workload.arrivals) + 4
    reader = MetricsReader(url, read_every_s)
    try:
        async with openai_client(url, max_connections=connections) as client:
            model = await discover_model(client, url, model)
            before = await asyncio.to_thread(reader.read_now)
            if before is None:
                raise BenchError(f"cannot read {url}/metrics: the twin scenario judges on the engine's counters")
            wrong = limit_mismatches(before, workload)
            if wrong:
                raise BenchError("the server runs other limits than the scenario's (start it with "
                                 "--output-rate-limits-file, written by --limits-out): " + "; ".join(wrong[:5]))
            records: list[RequestRecord] = []
            open_sent: list[asyncio.Task] = []
            loop_lag: list[float] = []
            t0 = time.monotonic()
            reader.start()
            tasks = [asyncio.create_task(_closed_stream(client, model, user, i, jobs, workload.seed, records, t0))
                     for user, streams in workload.streams.items() for i, jobs in enumerate(streams)]
            tasks.append(asyncio.create_task(_open_loop(client, model, workload.arrivals, workload.seed,
                                                        records, t0, open_sent)))
            lag_watcher = asyncio.create_task(watch_loop_lag(loop_lag))
            try:
                await asyncio.sleep(max(0.0, t0 + duration_s - time.monotonic()))
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                for task in open_sent:
                    task.cancel()
                await asyncio.gather(*open_sent, return_exceptions=True)
                lag_watcher.cancel()
        settled = await asyncio.to_thread(_settle, reader, settle_max_s)
    finally:
        reader.close()
    for record in records:
        if record.status == RUNNING:
            record.status = CANCELLED
    return TwinRun(model, t0, duration_s, reader.reads, records, loop_lag, settled)


def _settle(reader: MetricsReader, settle_max_s: float) -> bool:
    """Read until the engine is empty and two reads agree (the engine reports
    at once when it empties), at most ``settle_max_s``."""
    reader.stop()
    deadline = time.monotonic() + settle_max_s
    last = None
    while time.monotonic() < deadline:
        read = reader.read_now()
        if read is not None and last is not None and read.in_engine == 0 and last.in_engine == 0 \
                and read.output == last.output and read.prompt == last.prompt:
            return True
        last = read if read is not None else last
        time.sleep(reader.period_s)
    return False


# -- the figures -----------------------------------------------------------------


def _first_tokens_ms(records: Sequence[RequestRecord], users: set[str]) -> dict[str, Any]:
    client = [(r.token_times[0] - r.start) * 1000 for r in records if r.user in users and r.token_times]
    engine = [r.server_first_token_s * 1000 for r in records
              if r.user in users and r.server_first_token_s is not None]
    return {"requests": len(client), "p50": percentile(client, 50), "p99": percentile(client, 99),
            "engine_requests": len(engine), "engine_p50": percentile(engine, 50),
            "engine_p99": percentile(engine, 99)}


def _fairness_windows(workload: Any, reads: Sequence[EngineRead], t0: float, load_s: float,
                      window_s: float) -> list[dict[str, Any]]:
    """The twin's per-window fairness among backlogged borrowers, on the engine's
    counters: service = output tokens charged between two reads, dated at the
    earlier one (so a window counts the intervals that began in it);
    backlogged = the engine held a request of the user for quota, or had one
    waiting, at every read of the window (the engine's own gauges' rule).  A window's reading is taken at the first read past its end.
    Reads before the engine first showed a borrower's request are left out:
    the engine reports about once a second, so the load's first read or two
    show it empty and would keep every borrower out of the first window."""
    from vllm_output_rate.policy.fairness import FairnessWindow, jain_index, largest_gap

    ns = 1_000_000_000
    window = FairnessWindow(int(window_s * ns))
    for user, weight in workload.borrowers.items():
        window.set_weight(user, weight)
    equal = sorted(u for u, w in workload.borrowers.items() if w == 1)
    rows = []
    boundary = window_s
    reported = False
    for previous, read in zip(reads, reads[1:]):
        at = read.done - t0
        if previous.done - t0 >= load_s or boundary > load_s + 1e-9:
            break
        reported = reported or any(read.backlog.get(u, 0) > 0 for u in workload.borrowers)
        if not reported:
            while at >= boundary and boundary <= load_s + 1e-9:  # ended before any report: nobody
                rows.append({"end_s": boundary, "backlogged_borrowers": 0, "jain_equal_weight": None,
                             "gap_equal_weight_tokens": None, "jain_weighted_all": None,
                             "gap_weighted_all_tokens": None, "weighted_service": {}})
                boundary += window_s
            continue
        now = int(at * ns)
        began = int((previous.done - t0) * ns)
        for user in workload.borrowers:
            served = read.output.get(user, 0.0) - previous.output.get(user, 0.0)
            if served > 0:
                window.serve(user, int(served), began)
        window.observe([u for u in workload.borrowers if read.backlog.get(u, 0) > 0], now)
        while at >= boundary and boundary <= load_s + 1e-9:
            reading = window.reading(now)
            service = reading.weighted_service
            eq = [service[u] for u in equal if u in service]
            rows.append({"end_s": boundary, "backlogged_borrowers": reading.backlogged_users,
                         "jain_equal_weight": jain_index(eq), "gap_equal_weight_tokens": largest_gap(eq),
                         "jain_weighted_all": reading.jain, "gap_weighted_all_tokens": reading.gap_tokens,
                         "weighted_service": dict(service)})
            boundary += window_s
    return rows


def twin_figures(workload: Any, run: TwinRun, window_s: float = DEFAULT_FAIRNESS_WINDOW_S) -> dict[str, Any]:
    """The twin's figures for one engine, from the run's reads and records."""
    reads = run.reads
    before, final = reads[0], reads[-1]
    t0, load_s = run.t0, run.load_s
    load_end = next((r for r in reads[1:] if r.sent - t0 >= load_s), final)
    span_s = load_end.done - before.sent
    weight = workload.input_token_weight
    shared = 1 if final.shared_store else 0
    envelope_s = final.done - before.sent  # every charge of the run happened inside it
    capped = {}
    for user, limit in workload.capped.items():
        output = final.output.get(user, 0.0) - before.output.get(user, 0.0)
        prompt = final.prompt.get(user, 0.0) - before.prompt.get(user, 0.0)
        charged = output + weight * prompt
        bound = guarantee_bound(envelope_s, limit, BURST_S, shared_engines=shared)
        capped[user] = {"limit_tok_s": limit, "output_tokens": output, "prompt_tokens_charged": prompt,
                        "charged_tokens": charged, "achieved_over_limit": charged / (limit * load_s),
                        "bound_tokens": bound, "within_bound": charged <= bound}
    worst = max((c["achieved_over_limit"] for c in capped.values()), key=lambda r: abs(r - 1), default=None)
    groups = {}
    for group, (rate, members) in workload.groups.items():
        charged = sum(final.charged(u, weight) - before.charged(u, weight) for u in members)
        groups[group] = {"limit_tok_s": rate, "charged_tokens": charged,
                         "achieved_over_limit": charged / (rate * load_s)}
    statuses = {status: sum(1 for r in run.records if r.status == status)
                for status in (FINISHED, CANCELLED, HTTP_ERROR, ERROR)}
    return {
        "load_s": load_s,
        "throughput_tok_s": (load_end.generated - before.generated) / span_s if span_s > 0 else None,
        "throughput_span_s": span_s,
        "envelope_s": envelope_s,
        "shared_store": bool(shared),
        "settled": run.settled,
        "reads": len(reads),
        "capped": capped,
        "capped_worst_ratio": worst,
        "groups": groups,
        "fairness_window_s": window_s,
        "fairness_windows": _fairness_windows(workload, reads, t0, load_s, window_s),
        "in_quota_first_token_ms": _first_tokens_ms(run.records, workload.in_quota),
        "requests": {"sent": len(run.records), **statuses},
    }


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def format_twin_table(figures: Mapping[str, Any], title: str = "") -> str:
    """The twin's table for one engine (markdown), every column naming its clock."""
    ft = figures["in_quota_first_token_ms"]
    groups = figures["groups"]
    group_cell = ", ".join(f"{g} {_fmt(v['achieved_over_limit'])}" for g, v in groups.items()) or "–"
    engine_ft = ""
    if ft["engine_requests"]:
        engine_ft = f" (engine: {_fmt(ft['engine_p50'], 1)} / {_fmt(ft['engine_p99'], 1)})"
    lines = [title] if title else []
    lines += [
        f"| output tok/s [{ENGINE}] | worst capped / limit [{ENGINE}] | group / limit [{ENGINE}] | "
        f"first token p50 / p99 ms, in quota [{CLIENT}] | requests timed |",
        "|---|---|---|---|---|",
        f"| {_fmt(figures['throughput_tok_s'], 0)} | {_fmt(figures['capped_worst_ratio'], 4)} | {group_cell} | "
        f"{_fmt(ft['p50'], 1)} / {_fmt(ft['p99'], 1)}{engine_ft} | {ft['requests']} |",
        "",
        f"Capped users over the load's {figures['load_s']:g} s [{ENGINE}; charged = output + prompt cost]:",
        "",
        "| user | limit tok/s | output tokens | prompt tokens charged | charged / (limit × load s) | "
        "bound over the run's reads | within |",
        "|---|---|---|---|---|---|---|",
    ]
    for user, c in figures["capped"].items():
        lines.append(f"| {user} | {_fmt(c['limit_tok_s'], 1)} | {_fmt(c['output_tokens'], 0)} | "
                     f"{_fmt(c['prompt_tokens_charged'], 0)} | {_fmt(c['achieved_over_limit'], 4)} | "
                     f"{_fmt(c['bound_tokens'], 0)} | {'yes' if c['within_bound'] else 'NO'} |")
    lines += ["", f"Fairness per {figures['fairness_window_s']:g} s window among backlogged borrowers [{ENGINE}]:", "",
              "| window end s | backlogged borrowers | Jain, equal weight | gap, equal weight (tokens) | "
              "Jain, service/weight, all | largest weighted gap (tokens) |",
              "|---|---|---|---|---|---|"]
    for w in figures["fairness_windows"]:
        lines.append(f"| {w['end_s']:g} | {w['backlogged_borrowers']} | {_fmt(w['jain_equal_weight'], 4)} | "
                     f"{_fmt(w['gap_equal_weight_tokens'], 0)} | {_fmt(w['jain_weighted_all'], 4)} | "
                     f"{_fmt(w['gap_weighted_all_tokens'], 0)} |")
    if not figures["fairness_windows"]:
        lines.append("| – | no window ended inside the load | | | | |")
    return "\n".join(lines)


def twin_main(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """``--scenario twin``: write the limits, or drive the server and print the table."""
    duration_s = args.duration or 60.0
    try:
        workload = twin_workload(args, duration_s)
    except BenchError as exc:
        _fail(str(exc), 2)
    print(describe_workload(workload, duration_s))
    if args.limits_out == "-":
        print(workload.limits_text(), end="")
    elif args.limits_out:
        path = Path(args.limits_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(workload.limits_text())
        print(f"wrote {path}: start the server with\n  vllm-output-rate serve MODEL "
              + shlex.join(workload.serve_args(str(path))))
    document: dict[str, Any] = {"schema": TWIN_SCHEMA, "command": shlex.join(["vllm-output-rate", "bench", *argv])}
    if args.dry_run:
        return document
    if args.duration is None:
        _fail("--duration is required to run the scenario (or --dry-run)", 2)
    url = (args.urls or [DEFAULT_URL])[0].rstrip("/")
    if len(args.urls or []) > 1:
        _fail("--scenario twin drives one engine: give one --url", 2)
    try:
        run = asyncio.run(run_twin(url, workload, duration_s, args.model, args.read_every))
    except BenchError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    figures = twin_figures(workload, run, args.fairness_window)
    title = (f"{url}  model={run.model}  R={workload.concurrency}  users={len(workload.users):,}  "
             f"load={duration_s:g}s  requests={figures['requests']['sent']} (finished "
             f"{figures['requests'][FINISHED]}, cancelled at the end {figures['requests'][CANCELLED]}, errors "
             f"{figures['requests'][HTTP_ERROR] + figures['requests'][ERROR]})  /metrics reads={len(run.reads)}")
    print(format_twin_table(figures, title))
    lag = loop_lag_summary(run.loop_lag_s)
    if not run.reads[-1].output:
        print(f"\nwarning: {url}/metrics has no per-user counters ({CHARGED_TOKENS}): is the plugin on? "
              "Every capped and fairness figure above is then empty")
    if not run.settled:
        print("\nwarning: the engine was not empty (or its counters still moved) when the reads ended: "
              "totals may be short")
    warning = client_lag_warning(lag["loop_lag_max_s"])
    if warning:
        print(f"\nwarning (first-token times only): {warning}")
    document.update({
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "config": {"url": url, "model": run.model, "duration_s": duration_s, "concurrency": workload.concurrency,
                   "users": len(workload.users), "seed": workload.seed, "length_scale": args.length_scale,
                   "capacity_tok_s": args.capacity, "light_share": args.light_share,
                   "kv_pressure": args.kv_pressure, "tail_only": args.tail_only,
                   "read_every_s": args.read_every},
        "clocks": {"rates": f"{ENGINE}: /metrics deltas over seconds of the client's clock",
                   "first_token": f"{CLIENT}: first token received minus request sent"},
        "client": lag,
        "figures": figures,
    })
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {path}")
    return document


if __name__ == "__main__":
    main()
