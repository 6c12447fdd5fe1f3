"""What the engine side and a shared store say to each other, and the lease settings.

The bottom of the stores layer: the value types of one lease round trip
(:class:`LeaseAsk`, :class:`LeaseGrant`), what a store must offer
(:class:`LeaseBackend`), the lease sizes and timings (:class:`LeaseConfig`)
and the store modes.  :mod:`.redis_store` implements the backend and
:mod:`.lease` uses it; both import this module and neither imports the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple, Protocol, Sequence

from vllm_output_rate.policy.gcra import NS_PER_S

MS = 1_000_000
SHARED, LOCAL, CLOSED = "shared", "local", "closed"
FALLBACKS = (LOCAL, CLOSED)
#: Store modes in the order of their numeric code in the leased limiter's ``figures()``.
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
        between the engines asking for it (see :mod:`.redis_store`).  With no
        asks it only probes the store.  Raises on any failure (unreachable,
        timeout, error reply).
        """

    def publish_fingerprint(self, engine_id: str, fingerprint: str) -> dict[str, str]:
        """Record this engine's limits fingerprint; return every live engine's."""

    def describe(self) -> str:
        """Where the store is, for log lines (never includes a password)."""

    def close(self) -> None:
        """Close the connection."""


def interval_ns_of(rate: Fraction) -> int:
    """``1 / rate`` seconds in whole ns, rounded up (the store's unit)."""
    return -((-rate.denominator * NS_PER_S) // rate.numerator)


@dataclass(frozen=True)
class LeaseConfig:
    """Lease sizes and timings (see :mod:`.lease` for the bound they give)."""

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

    def store_burst_ns(self, burst_ns: int) -> int:
        """The credit the store keeps for a user nobody asked for: at least a
        lease lifetime, so an engine whose lease thread asks once per lifetime
        (a loaded machine) loses none of the rate."""
        return max(burst_ns, self.lifetime_ns)

    def bound_slack_ns(self, burst_ns: int) -> int:
        """What the bound across engines adds to the window: the store's
        credit and a lease lifetime (derived in :mod:`.lease`)."""
        return self.store_burst_ns(burst_ns) + self.lifetime_ns

    def bound_tokens(self, window_ns: int, rate: Fraction, engines: int, burst_ns: int) -> Fraction:
        """The most tokens ``engines`` engines sharing the store may charge a
        user of ``rate`` in any window of ``window_ns``."""
        slack_ns = self.bound_slack_ns(burst_ns)
        return Fraction(window_ns + slack_ns, NS_PER_S) * rate + 1 + engines * self.lease_size(rate)
