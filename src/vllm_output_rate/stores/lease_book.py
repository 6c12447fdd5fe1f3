"""The leases one engine holds, per user, and what it will ask the store for next.

The scheduler thread spends from the book; the lease thread fills it from
round trips and reads from it what to ask for, and when.  Both hold
:attr:`LeaseBook.lock` while they change it, and only for dict work, never
across a round trip -- except :meth:`LeaseBook.take_oldest`, the common take,
which needs no lock for a user the book already knows (it takes it to add
one: the lease thread iterates the users).

A user is asked for while it has demand: the scheduler wanted tokens for it
within ``active_ns``, or it was short after its last ask and the store's
"not before" time lies within ``active_ns`` (an engine whose users are all
throttled may sleep longer than ``active_ns`` between steps, and its
throttled users still want the token the store will grant them then).  A
user with demand is asked for no earlier than its *ask time*
(:func:`ask_due_ns`): when the store said it could grant again, and not
within half a round of the last ask.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Sequence

from vllm_output_rate.policy.rates import RateTable
from vllm_output_rate.stores.backend import LeaseAsk, LeaseConfig, LeaseGrant, interval_ns_of

NEVER = -(10**18)
#: Per-user counters of :class:`LeaseTally`, in the order of its rows.
TALLY_FIELDS = ("asks", "refused", "leased", "spent", "returned", "expired")
ASKS, REFUSED, LEASED, SPENT, RETURNED, EXPIRED = range(len(TALLY_FIELDS))
#: A tally row is dropped once its user was not asked for this long (ns).
TALLY_KEEP_NS = 300 * 10**9


def ask_due_ns(book: "LeaseBook", user: str, round_ns: int) -> int:
    """When a regular round may next ask for ``user``: the store's "not before"
    time, and half a round after the last ask."""
    return max(book.wait_until.get(user, 0), book.asked_at.get(user, NEVER) + round_ns // 2)


def has_demand(book: "LeaseBook", user: str, since_ns: int) -> bool:
    """Did ``user`` want tokens since ``since_ns``, or is it still owed the
    token it was short of when the store's "not before" time comes?"""
    if book.wanted_at.get(user, NEVER) >= since_ns:
        return True
    return (
        book.short_at.get(user, NEVER) >= book.asked_at.get(user, NEVER)
        and book.wait_until.get(user, NEVER) >= since_ns
    )


class LeaseTally:
    """Per user, running totals of what this engine did with the user's leases.

    ``asks``: rounds that asked the store for the user; ``refused``: those
    answered with nothing; ``leased``: tokens granted; ``spent``: tokens the
    scheduler took from leases, net of refunds; ``returned``: unspent tokens
    handed back (expired or refunded after expiry); ``expired``: tokens whose
    lease ran out unspent.  Read by the admin route, so how one user's quota
    splits between engines can be explained from each engine's own numbers.
    Rows are written by the thread that owns the event (the scheduler thread
    spends, the lease thread files asks and grants), one int at a time; a
    row lives until its user was not asked for in ``TALLY_KEEP_NS``.
    """

    def __init__(self) -> None:
        self.rows: dict[str, list[int]] = {}
        self.last_ask: dict[str, int] = {}
        self.spent_total = 0  # every user's ``spent``, forgotten rows included

    def spend(self, user: str, count: int) -> None:
        """Tokens taken from leases (negative: refunded); scheduler thread only."""
        self.spent_total += count
        self.add(user, SPENT, count)

    def add(self, user: str, field: int, count: int) -> None:
        row = self.rows.get(user)
        if row is None:
            row = self.rows[user] = [0] * len(TALLY_FIELDS)
        row[field] += count

    def of(self, user: str) -> dict[str, int]:
        """The user's totals by name (empty for a user without a row)."""
        row = self.rows.get(user)
        return {} if row is None else dict(zip(TALLY_FIELDS, row))

    def forget_idle(self, now_ns: int, keep: set[str]) -> None:
        """Drop rows of users not asked for lately and not in ``keep``."""
        stale = now_ns - TALLY_KEEP_NS
        for user in [u for u, t in self.last_ask.items() if t < stale and u not in keep]:
            del self.last_ask[user]
            self.rows.pop(user, None)


class LeaseBook:
    """Per user: leases held (oldest first), demand, and the store's last word."""

    def __init__(
        self, stats: dict[str, int], wake_rounds: Callable[[], None], config: LeaseConfig = LeaseConfig()
    ) -> None:
        self.lock = threading.Lock()
        self._stats = stats
        self._wake_rounds = wake_rounds
        self._config = config
        self.leases: dict[str, deque[list[int]]] = {}  # user -> deque of [expiry_ns, tokens]
        self.last_expiry: dict[str, int] = {}  # expiry of the lease last spent from
        self.wanted_at: dict[str, int] = {}  # last time the scheduler wanted tokens
        self.short_at: dict[str, int] = {}  # last time the scheduler found none held
        self.asked_at: dict[str, int] = {}  # last round that asked for the user
        self.wait_until: dict[str, int] = {}  # store said: nothing before this
        self.give_back: dict[str, int] = {}  # unspent tokens to hand back
        self.new_users: set[str] = set()  # want an extra round now
        self.new_since = NEVER  # when the first of new_users was added
        #: While the lease thread sleeps past its cadence (nobody to ask
        #: before then): when it will wake.  None: on the cadence, or woken.
        self.deferred_to: int | None = None
        self.tally = LeaseTally()

    # -- the scheduler thread ----------------------------------------------

    def take_oldest(self, user: str, now_ns: int, count: int) -> bool:
        """The common take, without the lock: the oldest lease is valid and covers ``count``.

        Safe without the lock because only the scheduler thread changes a
        held lease's count or removes leases; the lease thread only appends
        new leases (``deque.append`` is atomic) or, when an outage starts,
        swaps in an empty table (spending from a dropped lease is spending
        granted tokens, within the bound).  Noting the demand of a user the
        book already knows replaces one value; a new user is a new key, and
        a dict must not change size while the lease thread iterates it
        (:meth:`asks`, :meth:`next_ask_ns`), so that one write takes the lock.
        Only the scheduler thread removes users, so a user found here stays.
        """
        wanted_at = self.wanted_at
        if user in wanted_at:
            wanted_at[user] = now_ns
        else:
            with self.lock:
                wanted_at[user] = now_ns
        leases = self.leases.get(user)
        if leases:
            oldest = leases[0]
            if oldest[0] > now_ns and oldest[1] > count:
                oldest[1] -= count
                self.last_expiry[user] = oldest[0]
                self.tally.spend(user, count)
                return True
        return False

    def held(self, user: str, now_ns: int) -> int:
        """Tokens held for ``user`` now; expired leases move to the hand-back pile."""
        leases = self.leases.get(user)
        if not leases:
            return 0
        while leases and leases[0][0] <= now_ns:
            _, tokens = leases.popleft()
            if tokens:
                self.give_back[user] = self.give_back.get(user, 0) + tokens
                self._stats["expired"] += tokens
                self.tally.add(user, EXPIRED, tokens)
        return sum(lease[1] for lease in leases)

    def spend(self, user: str, count: int) -> None:
        """Spend ``count`` held tokens (the caller checked they are held), oldest first."""
        self.tally.spend(user, count)
        leases = self.leases[user]
        while count:
            lease = leases[0]
            self.last_expiry[user] = lease[0]
            if lease[1] > count:
                lease[1] -= count
                return
            count -= lease[1]
            leases.popleft()

    def want(self, user: str, now_ns: int) -> None:
        """Note that ``user`` is short; wake the lease thread if it was not
        asked lately, or if it sleeps past the user's ask time."""
        self.wanted_at[user] = self.short_at[user] = now_ns
        if user in self.new_users:
            return
        config = self._config
        if (
            self.asked_at.get(user, NEVER) + config.active_ns <= now_ns
            and self.wait_until.get(user, 0) <= now_ns
        ):
            if not self.new_users:
                self.new_since = now_ns
            self.new_users.add(user)
            self._wake_rounds()
            return
        deferred = self.deferred_to
        if deferred is not None and ask_due_ns(self, user, config.round_ns) < deferred:
            self.deferred_to = None  # the thread plans again; one wake is enough
            self._wake_rounds()

    def refund(self, user: str, now_ns: int, count: int) -> None:
        """Tokens taken and not used: spendable again until their lease expires."""
        expiry = self.last_expiry.get(user)
        if expiry is None:
            return
        self.tally.spend(user, -count)
        if expiry <= now_ns:
            self.give_back[user] = self.give_back.get(user, 0) + count
            return
        leases = self.leases.setdefault(user, deque())
        if leases and leases[0][0] == expiry:
            leases[0][1] += count
        else:
            leases.appendleft([expiry, count])  # the oldest lease held

    def forget_idle(self, now_ns: int, active_ns: int) -> int:
        """Drop expired leases and users not wanted lately; return how many users."""
        stale = now_ns - active_ns
        for user in list(self.leases):
            if not self.held(user, now_ns) and not has_demand(self, user, stale + 1):
                del self.leases[user]
        dropped = 0
        for user in list(self.wanted_at):
            if not has_demand(self, user, stale) and user not in self.leases:
                del self.wanted_at[user]
                self.short_at.pop(user, None)
                self.asked_at.pop(user, None)
                self.wait_until.pop(user, None)
                self.last_expiry.pop(user, None)
                dropped += 1
        self.tally.forget_idle(now_ns, set(self.wanted_at) | set(self.leases))
        return dropped

    def users(self) -> set[str]:
        """Users wanted lately or holding leases."""
        return {u for u, leases in self.leases.items() if leases} | set(self.wanted_at)

    # -- the lease thread --------------------------------------------------

    def asks(self, now_ns: int, only_new: bool, config: LeaseConfig, rates: RateTable) -> list[LeaseAsk]:
        """This round's asks: top each user with demand up to its lease size, hand back the pile.

        ``only_new``: an extra round, for the users that just became short.
        """
        users = set(self.new_users) if only_new else set(self.wanted_at)
        self.new_users.clear()
        users |= set(self.give_back)
        active_since = now_ns - config.active_ns
        skip_until = now_ns + config.round_ns // 2
        asked_before = now_ns - config.round_ns // 2  # no second ask right after an extra round
        asks = []
        for user in users:
            rate = rates.exact_rate_of(user)
            want = 0
            if has_demand(self, user, active_since) and (
                only_new
                or (
                    self.wait_until.get(user, 0) <= skip_until
                    and self.asked_at.get(user, NEVER) <= asked_before
                )
            ):
                # Read only (the scheduler thread owns held leases): a copy of
                # the user's leases, expired ones not counted.
                held = sum(c for e, c in list(self.leases.get(user, ())) if e > now_ns)
                want = max(0, config.lease_size(rate) - held)
            back = self.give_back.pop(user, 0)
            if want or back:
                if want:
                    self.asked_at[user] = self.tally.last_ask[user] = now_ns
                    self.tally.add(user, ASKS, 1)
                asks.append(LeaseAsk(user, want, back, interval_ns_of(rate)))
        self._stats["asks"] += len(asks)
        return asks

    def next_ask_ns(self, cadence_ns: int, config: LeaseConfig) -> int | None:
        """When the next regular round has someone to ask for or something to hand back.

        ``cadence_ns`` when a round then would (what :meth:`asks` takes in:
        demand then, the store's time within half a round, not asked in the
        last half round); otherwise the earliest exact ask time
        (:func:`ask_due_ns`) of a user whose demand lasts until then, which
        is later; None if nobody has demand.  A user becoming short wakes
        the thread when it needs a round sooner (:meth:`want`).
        """
        if self.give_back:
            return cadence_ns
        half = config.round_ns // 2
        active_since = cadence_ns - config.active_ns
        earliest = None
        for user in self.wanted_at:
            due = ask_due_ns(self, user, config.round_ns)
            if due <= cadence_ns + half and self.asked_at.get(user, NEVER) <= cadence_ns - half:
                if has_demand(self, user, active_since):
                    return cadence_ns
            if (earliest is None or due < earliest) and has_demand(self, user, due - config.active_ns):
                earliest = due
        return None if earliest is None else max(earliest, cadence_ns)

    def add_grants(
        self, asks: Sequence[LeaseAsk], grants: Sequence[LeaseGrant], sent_ns: int, received_ns: int,
        lifetime_ns: int,
    ) -> int:
        """File a round trip's grants (valid ``lifetime_ns`` from ``sent_ns``); return tokens granted."""
        granted = 0
        tally = self.tally
        for ask, grant in zip(asks, grants):
            self._stats["handed_back"] += ask.give_back
            if ask.give_back:
                tally.add(ask.user, RETURNED, ask.give_back)
            if ask.want:
                tally.add(ask.user, LEASED if grant.granted > 0 else REFUSED, grant.granted or 1)
            if grant.granted > 0:
                self.leases.setdefault(ask.user, deque()).append([sent_ns + lifetime_ns, grant.granted])
                granted += grant.granted
            if ask.want:
                wait_ns = grant.wait_ns
                if not grant.granted and not wait_ns:
                    # Refused with no time named: other engines hold the
                    # user's share, which frees one token per interval times
                    # the engines asking.  Asking every round would cost a
                    # round trip each; one interval delays this engine's
                    # next token by at most that.
                    wait_ns = ask.interval_ns
                self.wait_until[ask.user] = received_ns + wait_ns
        self._stats["leased"] += granted
        return granted

    def clear(self, forget_demand: bool = False) -> None:
        """Drop every lease held and what the store said (an outage: the store keeps
        them charged); ``forget_demand`` also forgets who wanted and was asked for."""
        self.leases = {}  # a new table: the scheduler's lock-free path may hold the old one
        self.give_back.clear()
        self.last_expiry.clear()
        self.wait_until.clear()
        self.deferred_to = None
        if forget_demand:
            self.asked_at.clear()
            self.wanted_at.clear()
            self.short_at.clear()
