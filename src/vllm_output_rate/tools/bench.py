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

What is measured, and how:

* Tokens are counted exactly from the ``token_ids`` of every streamed choice
  (``"return_token_ids": true``); one SSE chunk may carry several tokens.
  Every token gets the ``time.monotonic()`` at which its chunk was received.
* The server's ``usage.completion_tokens`` of each finished request must
  equal the number of tokens received for it.
* Guarantee: over any window of W seconds a user receives at most
  ``(W + 0.1) * N + 1`` tokens (N = limit in tok/s, 0.1 s = the limiter's
  burst).  Windows are closed intervals, so two tokens exactly W apart share
  a window (the conservative choice).  The server paces tokens when it
  schedules them, but the bench sees them when they arrive, after a delay
  that varies with the engine step, detokenization and the client's own
  event loop.  A receive-time window of W therefore covers up to W + jitter
  of server time, and a user paced exactly at its limit can exceed the
  strict bound by a token or two.  ``--jitter SECONDS`` (default 0.05) is
  that allowance: the verdict is PASS when every window is within the strict
  bound, "PASS (jitter)" when some window needs the allowance
  ``(W + 0.1 + jitter) * N + 1``, and FAIL beyond it.
* Inter-token gaps are taken between consecutive tokens of one request;
  tokens that arrived in the same chunk have a gap of 0.
* tok/s of a user is its token count divided by its active span (first token
  to last token, all of its requests together).

``--json OUT.json`` writes one object: ``schema``, ``command`` (the command
line), ``started_at`` (UTC), ``config`` (url, model, prompt, duration_s,
grace_s, users, limits, default_limit, burst_s, windows_s, jitter_s),
``wall_s``, ``client`` (event-loop lag of the bench itself), ``totals``,
``summary`` (one :class:`UserSummary` per user) and ``requests`` (one
:class:`RequestRecord` per request: user, stream, start, token_times,
completion_tokens, status, http_status, error).  :func:`summarize_document`
redoes the analysis from it.

The analysis (:func:`summarize`, :func:`max_in_window`, :func:`percentile`,
...) is pure functions over :class:`RequestRecord` lists; the network code
only produces those records.  Proxies from the environment are ignored: the
bench measures timing and must talk to the server directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from vllm_output_rate.limiter import DEFAULT_BURST_NS, NS_PER_S
from vllm_output_rate.settings import ANONYMOUS_USER, USER_ARG

PROG = "vllm-output-rate bench"
SCHEMA = "vllm-output-rate-bench/1"

#: The CLI name that selects the anonymous user (no ``vllm_xargs`` sent).
ANONYMOUS_CLI_NAME = "-"
#: The limiter's burst, which loosens the bound by ``BURST_S * N`` tokens.
BURST_S = DEFAULT_BURST_NS / NS_PER_S
DEFAULT_MAX_TOKENS = 200
DEFAULT_WINDOWS_S = (1.0, 2.0, 5.0)
DEFAULT_GRACE_S = 30.0
#: Receive-time jitter tolerated by the guarantee check (see module docstring).
DEFAULT_JITTER_S = 0.05
DEFAULT_PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a long story:"
#: Pause after a failed request so a broken server is not hammered in a tight loop.
ERROR_BACKOFF_S = 0.2

# Guarantee verdicts.
PASS = "PASS"
PASS_WITH_JITTER = "PASS (jitter)"
FAIL = "FAIL"
NOT_CHECKED = "n/a"

# Request outcomes (RequestRecord.status).
FINISHED = "finished"  # stream ended with [DONE]
HTTP_ERROR = "http_error"  # non-200 response
ERROR = "error"  # exception, error event, or stream cut short
CANCELLED = "cancelled"  # still running when the grace period ran out
RUNNING = "running"  # only while the bench is running
ERROR_STATUSES = (HTTP_ERROR, ERROR)


# --------------------------------------------------------------------------
# Recorded data
# --------------------------------------------------------------------------


@dataclass
class RequestRecord:
    """One completion request as the client saw it.

    Times are seconds since the start of the run (``time.monotonic()``
    minus the value it had when the first requests were issued).
    """

    user: str  # rate-limit identity; ANONYMOUS_USER for "-"
    stream: int  # which of the user's STREAMS slots issued it
    start: float  # when the request was sent
    token_times: list[float] = field(default_factory=list)  # one entry per token
    completion_tokens: int | None = None  # from the final usage chunk
    status: str = RUNNING
    http_status: int | None = None
    error: str | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RequestRecord":
        return cls(
            user=data["user"],
            stream=int(data.get("stream", 0)),
            start=float(data["start"]),
            token_times=[float(t) for t in data.get("token_times", [])],
            completion_tokens=data.get("completion_tokens"),
            status=data.get("status", FINISHED),
            http_status=data.get("http_status"),
            error=data.get("error"),
        )


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
# Analysis: pure functions over records
# --------------------------------------------------------------------------


@dataclass
class WindowCheck:
    """Most tokens seen in any window of ``window_s`` vs the guaranteed bound."""

    label: str  # "1s", "2s", ... or "span" for the user's whole active span
    window_s: float
    max_tokens: int
    bound: float | None  # (W + burst) * N + 1; None when the limit is unknown
    jitter_allowance: float | None  # extra tokens tolerated: jitter_s * N
    within_bound: bool | None  # max_tokens <= bound
    passed: bool | None  # max_tokens <= bound + jitter_allowance

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "WindowCheck":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class UserSummary:
    user: str
    streams: int
    requests_started: int
    requests_finished: int
    requests_cancelled: int
    errors: int
    tokens: int
    first_token_s: float | None
    last_token_s: float | None
    active_span_s: float | None
    tokens_per_s: float | None
    limit_tokens_per_s: float | None
    windows: list[WindowCheck]
    guarantee: str  # PASS, PASS_WITH_JITTER, FAIL or NOT_CHECKED
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    gap_p50_s: float | None
    gap_p99_s: float | None
    usage_mismatches: int  # finished requests whose completion_tokens != tokens received
    usage_match: bool | None  # None when no request finished

    @property
    def anonymous(self) -> bool:
        return self.user == ANONYMOUS_USER

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "UserSummary":
        values = dict(data)
        values["windows"] = [WindowCheck.from_dict(w) for w in data.get("windows", [])]
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in values.items() if k in names})


def max_in_window(times: Iterable[float], window_s: float) -> int:
    """Most events in any closed window ``[t, t + window_s]``.

    Events exactly ``window_s`` apart count as inside one window.
    """
    ordered = sorted(times)
    best = 0
    left = 0
    for right, t in enumerate(ordered):
        while t - ordered[left] > window_s:
            left += 1
        best = max(best, right - left + 1)
    return best


def guarantee_bound(window_s: float, rate: float, burst_s: float = BURST_S) -> float:
    """Tokens a user limited to ``rate`` tok/s may get in any ``window_s``."""
    return (window_s + burst_s) * rate + 1


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between ranks."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def time_to_first_token(record: RequestRecord) -> float | None:
    return record.token_times[0] - record.start if record.token_times else None


def inter_token_gaps(record: RequestRecord) -> list[float]:
    """Gaps between consecutive tokens of one request (0 within a chunk)."""
    times = record.token_times
    return [later - earlier for earlier, later in zip(times, times[1:])]


def usage_matches(record: RequestRecord) -> bool:
    """Does the server's completion_tokens equal the tokens received?"""
    return record.completion_tokens == len(record.token_times)


def limit_for(
    user: str, limits: Mapping[str, float], default_limit: float | None = None
) -> float | None:
    """The configured limit of ``user`` as far as the bench was told."""
    return limits.get(user, default_limit)


def window_label(window_s: float) -> str:
    return f"{window_s:g}s"


def check_windows(
    times: Sequence[float],
    limit: float | None,
    windows_s: Sequence[float] = DEFAULT_WINDOWS_S,
    burst_s: float = BURST_S,
    jitter_s: float = 0.0,
) -> list[WindowCheck]:
    """Window maxima for each W in ``windows_s`` plus the full active span."""
    if not times:
        return []
    span = max(times) - min(times)
    sized = [(window_label(w), w) for w in windows_s] + [("span", span)]
    checks = []
    for label, window_s in sized:
        most = max_in_window(times, window_s)
        if limit is None:
            checks.append(WindowCheck(label, window_s, most, None, None, None, None))
            continue
        bound = guarantee_bound(window_s, limit, burst_s)
        allowance = jitter_s * limit
        checks.append(
            WindowCheck(
                label=label,
                window_s=window_s,
                max_tokens=most,
                bound=bound,
                jitter_allowance=allowance,
                within_bound=most <= bound,
                passed=most <= bound + allowance,
            )
        )
    return checks


def verdict(checks: Sequence[WindowCheck]) -> str:
    checked = [c for c in checks if c.passed is not None]
    if not checked:
        return NOT_CHECKED
    if not all(c.passed for c in checked):
        return FAIL
    return PASS if all(c.within_bound for c in checked) else PASS_WITH_JITTER


def summarize_user(
    user: str,
    records: Sequence[RequestRecord],
    limit: float | None,
    streams: int | None = None,
    windows_s: Sequence[float] = DEFAULT_WINDOWS_S,
    burst_s: float = BURST_S,
    jitter_s: float = 0.0,
) -> UserSummary:
    """Summary of one user's requests (all of them must belong to ``user``)."""
    # Every received token counts toward the guarantee, including those of
    # cancelled or failed requests: the server did deliver them.
    times = sorted(t for r in records for t in r.token_times)
    finished = [r for r in records if r.status == FINISHED]
    first = times[0] if times else None
    last = times[-1] if times else None
    span = (last - first) if times else None
    ttfts = [x for x in (time_to_first_token(r) for r in records) if x is not None]
    gaps = [g for r in records for g in inter_token_gaps(r)]
    mismatches = sum(1 for r in finished if not usage_matches(r))
    checks = check_windows(times, limit, windows_s, burst_s, jitter_s)
    return UserSummary(
        user=user,
        streams=streams if streams is not None else len({r.stream for r in records}),
        requests_started=len(records),
        requests_finished=len(finished),
        requests_cancelled=sum(1 for r in records if r.status == CANCELLED),
        errors=sum(1 for r in records if r.status in ERROR_STATUSES),
        tokens=len(times),
        first_token_s=first,
        last_token_s=last,
        active_span_s=span,
        tokens_per_s=(len(times) / span) if span else None,
        limit_tokens_per_s=limit,
        windows=checks,
        guarantee=verdict(checks),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        gap_p50_s=percentile(gaps, 50),
        gap_p99_s=percentile(gaps, 99),
        usage_mismatches=mismatches,
        usage_match=(mismatches == 0) if finished else None,
    )


def summarize(
    records: Sequence[RequestRecord],
    limits: Mapping[str, float],
    default_limit: float | None = None,
    streams: Mapping[str, int] | None = None,
    windows_s: Sequence[float] = DEFAULT_WINDOWS_S,
    burst_s: float = BURST_S,
    jitter_s: float = 0.0,
) -> list[UserSummary]:
    """One summary per user: users of ``streams`` first (in order), then the rest."""
    streams = streams or {}
    by_user: dict[str, list[RequestRecord]] = {user: [] for user in streams}
    for record in records:
        by_user.setdefault(record.user, []).append(record)
    ordered = list(streams) + sorted(u for u in by_user if u not in streams)
    return [
        summarize_user(
            user,
            by_user[user],
            limit_for(user, limits, default_limit),
            streams.get(user),
            windows_s,
            burst_s,
            jitter_s,
        )
        for user in ordered
    ]


def cumulative_series(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Sorted token receive times per user (the x values of a cumulative plot)."""
    series: dict[str, list[float]] = {}
    for record in records:
        series.setdefault(record.user, []).extend(record.token_times)
    return {user: sorted(times) for user, times in series.items()}


# --------------------------------------------------------------------------
# Formatting (shared with tools.report)
# --------------------------------------------------------------------------

TABLE_HEADERS = [
    "user",
    "limit tok/s",
    "streams",
    "finished/sent",
    "tokens",
    "tok/s",
    "guarantee",
    "tightest window",
    "TTFT p50/p99 ms",
    "gap p50/p99 ms",
    "usage = tokens",
    "errors",
]


def _num(value: float | None, digits: int = 1) -> str:
    return "?" if value is None else f"{value:.{digits}f}"


def _ms_pair(p50: float | None, p99: float | None) -> str:
    if p50 is None or p99 is None:
        return "-"
    return f"{p50 * 1000:.0f} / {p99 * 1000:.0f}"


def tightest_window(summary: UserSummary) -> WindowCheck | None:
    """The window whose maximum came closest to (or furthest over) its bound."""
    bounded = [c for c in summary.windows if c.bound]
    if not bounded:
        return None
    return max(bounded, key=lambda c: c.max_tokens / c.bound)


def window_result(check: WindowCheck) -> str:
    if check.passed is None:
        return NOT_CHECKED
    if not check.passed:
        return FAIL
    return PASS if check.within_bound else PASS_WITH_JITTER


def format_window(check: WindowCheck | None) -> str:
    """E.g. ``1s: 23 <= 23.0`` or ``span: 401 > 400.0 (jitter ok)``."""
    if check is None or check.bound is None:
        return "-"
    relation = "<=" if check.within_bound else ">"
    text = f"{check.label}: {check.max_tokens} {relation} {check.bound:.1f}"
    if not check.within_bound and check.passed:
        text += " (jitter ok)"
    return text


def table_rows(summaries: Sequence[UserSummary]) -> list[list[str]]:
    """Cells of the per-user table, in the order of TABLE_HEADERS."""
    rows = []
    for s in summaries:
        if s.usage_match is None:
            usage = "n/a"
        elif s.usage_match:
            usage = "yes"
        else:
            usage = f"NO ({s.usage_mismatches})"
        rows.append(
            [
                s.user,
                "?" if s.limit_tokens_per_s is None else f"{s.limit_tokens_per_s:g}",
                str(s.streams),
                f"{s.requests_finished}/{s.requests_started}",
                str(s.tokens),
                _num(s.tokens_per_s),
                s.guarantee,
                format_window(tightest_window(s)),
                _ms_pair(s.ttft_p50_s, s.ttft_p99_s),
                _ms_pair(s.gap_p50_s, s.gap_p99_s),
                usage,
                str(s.errors),
            ]
        )
    return rows


def format_text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def guarantee_note(burst_s: float, jitter_s: float) -> str:
    return (
        f"Guarantee: max tokens in any window of W s <= (W + {burst_s:g}) * limit + 1, "
        f"on receive times; up to {jitter_s:g} s * limit more tokens are "
        "tolerated as delivery jitter"
    )


def format_report(
    summaries: Sequence[UserSummary], burst_s: float = BURST_S, jitter_s: float = 0.0
) -> str:
    """The plain-text report printed after a run."""
    window_rows = []
    for s in summaries:
        for c in s.windows:
            window_rows.append(
                [
                    s.user,
                    c.label,
                    f"{c.window_s:.2f}",
                    str(c.max_tokens),
                    "-" if c.bound is None else f"{c.bound:.1f}",
                    "-" if c.jitter_allowance is None else f"{c.jitter_allowance:.1f}",
                    window_result(c),
                ]
            )
    parts = [format_text_table(TABLE_HEADERS, table_rows(summaries))]
    if window_rows:
        parts.append(
            guarantee_note(burst_s, jitter_s)
            + "\n"
            + format_text_table(
                ["user", "window", "W s", "max tokens", "bound", "jitter +", "result"],
                window_rows,
            )
        )
    return "\n\n".join(parts)


# --------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------


def plot_label(user: str) -> str:
    """Legend text; matplotlib leaves labels starting with "_" out of legends."""
    if user == ANONYMOUS_USER:
        return "anonymous"
    return f"user {user}" if user.startswith("_") else user


def plot_cumulative(
    records: Sequence[RequestRecord],
    limits_by_user: Mapping[str, float | None],
    path: str | Path,
    title: str = "Cumulative output tokens per user",
    burst_s: float = BURST_S,
) -> None:
    """Cumulative tokens per user over time; each limit as a dashed line.

    The dashed line of a limited user starts at its first token with the
    guarantee's allowance ``burst * N + 1`` and rises with slope N, so the
    user's curve must stay below it (it is the bound for windows that begin
    at the user's first token).
    """
    # Figure + Agg canvas directly: no pyplot, so no global backend state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    series = cumulative_series(records)
    colors = [f"C{i}" for i in range(10)]
    for index, (user, times) in enumerate(series.items()):
        if not times:
            continue
        color = colors[index % len(colors)]
        counts = list(range(1, len(times) + 1))
        ax.step(times, counts, where="post", color=color, label=plot_label(user))
        limit = limits_by_user.get(user)
        if limit:
            start, end = times[0], times[-1]
            allowance = burst_s * limit + 1
            ax.plot(
                [start, end],
                [allowance, allowance + (end - start) * limit],
                linestyle="--",
                color=color,
                linewidth=1.2,
                zorder=3,  # above the curves, which run right along it when saturated
                label=f"{plot_label(user)} limit {limit:g} tok/s",
            )
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("tokens received")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(str(path))


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
            "each user's output rate, the rate-limit guarantee over sliding "
            "windows, TTFT and inter-token gaps."
        ),
        epilog=(
            f"NAME '{ANONYMOUS_CLI_NAME}' (in --user and --limit) is the anonymous "
            f"user: its requests carry no vllm_xargs.{USER_ARG} and share the "
            f"server's {ANONYMOUS_USER!r} quota."
        ),
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
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
    parser.add_argument(
        "--jitter", type=float, default=DEFAULT_JITTER_S, metavar="SECONDS",
        help="receive-time jitter tolerated by the guarantee check: windows may hold "
        f"jitter * limit extra tokens, reported as 'PASS (jitter)' (default {DEFAULT_JITTER_S:g})",
    )
    parser.add_argument("--json", dest="json_path", metavar="OUT.json", help="write raw data and summary")
    parser.add_argument("--plot", dest="plot_path", metavar="OUT.png", help="draw cumulative tokens per user")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it is also off when stdout is not a terminal)")
    return parser


@dataclass
class BenchConfig:
    url: str
    users: list[UserSpec]
    duration_s: float
    grace_s: float = DEFAULT_GRACE_S
    model: str | None = None
    prompt: str = DEFAULT_PROMPT
    progress: bool = False


def request_body(config: BenchConfig, model: str, spec: UserSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": config.prompt,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Run every request to max_tokens so load does not depend on the text.
        "ignore_eos": True,
        # Token ids in every chunk: the only exact way to count tokens.
        "return_token_ids": True,
    }
    if spec.sends_identity:
        body["vllm_xargs"] = {USER_ARG: spec.user}
    return body


# --------------------------------------------------------------------------
# Network: produces RequestRecords
# --------------------------------------------------------------------------


class StreamProtocolError(Exception):
    """The SSE stream did not look like an OpenAI completion stream."""


def apply_event(record: RequestRecord, payload: Mapping[str, Any], received: float) -> None:
    """Fold one decoded SSE ``data:`` object into ``record``."""
    if "error" in payload:
        error = payload["error"]
        message = error.get("message") if isinstance(error, Mapping) else error
        raise StreamProtocolError(f"error event: {message}")
    for choice in payload.get("choices") or []:
        token_ids = choice.get("token_ids")
        if token_ids is None:
            if choice.get("text"):
                raise StreamProtocolError(
                    "chunk without token_ids (does the server support return_token_ids?)"
                )
            continue
        record.token_times.extend([received] * len(token_ids))
    usage = payload.get("usage")
    if usage:
        # The last usage seen wins; the final usage-only chunk comes last.
        record.completion_tokens = usage.get("completion_tokens")


async def run_request(client: Any, body: Mapping[str, Any], record: RequestRecord, t0: float) -> None:
    """Send one streaming completion and fill ``record`` as chunks arrive."""
    import httpx

    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            record.http_status = response.status_code
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                record.status = HTTP_ERROR
                record.error = " ".join(text.split())[:300]
                return
            saw_done = False
            async for line in response.aiter_lines():
                received = time.monotonic() - t0
                if not line.startswith("data:"):
                    continue  # blank separators, comments, other SSE fields
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    saw_done = True
                    break
                apply_event(record, json.loads(data), received)
            if saw_done:
                record.status = FINISHED
            else:
                record.status = ERROR
                record.error = "stream ended before [DONE]"
    except asyncio.CancelledError:
        record.status = CANCELLED
        raise
    except (httpx.HTTPError, StreamProtocolError, ValueError) as exc:
        record.status = ERROR
        record.error = f"{type(exc).__name__}: {exc}"[:300]


async def stream_worker(
    client: Any,
    config: BenchConfig,
    model: str,
    spec: UserSpec,
    stream: int,
    records: list[RequestRecord],
    t0: float,
    deadline: float,
) -> None:
    """Keep one request of ``spec`` in flight until the deadline."""
    body = request_body(config, model, spec)
    while time.monotonic() < deadline:
        record = RequestRecord(user=spec.user, stream=stream, start=time.monotonic() - t0)
        records.append(record)  # visible to the progress bar, kept even if cancelled
        try:
            await run_request(client, body, record, t0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # keep the other streams going whatever happens
            record.status = ERROR
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        if record.status in ERROR_STATUSES:
            await asyncio.sleep(ERROR_BACKOFF_S)


async def discover_model(client: Any, url: str, model: str | None) -> str:
    """Check the server answers and pick the model; BenchError otherwise."""
    import httpx

    try:
        response = await client.get("/v1/models", timeout=10)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach server at {url}: {type(exc).__name__}: {exc}") from None
    if model is not None:
        return model  # any HTTP answer proves the server is there
    if response.status_code != 200:
        raise BenchError(f"GET {url}/v1/models returned HTTP {response.status_code}")
    try:
        return response.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET {url}/v1/models listed no model; pass --model") from None


class Progress:
    """tqdm bar over the run's duration, with live token/request counts."""

    def __init__(self, enabled: bool, duration_s: float):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(
                total=round(duration_s, 1),
                unit="s",
                desc="running",
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f}s {postfix}",
            )

    def update(self, elapsed: float, records: Sequence[RequestRecord], draining: bool) -> None:
        if self.bar is None:
            return
        tokens = sum(len(r.token_times) for r in records)
        in_flight = sum(1 for r in records if r.status == RUNNING)
        errors = sum(1 for r in records if r.status in ERROR_STATUSES)
        if draining:
            self.bar.set_description("draining", refresh=False)
        self.bar.n = min(round(elapsed, 1), self.bar.total)
        self.bar.set_postfix_str(
            f"tokens={tokens} in_flight={in_flight} errors={errors}", refresh=False
        )
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


LOOP_LAG_INTERVAL_S = 0.01


async def watch_loop_lag(samples: list[float]) -> None:
    """Record how late the client's event loop wakes up, until cancelled.

    Receive times are taken when the loop gets to a chunk; a stalled client
    (e.g. starved of CPU by a server on the same machine) bunches tokens that
    the server spread out.  A large lag points at the client, not the limiter.
    """
    while True:
        before = time.monotonic()
        await asyncio.sleep(LOOP_LAG_INTERVAL_S)
        samples.append(max(0.0, time.monotonic() - before - LOOP_LAG_INTERVAL_S))


def loop_lag_summary(samples: Sequence[float]) -> dict[str, float | None]:
    return {
        "loop_lag_p50_s": percentile(samples, 50),
        "loop_lag_p99_s": percentile(samples, 99),
        "loop_lag_max_s": max(samples) if samples else None,
    }


@dataclass
class RunOutcome:
    model: str
    started_at: str  # wall clock, ISO 8601 UTC
    wall_s: float  # whole run including drain
    records: list[RequestRecord]
    loop_lag_s: list[float] = field(default_factory=list)  # see watch_loop_lag


async def run_bench(config: BenchConfig) -> RunOutcome:
    """Drive all users for ``config.duration_s``; return what was recorded."""
    import httpx

    total_streams = sum(spec.streams for spec in config.users)
    client = httpx.AsyncClient(
        base_url=config.url.rstrip("/"),
        # No read timeout: a rate-limited stream may legitimately pause; the
        # grace period bounds how long the bench waits at the end.
        timeout=httpx.Timeout(connect=10.0, read=None, write=10.0, pool=None),
        limits=httpx.Limits(max_connections=total_streams + 4, max_keepalive_connections=total_streams + 4),
        trust_env=False,
    )
    async with client:
        model = await discover_model(client, config.url, config.model)
        records: list[RequestRecord] = []
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        t0 = time.monotonic()
        deadline = t0 + config.duration_s
        workers = [
            asyncio.create_task(
                stream_worker(client, config, model, spec, stream, records, t0, deadline)
            )
            for spec in config.users
            for stream in range(spec.streams)
        ]
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
                done, pending = await asyncio.wait(pending, timeout=min(0.25, grace_end - now))
                progress.update(time.monotonic() - t0, records, draining=time.monotonic() >= deadline)
            for task in pending:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            lag_watcher.cancel()
            progress.close()
        wall_s = time.monotonic() - t0
    for record in records:
        if record.status == RUNNING:  # cancelled before its request began
            record.status = CANCELLED
    return RunOutcome(model, started_at, wall_s, records, loop_lag)


# --------------------------------------------------------------------------
# Output and main
# --------------------------------------------------------------------------


def totals(records: Sequence[RequestRecord]) -> dict[str, int]:
    return {
        "requests": len(records),
        "finished": sum(1 for r in records if r.status == FINISHED),
        "cancelled": sum(1 for r in records if r.status == CANCELLED),
        "errors": sum(1 for r in records if r.status in ERROR_STATUSES),
        "tokens": sum(len(r.token_times) for r in records),
    }


def result_document(
    argv: Sequence[str],
    config: BenchConfig,
    limits: Mapping[str, float],
    default_limit: float | None,
    windows_s: Sequence[float],
    jitter_s: float,
    outcome: RunOutcome,
    summaries: Sequence[UserSummary],
) -> dict[str, Any]:
    """Everything needed to redo the analysis, plus the summary."""
    return {
        "schema": SCHEMA,
        "command": shlex.join(["vllm-output-rate", "bench", *argv]),
        "started_at": outcome.started_at,
        "config": {
            "url": config.url,
            "model": outcome.model,
            "prompt": config.prompt,
            "duration_s": config.duration_s,
            "grace_s": config.grace_s,
            "users": [asdict(spec) for spec in config.users],
            "limits": dict(limits),
            "default_limit": default_limit,
            "burst_s": BURST_S,
            "windows_s": list(windows_s),
            "jitter_s": jitter_s,
            "time_origin": "seconds since the first requests were issued (time.monotonic)",
        },
        "wall_s": outcome.wall_s,
        "client": loop_lag_summary(outcome.loop_lag_s),
        "totals": totals(outcome.records),
        "summary": [s.to_dict() for s in summaries],
        "requests": [asdict(r) for r in outcome.records],
    }


def records_from_document(document: Mapping[str, Any]) -> list[RequestRecord]:
    return [RequestRecord.from_dict(r) for r in document.get("requests", [])]


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
        config.get("jitter_s", 0.0),
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


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(attach_anonymous_values(argv))
    users: list[UserSpec] = args.users
    seen = [spec.user for spec in users]
    duplicates = sorted({u for u in seen if seen.count(u) > 1})
    if duplicates:
        parser.error(f"user given more than once: {', '.join(duplicates)}")
    if args.jitter < 0:
        parser.error("--jitter must not be negative")
    limits = dict(args.limits)
    config = BenchConfig(
        url=args.url,
        users=users,
        duration_s=args.duration,
        grace_s=args.grace,
        model=args.model,
        prompt=args.prompt,
        progress=not args.no_progress and sys.stdout.isatty(),
    )
    try:
        outcome = asyncio.run(run_bench(config))
    except BenchError as exc:
        _fail(str(exc))
    except KeyboardInterrupt:
        _fail("interrupted", 130)

    streams = {spec.user: spec.streams for spec in users}
    summaries = summarize(
        outcome.records, limits, args.default_limit, streams, args.windows, BURST_S, args.jitter
    )
    count = totals(outcome.records)
    print(
        f"{config.url}  model={outcome.model}  duration={config.duration_s:g}s  "
        f"wall={outcome.wall_s:.1f}s  requests={count['requests']}  "
        f"finished={count['finished']}  cancelled={count['cancelled']}  "
        f"errors={count['errors']}  tokens={count['tokens']}"
    )
    print(format_report(summaries, BURST_S, args.jitter))
    lag = loop_lag_summary(outcome.loop_lag_s)
    if lag["loop_lag_max_s"] is not None:
        print(
            f"client event-loop lag: p99 {lag['loop_lag_p99_s'] * 1000:.0f} ms, "
            f"max {lag['loop_lag_max_s'] * 1000:.0f} ms"
        )
        if lag["loop_lag_max_s"] > args.jitter:
            print(
                "note: the client stalled longer than --jitter; tokens it received "
                "late arrive bunched, so window maxima may overstate the server's rate"
            )
    errors = [r for r in outcome.records if r.error]
    if errors:
        print(f"\nfirst error: [{errors[0].user}] {errors[0].error}")

    if args.json_path:
        document = result_document(
            argv, config, limits, args.default_limit, args.windows, args.jitter, outcome, summaries
        )
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {path}")
    if args.plot_path:
        path = Path(args.plot_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        plot_cumulative(
            outcome.records,
            {s.user: s.limit_tokens_per_s for s in summaries},
            path,
            title=f"Cumulative output tokens per user ({outcome.model})",
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
