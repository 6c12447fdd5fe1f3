"""Per-user output-token rate limiter: GCRA on exact integers, in memory.

The arithmetic is :mod:`.gcra` (one user's TAT) and the configured rates are
a :class:`~.rates.RateTable`; :class:`OutputRateLimiter` keeps every user's
TAT in a mapping and answers the :class:`Limiter` operations.  Consequences
that the tests check:

* **Bound.**  In any window of ``W`` seconds at most ``(W + burst) * rate + 1``
  takes succeed, whatever the pattern of attempts.
* **Even pacing.**  A user who takes whenever allowed gets one token every
  ``1 / rate`` seconds after an initial burst; there is no "spend a second's
  worth at once, then stall".
* **Idle users are free to forget.**  A user whose TAT is not in the future
  behaves exactly like a user never seen, so dropping it changes nothing.

The limiter is pure bookkeeping with time passed in by the caller (the
scheduler reads its clock once per step).  It makes no fairness or queueing
decision and imports nothing from vLLM.

Storage.  The per-user state lives in an injected *state store*: a mutable
mapping ``user -> TAT on that user's scaled clock`` (absent == idle).  The
default is a plain ``dict``, the cheapest mapping there is: the scheduler
calls :meth:`OutputRateLimiter.take_up_to` and ``available`` once per user
per step.  A store shared between engines cannot be consulted synchronously
from the scheduler step (it would wait on the network); that case is
:mod:`vllm_output_rate.stores.lease`, which spends local leases of a GCRA
kept in the shared store through the same :class:`Limiter` operations.
:func:`vllm_output_rate.factory.make_limiter` picks one from the settings.
"""

from __future__ import annotations

from typing import Mapping, MutableMapping, Protocol

from vllm_output_rate.policy.gcra import DEFAULT_BURST_NS, NS_PER_S  # noqa: F401  (re-exported)
from vllm_output_rate.policy.rates import Rate, RateTable, exact_rate  # noqa: F401  (re-exported)

#: The per-user state store of the in-memory limiter: ``user -> TAT`` on the
#: user's scaled clock; a user without an entry is idle.  Any
#: ``MutableMapping[str, int]`` works; entries are only read, written and
#: deleted one user at a time, plus :meth:`items` for cleanup.
StateStore = MutableMapping[str, int]


class Limiter(Protocol):
    """What the gate and the scheduler need of a per-user output-token quota.

    Implemented by :class:`OutputRateLimiter` (one engine, in memory), by the
    store layer's leased limiter (one quota shared by several engines) and by
    :class:`~.quota.ComposedLimiter` (several quotas paid together).  Every
    operation takes ``now_ns`` from the caller's monotonic clock.  Asking
    (``available``, ``ready_at_ns``) changes nothing; demand is declared by
    ``want`` (a take that comes up short declares its shortfall itself).
    """

    def rate_of(self, user: str) -> float:
        """The user's configured tokens per second."""

    def available(self, user: str, now_ns: int) -> int:
        """How many tokens the user could take in a row at ``now_ns``; no side effect."""

    def want(self, user: str, now_ns: int, count: int = 1) -> None:
        """Declare that the user needs ``count`` tokens it may not hold (a leased quota asks its store)."""

    def try_take(self, user: str, now_ns: int, count: int = 1) -> bool:
        """Take ``count`` tokens if the quota allows all of them; else take none."""

    def take_up_to(self, user: str, now_ns: int, count: int) -> int:
        """Take as many of ``count`` tokens as the quota allows; return how many."""

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Give back ``count`` tokens taken earlier and not used."""

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """The earliest time >= ``now_ns`` at which the user can take one token; no side effect."""

    def cleanup_idle_users(self, now_ns: int) -> int:
        """Forget users whose quota is whole again; return how many."""

    def update_rates(self, default_rate: Rate, user_rates: Mapping[str, Rate] | None = None) -> list[str]:
        """Replace the configured rates; return the active users whose rate changed."""

    def figures(self, user: str | None = None) -> dict[str, int]:
        """Store counters for the metrics endpoint, or with ``user`` that user's ({} without a store)."""

    def close(self) -> None:
        """Release what the limiter holds (threads, connections)."""


class OutputRateLimiter:
    """Exact GCRA quota of output tokens per user, in memory.

    ``default_rate`` applies to every user without an entry in
    ``user_rates``.  Rates are tokens per second (positive, finite, may be
    fractional).  ``burst_ns`` is how far a user's TAT may run ahead of now.
    The rates are :attr:`rates` (a :class:`~.rates.RateTable`), the per-user
    state :attr:`state`.

    All methods take ``now_ns`` from the caller; callers must never pass a
    time earlier than one they passed before (a monotonic clock).
    """

    def __init__(
        self,
        default_rate: Rate,
        user_rates: Mapping[str, Rate] | None = None,
        burst_ns: int = DEFAULT_BURST_NS,
        store: StateStore | None = None,
    ) -> None:
        self.rates = RateTable(default_rate, user_rates, burst_ns)
        self.burst_ns = burst_ns
        # The table's own dict and default, read directly on the hot path.
        self._overrides, self._default = self.rates.overrides, self.rates.default
        #: user -> TAT on that user's scaled clock (absent == idle); its
        #: length is how many users hold limiter state.
        self.state: StateStore = {} if store is None else store

    def update_rates(
        self, default_rate: Rate, user_rates: Mapping[str, Rate] | None = None
    ) -> list[str]:
        """Replace the configured rates; return the tracked users whose rate changed.

        All or nothing: invalid rates raise ``ValueError`` (as the
        constructor does) and change nothing.  A user whose rate is the same
        before and after keeps its state exactly.  A tracked user whose rate
        changed keeps its TAT as a point in time (rounded up to the new
        scaled clock, never earlier), so it neither gets a fresh burst nor
        loses more than its current debt; its next take is judged at the new
        rate, and from the change on the bound holds at the new rate ``N``:
        over any window starting at or after the change, at most
        ``(W + burst) * N + 1`` takes.  (GCRA's bound holds from any starting
        TAT: a take needs ``TAT - now <= burst`` whatever came before.)
        """
        old, new = self.rates, RateTable(default_rate, user_rates, self.burst_ns)
        tat = self.state
        changed = old.changed_for(new, list(tat))
        for user in changed:
            tat[user] = old.of(user).moved_to(tat[user], new.of(user))
        self.rates = new
        self._overrides, self._default = new.overrides, new.default
        return changed

    def rate_of(self, user: str) -> float:
        """Configured tokens/s of ``user``."""
        return float(self._overrides.get(user, self._default).rate)

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """Earliest time >= ``now_ns`` at which ``try_take(user)`` succeeds.

        Rounded up to a whole nanosecond, so a take at the returned time
        succeeds and a take one nanosecond earlier does not (unless the
        returned value is ``now_ns`` itself).
        """
        return self._overrides.get(user, self._default).ready_at(self.state, user, now_ns)

    def available(self, user: str, now_ns: int) -> int:
        """How many takes in a row would succeed for ``user`` at ``now_ns``."""
        return self._overrides.get(user, self._default).available(self.state, user, now_ns)

    def want(self, user: str, now_ns: int, count: int = 1) -> None:
        """Nothing to ask for: every token is here."""

    def try_take(self, user: str, now_ns: int, count: int = 1) -> bool:
        """Take ``count`` tokens of ``user``'s quota at ``now_ns``, all or none.

        Taking ``count`` at once is exactly ``count`` successive single takes
        at the same instant, provided all of them would succeed.
        """
        if count <= 0:
            return True
        return self._overrides.get(user, self._default).take_all(self.state, user, now_ns, count)

    def take_up_to(self, user: str, now_ns: int, count: int) -> int:
        """Take as many of ``count`` tokens as ``user``'s quota allows at ``now_ns``.

        Returns how many were taken: exactly what ``count`` single
        :meth:`try_take` calls at the same instant, stopping at the first
        refusal, would take -- in one computation.
        """
        return self._overrides.get(user, self._default).take_up_to(self.state, user, now_ns, count)

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Give back ``count`` tokens taken earlier at a time <= ``now_ns``.

        Moves TAT back by ``count`` intervals.  A refund for a user without state
        (it is idle, so its quota is already whole) does nothing; a refund
        that leaves TAT at or before now makes the user idle again.
        """
        self._overrides.get(user, self._default).refund(self.state, user, now_ns, count)

    def cleanup_idle_users(self, now_ns: int) -> int:
        """Forget users whose TAT is not in the future; return how many.

        Such a user's next take starts from ``now`` either way, so dropping
        it changes no later outcome; it only bounds memory.
        """
        of = self.rates.of
        idle = [user for user, tat in self.state.items() if of(user).is_idle(tat, now_ns)]
        for user in idle:
            del self.state[user]
        return len(idle)

    def figures(self, user: str | None = None) -> dict[str, int]:
        """No store, no store figures."""
        return {}

    def close(self) -> None:
        """Nothing to release."""
