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
    loop_lag_summary,
    summarize,
    totals,
)
from vllm_output_rate.tools.measure import (
    CANCELLED,
    CHARGED_TOKENS,
    DEFAULT_PROMPT,
    ERROR_STATUSES,
    RUNNING,
    RequestRecord,
    openai_client,
    parse_metrics,
    per_label,
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
        dest="users",
        action="append",
        type=parse_user_spec,
        required=True,
        metavar="NAME:STREAMS[:MAX_TOKENS]",
        help=f"a user and its concurrent streams (MAX_TOKENS default {DEFAULT_MAX_TOKENS}); repeatable",
    )
    parser.add_argument(
        "--duration", type=_positive_float, required=True, metavar="SECONDS",
        help="how long to keep issuing requests",
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
    users: list[UserSpec] = args.users
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


if __name__ == "__main__":
    main()
