"""Judge a run on the engines' own per-user counters, read while it runs.

Client receive times are no measure of what an engine charged on this
machine (a client stalls for up to a second and gets tokens in bunches), so
the multi-engine tools read every engine's admin route
(``GET /v1/output_rate/users``: ``tokens_charged_total`` per user, exact at
the moment the engine answers) and its store mode (``/metrics``) from a
thread of their own, every ``period_s``.

A read is bracketed by the client's clock just before it was sent and just
after the answer came (:class:`CounterSample` ``sent`` / ``done``; every
process on the machine shares ``CLOCK_MONOTONIC``).  So between two reads
``a`` and ``b`` the engines charged their tokens inside ``[a.sent, b.done]``
(the window the bound is checked against: never shorter than the truth), and
charged nothing else between ``a.done`` and ``b.sent`` when their counters
did not move (the silence that surely happened).

Engines may be restarted: each sample records which start of each engine
answered, so a counter that begins from zero again adds to the last read of
the process before, never subtracts from the user's total (:func:`cumulative`).  What a stopped process charged after its last read
is not known; :class:`CounterReader` takes one read right before a stop is
requested (:meth:`CounterReader.sample_now`) to keep that short.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from vllm_output_rate.tools.analysis import BURST_S, guarantee_bound
from vllm_output_rate.tools.measure import parse_metrics

ADMIN_ROUTE = "/v1/output_rate/users"
STORE_MODE = "vllm:output_rate_store_mode"

#: What the reader asks each engine for: its base URL and which start of it
#: that is (``None``: the engine is down right now).
EngineView = Callable[[], Sequence[tuple[str | None, int]]]


@dataclass
class CounterSample:
    sent: float
    done: float
    #: Per engine: {user: tokens charged so far} (None: engine down or no answer).
    charged: list
    #: Per engine: which start of it answered (None: down).
    starts: list
    #: Per engine: the store mode its /metrics showed ("shared", "local",
    #: "closed"; None: not read or no store).  /metrics is refreshed by the
    #: engine about once a second, so a mode change shows up to ~1 s late.
    modes: list = field(default_factory=list)
    label: str = ""

    def to_dict(self) -> dict:
        return {"sent": round(self.sent, 4), "done": round(self.done, 4), "charged": self.charged,
                "starts": self.starts, "modes": self.modes, "label": self.label}


class CounterReader:
    """Reads every engine's counters every ``period_s`` from a daemon thread."""

    def __init__(self, engines: EngineView, period_s: float = 0.5, read_modes: bool = False,
                 timeout_s: float = 10.0) -> None:
        import httpx

        self.engines = engines
        self.period_s = period_s
        self.read_modes = read_modes
        self.samples: list[CounterSample] = []
        self.failed_reads = 0
        self._http = httpx.Client(timeout=timeout_s, trust_env=False)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read_one(self, url: str) -> tuple[dict[str, int] | None, str | None]:
        import httpx

        try:
            response = self._http.get(url + ADMIN_ROUTE)
            response.raise_for_status()
            charged = {u: int(row["tokens_charged_total"]) for u, row in response.json()["users"].items()}
            mode = None
            if self.read_modes:
                samples = parse_metrics(self._http.get(url + "/metrics").text)
                mode = next((labels.get("mode") for labels, value in samples.get(STORE_MODE, [])
                             if value == 1), None)
            return charged, mode
        except (httpx.HTTPError, ValueError, KeyError):
            self.failed_reads += 1
            return None, None

    def sample_now(self, label: str = "") -> CounterSample:
        """One read of every engine, now (also from the caller's thread)."""
        with self._lock:
            view = list(self.engines())
            sent = time.monotonic()
            reads = [self._read_one(url) if url else (None, None) for url, _ in view]
            done = time.monotonic()
            sample = CounterSample(sent, done, [r[0] for r in reads],
                                   [start if url and r[0] is not None else None
                                    for (url, start), r in zip(view, reads)],
                                   [r[1] for r in reads], label)
            self.samples.append(sample)
            return sample

    def _loop(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            self.sample_now()
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - began)))

    def start(self) -> "CounterReader":
        self._thread = threading.Thread(target=self._loop, name="counter-reader", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[CounterSample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._http.close()
        return self.samples

    def __enter__(self) -> "CounterReader":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------
# What the samples say
# --------------------------------------------------------------------------


def cumulative(samples: Sequence[CounterSample], user: str) -> list[int]:
    """Per sample: ``user``'s tokens charged so far, summed over engines and
    over every start of each engine.

    A counter that starts again from zero -- a new start of the engine, or
    the engine forgetting a user idle for a while (its total then counts
    from 0, see ``adapter/operate.py``) -- adds to the last read before it;
    an engine down, not answering or showing no row for the user keeps its
    last read.  A forgotten user's tokens charged after the last read
    before the reset and before being forgotten: none (it was idle).
    """
    engines = len(samples[0].charged) if samples else 0
    base = [0] * engines  # earlier counters, each at its last read
    last_start: list = [None] * engines
    last_value = [0] * engines
    out = []
    for sample in samples:
        for index, (charged, start) in enumerate(zip(sample.charged, sample.starts)):
            if charged is None or user not in charged:
                if charged is not None and start != last_start[index] and last_start[index] is not None:
                    base[index] += last_value[index]  # a new start that has not seen the user yet
                    last_start[index], last_value[index] = start, 0
                continue
            value = charged[user]
            if last_start[index] is not None and (start != last_start[index] or value < last_value[index]):
                base[index] += last_value[index]
            last_start[index], last_value[index] = start, value
        out.append(sum(base) + sum(last_value))
    return out


def engine_total(sample: CounterSample, index: int) -> int | None:
    """All tokens engine ``index`` had charged at this read (None: down)."""
    charged = sample.charged[index]
    return None if charged is None else sum(charged.values())


def longest_silence(samples: Sequence[CounterSample], index: int, t_from: float, t_to: float) -> float:
    """The longest time engine ``index`` surely charged nothing, between
    reads inside ``[t_from, t_to]``: ``b.sent - a.done`` over runs of reads
    of one start whose totals did not move.  A gap between reads (a stalled
    client) counts as silence only when the counter did not move across it,
    so a stalled reader cannot make a busy engine look silent."""
    inside = [s for s in samples if t_from <= s.sent and s.done <= t_to and s.charged[index] is not None]
    longest = 0.0
    run_start = None
    for previous, current in zip(inside, inside[1:]):
        same_start = previous.starts[index] == current.starts[index]
        if same_start and engine_total(previous, index) == engine_total(current, index):
            run_start = previous if run_start is None else run_start
            longest = max(longest, current.sent - run_start.done)
        else:
            run_start = None
    return longest


def fallback_bound(window_s: float, rate: float, engines: int) -> float:
    """The ``local`` fallback, summed over ``engines`` engines each enforcing
    ``rate / engines`` on its own: ``(W + burst) * N + E``."""
    return (window_s + BURST_S) * rate + engines


@dataclass(frozen=True)
class Outage:
    """When the store was down, on the shared monotonic clock.

    ``killed``: the store was surely dead from here (taken after the kill
    returned); ``kill_sent``: no engine could have fallen back before
    (taken before the kill); ``restarted``: taken before the new store
    process was started (no lease from it before); ``all_shared``: every
    engine's /metrics showed the shared mode again by here.
    """

    kill_sent: float
    killed: float
    restarted: float
    all_shared: float


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def widened_bound(a: float, b: float, rate: float, engines: int, outages: Sequence[Outage] = (),
                  lifetime_s: float = 0.3) -> float:
    """The documented bound for tokens charged inside ``[a, b]``, summed over
    ``engines`` engines sharing a store that was down during ``outages``.

    Each epoch of one store process contributes the shared bound over the
    part of the window it covers (a lease of the old store can still be spent
    ``lifetime_s`` after the kill); each outage adds the local fallback's
    bound over the part of the window from the kill until every engine
    showed the shared mode again.  A store restarted without persistence
    forgets every debt (README: "each user may get one fresh burst"), which
    is why every epoch brings its own burst.  A window in one epoch gets
    exactly the shared bound.
    """
    edges = [-math.inf]
    for outage in outages:
        edges += [outage.killed + lifetime_s, outage.restarted]
    edges.append(math.inf)
    total = 0.0
    for lo, hi in zip(edges[::2], edges[1::2]):  # store epochs
        part = _overlap(a, b, lo, hi)
        if part > 0:
            total += guarantee_bound(part, rate, shared_engines=engines)
    for outage in outages:
        part = _overlap(a, b, outage.kill_sent, outage.all_shared)
        if part > 0:
            total += fallback_bound(part, rate, engines)
    return total


@dataclass
class WorstWindow:
    excess: float  # tokens - bound (<= 0: within)
    tokens: int
    bound: float
    window_s: float
    start: float  # a.sent


def worst_window(samples: Sequence[CounterSample], totals: Sequence[int],
                 bound: Callable[[float, float], float], max_window_s: float = 60.0) -> WorstWindow | None:
    """Over every pair of reads ``a`` before ``b`` (at most ``max_window_s``
    apart), the largest ``tokens(a, b) - bound(a.sent, b.done)``; ``totals``
    from :func:`cumulative`."""
    worst = None
    for i, a in enumerate(samples):
        for j in range(i + 1, len(samples)):
            b = samples[j]
            if b.done - a.sent > max_window_s:
                break
            tokens = totals[j] - totals[i]
            limit = bound(a.sent, b.done)
            if worst is None or tokens - limit > worst.excess:
                worst = WorstWindow(tokens - limit, tokens, limit, b.done - a.sent, a.sent)
    return worst
