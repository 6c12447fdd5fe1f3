"""GCRA on one user's theoretical arrival time (TAT), in exact integers.

GCRA (generic cell rate algorithm) keeps one number per user, the TAT: the
instant at which the user's next token would be due if it had been served
exactly at its rate since it last went idle.  A take at time ``now``
succeeds when ``TAT - now <= burst``; it then moves TAT forward by one
interval ``1 / rate`` (from ``now`` if TAT lies in the past).  A user whose
TAT is not in the future is *idle*: it behaves exactly like a user never
seen, so its state may be dropped (``None`` here).

Exactness.  A rate ``p/q`` tokens/s (a fraction, so ``2.5`` and ``0.1`` are
exact) gives an interval of ``q/p`` seconds, rarely a whole number of
nanoseconds.  A TAT is therefore kept on a clock scaled by ``p``
(``scaled = ns * p``): one interval is ``q * 10**9`` scaled units and the
burst ``burst_ns * p``, so every operation is integer addition or
comparison and millions of takes accumulate no rounding error.  A store
that keeps times in plain nanoseconds (the Redis script) is the same
algorithm on a clock of scale 1 (:meth:`Gcra.on_ns`).

:class:`Gcra` holds one rate's constants and no state of its own: every
operation reads and writes one user's entry of a TAT mapping the caller
keeps (a dict in memory; the tests' model of the Redis store keeps one too).
"""

from __future__ import annotations

from fractions import Fraction
from typing import MutableMapping

#: user -> TAT on the user's scaled clock; no entry: idle.
TatMap = MutableMapping[str, int]

NS_PER_S = 1_000_000_000
DEFAULT_BURST_NS = 100_000_000  # 100 ms: must cover at least one engine step.


class Gcra:
    """One rate's GCRA, on that rate's scaled clock (see the module docstring).

    Every operation works on one user's entry of the caller's TAT mapping
    (no entry: idle), at a time in nanoseconds.
    """

    __slots__ = ("rate", "scale", "interval", "burst", "burst_ns")

    def __init__(self, rate: Fraction, scale: int, interval: int, burst_ns: int) -> None:
        self.rate = rate
        self.scale = scale  # scaled units per nanosecond
        self.interval = interval  # one token, in scaled units
        self.burst = burst_ns * scale  # how far TAT may run ahead of now, scaled
        self.burst_ns = burst_ns

    @classmethod
    def of_rate(cls, rate: Fraction, burst_ns: int) -> "Gcra":
        """The exact GCRA of ``rate`` tokens/s on the clock scaled by its numerator."""
        return cls(rate, rate.numerator, rate.denominator * NS_PER_S, burst_ns)

    @classmethod
    def on_ns(cls, interval_ns: int, burst_ns: int) -> "Gcra":
        """A GCRA whose interval is a whole number of ns (a store's unit)."""
        return cls(Fraction(NS_PER_S, interval_ns), 1, interval_ns, burst_ns)

    def available(self, tats: TatMap, user: str, now_ns: int) -> int:
        """How many takes in a row ``user`` could make at ``now_ns``."""
        debt = tats.get(user, 0) - now_ns * self.scale
        if debt < 0:
            debt = 0
        elif debt > self.burst:
            return 0
        return (self.burst - debt) // self.interval + 1

    def take_up_to(self, tats: TatMap, user: str, now_ns: int, count: int) -> int:
        """Take as many of ``count`` at ``now_ns`` as the quota allows; return how
        many -- what single takes would give, stopping at the first refusal."""
        now = now_ns * self.scale
        tat = tats.get(user, now)
        if tat < now:
            tat = now
        headroom = self.burst - (tat - now)
        if headroom < 0 or count <= 0:
            return 0
        taken = headroom // self.interval + 1
        if taken > count:
            taken = count
        tats[user] = tat + taken * self.interval
        return taken

    def take_all(self, tats: TatMap, user: str, now_ns: int, count: int) -> bool:
        """Take ``count`` at ``now_ns`` if all of them succeed; else take none."""
        now = now_ns * self.scale
        tat = tats.get(user, now)
        if tat < now:
            tat = now
        if tat - now + (count - 1) * self.interval > self.burst:
            return False
        tats[user] = tat + count * self.interval
        return True

    def charge(self, tats: TatMap, user: str, now_ns: int, count: int) -> None:
        """Count ``count`` takes at ``now_ns`` whatever this quota allows (tokens
        another cap granted, charged here too)."""
        now = now_ns * self.scale
        tat = tats.get(user, now)
        tats[user] = (tat if tat > now else now) + count * self.interval

    def refund(self, tats: TatMap, user: str, now_ns: int, count: int) -> None:
        """Give back ``count`` takes; a user left without debt becomes idle (no entry)."""
        tat = tats.get(user)
        if tat is None:
            return
        tat -= count * self.interval
        if tat <= now_ns * self.scale:
            del tats[user]
        else:
            tats[user] = tat

    def ready_at(self, tats: TatMap, user: str, now_ns: int) -> int:
        """Earliest time >= ``now_ns`` at which one take succeeds, rounded up to a
        whole nanosecond (a take one nanosecond earlier fails)."""
        tat = tats.get(user)
        if tat is None:
            return now_ns
        # Smallest t with tat - t * p <= burst_ns * p, i.e. t >= tat / p - burst_ns.
        earliest = -((-tat) // self.scale) - self.burst_ns
        return now_ns if earliest < now_ns else earliest

    def is_idle(self, tat: int, now_ns: int) -> bool:
        """True when ``tat`` is not in the future: dropping it changes nothing."""
        return tat <= now_ns * self.scale

    def moved_to(self, tat: int, other: "Gcra") -> int:
        """The same instant on ``other``'s clock, rounded up (never earlier)."""
        return -((-tat * other.scale) // self.scale)
