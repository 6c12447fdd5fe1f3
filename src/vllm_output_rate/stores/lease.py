"""One user's quota shared by several engines: local leases of a GCRA kept in a store.

The scheduler must never wait on the network, so it never asks the shared
store anything.  Instead a background thread of each engine *leases* small
batches of a user's tokens from the store, and the scheduler spends only what
its engine holds, through the same methods as the in-memory
:class:`~vllm_output_rate.policy.limiter.OutputRateLimiter` (``try_take``,
``take_up_to``, ``refund``, ``available``, ``ready_at_ns``, ...).  A user with
no lease left is throttled exactly like a user out of quota.

How a lease is granted (:meth:`.backend.LeaseBackend.lease`, one atomic server-side
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

Throttled users.  A user is asked for only when the store can grant it
something: not before the store's "not before" time for it (``wait_ns`` of
its last grant; after a refusal that names no time, because other engines
hold the user's share, one token interval), so a user at N tok/s costs at
most about N asks per second, however long it stays throttled.  When no
user can be asked at the next 50 ms round, the thread skips the cadence and
sleeps until the earliest such time (+ 0-5 ms drawn per round, so engines
told the same time take turns), or until a user becoming short needs a
round sooner; and :meth:`LeasedOutputRateLimiter.ready_at_ns` names that
round, so the engine's idle wait (capped by the scheduler) reaches the
time a lease can next be spent instead of the next 50 ms round.  A user short
after its last ask keeps its demand until ``active_ns`` past that time,
since a throttled engine may sleep longer than ``active_ns`` between steps.

Lifetime.  A lease is valid for ``lifetime_ns`` (300 ms) from the moment its
request was *sent* (before the store granted it, so the lifetime always covers
the grant).  Tokens still unspent then are not spendable any more and go back
to the store with the next round trip.

Store credit.  The store's GCRA keeps at most ``B`` of credit nobody asked
for: the burst (0.1 s), or the lease lifetime when that is longer, which it is
by default (0.3 s).  Lease threads on a loaded machine ask only every
150-250 ms, not every 50; a store keeping only 0.1 s of credit would drop the
rest of each gap, one keeping a lifetime of it loses nothing for a thread
that asks at least once per lifetime (``tests/stores/test_lease.py``, two
engines asking every 150 / 250 ms).  It costs 0.2 s x N on the bound below.

Guarantee across E engines.  Let ``B`` be the store's credit (above), ``T``
the lease lifetime and ``L`` the largest lease.  A token spent at time ``s`` was granted
at a time in ``[s - T, s]``.  The store's GCRA with refunds allows at most
``(W' + B) * N + 1`` net grants (grants minus hand-backs) in any window of
``W'`` seconds; tokens granted in the window and never handed back exceed the
net count only by hand-backs, inside the window, of tokens granted before it,
at most what all engines held then: ``E * L``.  Hence over any window of ``W``
seconds, summed over all engines::

    charged tokens <= (W + B + T) * N + 1 + E * L

With the defaults: ``(W + 0.6) * N + 1 + E * (ceil(0.1 * N))``; for N = 30
tok/s and E = 2, a 1 s window allows at most 55 tokens, 20 s at most 625.
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
store gives no fresh local burst.  A refund goes back to where its tokens
came from, not to whichever mode is in force when it arrives
(:class:`TakeSources`): tokens leased before an outage are not credited to
the local limiter (cancelling local debt it never lent), nor local tokens to
a lease granted after the outage.

Limits mismatch: see :mod:`.fingerprints`.

Parts.  :class:`LeasedOutputRateLimiter` answers the scheduler (the
:class:`~vllm_output_rate.policy.limiter.Limiter` operations) and composes:
the leases held (:class:`~.lease_book.LeaseBook`), the round trips and
their thread (:class:`~.rounds.LeaseRounds`), the outage state machine
(:class:`~.health.StoreHealth`), the limits check
(:class:`~.fingerprints.LimitsFingerprints`) and the in-memory limiter of
the local fallback.  The value types and the backend protocol are in
:mod:`.backend`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any, Callable, Mapping

from vllm_output_rate.policy.gcra import DEFAULT_BURST_NS
from vllm_output_rate.policy.limiter import OutputRateLimiter
from vllm_output_rate.policy.rates import Rate, RateTable
from vllm_output_rate.stores.backend import LOCAL, MODES, MS, SHARED, LeaseBackend, LeaseConfig
from vllm_output_rate.stores.fingerprints import LimitsFingerprints
from vllm_output_rate.stores.health import StoreHealth
from vllm_output_rate.stores.lease_book import LeaseBook, ask_due_ns
from vllm_output_rate.stores.rounds import IDLE, LeaseRounds

#: A user's record of where its tokens came from is dropped once it took
#: nothing for this long: refunds follow their takes within a step or two.
TAKES_KEEP_NS = 60 * 10**9


class TakeSources:
    """Where each user's recent tokens were taken from: the store's leases
    (``shared``) or the local fallback (``local``).  Scheduler thread only.

    Per user, runs of takes from one source, oldest first (at most
    :attr:`KEEP_RUNS`: a refund follows its take within a step or two, and
    the source changes only when an outage starts or ends): ``[source,
    tokens not refunded, last take ns]``.  A refund is split over the runs
    newest first, never giving a source back more than it gave since the
    runs began, so each quota's refunds stay within its own takes (its GCRA
    bound holds) whatever the mode when the refund arrives.  A refund takes
    no token back from a call: within one step the newest tokens are the
    ones refunded first, which is the order the callers settle in.
    """

    KEEP_RUNS = 2

    def __init__(self) -> None:
        self.runs: dict[str, list[list[Any]]] = {}

    def took(self, user: str, source: str, count: int, now_ns: int) -> None:
        runs = self.runs.get(user)
        if runs is None:
            self.runs[user] = [[source, count, now_ns]]
            return
        run = runs[-1]
        if run[0] is source:
            run[1] += count
            run[2] = now_ns
            return
        runs.append([source, count, now_ns])
        if len(runs) > self.KEEP_RUNS:
            del runs[0]

    def split(self, user: str, count: int) -> list[tuple[str | None, int]]:
        """Where a refund of ``count`` goes: (source, tokens) newest first;
        source None for tokens no run accounts for (the caller's choice)."""
        runs = self.runs.get(user)
        out: list[tuple[str | None, int]] = []
        while count and runs:
            run = runs[-1]
            back = min(count, run[1])
            if back:
                out.append((run[0], back))
                count -= back
                run[1] -= back
            if not run[1] and len(runs) > 1:
                runs.pop()  # spent: the older run is the one refunds go to now
            elif not back:
                break
        if count:
            out.append((None, count))
        return out

    def forget_idle(self, now_ns: int) -> None:
        stale = now_ns - TAKES_KEEP_NS
        for user in [u for u, runs in self.runs.items() if runs[-1][2] < stale]:
            del self.runs[user]


class LeasedOutputRateLimiter:
    """The :class:`~vllm_output_rate.policy.limiter.Limiter` operations over leases
    of a shared GCRA quota.

    Same meaning as the in-memory limiter's, except that quota arrives from
    the store in leases: ``available`` is what this engine holds now (asking
    for more is :meth:`want`, or a take that comes up short),
    ``ready_at_ns`` is when the next lease is expected (an estimate, never
    "now" while nothing is held).  Thread-safe: the scheduler thread and the
    lease thread share the book's lock, held only for dict work, never
    across a round trip; a take covered by the oldest lease takes no lock
    at all (:meth:`.lease_book.LeaseBook.take_oldest`).

    Parts, for tests and benchmarks: :attr:`rates`, :attr:`book`,
    :attr:`rounds` (``run``, ``pump``, ``drive_by_hand``), :attr:`health`,
    :attr:`fingerprints`, :attr:`local` (the fallback limiter), :attr:`stats`;
    the mode in force (shared, or the fallback) is ``health.mode``.
    """

    def __init__(
        self,
        default_rate: Rate,
        user_rates: Mapping[str, Rate] | None,
        backend: LeaseBackend,
        burst_ns: int = DEFAULT_BURST_NS,
        config: LeaseConfig = LeaseConfig(),
        clock: Callable[[], int] = time.monotonic_ns,
        start: bool = True,
        engine_id: str | None = None,
    ) -> None:
        self.rates = RateTable(default_rate, user_rates, burst_ns)
        self.config = config
        self.backend = backend
        engine_id = engine_id or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.engine_id = engine_id
        default, overrides = self.rates.divided(config.expected_engines).configured()
        self.local = OutputRateLimiter(default, overrides, burst_ns)
        self.sources = TakeSources()
        self.stats = dict.fromkeys(
            ("round_trips", "asks", "leased", "handed_back", "expired", "outages", "failed_rounds"), 0
        )
        now = clock()
        wake = threading.Event()
        self._wake_rounds = wake.set
        self.book = LeaseBook(self.stats, wake.set, config)
        self.health = StoreHealth(config, backend.describe, self.stats, now)
        self.fingerprints = LimitsFingerprints(backend, engine_id, config.fingerprint_every_ns, now)
        self.rounds = LeaseRounds(
            book=self.book, health=self.health, fingerprints=self.fingerprints, backend=backend,
            config=config, rates=self.rates, engine_id=engine_id, stats=self.stats, clock=clock,
            wake=wake,
        )
        if start:
            self.rounds.start()

    def rate_of(self, user: str) -> float:
        return float(self.rates.exact_rate_of(user))

    def update_rates(
        self, default_rate: Rate, user_rates: Mapping[str, Rate] | None = None
    ) -> list[str]:
        """New limits; return the users this engine tracks whose rate changed.

        Leases already held stay spendable until they expire.  The store
        keeps each user's GCRA debt in ns, so a changed rate applies from the
        next lease on with the debt kept as time (as in memory).
        """
        new = RateTable(default_rate, user_rates, self.rates.burst_ns)
        with self.book.lock:
            default, overrides = new.divided(self.config.expected_engines).configured()
            changed = set(self.local.update_rates(default, overrides))
            changed.update(self.rates.changed_for(new, self.book.users()))
            self.rates = self.rounds.rates = new
            self.fingerprints.next_ns = self.rounds.clock()  # publish now
        self._wake_rounds()
        return sorted(changed)

    def available(self, user: str, now_ns: int) -> int:
        mode = self.health.mode
        if mode is not SHARED:
            return self.local.available(user, now_ns) if mode is LOCAL else 0
        with self.book.lock:
            return self.book.held(user, now_ns)

    def want(self, user: str, now_ns: int, count: int = 1) -> None:
        """The user needs ``count`` tokens: unless this engine holds them, the
        lease thread asks the store for the user (at once for a new user).
        Nothing to ask for while the store is out."""
        if self.health.mode is not SHARED:
            return
        book = self.book
        with book.lock:
            if book.held(user, now_ns) < count:
                book.want(user, now_ns)

    def try_take(self, user: str, now_ns: int, count: int = 1) -> bool:
        if count <= 0:
            return True
        mode = self.health.mode  # read once: the lease thread may change it
        if mode is not SHARED:
            if mode is LOCAL and self.local.try_take(user, now_ns, count):
                self.sources.took(user, LOCAL, count, now_ns)
                return True
            return False
        book = self.book
        if not book.take_oldest(user, now_ns, count):
            with book.lock:
                if book.held(user, now_ns) < count:
                    book.want(user, now_ns)
                    return False
                book.spend(user, count)
        self.sources.took(user, SHARED, count, now_ns)
        return True

    def take_up_to(self, user: str, now_ns: int, count: int) -> int:
        if count <= 0:
            return 0
        mode = self.health.mode  # read once: the lease thread may change it
        if mode is not SHARED:
            taken = self.local.take_up_to(user, now_ns, count) if mode is LOCAL else 0
            if taken:
                self.sources.took(user, LOCAL, taken, now_ns)
            return taken
        book = self.book
        if not book.take_oldest(user, now_ns, count):
            with book.lock:
                have = book.held(user, now_ns)
                if have < count:
                    book.want(user, now_ns)
                    if not have:
                        return 0
                    count = have
                book.spend(user, count)
        self.sources.took(user, SHARED, count, now_ns)
        return count

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Give back tokens taken earlier, to where they were taken from
        (:class:`TakeSources`): to their lease, spendable again until it
        expires (nothing, if the lease was dropped when an outage began: the
        store keeps it charged), or to the local fallback.  Tokens no record
        accounts for (their run was dropped, :attr:`TakeSources.KEEP_RUNS`,
        or the user was idle for ``TAKES_KEEP_NS``) go back nowhere: the
        source in force now may not be the one that gave them."""
        if count <= 0:
            return
        for source, back in self.sources.split(user, count):
            if source is LOCAL:
                self.local.refund(user, now_ns, back)
            elif source is SHARED:
                with self.book.lock:
                    self.book.refund(user, now_ns, back)

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """When a take for ``user`` is expected to succeed (an estimate).

        ``now_ns`` while tokens are held (or for a user never asked for);
        otherwise shortly after the round trip that will bring the next lease:
        1 ms after the round planned for the user (not before the store's
        own "not before" for it), which on an engine whose users are all
        throttled is when the store can grant again, not the next 50 ms
        round.  While that round is late or under way (sent, or woken for a
        new user), the estimate doubles the time it has taken so far
        (at least 1 ms), so a slow store or a busy machine costs the engine a
        few wake-ups, not one per millisecond.  Only a query: it does not
        make the engine ask for quota.
        """
        mode = self.health.mode
        if mode is LOCAL:
            return self.local.ready_at_ns(user, now_ns)
        book, rounds = self.book, self.rounds
        with book.lock:
            if mode is not SHARED:  # closed: the next probe may end the outage
                return max(rounds.next_round_ns, now_ns) + MS
            if book.held(user, now_ns) or user not in book.wanted_at:
                return now_ns  # tokens held, or never short: a first ask brings them
            if user in book.new_users:
                since = book.new_since
            elif rounds.in_flight and book.asked_at.get(user) == rounds.last_round_ns:
                since = rounds.last_round_ns
            else:
                since = ask_due_ns(book, user, self.config.round_ns)
                if rounds.next_round_ns != IDLE:
                    since = max(since, rounds.next_round_ns)
                if since > now_ns:
                    return since + MS
            return now_ns + max(MS, now_ns - since)

    def cleanup_idle_users(self, now_ns: int) -> int:
        """Drop expired leases and users not wanted lately; return how many users."""
        dropped = self.local.cleanup_idle_users(now_ns)
        self.sources.forget_idle(now_ns)
        with self.book.lock:
            return dropped + self.book.forget_idle(now_ns, self.config.active_ns)

    def figures(self, user: str | None = None) -> dict[str, int]:
        """Engine-wide store figures for the per-user report (exported to /metrics);
        with ``user``, that user's lease totals on this engine
        (:class:`~.lease_book.LeaseTally`: asks, refused, leased, spent,
        returned, expired), read by the admin route.

        ``store_mode`` is the index of ``health.mode`` in :data:`MODES` (a
        gauge); names ending in ``_total`` are running totals since start
        (the report turns them into increments).  Read without the lock: each
        figure is one int the lease thread replaces whole.
        """
        if user is not None:
            return self.book.tally.of(user)
        stats = self.stats
        return {
            "store_mode": MODES.index(self.health.mode),
            "store_outages_total": stats["outages"],
            "store_round_trips_total": stats["round_trips"],
            "store_failed_round_trips_total": stats["failed_rounds"],
            "store_commands_total": int(getattr(self.backend, "commands", 0)),
            "store_leased_tokens_total": stats["leased"],
            "store_spent_tokens_total": self.book.tally.spent_total,
            "store_returned_tokens_total": stats["handed_back"],
            "store_expired_tokens_total": stats["expired"],
        }

    def close(self) -> None:
        """Stop the lease thread and close the store connection."""
        self.rounds.stop()
        self.backend.close()
