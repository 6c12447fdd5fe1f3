"""Bench analysis: pure functions over :class:`~.measure.RequestRecord` lists.

The guarantee verdict
    The limiter promises at most ``(W + burst) * N + 1`` tokens in any window
    of W seconds (N = the user's limit).  The server charges a token when it
    schedules it; the client sees it later, after a delay that varies with the
    engine step, the API server and the client's own event loop (on a loaded
    2-core machine receive stalls reach ~1 s).  Windows over *receive* times
    therefore overstate what the server did whenever tokens arrive bunched.
    The verdict is judged on two checks that such stalls cannot inflate:

    1. **Envelope** (no allowance at all).  Every token of a request was
       charged after the client sent it and before the client saw the stream
       end.  So for any times a < b, the tokens of the user's requests sent at
       or after a and ended by b were charged within ``[a, b]``: they must
       fit ``(b - a + burst) * N + 1``.  A late delivery only moves b later,
       which loosens this check; it can never make it fail.
    2. **Receive-time windows widened by the measured stall.**  For
       W in ``windows_s`` and the user's whole active span, the most tokens
       received in a closed window ``[t, t + W]`` must fit
       ``(W + burst + stall) * N + 1``, where ``stall`` is this user's measured
       receive stall: the larger of the client's own event-loop lag (max) and,
       when the server sends per-request timing, the largest difference
       between a request's first->last token interval as the server stamped
       it and as the client received it.

    PASS when both hold; FAIL otherwise.

    **Several engines sharing one store** (``shared_store``; the bench sets it
    when given several ``--url``): a user's tokens are summed over every
    engine that served it, and the bound is the one ``stores/lease.py``
    derives for E engines leasing from one store: ``(W + burst + lease
    lifetime) * N + 1 + E * L`` with the lease defaults (lifetime 0.3 s,
    ``L = max(1, ceil(0.1 s * N))``) and E the engines the user's requests
    went to.  Both checks above stay valid: every token of a request is
    charged by its engine between send and end, whichever engine it is.  A server that really overruns
    fails both: a sustained overrun fails the envelope and the span window; a
    burst fails the short windows unless it is smaller than the stall.
    The strict receive-time figure (no stall allowance) is kept in the
    window details, and the stall itself is reported as its own column.

Other figures: tok/s over the user's active span (first to last token
received), share of all tokens received in the run, TTFT (first token
received minus send), inter-token gaps within a request (0 inside a chunk),
``usage.completion_tokens`` == tokens received for every finished request.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from vllm_output_rate.policy.limiter import DEFAULT_BURST_NS, NS_PER_S, exact_rate
from vllm_output_rate.settings import ANONYMOUS_USER
from vllm_output_rate.stores.backend import LeaseConfig
from vllm_output_rate.tools.measure import (
    CANCELLED,
    ERROR_STATUSES,
    FINISHED,
    RequestRecord,
    max_in_window,
    percentile,
    usage_matches,
)

#: The limiter's burst, which loosens the bound by ``BURST_S * N`` tokens.
BURST_S = DEFAULT_BURST_NS / NS_PER_S
DEFAULT_WINDOWS_S = (1.0, 2.0, 5.0)

# Guarantee verdicts.
PASS = "PASS"
FAIL = "FAIL"
NOT_CHECKED = "n/a"

#: How the verdict is judged, for tables and JSON.
VERDICT_BASIS = "send/end envelope + receive windows widened by the measured stall"


#: The lease defaults of a shared store (``stores/lease.py``): the credit the
#: store keeps and how long a lease stays spendable loosen the bound across
#: engines.
_LEASES = LeaseConfig()


def lease_size(rate: float) -> int:
    """``L``: the largest lease one engine holds for a user of ``rate`` tok/s."""
    return _LEASES.lease_size(exact_rate(rate))


def bound_terms(rate: float, burst_s: float = BURST_S, shared_engines: int = 0) -> tuple[float, float]:
    """``(seconds added to W, tokens added)`` of the bound.

    ``shared_engines`` 0: one engine's own limiter, ``(W + burst) * N + 1``.
    E >= 1: E engines leasing from one store, ``(W + B + lifetime) * N + 1 + E * L``,
    ``B`` the credit the store keeps (the burst, at least a lease lifetime).
    """
    if shared_engines <= 0:
        return burst_s, 0.0
    return shared_slack_s(burst_s), float(shared_engines * lease_size(rate))


def shared_slack_s(burst_s: float = BURST_S) -> float:
    """Seconds the bound across engines sharing a store adds to the window."""
    return _LEASES.bound_slack_ns(round(burst_s * NS_PER_S)) / NS_PER_S


def guarantee_bound(window_s: float, rate: float, burst_s: float = BURST_S,
                    shared_engines: int = 0) -> float:
    """Tokens a user limited to ``rate`` tok/s may get in any ``window_s``
    (summed over ``shared_engines`` engines sharing a store, when > 0)."""
    slack_s, extra = bound_terms(rate, burst_s, shared_engines)
    return (window_s + slack_s) * rate + 1 + extra


@dataclass
class WindowCheck:
    """Most tokens received in any window of ``window_s`` vs the bound."""

    label: str  # "1s", "2s", ... or "span" for the user's whole active span
    window_s: float
    max_tokens: int
    bound: float | None  # strict (W + burst) * N + 1; None when the limit is unknown
    stall_allowance: float | None  # extra tokens tolerated: stall_s * N
    within_bound: bool | None  # max_tokens <= bound (strict, information only)
    passed: bool | None  # max_tokens <= bound + stall_allowance

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "WindowCheck":
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class EnvelopeCheck:
    """The tightest set of whole requests: sent at or after ``a``, ended by ``b``."""

    window_s: float  # b - a
    tokens: int
    bound: float | None
    passed: bool | None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "EnvelopeCheck | None":
        return None if data is None else cls(**data)


def envelope_worst(
    requests: Iterable[tuple[float, float, int]], rate: float, burst_s: float = BURST_S,
    shared_engines: int = 0,
) -> tuple[float, float, int] | None:
    """Largest ``count - guarantee_bound(b - a)`` over request sets.

    ``requests`` are ``(sent, ended, tokens)``; a set is every request sent at
    or after ``a`` and ended by ``b``, for a among the send times and b among
    the end times.  Returns ``(excess, b - a, count)`` of the worst set
    (excess <= 0 means within the bound), or None without tokens.
    O(R^2) for R requests.
    """
    reqs = sorted((s, e, n) for s, e, n in requests if n > 0)
    if not reqs:
        return None
    slack_s, extra = bound_terms(rate, burst_s, shared_engines)
    best: tuple[float, float, int] | None = None
    starts = sorted({s for s, _, _ in reqs}, reverse=True)
    inside: list[tuple[float, int]] = []  # (end, tokens) of requests sent at or after a
    pending = sorted(reqs, key=lambda r: r[0], reverse=True)
    i = 0
    for a in starts:
        while i < len(pending) and pending[i][0] >= a:
            bisect.insort(inside, (pending[i][1], pending[i][2]))
            i += 1
        count = 0
        for end, tokens in inside:
            count += tokens
            width = max(end - a, 0.0)
            excess = count - (width + slack_s) * rate - 1 - extra
            if best is None or excess > best[0]:
                best = (excess, width, count)
    return best


def sliding_excess(times: Iterable[float], rate: float, extra_s: float = 0.0,
                   burst_s: float = BURST_S) -> tuple[float, float]:
    """Largest ``count - guarantee_bound(W) - extra_s * rate`` over every window of any length.

    The windows are ``[t_i, t_j]`` between two of the token ``times`` (the
    tightest a token count allows); ``extra_s`` widens every window by a
    delivery-jitter allowance.  Returns ``(excess, W)`` of the worst window
    (excess <= 0: within the bound).  O(n log n).
    """
    ordered = sorted(times)
    best, best_w = -math.inf, 0.0
    lowest, lowest_at = math.inf, 0
    for j, t in enumerate(ordered):
        # count - (W + burst + extra) N - 1 with count = j - i + 1 and W = t_j - t_i
        # is (j - N t_j) - (i - N t_i) - (burst + extra) N: keep the smallest i - N t_i.
        value = j - rate * t
        if value < lowest:
            lowest, lowest_at = value, j
        excess = value - lowest - (burst_s + extra_s) * rate
        if excess > best:
            best, best_w = excess, t - ordered[lowest_at]
    return best, best_w


def check_envelope(
    records: Sequence[RequestRecord], limit: float | None, burst_s: float = BURST_S,
    shared_engines: int = 0,
) -> EnvelopeCheck | None:
    reqs = [(r.start, r.end, r.n_tokens) for r in records if r.end is not None]
    worst = envelope_worst(reqs, limit, burst_s, shared_engines) if limit else None
    if worst is None:
        if not limit:
            tokens = sum(n for _, _, n in reqs)
            return EnvelopeCheck(0.0, tokens, None, None) if tokens else None
        return None
    excess, width, count = worst
    bound = guarantee_bound(width, limit, burst_s, shared_engines)
    return EnvelopeCheck(width, count, bound, excess <= 1e-9)


def window_label(window_s: float) -> str:
    return f"{window_s:g}s"


def check_windows(
    times: Sequence[float],
    limit: float | None,
    windows_s: Sequence[float] = DEFAULT_WINDOWS_S,
    burst_s: float = BURST_S,
    stall_s: float = 0.0,
    shared_engines: int = 0,
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
        bound = guarantee_bound(window_s, limit, burst_s, shared_engines)
        allowance = stall_s * limit
        checks.append(WindowCheck(label, window_s, most, bound, allowance,
                                  most <= bound, most <= bound + allowance))
    return checks


def verdict(checks: Sequence[WindowCheck], envelope: EnvelopeCheck | None) -> str:
    results = [c.passed for c in checks if c.passed is not None]
    if envelope is not None and envelope.passed is not None:
        results.append(envelope.passed)
    if not results:
        return NOT_CHECKED
    return PASS if all(results) else FAIL


def time_to_first_token(record: RequestRecord) -> float | None:
    return record.token_times[0] - record.start if record.token_times else None


def inter_token_gaps(record: RequestRecord) -> list[float]:
    """Gaps between consecutive tokens of one request (0 within a chunk)."""
    times = record.token_times
    return [later - earlier for earlier, later in zip(times, times[1:])]


def receive_stall(records: Sequence[RequestRecord], client_lag_s: float = 0.0) -> float:
    """This user's measured receive stall (see the module docstring)."""
    stall = client_lag_s
    for r in records:
        if r.status == FINISHED and r.server_generation_s is not None and r.n_tokens > 1:
            client_span = r.token_times[-1] - r.token_times[0]
            stall = max(stall, abs(client_span - r.server_generation_s))
    return stall


def limit_for(user: str, limits: Mapping[str, float], default_limit: float | None = None) -> float | None:
    return limits.get(user, default_limit)


@dataclass
class UserSummary:
    user: str
    streams: int
    requests_started: int
    requests_finished: int
    requests_cancelled: int
    errors: int
    tokens: int
    share: float | None  # of all tokens received in the run
    first_token_s: float | None
    last_token_s: float | None
    active_span_s: float | None
    tokens_per_s: float | None
    limit_tokens_per_s: float | None
    receive_stall_s: float  # allowance of the receive-window check
    envelope: EnvelopeCheck | None
    windows: list[WindowCheck]
    guarantee: str  # PASS, FAIL or NOT_CHECKED
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    gap_p50_s: float | None
    gap_p99_s: float | None
    usage_mismatches: int  # finished requests whose completion_tokens != tokens received
    usage_match: bool | None  # None when no request finished
    # Several engines (bench with several --url); defaults fit a one-engine run.
    engines: int = 1  # engines the user's requests went to
    tokens_by_engine: dict[str, int] = field(default_factory=dict)  # url -> tokens received
    shared_store: bool = False  # judged against the bound across engines sharing a store
    # From the engines' /metrics, summed over engines (None: not read / no plugin series).
    server_charged_tokens: float | None = None
    server_charged_by_engine: dict[str, float] = field(default_factory=dict)

    @property
    def anonymous(self) -> bool:
        return self.user == ANONYMOUS_USER

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "UserSummary":
        values = dict(data)
        values["windows"] = [WindowCheck.from_dict(w) for w in data.get("windows", [])]
        values["envelope"] = EnvelopeCheck.from_dict(data.get("envelope"))
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in values.items() if k in names})


def summarize_user(
    user: str,
    records: Sequence[RequestRecord],
    limit: float | None,
    streams: int | None = None,
    windows_s: Sequence[float] = DEFAULT_WINDOWS_S,
    burst_s: float = BURST_S,
    client_lag_s: float = 0.0,
    run_tokens: int | None = None,
    shared_store: bool = False,
    server_charged: Mapping[str, float] | None = None,
) -> UserSummary:
    """Summary of one user's requests (all of them must belong to ``user``).

    With ``shared_store`` the bound is the one across the engines the
    requests went to (``RequestRecord.url``); ``server_charged`` is this
    user's charged-token delta per engine, as read from each ``/metrics``.
    """
    # Every received token counts toward the guarantee, including those of
    # cancelled or failed requests: the server did deliver them.
    times = sorted(t for r in records for t in r.token_times)
    finished = [r for r in records if r.status == FINISHED]
    span = (times[-1] - times[0]) if times else None
    ttfts = [x for x in (time_to_first_token(r) for r in records) if x is not None]
    gaps = [g for r in records for g in inter_token_gaps(r)]
    mismatches = sum(1 for r in finished if not usage_matches(r))
    stall = receive_stall(records, client_lag_s)
    by_engine = tokens_by_engine(records)
    shared_engines = max(1, len(by_engine)) if shared_store else 0
    checks = check_windows(times, limit, windows_s, burst_s, stall, shared_engines)
    envelope = check_envelope(records, limit, burst_s, shared_engines)
    charged = dict(server_charged or {})
    return UserSummary(
        user=user,
        streams=streams if streams is not None else len({r.stream for r in records}),
        requests_started=len(records),
        requests_finished=len(finished),
        requests_cancelled=sum(1 for r in records if r.status == CANCELLED),
        errors=sum(1 for r in records if r.status in ERROR_STATUSES),
        tokens=len(times),
        share=(len(times) / run_tokens) if run_tokens else None,
        first_token_s=times[0] if times else None,
        last_token_s=times[-1] if times else None,
        active_span_s=span,
        tokens_per_s=(len(times) / span) if span else None,
        limit_tokens_per_s=limit,
        receive_stall_s=stall,
        envelope=envelope,
        windows=checks,
        guarantee=verdict(checks, envelope),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        gap_p50_s=percentile(gaps, 50),
        gap_p99_s=percentile(gaps, 99),
        usage_mismatches=mismatches,
        usage_match=(mismatches == 0) if finished else None,
        engines=len(by_engine),
        tokens_by_engine=by_engine,
        shared_store=shared_store,
        server_charged_tokens=sum(charged.values()) if charged else None,
        server_charged_by_engine=charged,
    )


def tokens_by_engine(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Tokens received per engine URL, for every engine a request was sent to
    (0 when none came back); records without a URL are left out."""
    out: dict[str, int] = {}
    for r in records:
        if r.url is not None:
            out[r.url] = out.get(r.url, 0) + r.n_tokens
    return out


def summarize(
    records: Sequence[RequestRecord],
    limits: Mapping[str, float],
    default_limit: float | None = None,
    streams: Mapping[str, int] | None = None,
    windows_s: Sequence[float] = DEFAULT_WINDOWS_S,
    burst_s: float = BURST_S,
    client_lag_s: float = 0.0,
    shared_store: bool = False,
    server_charged: Mapping[str, Mapping[str, float]] | None = None,
) -> list[UserSummary]:
    """One summary per user: users of ``streams`` first (in order), then the rest.

    ``server_charged``: per engine URL, per user, the charged tokens the
    engine's ``/metrics`` counted during the run (see ``summarize_user``).
    """
    streams = streams or {}
    by_user: dict[str, list[RequestRecord]] = {user: [] for user in streams}
    for record in records:
        by_user.setdefault(record.user, []).append(record)
    ordered = list(streams) + sorted(u for u in by_user if u not in streams)
    run_tokens = sum(r.n_tokens for r in records)
    server_charged = server_charged or {}
    return [
        summarize_user(user, by_user[user], limit_for(user, limits, default_limit),
                       streams.get(user), windows_s, burst_s, client_lag_s, run_tokens,
                       shared_store,
                       {url: per_user[user] for url, per_user in server_charged.items()
                        if user in per_user})
        for user in ordered
    ]


def totals(records: Sequence[RequestRecord]) -> dict[str, int]:
    return {
        "requests": len(records),
        "finished": sum(1 for r in records if r.status == FINISHED),
        "cancelled": sum(1 for r in records if r.status == CANCELLED),
        "errors": sum(1 for r in records if r.status in ERROR_STATUSES),
        "tokens": sum(r.n_tokens for r in records),
    }


def loop_lag_summary(samples: Sequence[float]) -> dict[str, float | None]:
    return {
        "loop_lag_p50_s": percentile(samples, 50),
        "loop_lag_p99_s": percentile(samples, 99),
        "loop_lag_max_s": max(samples) if samples else None,
    }


def cumulative_series(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Sorted token receive times per user (the x values of a cumulative plot)."""
    series: dict[str, list[float]] = {}
    for record in records:
        series.setdefault(record.user, []).extend(record.token_times)
    return {user: sorted(times) for user, times in series.items()}


def rate_series(records: Sequence[RequestRecord], bin_s: float = 1.0,
                end_s: float | None = None) -> dict[str, list[float]]:
    """Tokens received per second in consecutive ``bin_s`` bins from t = 0, per user.

    Every user's list has the same length (bins up to ``end_s`` or the last token).
    """
    series = cumulative_series(records)
    last = max((t[-1] for t in series.values() if t), default=0.0)
    n_bins = max(1, math.ceil(max(end_s or 0.0, last) / bin_s - 1e-9))
    out: dict[str, list[float]] = {}
    for user, times in series.items():
        counts = [0] * n_bins
        for t in times:
            counts[min(int(max(t, 0.0) // bin_s), n_bins - 1)] += 1
        out[user] = [c / bin_s for c in counts]
    return out


def ttft_series(records: Sequence[RequestRecord], user: str) -> list[tuple[float, float]]:
    """(send time, TTFT) of every request of ``user`` that got a token."""
    return [(r.start, r.token_times[0] - r.start) for r in records
            if r.user == user and r.token_times]


# --------------------------------------------------------------------------
# Service over time and the service difference between backlogged users
# --------------------------------------------------------------------------


def counter_windows(snapshots: Sequence[tuple[float, Mapping[str, float]]], window_s: float,
                    n_windows: int, max_skew_s: float = math.inf) -> dict[str, list[float | None]]:
    """Per-key increase of cumulative counters over the windows ``[k W, (k + 1) W]``.

    ``snapshots`` are ``(time, {key: counter value})`` readings (e.g. one
    ``/metrics`` read per second, keyed by user), in any order.  Each window
    edge is read from the snapshot whose time is nearest to it, so every key's
    window spans the same two readings; a key missing from a reading counts
    as 0 there (a series not exported yet).  A window with an edge farther
    than ``max_skew_s`` from its nearest reading is None for every key.
    """
    ordered = sorted(snapshots, key=lambda s: s[0])
    if not ordered:
        return {}
    times = [t for t, _ in ordered]
    keys = sorted({k for _, values in ordered for k in values})

    def nearest(edge: float) -> Mapping[str, float] | None:
        i = bisect.bisect_left(times, edge)
        j = min((j for j in (i - 1, i) if 0 <= j < len(ordered)), key=lambda j: abs(times[j] - edge))
        return ordered[j][1] if abs(times[j] - edge) <= max_skew_s else None

    edges = [nearest(k * window_s) for k in range(n_windows + 1)]

    def delta(key: str, k: int) -> float | None:
        low, high = edges[k], edges[k + 1]
        return None if low is None or high is None else high.get(key, 0.0) - low.get(key, 0.0)

    return {key: [delta(key, k) for k in range(n_windows)] for key in keys}


def covers(intervals: Iterable[tuple[float, float]], start: float, end: float) -> bool:
    """Does the union of the closed ``intervals`` cover ``[start, end]`` without a gap?"""
    reach = start
    for a, b in sorted(intervals):
        if a > reach:
            break
        reach = max(reach, b)
        if reach >= end:
            return True
    return reach >= end


def service_difference(service: Mapping[str, Sequence[float | None]], weights: Mapping[str, float],
                       backlogged: Mapping[str, Sequence[bool]], skip: int = 1) -> dict[str, Any]:
    """VTC's fairness metric over windows: how far apart backlogged users' service is.

    In window k, among the users of ``weights`` that were backlogged in it
    (at least two), each user's service is divided by its weight; the
    window's difference is the largest minus the smallest of these (tokens
    per unit weight).  Also, per window, each backlogged user's share of the
    backlogged users' tokens against its weight share: the largest
    ``|share / weight share - 1|``.  The first ``skip`` windows (warm-up) are
    left out of the maxima and the mean.  Windows with fewer than two
    backlogged users, no tokens, or a service of None (not measured) have no
    figure (None).
    """
    n = min((len(v) for v in service.values()), default=0)
    per_window: list[float | None] = []
    share_dev: list[float | None] = []
    for k in range(n):
        users = [u for u in weights if u in service and backlogged.get(u, [False] * n)[k]]
        if len(users) < 2 or any(service[u][k] is None for u in users):
            per_window.append(None)
            share_dev.append(None)
            continue
        normalised = [service[u][k] / weights[u] for u in users]
        per_window.append(max(normalised) - min(normalised))
        total, total_weight = sum(service[u][k] for u in users), sum(weights[u] for u in users)
        share_dev.append(None if total <= 0 else max(
            abs((service[u][k] / total) / (weights[u] / total_weight) - 1) for u in users))
    counted = [d for d in per_window[skip:] if d is not None]
    devs = [d for d in share_dev[skip:] if d is not None]
    return {
        "per_window": per_window,
        "max": max(counted) if counted else None,
        "mean": sum(counted) / len(counted) if counted else None,
        "windows_counted": len(counted),
        "share_deviation_per_window": share_dev,
        "max_share_deviation": max(devs) if devs else None,
    }


def spread_service(spans: Iterable[tuple[str, float, float, float]], window_s: float,
                   n_windows: int) -> dict[str, list[float]]:
    """Per-user tokens in the windows ``[k W, (k + 1) W]``, each request's tokens
    spread evenly over its generation span (VTC's attribution).

    ``spans`` are ``(user, begin, end, tokens)``; a span with ``end <= begin``
    puts all its tokens at ``begin``.  Tokens outside ``[0, n W]`` are left out.
    """
    out: dict[str, list[float]] = {}
    horizon = n_windows * window_s
    for user, begin, end, tokens in spans:
        row = out.setdefault(user, [0.0] * n_windows)
        if end <= begin:
            if 0 <= begin < horizon:
                row[int(begin // window_s)] += tokens
            elif begin == horizon and n_windows:
                row[-1] += tokens
            continue
        density = tokens / (end - begin)
        for k in range(max(0, int(begin // window_s)), min(n_windows, math.ceil(end / window_s))):
            overlap = min(end, (k + 1) * window_s) - max(begin, k * window_s)
            if overlap > 0:
                row[k] += density * overlap
    return out
