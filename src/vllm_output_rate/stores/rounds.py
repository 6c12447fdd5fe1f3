"""The lease thread: round trips to the store that fill one engine's lease book.

Regular rounds come every ``round_ns`` (jittered) while some user has
demand and may be asked for then; a user that just became short triggers
an extra round for the new users only, at most every ``min_round_gap_ns``.
When nobody could be asked at the next cadence round -- every user with
demand waits for the store's "not before" time, as on an engine whose users
are all throttled -- the thread sleeps until the earliest such time (or the
next limits-fingerprint check), and a user becoming short wakes it when it
needs a round sooner (:meth:`.lease_book.LeaseBook.want`).  So a throttled
user costs about one round trip per token it is granted, not one per round.
During an outage rounds keep the cadence and ask for nothing: each probes
the whole store, and the first answer ends the outage.  Tests and
benchmarks on a fake clock call :meth:`LeaseRounds.run` or
:meth:`LeaseRounds.pump` themselves instead of starting the thread.
"""

from __future__ import annotations

import logging
import random
import threading
from typing import Callable

from vllm_output_rate.policy.gcra import NS_PER_S
from vllm_output_rate.policy.rates import RateTable
from vllm_output_rate.stores.backend import SHARED, LeaseBackend, LeaseConfig
from vllm_output_rate.stores.fingerprints import LimitsFingerprints
from vllm_output_rate.stores.health import StoreHealth
from vllm_output_rate.stores.lease_book import NEVER, LeaseBook

logger = logging.getLogger("vllm_output_rate.stores.lease")

#: :attr:`LeaseRounds.next_round_ns` while nobody has demand: no round planned.
IDLE = 2**62


class LeaseRounds:
    """Runs the round trips of one engine, on its thread or by hand."""

    def __init__(
        self,
        *,
        book: LeaseBook,
        health: StoreHealth,
        fingerprints: LimitsFingerprints,
        backend: LeaseBackend,
        config: LeaseConfig,
        rates: RateTable,
        engine_id: str,
        stats: dict[str, int],
        clock: Callable[[], int],
        wake: threading.Event,
    ) -> None:
        self._book = book
        self._health = health
        self._fingerprints = fingerprints
        self._backend = backend
        self._config = config
        self.rates = rates  # replaced when the limits change
        self._engine_id = engine_id
        self._stats = stats
        self.clock = clock
        self._wake = wake
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.random = random.Random()
        self.in_flight = False
        self.last_round_ns = NEVER
        self.cadence_ns = clock()  # the next regular round on the cadence
        #: When the next regular round runs: the cadence, or later when
        #: nobody could be asked before (see :meth:`plan`); :data:`IDLE`
        #: when nobody has demand.
        self.next_round_ns = self.cadence_ns
        self._late_ns = 0  # added to a round put off past the cadence (drawn per round)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="output-rate-lease", daemon=True)
        self._thread.start()

    def pump(self, now_ns: int) -> bool:
        """What the lease thread does at ``now_ns``: a regular round when due,
        else an extra round for users that just became short; True if a round ran."""
        self.plan()
        regular = now_ns >= self.next_round_ns
        extra = bool(self._book.new_users) and now_ns >= self.last_round_ns + self._config.min_round_gap_ns
        if regular or extra:
            self.run(now_ns, only_new=not regular)
            self.plan()
            return True
        return False

    def plan(self) -> None:
        """Set :attr:`next_round_ns`: the cadence, or the time someone can next
        be asked for when nobody can be at the cadence round."""
        book = self._book
        with book.lock:
            due: int | None
            if self._health.mode is not SHARED:
                due = self.cadence_ns  # every round is a probe
            else:
                due = book.next_ask_ns(self.cadence_ns, self._config)
            if due is None:
                self.next_round_ns = book.deferred_to = IDLE
            elif due == self.cadence_ns:
                self.next_round_ns, book.deferred_to = due, None
            else:
                self.next_round_ns, book.deferred_to = due + self._late_ns, due

    def wake_at_ns(self) -> int:
        """When the thread next has work: a round, or the fingerprint check."""
        if self._book.new_users:
            return self.last_round_ns + self._config.min_round_gap_ns
        if self._health.mode is SHARED:
            return min(self.next_round_ns, self._fingerprints.next_ns)
        return self.next_round_ns

    def run(self, now_ns: int, only_new: bool = False) -> int:
        """One round trip: hand back unspent tokens, ask for leases; returns tokens granted.

        ``only_new``: an extra round for users that just became short.
        """
        cfg, book, health = self._config, self._book, self._health
        with book.lock:
            if self.cadence_ns < now_ns and self.cadence_ns < self.next_round_ns:
                # Cadence rounds were skipped, nobody to ask then: idle rounds.
                health.idle_round()
            if health.mode is SHARED:
                asks = book.asks(now_ns, only_new, cfg, self.rates)
            else:
                # During an outage a round is only a probe of the whole store
                # (every node of a cluster): an answer about some users'
                # keys would end the outage while other nodes are still down.
                asks = []
                book.new_users.clear()
            self.last_round_ns = now_ns
            if not only_new:
                # Jittered cadence (mean round_ns): engines sharing a user do
                # not stay in phase, so none of them is always first in line.
                self.cadence_ns = now_ns + int(cfg.round_ns * self.random.uniform(0.8, 1.2))
                self.next_round_ns = self.cadence_ns
                # Engines told the same "not before" time by the store would
                # otherwise ask at the same instant, and the same one would
                # always come first.
                self._late_ns = int(cfg.round_ns * self.random.uniform(0, 0.1))
            if not asks and health.mode is SHARED:
                health.idle_round()  # no round trip, and no news about the store
                return 0
            self.in_flight = True
        try:
            grants = self._backend.lease(cfg.store_burst_ns(self.rates.burst_ns), asks, self._engine_id)
            if len(grants) != len(asks):
                raise RuntimeError(f"store answered {len(grants)} grants for {len(asks)} asks")
        except Exception as exc:  # unreachable, timeout, error reply: all the same
            with book.lock:
                self.in_flight = False
                self._stats["failed_rounds"] += 1
                if health.failed(now_ns, exc):
                    book.clear()  # never spent: the store keeps them charged
            return 0
        received = self.clock()
        with book.lock:
            self.in_flight = False
            health.answered(received)
            self._stats["round_trips"] += 1  # answered round trips only
            return book.add_grants(asks, grants, now_ns, received, cfg.lifetime_ns)

    def drive_by_hand(self, clock: Callable[[], int]) -> None:
        """Stop the thread and read ``clock`` from now on; the caller calls
        :meth:`pump` (benchmarks that step a scheduler on a fake clock)."""
        self.stop()
        with self._book.lock:
            self.clock = clock
            now = clock()
            self.cadence_ns = self.next_round_ns = self._fingerprints.next_ns = now
            self._health.restart(now)
            self.last_round_ns = NEVER
            self._book.clear(forget_demand=True)

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = self.clock()
            try:
                if self.pump(now):
                    now = self.clock()
            except Exception:  # never let the thread die
                logger.exception("output-rate lease round failed")
                now = self.clock()
            if now >= self._fingerprints.next_ns and self._health.mode is SHARED:
                self._fingerprints.check(now, self.rates)
            self._wake.wait(max(self.wake_at_ns() - now, 0) / NS_PER_S)
            self._wake.clear()
