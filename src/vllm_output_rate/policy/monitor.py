"""Per-user accounting for metrics and the admin route, with bounded cardinality.

Plain Python, no vLLM import.  The scheduler hands over the gate's
cumulative per-user numbers about once a second; :class:`UserMonitor` turns
them into a *report*: per-user counter increments since the last report and
current gauges, for a bounded set of users:

* every user with a configured rate has its own series;
* up to ``max_users`` other users get their own series, first come (the
  busiest of the candidates of one report first), kept while they are active
  and dropped after ``idle_evict_s`` without activity (the report lists
  them under ``removed`` so the exporter can drop their series);
* everything else is summed under the user ``__other__``.

Counters are sent as increments, not totals, because vLLM delivers each
scheduler-stats message to exactly one API-server process: summing
increments over processes gives the right total, totals would not.  An
increment is never negative and never counts a token twice: a user's total
restarts from 0 only when its owner forgets it, and the owner tells
:meth:`UserMonitor.forget` so; a total that went down otherwise (it should
not: the owners' totals only grow) is held at its highest value, and only
growth beyond that is reported.

:class:`GroupTotals` sums users' totals per group (the group series use a
second :class:`UserMonitor` over them, configured groups always having their
series).  :class:`ChargeHistory` keeps a few seconds of cumulative charges to answer
"tokens in the last 10 s" for the admin route.

Fairness (``report["fairness"]``, :class:`BorrowerFairness`): at every
report, over a sliding window (:data:`FAIRNESS_WINDOW_S`), Jain's index of
service / weight among the *backlogged borrowers* and the largest weighted
service gap between two of them -- the numbers the GPU twin
(``harness/vllm_output_rate_harness/twin.py``) reports per window:

* a *borrower* is a user whose ceiling is above its rate (or who has no
  ceiling): its share of spare capacity is what its weight promises.  A
  hard-capped user is left out: its service is its cap, not a share;
* *backlogged*: at every report in the window the user wanted more than it
  got -- a resident request held back for quota, or a request waiting
  (``counts``' throttled or waiting > 0).  A user all of whose requests ran
  in the last step was served all it asked for then; counting it would make
  a demand-limited user (one stream, say) look short-changed.  The twin
  (``harness/vllm_output_rate_harness/twin.py``) asks at every step whether
  the user has an unfinished request: the same users whenever every
  borrower has more streams than it gets slots (its workloads), more users
  otherwise;
* *service*: output tokens charged (``charged``), divided by the user's
  weight (``limits_of(user)[WEIGHT]``, at the latest report).

With fewer than two backlogged borrowers nobody competed: the index is 1
and the gap 0, and ``backlogged_users`` says so.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from vllm_output_rate.policy.fairness import FairnessWindow

NS_PER_S = 1_000_000_000
#: The one series that stands for every user beyond the metrics cap.
OTHER_USERS = "__other__"

#: Report fields per user: [charged tokens (increment), throttled seconds
#: (increment), active, throttled, waiting requests, limit tokens/s or None,
#: prompt tokens charged (increment; only with an input token weight), and
#: -- only while some user may borrow -- borrowed tokens (increment)].
CHARGED, THROTTLED_S, ACTIVE, THROTTLED, WAITING, LIMIT, PROMPT, BORROWED = range(8)

#: ``report["limits"]`` fields per holder (gauges): [ceiling tokens/s (None:
#: no ceiling), weight, residency cap in requests (None: no cap), waiting
#: requests its residency cap holds now].  ``__other__`` has only the last.
CEIL, WEIGHT, RESIDENCY_CAP, RESIDENCY_HELD = range(4)
#: ``report["shadow"]`` fields per holder (increments, then a gauge): [tokens
#: the policy would have held, seconds it would have throttled, tokens it
#: would have borrowed, resident requests its residency cap would have kept
#: waiting].
SHADOW_HELD, SHADOW_THROTTLED_S, SHADOW_BORROWED, SHADOW_RESIDENCY_HELD = range(4)

#: Default length of the fairness window (s): the GPU twin's window.
FAIRNESS_WINDOW_S = 10.0
#: ``report["fairness"]`` keys (gauges, one set per engine).
FAIRNESS_KEYS = ("window_s", "backlogged_users", "jain_index", "service_gap_tokens")


@dataclass
class ShadowTotals:
    """What shadow mode counted, per holder: cumulative ``held`` and
    ``borrowed`` tokens and ``throttled_ns``, and ``residency_held`` now."""

    held: Mapping[str, int] = field(default_factory=dict)
    throttled_ns: Mapping[str, int] = field(default_factory=dict)
    borrowed: Mapping[str, int] = field(default_factory=dict)
    residency_held: Mapping[str, int] = field(default_factory=dict)


class UserMonitor:
    """Turn cumulative per-user numbers into bounded, incremental reports."""

    def __init__(
        self, max_users: int, idle_evict_s: float = 300.0, fairness_window_s: float = FAIRNESS_WINDOW_S
    ) -> None:
        self.max_users = max_users
        self.fairness = BorrowerFairness(fairness_window_s)
        self._idle_evict_ns = int(idle_evict_s * NS_PER_S)
        self._last_charged: dict[str, int] = {}
        self._last_throttled: dict[str, int] = {}
        self._last_prompt: dict[str, int] = {}
        self._last_borrowed: dict[str, int] = {}
        #: Shadow totals, last reported: held, throttled ns, borrowed.
        self._last_shadow: tuple[dict[str, int], ...] = ({}, {}, {})
        self._labelled: dict[str, int] = {}  # non-configured user -> last active ns
        self._configured: frozenset[str] = frozenset()
        self._last_engine: dict[str, int] = {}
        self._idle_since: dict[str, int] = {}  # user -> first report it was seen idle

    def tracked(self) -> int:
        """Entries held (for memory checks): bounded by the callers' dicts plus max_users."""
        return (
            len(self._last_charged) + len(self._last_throttled) + len(self._labelled)
            + len(self._idle_since) + len(self._last_prompt)
        )

    def report(
        self,
        now_ns: int,
        charged: Mapping[str, int],
        throttled_ns: Mapping[str, int],
        counts: Mapping[str, tuple[int, int, int]],
        configured: Mapping[str, float],
        rate_of: Callable[[str], float],
        engine: Mapping[str, int] | None = None,
        prompt_charged: Mapping[str, int] | None = None,
        borrowed: Mapping[str, int] | None = None,
        limits_of: Callable[[str], list[Any]] | None = None,
        shadow: ShadowTotals | None = None,
    ) -> dict[str, Any]:
        """One report; see the module doc.  ``engine`` holds engine-wide totals.

        ``charged`` / ``throttled_ns`` / ``prompt_charged`` are cumulative
        per user (a user may disappear when its owner forgets it);
        ``counts`` is user -> (active, throttled, waiting) requests now.
        ``borrowed`` (cumulative borrowed tokens per user) is given only
        while some user may borrow; then every row has a :data:`BORROWED` field.
        ``limits_of(holder)`` gives the gauges of ``report["limits"]``
        (:data:`CEIL` ...); ``shadow`` the totals behind ``report["shadow"]``
        (:data:`SHADOW_HELD` ...), while shadow mode counts or has counted.
        With ``limits_of`` the report also has ``fairness``
        (:class:`BorrowerFairness`; keys :data:`FAIRNESS_KEYS`).
        """
        charged_inc, self._last_charged = _growth(charged, self._last_charged)
        throttled_inc, self._last_throttled = _growth(throttled_ns, self._last_throttled)
        prompt_inc, self._last_prompt = _growth(prompt_charged or {}, self._last_prompt)
        borrowed_inc = None
        if borrowed is not None:
            borrowed_inc, self._last_borrowed = _growth(borrowed, self._last_borrowed)

        removed: list[str] = []
        new_configured = frozenset(configured)
        if new_configured != self._configured:
            for user in self._configured - new_configured:
                removed.append(user)  # may come back below as an ordinary user
            self._configured = new_configured
            for user in new_configured & set(self._labelled):
                del self._labelled[user]

        shadow_inc = None
        if shadow is not None:
            shadow_inc, self._last_shadow = _shadow_growth(shadow, self._last_shadow)
        active_users = set(charged_inc) | set(throttled_inc) | set(prompt_inc) | {
            u for u, c in counts.items() if any(c)
        }
        if shadow_inc is not None:
            active_users.update(shadow_inc[SHADOW_HELD], shadow_inc[SHADOW_BORROWED])
        labelled = self._labelled
        candidates = [u for u in active_users if u not in labelled and u not in new_configured]
        if candidates and len(labelled) < self.max_users:
            candidates.sort(key=lambda u: (-charged_inc.get(u, 0), u))
            for user in candidates[: self.max_users - len(labelled)]:
                labelled[user] = now_ns
                if user in removed:
                    removed.remove(user)
        for user in active_users:
            if user in labelled:
                labelled[user] = now_ns
        for user, seen in list(labelled.items()):
            if now_ns - seen >= self._idle_evict_ns:
                del labelled[user]
                removed.append(user)

        idle_since = self._idle_since
        for user in charged:
            if user in active_users:
                idle_since.pop(user, None)
            elif user not in idle_since:
                idle_since[user] = now_ns

        users: dict[str, list[Any]] = {}
        for user in new_configured.union(labelled):
            active, throttled, waiting = counts.get(user, (0, 0, 0))
            users[user] = [
                charged_inc.get(user, 0),
                throttled_inc.get(user, 0) / NS_PER_S,
                active,
                throttled,
                waiting,
                rate_of(user),
                prompt_inc.get(user, 0),
            ]
            if borrowed_inc is not None:
                users[user].append(borrowed_inc.get(user, 0))
        other: list[Any] = [0, 0.0, 0, 0, 0, None, 0]
        if borrowed_inc is not None:
            other.append(0)
        for user in active_users:
            if user in users:
                continue
            active, throttled, waiting = counts.get(user, (0, 0, 0))
            other[CHARGED] += charged_inc.get(user, 0)
            other[THROTTLED_S] += throttled_inc.get(user, 0) / NS_PER_S
            other[ACTIVE] += active
            other[THROTTLED] += throttled
            other[WAITING] += waiting
            other[PROMPT] += prompt_inc.get(user, 0)
            if borrowed_inc is not None:
                other[BORROWED] += borrowed_inc.get(user, 0)
        users[OTHER_USERS] = other
        folded = [u for u in active_users if u not in users]

        extra: dict[str, Any] = {}
        if limits_of is not None:
            extra["limits"] = _limit_rows(users, folded, limits_of)
            extra["fairness"] = self.fairness.report(now_ns, charged_inc, counts, rate_of, limits_of)
        if shadow_inc is not None:
            assert shadow is not None
            extra["shadow"] = _shadow_rows(users, folded, shadow_inc, shadow.residency_held)

        engine_inc: dict[str, int] = {}
        for name, total in (engine or {}).items():
            if name.endswith("_total"):
                engine_inc[name] = max(0, total - self._last_engine.get(name, 0))
                self._last_engine[name] = total
            else:
                engine_inc[name] = total  # a gauge
        return {"users": users, "removed": removed, "engine": engine_inc, **extra}

    def idle_users(self, now_ns: int, idle_s: float) -> list[str]:
        """Users idle (no charge, no request) for ``idle_s`` or more at the last reports.

        Their totals may be forgotten by the owner of the cumulative dicts
        (with :meth:`forget` here): a user seen again later counts from 0.
        """
        limit = now_ns - int(idle_s * NS_PER_S)
        return [u for u, since in self._idle_since.items() if since <= limit]

    def forget(self, users: Iterable[str]) -> None:
        for user in users:
            self._last_charged.pop(user, None)
            self._last_throttled.pop(user, None)
            self._last_prompt.pop(user, None)
            self._last_borrowed.pop(user, None)
            self._idle_since.pop(user, None)
            for last in self._last_shadow:
                last.pop(user, None)


def _shadow_growth(
    shadow: ShadowTotals, last: tuple[dict[str, int], ...]
) -> tuple[list[dict[str, int]], tuple[dict[str, int], ...]]:
    """Increments of the shadow totals (held, throttled ns, borrowed) and the new ``last``."""
    incs: list[dict[str, int]] = []
    highs: list[dict[str, int]] = []
    for current, before in zip((shadow.held, shadow.throttled_ns, shadow.borrowed), last):
        inc, high = _growth(current, before)
        incs.append(inc)
        highs.append(high)
    return incs, tuple(highs)


def _limit_rows(
    users: Mapping[str, Any], folded: list[str], limits_of: Callable[[str], list[Any]]
) -> dict[str, list[Any]]:
    rows = {user: limits_of(user) for user in users if user != OTHER_USERS}
    held = sum(limits_of(user)[RESIDENCY_HELD] for user in folded)
    rows[OTHER_USERS] = [None, None, None, held]
    return rows


def _shadow_rows(
    users: Mapping[str, Any],
    folded: list[str],
    inc: list[dict[str, int]],
    residency_held: Mapping[str, int],
) -> dict[str, list[Any]]:
    held, throttled, borrowed = inc

    def row(of: Iterable[str]) -> list[Any]:
        names = list(of)
        return [
            sum(held.get(u, 0) for u in names),
            sum(throttled.get(u, 0) for u in names) / NS_PER_S,
            sum(borrowed.get(u, 0) for u in names),
            sum(residency_held.get(u, 0) for u in names),
        ]

    rows = {user: row((user,)) for user in users if user != OTHER_USERS}
    rows[OTHER_USERS] = row(folded)
    return rows


def _growth(
    current: Mapping[str, int], last: Mapping[str, int]
) -> tuple[dict[str, int], dict[str, int]]:
    """Increments since ``last`` and the new ``last``, for a monitor that is
    told of every restart (:meth:`UserMonitor.forget` drops the user from
    ``last``): a user absent from ``last`` counts whole, one that went down
    counts nothing until it passes its highest total again.

    Not a restart: nothing else ever resets a total, and taking a decrease
    for one would count the whole total a second time (a user's 1,000,000
    tokens reported again for a refund of three)."""
    out: dict[str, int] = {}
    high: dict[str, int] = {}
    for user, total in current.items():
        before = last.get(user)
        if before is None:
            inc, high[user] = total, total
        elif total > before:
            inc, high[user] = total - before, total
        else:
            inc, high[user] = 0, before
        if inc:
            out[user] = inc
    return out, high


def _increments(current: Mapping[str, int], last: Mapping[str, int]) -> dict[str, int]:
    """Positive increments since ``last``; a user that restarted from 0 counts whole."""
    out: dict[str, int] = {}
    for user, total in current.items():
        before = last.get(user, 0)
        inc = total - before if total >= before else total
        if inc:
            out[user] = inc
    return out


class BorrowerFairness:
    """Fairness among backlogged borrowers over a sliding window, fed once a report.

    Each report is one observation of a :class:`FairnessWindow` (1 s
    buckets for the default 10 s window): the borrowers with a request held
    for quota or waiting now, and the tokens each of them was charged since
    the last report.  Only users backlogged now are looked at (a borrower that is
    not cannot count in any window holding this report), so the work per
    report is bounded by the users with requests, never by every
    configured user.
    """

    def __init__(self, window_s: float = FAIRNESS_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"fairness window must be positive, got {window_s!r}")
        self.window_s = float(window_s)
        self._window = FairnessWindow(int(window_s * NS_PER_S))

    def report(
        self,
        now_ns: int,
        charged_inc: Mapping[str, int],
        counts: Mapping[str, Any],
        rate_of: Callable[[str], float],
        limits_of: Callable[[str], list[Any]],
    ) -> dict[str, Any]:
        """Observe this report and read the window ending now (keys :data:`FAIRNESS_KEYS`)."""
        weights: dict[str, float] = {}
        for user, (_active, throttled, waiting) in counts.items():
            if not (throttled or waiting) or user == OTHER_USERS:
                continue  # got all it asked for in the last step: not competing
            limits = limits_of(user)
            weight, ceil = limits[WEIGHT], limits[CEIL]
            if weight is None or not weight > 0:
                continue
            rate = rate_of(user)
            if rate is not None and (ceil is None or ceil > rate):
                weights[user] = weight
        window = self._window
        window.observe(weights, now_ns)
        for user in weights:
            tokens = charged_inc.get(user, 0)
            if tokens:
                window.serve(user, tokens, now_ns)
        reading = window.reading(now_ns, weights)
        return {
            "window_s": self.window_s,
            "backlogged_users": reading.backlogged_users,
            # Fewer than two: nobody competed (backlogged_users tells it apart).
            "jain_index": 1.0 if reading.jain is None else reading.jain,
            "service_gap_tokens": 0.0 if reading.gap_tokens is None else reading.gap_tokens,
        }


class GroupTotals:
    """Cumulative per-group totals, built from cumulative per-user ones.

    Each :meth:`update` adds every user's increment since the last one to the
    total of the user's group at that time, so a group's totals only grow,
    also when a user is forgotten (its total restarts from 0), changes group
    or leaves every group on a reload.
    """

    def __init__(self) -> None:
        self._last: dict[str, dict[str, int]] = {}
        #: kind -> group -> cumulative total.
        self.totals: dict[str, dict[str, int]] = {}

    def update(
        self, kind: str, per_user: Mapping[str, int], group_of: Callable[[str], str | None]
    ) -> dict[str, int]:
        """Add ``per_user``'s increments to the groups' ``kind`` totals; return them."""
        totals = self.totals.setdefault(kind, {})
        for user, inc in _increments(per_user, self._last.get(kind, {})).items():
            group = group_of(user)
            if group is not None:
                totals[group] = totals.get(group, 0) + inc
        self._last[kind] = dict(per_user)
        return totals


class ChargeHistory:
    """Cumulative charges sampled about once a second, for "tokens in the last W s"."""

    def __init__(self, window_s: float = 10.0) -> None:
        self._window_ns = int(window_s * NS_PER_S)
        self._points: deque[tuple[int, dict[str, int]]] = deque()

    def record(self, now_ns: int, charged: Mapping[str, int]) -> None:
        self._points.append((now_ns, dict(charged)))
        # Keep one point at or before the window start, drop older ones.
        while len(self._points) >= 2 and self._points[1][0] <= now_ns - self._window_ns:
            self._points.popleft()

    def tokens_in_window(self, now_ns: int, charged: Mapping[str, int], users: Iterable[str]) -> dict[str, int]:
        """Tokens each user was charged between ``now - window`` and now (as well as sampled)."""
        base: Mapping[str, int] = {}  # no point that old: everything counted so far is recent
        for t, point in self._points:
            if t > now_ns - self._window_ns:
                break
            base = point
        out = {}
        for user in users:
            total = charged.get(user, 0)
            before = base.get(user, 0)
            out[user] = total - before if total >= before else total
        return out
