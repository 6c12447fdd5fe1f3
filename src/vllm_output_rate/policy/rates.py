"""The configured rates: a default, per-user overrides and the burst, validated.

A :class:`RateTable` maps every user to its :class:`~.gcra.Gcra` (the
default's unless the user has an override).  It holds no per-user state, so
the in-memory limiter and the leased limiter (which keeps its state in a
shared store) both read their rates from one.
"""

from __future__ import annotations

import math
from fractions import Fraction
from numbers import Real
from typing import Iterable, Mapping, Union

from vllm_output_rate.policy.gcra import DEFAULT_BURST_NS, Gcra

#: A rate in tokens per second: a float as configured, or the exact Fraction kept internally.
Rate = Union[float, Fraction]


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


class RateTable:
    """Every user's rate: ``default`` unless ``overrides`` names the user.

    Construction validates everything (``ValueError`` naming the culprit), so
    a table that exists is a valid one.  ``default`` and ``overrides`` are
    plain attributes: the in-memory limiter reads them directly on its hot path.
    """

    def __init__(
        self,
        default_rate: Rate,
        user_rates: Mapping[str, Rate] | None = None,
        burst_ns: int = DEFAULT_BURST_NS,
    ) -> None:
        if isinstance(burst_ns, bool) or not isinstance(burst_ns, int) or burst_ns <= 0:
            raise ValueError(f"burst_ns must be a positive integer, got {burst_ns!r}")
        self.burst_ns = burst_ns
        self.default = Gcra.of_rate(exact_rate(default_rate, "default rate"), burst_ns)
        self.overrides: dict[str, Gcra] = {}
        for user, rate in (user_rates or {}).items():
            if not isinstance(user, str) or not user:
                raise ValueError(f"user names must be non-empty strings, got {user!r}")
            self.overrides[user] = Gcra.of_rate(exact_rate(rate, f"rate of user {user!r}"), burst_ns)

    def of(self, user: str) -> Gcra:
        return self.overrides.get(user, self.default)

    def exact_rate_of(self, user: str) -> Fraction:
        """``user``'s tokens per second, exactly."""
        return self.overrides.get(user, self.default).rate

    def configured(self) -> tuple[Fraction, dict[str, Fraction]]:
        """The default rate and the per-user overrides, exactly."""
        return self.default.rate, {u: g.rate for u, g in self.overrides.items()}

    def divided(self, parts: int) -> "RateTable":
        """The same table with every rate divided by ``parts`` (same burst)."""
        default, overrides = self.configured()
        return RateTable(default / parts, {u: r / parts for u, r in overrides.items()}, self.burst_ns)

    def changed_for(self, other: "RateTable", users: Iterable[str]) -> list[str]:
        """Those of ``users`` whose rate differs in ``other``."""
        return [u for u in users if self.of(u).rate != other.of(u).rate]
