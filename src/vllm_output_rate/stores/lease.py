"""One user's quota shared by several engines: local leases of a GCRA kept in a store.

The scheduler must never wait on the network, so it never asks the shared
store anything.  Instead a background thread of each engine *leases* small
batches of a user's tokens from the store, and the scheduler spends only what
its engine holds, through the same methods as the in-memory
:class:`~vllm_output_rate.policy.limiter.OutputRateLimiter` (``try_take``,
``take_up_to``, ``refund``, ``available``, ``ready_at_ns``, ...).  A user with
no lease left is throttled exactly like a user out of quota.

How a lease is granted (:meth:`LeaseBackend.lease`, one atomic server-side
script per round trip -- per node on a Redis Cluster, see
:mod:`.redis_store` -- batched over every user the engine asks for): the store
keeps one GCRA state per user on *its own* clock (engine clocks never matter),
and grants ``min(asked, what GCRA allows now)`` tokens -- exactly the takes
that many single GCRA takes at the store's "now" would allow.  Unused tokens
are handed back in a later round trip (GCRA's refund).  Each round trip
names its engine, and the store splits a user's quota evenly between the
engines that asked for it lately and got less than they wanted (a second,
per-engine GCRA at ``N / engines``; idle headroom still goes to whoever
asks), so how often or how early an engine asks does not decide its part;
see :mod:`.redis_store`.

Rounds.  Every ``round_ns`` (50 ms on average, jittered by +-20 % so engines
do not stay in phase and take turns being first) the thread asks, for each user the
scheduler wanted tokens for in the last ``active_ns``, enough to top the
engine's balance up to the user's lease size ``L = max(1, ceil(N *
lease_s))`` (N the user's rate; ``lease_s`` 0.1 s, two rounds' worth so a
late round does not cost throughput).  A user seen for the first time (or
again after a round without asking) triggers an immediate extra round for
that user only, so a new user's first token does not wait for the cadence
(a user counts as new when it was not asked for in the last ``active_ns``).
So one engine asks about each active user at most about once per 50 ms, and
one round trip carries all of them.

Lifetime.  A lease is valid for ``lifetime_ns`` (300 ms) from the moment its
request was *sent* (before the store granted it, so the lifetime always covers
the grant).  Tokens still unspent then are not spendable any more and go back
to the store with the next round trip.

Guarantee across E engines.  Let ``B`` be the burst (0.1 s), ``T`` the lease
lifetime and ``L`` the largest lease.  A token spent at time ``s`` was granted
at a time in ``[s - T, s]``.  The store's GCRA with refunds allows at most
``(W' + B) * N + 1`` net grants (grants minus hand-backs) in any window of
``W'`` seconds; tokens granted in the window and never handed back exceed the
net count only by hand-backs, inside the window, of tokens granted before it,
at most what all engines held then: ``E * L``.  Hence over any window of ``W``
seconds, summed over all engines::

    charged tokens <= (W + B + T) * N + 1 + E * L

With the defaults: ``(W + 0.4) * N + 1 + E * (ceil(0.1 * N))``; for N = 30
tok/s and E = 2, a 1 s window allows at most 49 tokens, 20 s at most 619.
The lifetime is 300 ms rather than the few rounds it needs on a fast engine
because an engine spends a lease only when its scheduler plans: one that
plans less often than the lifetime loses its part (fake clock, three engines
planning every 250 ms: 0.81 x N with 150 ms, 0.98 x N with 300 ms).

Store unreachable or too slow (no answer -- any error, or nothing within
the backend's timeout, 0.25 s for Redis -- for ``outage_after_ns``, 0.3 s; a
single failed round trip only delays that round's leases): the engine keeps
serving without it.  The silence counts from the last answer, or, when a
round with nothing to ask came after that answer, from the first failed
round trip: such an idle round sends nothing (no ping: round trips cost) and
so proves nothing, and it never counts as an answer.  ``fallback="local"``: each
engine enforces ``N / expected_engines`` with its own in-memory limiter (over
E engines the bound is then ``(W + B) * N + E``); ``fallback="closed"``: every
user is throttled (requests pause, nothing fails) until the store answers.
One log line when the outage starts, one when it ends; leases held when it
started are dropped (never spent); the first answer switches back to the
shared quota.  During an outage a round asks for nothing: it probes the whole
store (a PING; on a Redis Cluster, every primary must report
``cluster_state:ok``), and the first round after a good probe asks for
leases again.  The local limiter keeps its state across outages, so a flapping
store gives no fresh local burst.

Limits mismatch.  Every engine publishes a fingerprint of its limits (rates,
burst) in the store every few seconds and logs a warning, once per engine
and fingerprint, when another engine of the deployment (same key prefix)
publishes a different one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable, Mapping, NamedTuple, Protocol, Sequence

from vllm_output_rate.policy.gcra import DEFAULT_BURST_NS, NS_PER_S
from vllm_output_rate.policy.limiter import OutputRateLimiter
from vllm_output_rate.policy.rates import RateTable

logger = logging.getLogger(__name__)

MS = 1_000_000
SHARED, LOCAL, CLOSED = "shared", "local", "closed"
FALLBACKS = (LOCAL, CLOSED)
#: Store modes in the order of their numeric code in :meth:`LeasedOutputRateLimiter.store_figures`.
MODES = (SHARED, LOCAL, CLOSED)


class LeaseAsk(NamedTuple):
    """One user's part of a lease round trip."""

    user: str
    want: int  # tokens asked for (>= 0)
    give_back: int  # unspent tokens handed back (>= 0)
    interval_ns: int  # 1 / rate in ns, rounded up (never grants faster than the rate)


class LeaseGrant(NamedTuple):
    granted: int  # tokens granted (<= want)
    wait_ns: int  # how long after the grant until one more token could be granted


class LeaseBackend(Protocol):
    """The shared side: GCRA per user on the store's clock."""

    def lease(
        self, burst_ns: int, asks: Sequence[LeaseAsk], engine: str = ""
    ) -> list[LeaseGrant]:
        """Hand back, then grant, for every ask, atomically; one round trip.

        ``engine`` names the asking engine, so a user's quota is split evenly
        between the engines asking for it (see the module docstring).  Raises
        on any failure (unreachable, timeout, error reply).
        """

    def publish_fingerprint(self, engine_id: str, fingerprint: str) -> dict[str, str]:
        """Record this engine's limits fingerprint; return every live engine's."""

    def describe(self) -> str:
        """Where the store is, for log lines (never includes a password)."""

    def close(self) -> None: ...


def interval_ns_of(rate: Fraction) -> int:
    """``1 / rate`` seconds in whole ns, rounded up (the store's unit)."""
    return -((-rate.denominator * NS_PER_S) // rate.numerator)


@dataclass(frozen=True)
class LeaseConfig:
    """Lease sizes and timings (see the module docstring for the bound)."""

    round_ns: int = 50 * MS  # regular round-trip cadence
    lease_s: Fraction = Fraction(1, 10)  # lease size: this many seconds of the rate
    lifetime_ns: int = 300 * MS  # a lease is spendable this long after its request
    active_ns: int = 200 * MS  # a user is asked for while wanted this recently
    min_round_gap_ns: int = 5 * MS  # extra rounds (new users) at most this often
    outage_after_ns: int = 300 * MS  # no answer for this long: fall back
    fallback: str = LOCAL
    expected_engines: int = 1
    fingerprint_every_ns: int = 5 * NS_PER_S

    def __post_init__(self) -> None:
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if (
            isinstance(self.expected_engines, bool)
            or not isinstance(self.expected_engines, int)
            or self.expected_engines < 1
        ):
            raise ValueError(
                f"expected engines must be a positive integer, got {self.expected_engines!r}"
            )
        if self.lifetime_ns <= self.round_ns:
            raise ValueError("lease lifetime must exceed the round interval")

    def lease_size(self, rate: Fraction) -> int:
        return max(1, math.ceil(rate * self.lease_s))


def limits_fingerprint(default: Fraction, overrides: Mapping[str, Fraction], burst_ns: int) -> str:
    """A short hash of the limits; equal limits give equal fingerprints."""
    body = json.dumps(
        {
            "default": str(default),
            "users": {u: str(r) for u, r in sorted(overrides.items())},
            "burst_ns": burst_ns,
        },
        sort_keys=True,
    )
    return hashlib.sha256(body.encode()).hexdigest()[:16]


class LeasedOutputRateLimiter:
    """The limiter interface over leases of a shared GCRA quota.

    Same public methods and meaning as
    :class:`~vllm_output_rate.policy.limiter.OutputRateLimiter`, except that quota
    arrives from the store in leases: ``available`` is what this engine holds
    now, ``ready_at_ns`` is when the next lease is expected (an estimate,
    never "now" while nothing is held).  Thread-safe: the scheduler thread and
    the lease thread share one lock, held only for dict work, never across a
    round trip; a take covered by the oldest lease takes no lock at all (see
    :meth:`_take_from_oldest`).
    """

    def __init__(
        self,
        default_rate: float,
        user_rates: Mapping[str, float] | None,
        backend: LeaseBackend,
        burst_ns: int = DEFAULT_BURST_NS,
        config: LeaseConfig = LeaseConfig(),
        clock: Callable[[], int] = time.monotonic_ns,
        start: bool = True,
        engine_id: str | None = None,
    ) -> None:
        self._rates = RateTable(default_rate, user_rates, burst_ns)
        self._config = config
        self._backend = backend
        self._clock = clock
        self._engine_id = engine_id or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self._local = self._local_limiter()
        self._lock = threading.Lock()
        self._random = random.Random()
        self._mode = SHARED
        # Leases held: user -> deque of [expiry_ns, tokens], oldest first.
        self._leases: dict[str, deque] = {}
        self._last_expiry: dict[str, int] = {}  # expiry of the lease last spent from
        self._wanted_at: dict[str, int] = {}  # last time the scheduler wanted tokens
        self._asked_at: dict[str, int] = {}  # last round that asked for the user
        self._wait_until: dict[str, int] = {}  # store said: nothing before this
        self._give_back: dict[str, int] = {}  # unspent tokens to hand back
        self._new_users: set[str] = set()  # want an extra round now
        self._in_flight = False
        self._last_round_ns = -(10**18)
        self._next_round_ns = clock()
        self._next_fingerprint_ns = self._next_round_ns
        self._outage_started_ns: int | None = None
        self._last_answer_ns = self._next_round_ns  # the store counts as up at start
        # Start of the current run of failed round trips (None: the last one
        # was answered); see run_round for how idle rounds count.
        self._silent_since_ns: int | None = None
        self._idle_since_answer = True  # no round trip since the last answer (none yet)
        self._warned_mismatch: set[tuple[str, str]] = set()
        self.stats = {
            "round_trips": 0,
            "asks": 0,
            "leased": 0,
            "handed_back": 0,
            "expired": 0,
            "outages": 0,
            "failed_rounds": 0,
        }
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(
                target=self._run, name="output-rate-lease", daemon=True
            )
            self._thread.start()

    # -- configuration (same as OutputRateLimiter) -------------------------

    @property
    def burst_ns(self) -> int:
        return self._rates.burst_ns

    @property
    def mode(self) -> str:
        """``shared`` while the store answers, else the fallback in force."""
        return self._mode

    def store_figures(self) -> dict[str, int]:
        """Engine-wide store figures for the per-user report (exported to /metrics).

        ``store_mode`` is the index of :attr:`mode` in :data:`MODES` (a
        gauge); names ending in ``_total`` are running totals since start
        (the report turns them into increments).  Read without the lock: each
        figure is one int the lease thread replaces whole.
        """
        stats = self.stats
        return {
            "store_mode": MODES.index(self._mode),
            "store_outages_total": stats["outages"],
            "store_round_trips_total": stats["round_trips"],
            "store_failed_round_trips_total": stats["failed_rounds"],
            "store_commands_total": int(getattr(self._backend, "commands", 0)),
            "store_leased_tokens_total": stats["leased"],
            "store_returned_tokens_total": stats["handed_back"],
            "store_expired_tokens_total": stats["expired"],
        }

    def rate_of(self, user: str) -> float:
        return float(self._rates.exact_rate_of(user))

    def exact_rate_of(self, user: str) -> Fraction:
        return self._rates.exact_rate_of(user)

    def configured_rates(self) -> tuple[Fraction, dict[str, Fraction]]:
        return self._rates.configured()

    def fingerprint(self) -> str:
        default, overrides = self._rates.configured()
        return limits_fingerprint(default, overrides, self.burst_ns)

    def update_rates(
        self, default_rate: float, user_rates: Mapping[str, float] | None = None
    ) -> list[str]:
        """New limits; leases already held stay spendable until they expire.

        The store keeps each user's GCRA debt in ns, so a changed rate applies
        from the next lease on with the debt kept as time (as in memory).
        """
        with self._lock:
            self._rates = RateTable(default_rate, user_rates, self._rates.burst_ns)
            changed: list[str] = []
            default, overrides = self._rates.configured()
            engines = self._config.expected_engines
            self._local.update_rates(
                default / engines, {u: r / engines for u, r in overrides.items()}
            )
            self._next_fingerprint_ns = self._clock()  # publish at the next round
        return changed

    # -- the limiter interface ---------------------------------------------

    def tracked_users(self) -> int:
        with self._lock:
            holding = {u for u, leases in self._leases.items() if leases}
            return len(holding | set(self._wanted_at)) + self._local.tracked_users()

    def available(self, user: str, now_ns: int) -> int:
        if self._mode is not SHARED:
            return self._local.available(user, now_ns) if self._mode is LOCAL else 0
        with self._lock:
            have = self._held(user, now_ns)
            if not have:
                self._want(user, now_ns)
            return have

    def try_take(self, user: str, now_ns: int, count: int = 1) -> bool:
        if count <= 0:
            return True
        if self._mode is not SHARED:
            return self._local.try_take(user, now_ns, count) if self._mode is LOCAL else False
        if self._take_from_oldest(user, now_ns, count):
            return True
        with self._lock:
            if self._held(user, now_ns) < count:
                self._want(user, now_ns)
                return False
            self._spend(user, count)
            return True

    def take_up_to(self, user: str, now_ns: int, count: int) -> int:
        if count <= 0:
            return 0
        if self._mode is not SHARED:
            return self._local.take_up_to(user, now_ns, count) if self._mode is LOCAL else 0
        if self._take_from_oldest(user, now_ns, count):
            return count
        with self._lock:
            have = self._held(user, now_ns)
            if have < count:
                self._want(user, now_ns)
                if not have:
                    return 0
                count = have
            self._spend(user, count)
            return count

    def _take_from_oldest(self, user: str, now_ns: int, count: int) -> bool:
        """The common case without the lock: the oldest lease is valid and covers ``count``.

        Safe without the lock because only the scheduler thread changes a
        held lease's count or removes leases; the lease thread only appends
        new leases (``deque.append`` is atomic) or, when an outage starts,
        swaps in an empty table (spending from a dropped lease is spending
        granted tokens, within the bound).
        """
        self._wanted_at[user] = now_ns
        leases = self._leases.get(user)
        if leases:
            oldest = leases[0]
            if oldest[0] > now_ns and oldest[1] > count:
                oldest[1] -= count
                self._last_expiry[user] = oldest[0]
                return True
        return False

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Give back tokens taken earlier: spendable again until their lease expires."""
        if count <= 0:
            return
        if self._mode is not SHARED:
            if self._mode is LOCAL:
                self._local.refund(user, now_ns, count)
            return
        with self._lock:
            expiry = self._last_expiry.get(user)
            if expiry is None:
                return
            if expiry <= now_ns:
                self._give_back[user] = self._give_back.get(user, 0) + count
                return
            leases = self._leases.setdefault(user, deque())
            if leases and leases[0][0] == expiry:
                leases[0][1] += count
            else:
                leases.appendleft([expiry, count])  # the oldest lease held

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """When a take for ``user`` is expected to succeed (an estimate).

        ``now_ns`` while tokens are held (or for a user never asked for);
        otherwise shortly after the round trip that will bring the next lease
        (1 ms after the next round, or after the store's own "not before" for
        this user).  Only a query: it does not make the engine ask for quota.
        """
        if self._mode is LOCAL:
            return self._local.ready_at_ns(user, now_ns)
        with self._lock:
            if self._mode is SHARED and (
                self._held(user, now_ns) or user not in self._wanted_at
            ):
                return now_ns  # tokens held, or never short: a first ask brings them
            if self._in_flight or user in self._new_users:
                return now_ns + MS
            due = max(self._next_round_ns, self._wait_until.get(user, 0))
            return max(due, now_ns) + MS

    def cleanup_idle_users(self, now_ns: int) -> int:
        """Drop expired leases and users not wanted lately; return how many users."""
        dropped = self._local.cleanup_idle_users(now_ns)
        with self._lock:
            stale = now_ns - self._config.active_ns
            for user in list(self._leases):
                if not self._held(user, now_ns) and self._wanted_at.get(user, stale) <= stale:
                    del self._leases[user]
            for user in list(self._wanted_at):
                if self._wanted_at[user] < stale and user not in self._leases:
                    del self._wanted_at[user]
                    self._asked_at.pop(user, None)
                    self._wait_until.pop(user, None)
                    self._last_expiry.pop(user, None)
                    dropped += 1
        return dropped

    # -- local lease bookkeeping (scheduler thread, lock held) -------------

    def _held(self, user: str, now_ns: int) -> int:
        """Tokens held for ``user`` now; expired leases move to the hand-back pile."""
        leases = self._leases.get(user)
        if not leases:
            return 0
        while leases and leases[0][0] <= now_ns:
            _, tokens = leases.popleft()
            if tokens:
                self._give_back[user] = self._give_back.get(user, 0) + tokens
                self.stats["expired"] += tokens
        return sum(lease[1] for lease in leases)

    def _spend(self, user: str, count: int) -> None:
        """Spend ``count`` held tokens (the caller checked they are held), oldest first."""
        leases = self._leases[user]
        while count:
            lease = leases[0]
            self._last_expiry[user] = lease[0]
            if lease[1] > count:
                lease[1] -= count
                return
            count -= lease[1]
            leases.popleft()

    def _want(self, user: str, now_ns: int) -> None:
        """Note that ``user`` is short; ask at once if it was not asked lately."""
        self._wanted_at[user] = now_ns
        if (
            user not in self._new_users
            and self._asked_at.get(user, -(10**18)) + self._config.active_ns <= now_ns
            and self._wait_until.get(user, 0) <= now_ns
        ):
            self._new_users.add(user)
            self._wake.set()

    # -- the lease thread -----------------------------------------------------

    def pump(self, now_ns: int) -> bool:
        """What the lease thread does at ``now_ns``: a regular round when due,
        else an extra round for users that just became short; True if a round ran."""
        regular = now_ns >= self._next_round_ns
        extra = bool(self._new_users) and now_ns >= self._last_round_ns + self._config.min_round_gap_ns
        if regular or extra:
            self.run_round(now_ns, only_new=not regular)
            return True
        return False

    def drive_by_hand(self, clock: Callable[[], int]) -> None:
        """Stop the lease thread and read ``clock`` from now on; the caller calls
        :meth:`pump` (benchmarks that step a scheduler on a fake clock)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        with self._lock:
            self._clock = clock
            now = clock()
            self._next_round_ns = self._last_answer_ns = self._next_fingerprint_ns = now
            self._silent_since_ns = None
            self._idle_since_answer = True
            self._last_round_ns = -(10**18)
            self._leases = {}
            self._give_back.clear()
            self._wait_until.clear()
            self._asked_at.clear()
            self._wanted_at.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = self._clock()
            try:
                if self.pump(now):
                    now = self._clock()
            except Exception:  # never let the thread die
                logger.exception("output-rate lease round failed")
                now = self._clock()
            if now >= self._next_fingerprint_ns and self._mode is SHARED:
                self.check_fingerprints(now)
            if self._new_users:
                timeout_ns = self._last_round_ns + self._config.min_round_gap_ns - now
            else:
                timeout_ns = self._next_round_ns - now
            self._wake.wait(max(timeout_ns, 0) / NS_PER_S)
            self._wake.clear()

    def run_round(self, now_ns: int, only_new: bool = False) -> int:
        """One round trip: hand back unspent tokens, ask for leases; returns tokens granted.

        ``only_new``: an extra round for users that just became short.
        Called by the lease thread; tests call it directly with a fake clock.
        """
        cfg = self._config
        with self._lock:
            if self._mode is SHARED:
                asks = self._collect_asks(now_ns, only_new)
            else:
                # During an outage a round is only a probe of the whole store
                # (every node of a cluster): an answer about some users'
                # keys would end the outage while other nodes are still down.
                asks = []
                self._new_users.clear()
            self._last_round_ns = now_ns
            if not only_new:
                # Jittered cadence (mean round_ns): engines sharing a user do
                # not stay in phase, so none of them is always first in line.
                self._next_round_ns = now_ns + int(cfg.round_ns * self._random.uniform(0.8, 1.2))
            if not asks and self._mode is SHARED:
                # Nothing to ask: no round trip, and no news about the store.
                # An idle round neither pings (round trips cost) nor counts as
                # an answer, so it never delays noticing a store that stopped
                # answering.
                self._idle_since_answer = True
                return 0
            self._in_flight = True
        granted_total = 0
        try:
            grants = self._backend.lease(self.burst_ns, asks, self._engine_id)
            if len(grants) != len(asks):
                raise RuntimeError(f"store answered {len(grants)} grants for {len(asks)} asks")
        except Exception as exc:  # unreachable, timeout, error reply: all the same
            with self._lock:
                self._in_flight = False
                self.stats["failed_rounds"] += 1
                # One slow or lost answer on a loaded machine is not an outage;
                # no answer for outage_after_ns is.  Leases held stay valid.
                # The silence starts at the last answer, or, when idle rounds
                # (nothing sent, so nothing learnt) came after it, at this
                # first failed round trip.
                if self._silent_since_ns is None:
                    self._silent_since_ns = (
                        now_ns if self._idle_since_answer else self._last_answer_ns
                    )
                if now_ns - self._silent_since_ns >= cfg.outage_after_ns:
                    self._enter_outage(now_ns, exc)
            return 0
        received = self._clock()
        with self._lock:
            self._in_flight = False
            self._last_answer_ns = received
            self._silent_since_ns = None
            self._idle_since_answer = False
            if self._mode is not SHARED:
                self._end_outage(received)
            self.stats["round_trips"] += 1  # answered round trips only
            for ask, grant in zip(asks, grants):
                self.stats["handed_back"] += ask.give_back
                if grant.granted > 0:
                    leases = self._leases.setdefault(ask.user, deque())
                    leases.append([now_ns + cfg.lifetime_ns, grant.granted])
                    granted_total += grant.granted
                if ask.want:
                    self._wait_until[ask.user] = received + grant.wait_ns
            self.stats["leased"] += granted_total
        return granted_total

    def _collect_asks(self, now_ns: int, only_new: bool) -> list[LeaseAsk]:
        cfg = self._config
        users = set(self._new_users) if only_new else set(self._wanted_at)
        self._new_users.clear()
        users |= set(self._give_back)
        active_since = now_ns - cfg.active_ns
        skip_until = now_ns + cfg.round_ns // 2
        asked_before = now_ns - cfg.round_ns // 2  # no second ask right after an extra round
        asks = []
        for user in users:
            rate = self._rates.exact_rate_of(user)
            want = 0
            if self._wanted_at.get(user, -(10**18)) >= active_since and (
                only_new
                or (
                    self._wait_until.get(user, 0) <= skip_until
                    and self._asked_at.get(user, -(10**18)) <= asked_before
                )
            ):
                # Read only (the scheduler thread owns held leases): a copy of
                # the user's leases, expired ones not counted.
                held = sum(c for e, c in list(self._leases.get(user, ())) if e > now_ns)
                want = max(0, cfg.lease_size(rate) - held)
            back = self._give_back.pop(user, 0)
            if want or back:
                if want:
                    self._asked_at[user] = now_ns
                asks.append(LeaseAsk(user, want, back, interval_ns_of(rate)))
        self.stats["asks"] += len(asks)
        return asks

    def _enter_outage(self, now_ns: int, exc: BaseException) -> None:
        if self._outage_started_ns is None:
            self._outage_started_ns = now_ns
            self.stats["outages"] += 1
            what = (
                f"each engine enforces rate / {self._config.expected_engines} locally"
                if self._config.fallback == LOCAL
                else "every limited user pauses"
            )
            logger.warning(
                "output-rate store %s unreachable (%s); until it answers, %s",
                self._backend.describe(),
                type(exc).__name__,
                what,
            )
        self._mode = LOCAL if self._config.fallback == LOCAL else CLOSED
        # Leases held are dropped, never spent: the store keeps them charged.
        self._leases = {}  # a new table: the scheduler's lock-free path may hold the old one
        self._give_back.clear()
        self._last_expiry.clear()
        self._wait_until.clear()

    def _end_outage(self, now_ns: int) -> None:
        started = self._outage_started_ns
        self._outage_started_ns = None
        self._mode = SHARED
        logger.warning(
            "output-rate store %s answers again after %.1f s; shared quota resumed",
            self._backend.describe(),
            (now_ns - started) / NS_PER_S if started is not None else 0.0,
        )

    def check_fingerprints(self, now_ns: int) -> list[str]:
        """Publish this engine's limits fingerprint; warn about engines that differ.

        Returns the ids of live engines whose fingerprint differs.
        """
        self._next_fingerprint_ns = now_ns + self._config.fingerprint_every_ns
        mine = self.fingerprint()
        try:
            everyone = self._backend.publish_fingerprint(self._engine_id, mine)
        except Exception:
            return []  # the lease rounds notice outages
        differ = sorted(e for e, fp in everyone.items() if e != self._engine_id and fp != mine)
        for engine in differ:
            key = (engine, everyone[engine])
            if key not in self._warned_mismatch:
                self._warned_mismatch.add(key)
                logger.warning(
                    "output-rate limits differ between engines sharing store prefix: "
                    "engine %s has limits fingerprint %s, this engine (%s) has %s",
                    engine,
                    everyone[engine],
                    self._engine_id,
                    mine,
                )
        return differ

    def _local_limiter(self) -> OutputRateLimiter:
        default, overrides = self._rates.configured()
        engines = self._config.expected_engines
        return OutputRateLimiter(
            default / engines,
            {u: r / engines for u, r in overrides.items()},
            self.burst_ns,
        )

    def close(self) -> None:
        """Stop the lease thread and close the store connection."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self._backend.close()

