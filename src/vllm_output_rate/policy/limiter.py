"""Per-user output-token rate limiter: GCRA on exact integers.

GCRA (generic cell rate algorithm) keeps one number per user, the
theoretical arrival time (TAT): the instant at which the user's next token
would be due if it had been served exactly at its rate since it last went
idle.  A take at time ``now`` succeeds when ``TAT - now <= burst``; it then
moves TAT forward by one interval ``1 / rate`` (from ``now`` if TAT lies in
the past).  Consequences that the tests check:

* **Bound.**  In any window of ``W`` seconds at most ``(W + burst) * rate + 1``
  takes succeed, whatever the pattern of attempts.
* **Even pacing.**  A user who takes whenever allowed gets one token every
  ``1 / rate`` seconds after an initial burst; there is no "spend a second's
  worth at once, then stall".
* **Idle users are free to forget.**  A user whose TAT is not in the future
  behaves exactly like a user never seen, so dropping it changes nothing.

Exactness.  A rate ``p/q`` tokens/s (a fraction, so ``2.5`` and ``0.1`` are
exact) gives an interval of ``q/p`` seconds, which is rarely a whole number of
nanoseconds.  Each user's TAT is therefore stored on a clock scaled by ``p``:
``scaled = ns * p``.  One interval is then ``q * 10**9`` scaled units and the
burst is ``burst_ns * p``; every operation is integer addition or comparison,
so millions of takes accumulate no rounding error.

The limiter is pure bookkeeping with time passed in by the caller (the
scheduler reads its clock once per step).  It makes no fairness or queueing
decision and imports nothing from vLLM.

Strategy and storage.  :class:`OutputRateLimiter` is the GCRA strategy; the
per-user state it reads and writes lives in an injected *state store*: a
mutable mapping ``user -> TAT on that user's scaled clock`` (absent == idle).
The default store is a plain ``dict`` (:data:`MemoryStore`), so the in-memory
path costs exactly what it did before the split.  A store shared between
engines cannot be consulted synchronously from the scheduler step (it would
wait on the network); that case is :mod:`vllm_output_rate.stores.lease`, which
runs the same algorithm on the shared server and spends local leases through
this same interface.  :func:`vllm_output_rate.factory.make_limiter` picks one
from the settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from numbers import Real
from typing import Mapping, MutableMapping, Protocol

NS_PER_S = 1_000_000_000
DEFAULT_BURST_NS = 100_000_000  # 100 ms: must cover at least one engine step.

#: The per-user state store the GCRA strategy runs over: ``user -> TAT`` on
#: the user's scaled clock (see the module docstring); a user without an entry
#: is idle.  Any ``MutableMapping[str, int]`` works; entries are only read,
#: written and deleted one user at a time, plus :meth:`items` for cleanup.
StateStore = MutableMapping[str, int]
#: The default store: a plain dict, the fastest mapping CPython has.
MemoryStore = dict


def exact_rate(value: object, what: str = "rate") -> Fraction:
    """Return ``value`` as an exact positive fraction of tokens per second.

    Floats are read through their shortest decimal form, so ``0.1`` is
    ``1/10`` rather than the binary approximation.  Raises ``ValueError``
    naming ``what`` for anything that is not a positive finite number.
    """
    if isinstance(value, bool) or not isinstance(value, (Real, str)):
        raise ValueError(f"{what} must be a number, got {value!r}")
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number, got {value!r}") from None
    if math.isnan(as_float) or math.isinf(as_float):
        raise ValueError(f"{what} must be finite, got {value!r}")
    if as_float <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    if isinstance(value, Fraction):
        return value
    if isinstance(value, int):
        return Fraction(value)
    return Fraction(repr(as_float))



class Limiter(Protocol):
    """What the gate and the scheduler need of a per-user output-token quota.

    Implemented by :class:`OutputRateLimiter` (one engine, in memory) and by
    the store layer's leased limiter (one quota shared by several engines).
    Every operation takes ``now_ns`` from the caller's monotonic clock.
    """

    def rate_of(self, user: str) -> float:
        """The user's configured tokens per second."""

    def available(self, user: str, now_ns: int) -> int:
        """How many tokens the user could take in a row at ``now_ns``."""

    def take_up_to(self, user: str, now_ns: int, count: int) -> int:
        """Take as many of ``count`` tokens as the quota allows; return how many."""

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Give back ``count`` tokens taken earlier and not used."""

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """The earliest time >= ``now_ns`` at which the user can take one token."""

    def cleanup_idle_users(self, now_ns: int) -> int:
        """Forget users whose quota is whole again; return how many."""

    def update_rates(self, default_rate: float, user_rates: Mapping[str, float] | None = None) -> list[str]:
        """Replace the configured rates; return the active users whose rate changed."""

    def figures(self) -> dict[str, int]:
        """Counters for the metrics endpoint (empty for a limiter without a store)."""

    def close(self) -> None:
        """Release what the limiter holds (threads, connections)."""


@dataclass(frozen=True)
class _ScaledRate:
    """One rate expressed in the integer units of its scaled clock."""

    rate: Fraction
    clock_scale: int  # p: scaled units per nanosecond
    interval: int  # one token, in scaled units (q * 10**9)
    burst: int  # burst, in scaled units (burst_ns * p)

    @classmethod
    def of(cls, rate: Fraction, burst_ns: int) -> "_ScaledRate":
        return cls(
            rate=rate,
            clock_scale=rate.numerator,
            interval=rate.denominator * NS_PER_S,
            burst=burst_ns * rate.numerator,
        )


class OutputRateLimiter:
    """Exact GCRA quota of output tokens per user.

    ``default_rate`` applies to every user without an entry in
    ``user_rates``.  Rates are tokens per second (positive, finite, may be
    fractional).  ``burst_ns`` is how far a user's TAT may run ahead of now.

    All methods take ``now_ns`` from the caller; callers must never pass a
    time earlier than one they passed before (a monotonic clock).
    """

    def __init__(
        self,
        default_rate: float,
        user_rates: Mapping[str, float] | None = None,
        burst_ns: int = DEFAULT_BURST_NS,
        store: StateStore | None = None,
    ) -> None:
        if isinstance(burst_ns, bool) or not isinstance(burst_ns, int) or burst_ns <= 0:
            raise ValueError(f"burst_ns must be a positive integer, got {burst_ns!r}")
        self._burst_ns = burst_ns
        self._default, self._overrides = _scaled_rates(default_rate, user_rates, burst_ns)
        # user -> TAT on that user's scaled clock.  Absent == idle.
        self._tat: StateStore = MemoryStore() if store is None else store

    # -- configuration ----------------------------------------------------

    def update_rates(
        self, default_rate: float, user_rates: Mapping[str, float] | None = None
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
        default, overrides = _scaled_rates(default_rate, user_rates, self._burst_ns)
        changed: list[str] = []
        tat = self._tat
        for user in list(tat):
            old = self._overrides.get(user, self._default)
            new = overrides.get(user, default)
            if old.rate != new.rate:
                # Same instant on the new clock: tat / p_old * p_new, rounded up.
                tat[user] = -((-tat[user] * new.clock_scale) // old.clock_scale)
                changed.append(user)
        self._default = default
        self._overrides = overrides
        return changed

    def configured_rates(self) -> tuple[Fraction, dict[str, Fraction]]:
        """The default rate and the per-user overrides, exactly."""
        return self._default.rate, {u: r.rate for u, r in self._overrides.items()}

    # -- queries ----------------------------------------------------------

    @property
    def burst_ns(self) -> int:
        return self._burst_ns

    def rate_of(self, user: str) -> float:
        """Configured tokens/s of ``user``."""
        return float(self._scaled(user).rate)

    def exact_rate_of(self, user: str) -> Fraction:
        return self._scaled(user).rate

    def tracked_users(self) -> int:
        """How many users currently hold limiter state."""
        return len(self._tat)

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """Earliest time >= ``now_ns`` at which ``try_take(user)`` succeeds.

        Rounded up to a whole nanosecond, so a take at the returned time
        succeeds and a take one nanosecond earlier does not (unless the
        returned value is ``now_ns`` itself).
        """
        tat = self._tat.get(user)
        if tat is None:
            return now_ns
        r = self._scaled(user)
        # Smallest t with tat - t * p <= burst_ns * p, i.e. t >= tat / p - burst_ns.
        earliest = -((-tat) // r.clock_scale) - self._burst_ns
        return max(now_ns, earliest)

    def available(self, user: str, now_ns: int) -> int:
        """How many takes in a row would succeed for ``user`` at ``now_ns``."""
        tat = self._tat.get(user)
        if tat is None:
            r = self._scaled(user)
            return r.burst // r.interval + 1
        r = self._scaled(user)
        debt = tat - now_ns * r.clock_scale
        if debt <= 0:
            return r.burst // r.interval + 1
        if debt > r.burst:
            return 0
        return (r.burst - debt) // r.interval + 1

    # -- operations -------------------------------------------------------

    def try_take(self, user: str, now_ns: int, count: int = 1) -> bool:
        """Take ``count`` tokens of ``user``'s quota at ``now_ns``, all or none.

        Taking ``count`` at once is exactly ``count`` successive single takes
        at the same instant, provided all of them would succeed.
        """
        if count <= 0:
            return True
        r = self._scaled(user)
        now = now_ns * r.clock_scale
        tat = self._tat.get(user, now)
        if tat < now:
            tat = now
        if tat - now + (count - 1) * r.interval > r.burst:
            return False
        self._tat[user] = tat + count * r.interval
        return True

    def take_up_to(self, user: str, now_ns: int, count: int) -> int:
        """Take as many of ``count`` tokens as ``user``'s quota allows at ``now_ns``.

        Returns how many were taken: exactly what ``count`` single
        :meth:`try_take` calls at the same instant, stopping at the first
        refusal, would take -- in one computation.
        """
        if count <= 0:
            return 0
        r = self._overrides.get(user, self._default)  # _scaled(), inlined: once per user per step
        now = now_ns * r.clock_scale
        tat = self._tat.get(user, now)
        if tat < now:
            tat = now
        headroom = r.burst - (tat - now)
        if headroom < 0:
            return 0
        taken = headroom // r.interval + 1
        if taken > count:
            taken = count
        self._tat[user] = tat + taken * r.interval
        return taken

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Give back ``count`` tokens taken earlier at a time <= ``now_ns``.

        Moves TAT back by ``count`` intervals.  A refund for a user without state
        (it is idle, so its quota is already whole) does nothing; a refund
        that leaves TAT at or before now makes the user idle again.
        """
        tat = self._tat.get(user)
        if tat is None:
            return
        r = self._scaled(user)
        tat -= count * r.interval
        if tat <= now_ns * r.clock_scale:
            del self._tat[user]
        else:
            self._tat[user] = tat

    def cleanup_idle_users(self, now_ns: int) -> int:
        """Forget users whose TAT is not in the future; return how many.

        Such a user's next take starts from ``now`` either way, so dropping
        it changes no later outcome; it only bounds memory.
        """
        idle = [
            user
            for user, tat in self._tat.items()
            if tat <= now_ns * self._scaled(user).clock_scale
        ]
        for user in idle:
            del self._tat[user]
        return len(idle)

    # -- internals --------------------------------------------------------

    def _scaled(self, user: str) -> _ScaledRate:
        return self._overrides.get(user, self._default)


def _scaled_rates(
    default_rate: float, user_rates: Mapping[str, float] | None, burst_ns: int
) -> tuple[_ScaledRate, dict[str, _ScaledRate]]:
    """Validate and scale a default rate and per-user overrides."""
    default = _ScaledRate.of(exact_rate(default_rate, "default rate"), burst_ns)
    overrides: dict[str, _ScaledRate] = {}
    for user, rate in (user_rates or {}).items():
        if not isinstance(user, str) or not user:
            raise ValueError(f"user names must be non-empty strings, got {user!r}")
        overrides[user] = _ScaledRate.of(exact_rate(rate, f"rate of user {user!r}"), burst_ns)
    return default, overrides

