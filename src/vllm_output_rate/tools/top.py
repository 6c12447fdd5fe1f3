"""``vllm-output-rate top``: a live per-user view of one engine or a cluster, like htop.

Reads the ``vllm:output_rate_*`` series once a second from one or several
engines' ``/metrics`` (``--url``, repeated or comma-separated) or from a
Prometheus server that scrapes them (``--prometheus``), and shows one row per
user: its group (only when groups are configured), quota, current tok/s over
all engines, active / throttled / waiting requests, throttled %, borrowed
tok/s and a spark-line of the last minute; sorted by current rate.  Columns
for the ceiling, the weight, the residency cap and, in shadow mode, what the
limiter *would* have done appear when some engine exports those series.
Above the table, one fairness line per engine (each data-parallel engine of
each source): Jain's index among the backlogged borrowers over the engine's
window, the largest weighted service gap and how many borrowers competed.
``q`` quits.  Drawn with ``rich``.

Cluster rates are the sum over engines of each engine's own counter rate; a
counter that goes down between two reads is an engine that restarted (counted
from zero, never as a negative rate).  With a shared store
(``--output-rate-store``) the quota is one across engines and LIMIT shows it
once; without one each engine enforces the limit on its own, and LIMIT shows
``E×N`` (E engines answering, N each).

The reading, parsing and per-user model (:func:`read_sources`,
:func:`parse_metrics`, :class:`TopModel`, :func:`cluster_view`) are plain
functions, tested without a terminal.
"""

from __future__ import annotations

import argparse
import math
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from vllm_output_rate.tools import measure

PREFIX = "vllm:output_rate_"
SPARKS = "▁▂▃▄▅▆▇█"
HISTORY_S = 60
#: Current rate: charged tokens over this many seconds (smooths stats batching).
RATE_WINDOW_S = 3.0
#: Through Prometheus a counter moves once per scrape (15 s by default): a
#: window of several scrapes keeps the rate from jumping between 0 and bursts.
PROMETHEUS_WINDOW_S = 60.0
#: How long the key loop waits for a key before looking for a new reading.
KEY_WAIT_S = 0.1
#: How long one /metrics read may take before it counts as failed.
READ_TIMEOUT_S = 5.0
#: What top asks Prometheus for: the plugin's series and vLLM's queue gauges.
PROMETHEUS_SELECTOR = '{__name__=~"vllm:output_rate_.+|vllm:num_requests_(running|waiting)"}'
#: When Prometheus last scraped each target (``up`` is written with every
#: scrape; timestamp() of the plugin's series would drop their names and
#: collide).
SCRAPE_TIMES = "timestamp(up)"
#: A fairness line is red below this Jain's index (with two or more competing).
FAIRNESS_WARN = 0.9
#: Labels Prometheus adds that tell engines apart.
TARGET_LABELS = ("instance", "job")


@dataclass
class UserSample:
    charged: float = 0.0
    prompt: float | None = None  # prompt tokens charged; None: not exported
    throttled_s: float = 0.0
    limit: float | None = None
    active: int = 0
    throttled: int = 0
    waiting: int = 0
    borrowed: float | None = None  # None: the server exports no borrowed series
    group: str | None = None  # None: in no group (or no groups configured)
    # Series other parts of the plugin export (None: not exported by this engine).
    ceil: float | None = None
    weight: float | None = None
    residency_cap: float | None = None
    residency_held: float | None = None
    shadow_held: float | None = None  # tokens shadow mode would have held (counter)
    shadow_throttled_s: float | None = None
    shadow_borrowed: float | None = None
    shadow_residency_held: float | None = None  # requests the cap would keep waiting now


#: Per-user counters, summed over engines, whose rate top shows.
COUNTERS = {
    "output_tokens_charged_total": "charged",
    "prompt_tokens_charged_total": "prompt",
    "throttled_seconds_total": "throttled_s",
    "borrowed_tokens_total": "borrowed",
    "shadow_held_tokens_total": "shadow_held",
    "shadow_throttled_seconds_total": "shadow_throttled_s",
    "shadow_borrowed_tokens_total": "shadow_borrowed",
}
#: Per-user gauges that are a setting (the same on every engine that knows the user).
SETTINGS = {
    "limit_tokens_per_second": "limit",
    "ceil_tokens_per_second": "ceil",
    "weight": "weight",
    "residency_cap_requests": "residency_cap",
}
#: Per-user gauges of requests on one engine (summed over engines).
HELD = {
    "residency_held_requests": "residency_held",
    "shadow_residency_held_requests": "shadow_residency_held",
}


#: Per-engine fairness gauges (``vllm:output_rate_fairness_*``, label ``engine``).
FAIRNESS = {
    "fairness_window_seconds": "window_s",
    "fairness_backlogged_users": "backlogged",
    "fairness_jain_index": "jain",
    "fairness_service_gap_tokens": "gap_tokens",
}


@dataclass
class EngineFairness:
    """One engine's fairness gauges (None: not exported)."""

    window_s: float | None = None
    backlogged: float | None = None
    jain: float | None = None
    gap_tokens: float | None = None


@dataclass
class Snapshot:
    users: dict[str, UserSample] = field(default_factory=dict)
    #: vLLM's engine label (data-parallel rank) -> its fairness gauges.
    fairness: dict[str, EngineFairness] = field(default_factory=dict)
    engine: dict[str, float] = field(default_factory=dict)
    store_mode: str | None = None  # shared / local / closed; None: no store configured
    mode: str | None = None  # enforce / shadow; None: not exported
    #: When the engine produced these values (Prometheus' scrape time, on the
    #: model's clock); None: when top read them.
    t: float | None = None


def parse_metrics(text: str) -> Snapshot:
    """The plugin's series (summed over models) from Prometheus text."""
    snap = Snapshot()
    for name, samples in measure.parse_metrics(text).items():
        for labels, value in samples:
            _add_sample(snap, name, labels, value)
    return snap


def _add_sample(snap: Snapshot, name: str, labels: dict[str, str], value: float) -> None:
    if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
        key = name.removeprefix("vllm:")
        snap.engine[key] = snap.engine.get(key, 0.0) + value
        return
    if not name.startswith(PREFIX) or name.endswith("_created"):
        return
    key = name[len(PREFIX):]
    if key in FAIRNESS:  # per engine: an index is not summed
        setattr(snap.fairness.setdefault(labels.get("engine", ""), EngineFairness()), FAIRNESS[key], value)
        return
    if key in ("store_mode", "mode"):
        if value == 1 and "mode" in labels:
            setattr(snap, "store_mode" if key == "store_mode" else "mode", labels["mode"])
        return
    user = labels.get("user")
    if user is None:
        snap.engine[key] = snap.engine.get(key, 0.0) + value
        return
    row = snap.users.setdefault(user, UserSample())
    if key in ("output_tokens_charged_total", "throttled_seconds_total"):
        setattr(row, COUNTERS[key], getattr(row, COUNTERS[key]) + value)
    elif key in COUNTERS or key in HELD:
        attr = COUNTERS.get(key) or HELD[key]
        setattr(row, attr, (getattr(row, attr) or 0.0) + value)
    elif key in SETTINGS:
        setattr(row, SETTINGS[key], value)
    elif key == "user_group" and value and "group" in labels:
        row.group = labels["group"]
    elif key == "requests":
        state = labels.get("state")
        if state in ("active", "throttled", "waiting"):
            setattr(row, state, getattr(row, state) + int(value))


def parse_prometheus(values: dict, times: dict | None = None) -> dict[str, Snapshot]:
    """Per scrape target (``instance``, else ``job``), a snapshot from the
    answers of Prometheus' instant-query API: ``values`` for the selector,
    ``times`` for :data:`SCRAPE_TIMES` (the scrape times, in seconds)."""
    snaps: dict[str, Snapshot] = {}
    for item in _vector(values):
        labels = dict(item["metric"])
        name = labels.pop("__name__", "")
        target = _target(labels)
        snap = snaps.setdefault(target, Snapshot())
        _add_sample(snap, name, labels, float(item["value"][1]))
    for item in _vector(times or {}):
        target = _target(dict(item["metric"]))
        if target in snaps:
            scraped = float(item["value"][1])
            snaps[target].t = max(snaps[target].t or scraped, scraped)
    return snaps


def _vector(answer: dict) -> list:
    data = answer.get("data") or {}
    return data.get("result") or [] if data.get("resultType") == "vector" else []


def _target(labels: dict[str, str]) -> str:
    target = next((labels.pop(k) for k in TARGET_LABELS if k in labels), "")
    for k in TARGET_LABELS:
        labels.pop(k, None)
    return target


@dataclass
class Row:
    user: str
    limit: float | None  # one engine's limit (the rate N)
    rate: float  # tok/s over every engine
    active: int
    throttled: int
    waiting: int
    throttled_pct: float
    spark: str
    prompt_rate: float | None = None  # prompt tokens charged per second; None: not exported
    borrowed: float | None = None  # tok/s beyond the rate; None: not exported
    group: str | None = None  # the user's group; None: none
    #: The user's quota over the engines answering: N with a shared store, E x N without.
    quota: float | None = None
    quota_text: str = ""  # how LIMIT shows it ("30", "2×30")
    charged: float = 0.0  # the charge counters now, summed over the engines answering
    charged_by_engine: dict[str, float] = field(default_factory=dict)
    ceil: float | None = None
    weight: float | None = None
    residency_cap: float | None = None
    residency_held: float | None = None
    would_hold: float | None = None  # shadow mode: tok/s it would have held
    would_throttle_pct: float | None = None
    would_borrow: float | None = None
    would_wait: float | None = None  # requests the residency cap would keep waiting


@dataclass
class FairnessLine:
    """One engine's fairness as top shows it."""

    source: str  # the URL or Prometheus target ("" for the single-URL view)
    engine: str  # vLLM's engine label (data-parallel rank)
    fairness: EngineFairness

    def text(self, where: bool) -> str:
        f = self.fairness
        head = f"fairness {self.source + ' ' if self.source else ''}engine {self.engine}" if where else "fairness"
        window = "" if f.window_s is None else f" over {_fmt(f.window_s)} s"
        n = int(f.backlogged or 0)
        if n < 2:
            return (f"{head}: nobody competed{window} ({n} backlogged borrower{'' if n == 1 else 's'}; "
                    "Jain 1 by definition)")
        jain = "-" if f.jain is None else f"{f.jain:.3f}"
        return (f"{head}: Jain {jain} among {n} backlogged borrowers{window}, "
                f"largest weighted gap {_fmt(f.gap_tokens)} tokens")


@dataclass
class ClusterView:
    """What top shows, without the terminal."""

    engines: list[str]  # every source top reads
    answering: list[str]  # those whose latest read succeeded
    shared_store: bool  # every answering engine shares its quotas through a store
    store_modes: dict[str, str]  # engine -> shared / local / closed (store configured)
    modes: dict[str, str]  # engine -> enforce / shadow (when exported)
    engine: dict[str, float]  # engine-wide series summed over the answering engines
    rows: list[Row]
    errors: dict[str, str]
    #: Every answering engine's fairness, by source then engine label.
    fairness: list[FairnessLine] = field(default_factory=list)

    @property
    def shadow(self) -> bool:
        return any(mode == "shadow" for mode in self.modes.values())


def _increase(before: float | None, after: float | None) -> float:
    """How much a counter grew; a counter that went down was reset (its
    engine restarted) and counts from zero."""
    before, after = before or 0.0, after or 0.0
    return after - before if after >= before else after


class TopModel:
    """Per-user cluster rates from successive reads of every engine (times in seconds)."""

    def __init__(self, history_s: int = HISTORY_S, window_s: float = RATE_WINDOW_S) -> None:
        self._points: deque[tuple[float, dict[str, Snapshot]]] = deque()
        self._history_s = history_s
        self.window_s = window_s
        self.engine: dict[str, float] = {}
        self.engines: list[str] = []
        self.errors: dict[str, str] = {}

    def update(self, t: float, snap: Snapshot) -> None:
        """One engine's read (the single-URL view)."""
        self.update_engines(t, {"": snap})

    def update_engines(
        self, t: float, snaps: dict[str, Snapshot], errors: dict[str, str] | None = None
    ) -> None:
        """One read of every engine; an engine missing from ``snaps`` did not answer."""
        self._points.append((t, snaps))
        keep = max(self._history_s, self.window_s) + 1.5
        while self._points and self._points[0][0] < t - keep:
            self._points.popleft()
        self.errors = dict(errors or {})
        for name in [*snaps, *self.errors]:
            if name not in self.engines:
                self.engines.append(name)
        self.engine = {}
        for snap in snaps.values():
            for key, value in snap.engine.items():
                self.engine[key] = self.engine.get(key, 0.0) + value

    def _series(self, engine: str) -> list[tuple[float, Snapshot]]:
        """The engine's reads, oldest first, on its own clock (a Prometheus
        scrape read twice counts once)."""
        out: list[tuple[float, Snapshot]] = []
        for t, snaps in self._points:
            snap = snaps.get(engine)
            if snap is None:
                continue
            at = snap.t if snap.t is not None else t
            if out and at <= out[-1][0]:
                continue
            out.append((at, snap))
        return out

    def _rates(self, engine: str) -> dict[str, dict[str, float]]:
        """user -> counter attribute -> rate on this engine over the window
        (reset-aware, summed read to read)."""
        series = self._series(engine)
        if len(series) < 2:
            return {}
        t_now = series[-1][0]
        first = 0
        for i, (at, _) in enumerate(series):
            if at > t_now - self.window_s:
                break
            first = i
        span = series[first:]
        dt = span[-1][0] - span[0][0]
        if dt <= 0:
            return {}
        out: dict[str, dict[str, float]] = {}
        for user in span[-1][1].users:
            rates = out.setdefault(user, {})
            for attr in COUNTERS.values():
                grew = sum(
                    _increase(getattr(a.users.get(user, UserSample()), attr),
                              getattr(b.users.get(user, UserSample()), attr))
                    for (_, a), (_, b) in zip(span, span[1:])
                )
                rates[attr] = grew / dt
        return out

    def view(self) -> ClusterView:
        latest = self._points[-1][1] if self._points else {}
        answering = [name for name in self.engines if name in latest]
        store_modes = {n: s.store_mode for n, s in latest.items() if s.store_mode}
        modes = {n: s.mode for n, s in latest.items() if s.mode}
        shared = bool(latest) and len(store_modes) == len(latest)
        rates = {name: self._rates(name) for name in answering}
        rows = [
            self._row(user, [latest[n] for n in answering], [rates[n] for n in answering], shared)
            for user in dict.fromkeys(u for n in answering for u in latest[n].users)
        ]
        for row in rows:
            row.charged_by_engine = {
                n: latest[n].users[row.user].charged for n in answering
                if row.user in latest[n].users
            }
        rows.sort(key=lambda r: (-r.rate, r.user))
        fairness = [
            FairnessLine(name, engine, latest[name].fairness[engine])
            for name in answering
            for engine in sorted(latest[name].fairness, key=lambda e: (len(e), e))
        ]
        return ClusterView(
            engines=list(self.engines), answering=answering, shared_store=shared,
            store_modes=store_modes, modes=modes, engine=dict(self.engine), rows=rows,
            errors=dict(self.errors), fairness=fairness,
        )

    def rows(self) -> list[Row]:
        return self.view().rows

    def _row(self, user: str, snaps: list[Snapshot], rates: list[dict], shared: bool) -> Row:
        samples = [s.users[user] for s in snaps if user in s.users]

        def total(attr: str) -> float | None:
            values = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
            return sum(values) if values else None

        def setting(attr: str) -> float | None:
            values = [getattr(s, attr) for s in samples if getattr(s, attr) is not None]
            return max(values) if values else None

        def rate(attr: str) -> float | None:
            if total(attr) is None:
                return None
            return sum(r.get(user, {}).get(attr, 0.0) for r in rates)

        limit = setting("limit")
        quota, quota_text = None, ""
        if limit is not None:
            # Without a store every engine grants the limit on its own: the
            # cluster quota is one limit per engine that could serve the user.
            engines = 1 if shared else len(snaps)
            quota = limit * engines
            quota_text = _fmt(limit) if engines == 1 else f"{engines}×{_fmt(limit)}"
        throttled_rate = rate("throttled_s") or 0.0
        would_thr = rate("shadow_throttled_s")
        return Row(
            user=user, limit=limit, rate=rate("charged") or 0.0,
            active=sum(s.active for s in samples), throttled=sum(s.throttled for s in samples),
            waiting=sum(s.waiting for s in samples),
            throttled_pct=min(100.0, 100.0 * throttled_rate), spark=self._spark(user, quota),
            prompt_rate=rate("prompt"), borrowed=rate("borrowed"),
            group=next((s.group for s in samples if s.group is not None), None),
            quota=quota, quota_text=quota_text, charged=total("charged") or 0.0,
            ceil=setting("ceil"), weight=setting("weight"),
            residency_cap=setting("residency_cap"), residency_held=total("residency_held"),
            would_hold=rate("shadow_held"),
            would_throttle_pct=None if would_thr is None else min(100.0, 100.0 * would_thr),
            would_borrow=rate("shadow_borrowed"), would_wait=total("shadow_residency_held"),
        )

    def per_second(self, user: str) -> list[float]:
        """The user's cluster rate in each interval between reads, oldest first."""
        out = []
        points = list(self._points)
        for (t0, a), (t1, b) in zip(points, points[1:]):
            if t1 <= t0:
                continue
            grew = sum(
                _increase(a[n].users.get(user, UserSample()).charged,
                          b[n].users.get(user, UserSample()).charged)
                for n in b if n in a
            )
            out.append(grew / (t1 - t0))
        return out[-self._history_s:]

    def _spark(self, user: str, limit: float | None) -> str:
        values = self.per_second(user)
        if not values:
            return ""
        top = max(max(values), limit or 0.0) or 1.0
        return "".join(
            " " if v <= 0 else SPARKS[min(len(SPARKS) - 1, int(v / top * (len(SPARKS) - 1) + 0.5))]
            for v in values
        )


def cluster_view(model: TopModel) -> ClusterView:
    """The rows and the cluster's state as top would show them."""
    return model.view()


# -- reading ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sources:
    """Where top reads: engine base URLs, or one Prometheus server."""

    urls: tuple[str, ...] = ()
    prometheus: str | None = None

    def label(self) -> str:
        if self.prometheus:
            return f"prometheus {self.prometheus}"
        return self.urls[0] if len(self.urls) == 1 else f"{len(self.urls)} engines"


def _http_error(url: str, exc) -> str:
    import httpx

    if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in (401, 403):
        return (f"{url} answered {exc.response.status_code}: top sends no credentials "
                "(the engine's /metrics is open; is a proxy in front?)")
    return f"cannot read {url}: {exc}"


def read_sources(sources: Sources, client) -> tuple[float, dict[str, Snapshot], dict[str, str]]:
    """One read of every source: (when, engine -> snapshot, engine -> error).

    ``client`` is an ``httpx.Client``.  Engines are read one after another
    (a handful of small texts); a failed read is an error, never an exception."""
    import httpx

    if sources.prometheus:
        base = sources.prometheus.rstrip("/")
        url = f"{base}/api/v1/query"
        try:
            answers = []
            for query in (PROMETHEUS_SELECTOR, SCRAPE_TIMES):
                response = client.get(url, params={"query": query})
                response.raise_for_status()
                answers.append(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            return time.monotonic(), {}, {base: _http_error(url, exc)}
        t_read = time.monotonic()
        snaps = parse_prometheus(*answers)
        # Scrape times are wall-clock seconds: move them onto the monotonic clock.
        offset = t_read - time.time()
        for snap in snaps.values():
            if snap.t is not None:
                snap.t += offset
        return t_read, snaps, {}
    snaps, errors = {}, {}
    for base in sources.urls:
        try:
            response = client.get(f"{base}/metrics")
            response.raise_for_status()
            snaps[base] = parse_metrics(response.text)
        except httpx.HTTPError as exc:
            errors[base] = _http_error(f"{base}/metrics", exc)
    return time.monotonic(), snaps, errors


def _fmt(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "∞"  # a ceiling or cap of +Inf: none
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def _blank(value: float | None) -> str:
    """A column other engines may not export yet: blank where absent."""
    return "" if value is None else _fmt(value)


def _residency(row: Row) -> str:
    """Requests held by the residency cap / the cap (blank where not exported)."""
    if row.residency_cap is None:
        return _blank(row.residency_held)
    return f"{_fmt(row.residency_held or 0)}/{_fmt(row.residency_cap)}"


class _Spark:
    """A spark line that, in a narrow column, keeps its newest points."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __rich_console__(self, console, options):
        from rich.text import Text

        yield Text(self.text[-options.max_width:] if options.max_width > 0 else "", no_wrap=True)

    def __rich_measure__(self, console, options):
        from rich.measure import Measurement

        return Measurement(min(1, len(self.text)), len(self.text))


def _cluster_line(view: ClusterView) -> str:
    parts = []
    if len(view.engines) > 1:
        parts.append(f"engines {len(view.answering)}/{len(view.engines)} answering")
    if view.shared_store:
        fallback = sorted(n for n, m in view.store_modes.items() if m != "shared")
        parts.append("quota shared through the store: LIMIT is one quota over all engines"
                     + (f" (fallback on {', '.join(fallback)})" if fallback else ""))
    elif len(view.answering) > 1:
        parts.append("no shared store: each engine enforces its own limit (LIMIT = engines×N)")
    shadow = sorted(n for n, m in view.modes.items() if m == "shadow")
    if shadow and len(shadow) == len(view.modes):
        parts.append("SHADOW mode: nothing is held; WOULD columns show what enforce would do")
    elif shadow:
        parts.append(f"shadow mode on {len(shadow)}/{len(view.modes)} engines, "
                     "the others enforcing")
    return "   ".join(parts)


#: Optional columns given up first when the terminal is too narrow (the
#: shadow columns last: in shadow mode they are what the operator came for).
DROP_FIRST = ("RES HELD/CAP", "WEIGHT", "CEIL", "PROMPT/S", "BORROWED",
              "WOULD WAIT", "WOULD BORROW", "WOULD THR%", "WOULD HOLD/S")
#: The spark line's narrowest useful width.
SPARK_MIN = 10


def _fit(columns: list[tuple[str, list[str]]], width: int) -> set[str]:
    """The optional columns to leave out so that every cell shows whole
    in ``width`` characters (each column: padding and a border, 3 more)."""
    def needed(kept):
        return 1 + SPARK_MIN + 3 + sum(
            3 + max([len(name), *map(len, cells)]) for name, cells in kept)

    dropped: set[str] = set()
    for name in DROP_FIRST:
        if needed([c for c in columns if c[0] not in dropped]) <= width:
            break
        if any(c[0] == name for c in columns):
            dropped.add(name)
    return dropped


def render(model: TopModel, url: str, error: str | None = None, width: int | None = None):
    """The table; ``width``: the terminal's, to leave out optional columns
    that would not fit (None: keep them all)."""
    from rich.table import Table
    from rich.text import Text

    view = model.view()
    engine = view.engine
    title = Text.assemble(
        ("vllm-output-rate top ", "bold"), (url, "cyan"),
        f"   running {_fmt(engine.get('num_requests_running'))}"
        f"  waiting {_fmt(engine.get('num_requests_waiting'))}"
        f"  throttled {_fmt(engine.get('throttled_requests'))}"
        f"  reloads {_fmt(engine.get('limit_reloads_total'))}"
        f" (failed {_fmt(engine.get('limit_reload_failures_total'))})   q quits",
    )
    cluster = _cluster_line(view)
    if cluster:
        title.append("\n" + cluster, style="magenta" if view.shadow else None)
    # One line per engine; which engine only when there are several.
    where = len(view.fairness) > 1
    for line in view.fairness:
        f = line.fairness
        low = (f.backlogged or 0) >= 2 and f.jain is not None and f.jain < FAIRNESS_WARN
        title.append("\n" + line.text(where), style="red" if low else None)
    table = Table(title=title, title_justify="left", expand=True)
    rows = view.rows

    def shown(attr: str) -> bool:
        return any(getattr(row, attr) is not None for row in rows)

    # Optional columns only when some engine exports their series (an input
    # token weight; someone who may borrow; a newer plugin): a narrow pane keeps room.
    prompt, borrowed = shown("prompt_rate"), shown("borrowed")
    ceil, weight = shown("ceil"), shown("weight")
    residency = shown("residency_cap") or shown("residency_held")
    # The shadow counters stay exported once enforcing: their columns only
    # while some engine is in shadow mode.
    shadow = view.shadow
    # The group column only when some user is in a group (groups configured).
    grouped = any(row.group is not None for row in rows)
    right = {"justify": "right", "no_wrap": True}
    optional = [
        (prompt, "PROMPT/S", lambda r: _fmt(r.prompt_rate)),
        (borrowed, "BORROWED", lambda r: _fmt(r.borrowed)),
        (ceil, "CEIL", lambda r: _blank(r.ceil)),
        (weight, "WEIGHT", lambda r: _blank(r.weight)),
        (residency, "RES HELD/CAP", _residency),
        (shadow, "WOULD HOLD/S", lambda r: _blank(r.would_hold)),
        (shadow, "WOULD THR%",
         lambda r: "" if r.would_throttle_pct is None else f"{r.would_throttle_pct:.0f}%"),
        (shadow, "WOULD BORROW", lambda r: _blank(r.would_borrow)),
        (shadow, "WOULD WAIT", lambda r: _blank(r.would_wait)),
    ]
    optional = [(name, cell) for on, name, cell in optional if on]
    if width is not None:
        base = ["USER", *(["GROUP"] if grouped else []), "LIMIT", "TOK/S", "ACTIVE",
                "THROTTLED", "WAITING", "THR%"]
        columns = [(name, ["00000"]) for name in base]  # room for a rate of 5 digits
        columns[0] = ("USER", [row.user for row in rows])
        if grouped:
            columns[1] = ("GROUP", [(row.group or "-")[:16] for row in rows])
        columns += [(name, [cell(row) for row in rows]) for name, cell in optional]
        dropped = _fit(columns, width)
        optional = [(name, cell) for name, cell in optional if name not in dropped]
    for name, kw in (
        ("USER", {"no_wrap": True}),
        *((("GROUP", {"no_wrap": True, "max_width": 16}),) if grouped else ()),
        ("LIMIT", right), ("TOK/S", right), ("ACTIVE", right),
        ("THROTTLED", right), ("WAITING", right), ("THR%", right),
        *((name, right) for name, _ in optional),
        # The spark line takes what the numbers leave (its oldest points dropped).
        (f"LAST {HISTORY_S}s", {"no_wrap": True, "ratio": 1}),
    ):
        table.add_column(name, **kw)
    for row in rows:
        style = "red" if row.throttled_pct >= 50 else None
        cells = [row.user, *([row.group or "-"] if grouped else []),
                 row.quota_text or _fmt(row.limit),
                 _fmt(row.rate), str(row.active), str(row.throttled), str(row.waiting),
                 f"{row.throttled_pct:.0f}%"]
        cells += [cell(row) for _, cell in optional]
        table.add_row(*cells, _Spark(row.spark), style=style)
    errors = [error] if error else []
    errors += [message for name, message in view.errors.items() if message != error]
    if errors:
        table.caption = Text("\n".join(errors), style="yellow")
    return table


class _Keys:
    """Single key presses from the terminal without waiting for Enter (POSIX)."""

    def __init__(self) -> None:
        self._fd = None
        self._saved = None

    def __enter__(self) -> "_Keys":
        if sys.stdin.isatty():
            import termios
            import tty

            self._fd = sys.stdin.fileno()
            self._saved = termios.tcgetattr(self._fd)
            tty.setcbreak(self._fd)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is not None:
            import termios

            termios.tcsetattr(self._fd, termios.TCSADRAIN, self._saved)

    def read(self, timeout: float) -> str | None:
        import select

        if self._fd is None:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if ready:
            import os

            return os.read(self._fd, 1).decode(errors="ignore")
        return None


Reading = tuple[float, dict[str, Snapshot], dict[str, str]]


class _Poller:
    """Reads every source every ``interval`` seconds on its own thread.

    A read can take seconds on a loaded server (up to READ_TIMEOUT_S per
    engine), and the key loop must not wait for it: ``q`` quits at once."""

    def __init__(self, sources: Sources, interval: float) -> None:
        self.sources = sources
        self.interval = interval
        self.results: "queue.Queue[Reading]" = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="top-poller", daemon=True)

    def read_once(self, client) -> Reading:
        return read_sources(self.sources, client)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()  # the thread is a daemon: a read in flight is not waited for

    def _loop(self) -> None:
        import httpx

        with httpx.Client(timeout=READ_TIMEOUT_S, trust_env=False) as client:
            while not self._stop.wait(self.interval):
                self.results.put(self.read_once(client))


def run(
    sources: Sources | str, interval: float = 1.0, once: bool = False,
    window_s: float | None = None,
) -> None:
    import httpx
    from rich.console import Console
    from rich.live import Live

    if isinstance(sources, str):
        sources = Sources(urls=(sources.rstrip("/"),))
    if window_s is None:
        window_s = PROMETHEUS_WINDOW_S if sources.prometheus else RATE_WINDOW_S
    model = TopModel(window_s=window_s)
    console = Console()
    poller = _Poller(sources, interval)
    label = sources.label()

    def apply(result: Reading) -> None:
        t, snaps, errors = result
        model.update_engines(t, snaps, errors)

    with httpx.Client(timeout=READ_TIMEOUT_S, trust_env=False) as client:
        apply(poller.read_once(client))
    if once:
        console.print(render(model, label, width=console.width))
        return
    poller.start()
    try:
        with _Keys() as keys, Live(
            render(model, label, width=console.width), console=console, screen=True,
            auto_refresh=False
        ) as live:
            while True:
                if keys.read(KEY_WAIT_S) in ("q", "Q", "\x03"):
                    return
                try:
                    result = poller.results.get_nowait()
                except queue.Empty:
                    continue
                apply(result)
                live.update(render(model, label, width=console.width), refresh=True)
    finally:
        poller.stop()


def parse_sources(urls: list[str] | None, prometheus: str | None) -> Sources:
    """``--url`` values (each may be comma-separated) or ``--prometheus``."""
    if prometheus:
        if urls:
            raise ValueError("give engine URLs (--url) or a Prometheus URL (--prometheus), not both")
        return Sources(prometheus=prometheus.rstrip("/"))
    flat = [u.strip().rstrip("/") for value in urls or [] for u in value.split(",") if u.strip()]
    return Sources(urls=tuple(dict.fromkeys(flat or ["http://127.0.0.1:8000"])))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="vllm-output-rate top",
        description="Live per-user view of one or several vLLM engines running the "
        "output-rate plugin (reads their /metrics once a second; q quits).  With several "
        "engines each user's TOK/S is the sum of every engine's rate (a counter that goes "
        "down is an engine that restarted, counted from zero).  LIMIT is the user's quota "
        "over the cluster: with a shared store (--output-rate-store) one quota for all "
        "engines, shown once; without one every engine enforces the limit on its own, "
        "shown as E×N (E engines answering).  CEIL, WEIGHT and RES HELD/CAP (requests "
        "held by the residency cap / the cap) appear when the engines export them (blank "
        "for a user an engine does not report); in shadow mode WOULD HOLD/S, WOULD THR%%, "
        "WOULD BORROW and WOULD WAIT show what enforcing would have done.  A fairness line "
        "per engine shows Jain's index of output tokens / weight among the borrowers "
        "with a request held for quota or waiting throughout its window (10 s), the largest weighted gap in tokens and how "
        "many competed (under two: nobody competed).  top reads only "
        "/metrics: the admin route and its key are not needed.",
    )
    parser.add_argument(
        "--url", action="append", metavar="URL",
        help="engine base URL; repeat it or separate URLs with commas for several engines "
        "(default http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--prometheus", metavar="URL",
        help="read the engines through a Prometheus server that scrapes them (its HTTP "
        "API; engines are told apart by the instance label) instead of --url",
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between reads")
    parser.add_argument(
        "--window", type=float, default=None, metavar="S",
        help=f"seconds the current rate is taken over (default {RATE_WINDOW_S:g}; "
        f"{PROMETHEUS_WINDOW_S:g} with --prometheus, whose counters move once per scrape)",
    )
    parser.add_argument("--once", action="store_true", help="print one table and exit")
    args = parser.parse_args(argv)
    try:
        sources = parse_sources(args.url, args.prometheus)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        run(sources, args.interval, args.once, args.window)
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
