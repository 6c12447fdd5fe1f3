"""What evicting a resident request for a waiting one may cost.

An eviction frees a throttled request's slot and KV for a waiting request of
another user, and its price is paid later: when the evicted request comes
back, vLLM computes its prompt and every token generated so far again.  Under
sustained pressure that price can exceed the work the engine is there for, so
evictions on behalf of waiting requests draw on a budget earned by serving:
each output token of a finished request earns ``ratio`` tokens of recompute,
and the budget holds at most ``burst_tokens``.  An eviction costs the tokens
the victim holds (all of them, as if the prefix cache kept none).

Bound: recomputed tokens caused by such evictions <= burst_tokens + ratio x
(output tokens of finished requests).  When the budget is spent, waiting
requests take slots and KV as they free up, the way stock vLLM admits them.

Which waiting request may displace whom is decided by
:func:`evens_out`: resident requests are shared between users in proportion
to their rates, and an eviction must move a slot from a user above its share
to one below it.

Plain Python: no vLLM import.
"""

from __future__ import annotations

#: Recomputed tokens allowed per output token served (the default).
DEFAULT_RECOMPUTE_RATIO = 0.25


class EvictionBudget:
    """Tokens of recompute that evictions for waiting requests may still cause."""

    __slots__ = ("ratio", "burst_tokens", "_available", "spent_tokens")

    def __init__(self, burst_tokens: int, ratio: float = DEFAULT_RECOMPUTE_RATIO) -> None:
        if burst_tokens < 0 or ratio < 0:
            raise ValueError("burst_tokens and ratio must not be negative")
        self.ratio = ratio
        self.burst_tokens = burst_tokens
        self._available = float(burst_tokens)  # starts full: the first eviction is never late
        #: Recompute tokens spent so far (cumulative; for metrics and tests).
        self.spent_tokens = 0

    def earn(self, output_tokens: int) -> None:
        """Credit the output tokens of a request that left the engine."""
        if output_tokens > 0:
            self._available = min(
                self._available + self.ratio * output_tokens, float(self.burst_tokens)
            )

    def affords(self, cost_tokens: int) -> bool:
        """Could an eviction that costs ``cost_tokens`` of recompute be paid now?"""
        return cost_tokens <= self._available

    def spend(self, cost_tokens: int) -> None:
        """Pay for one eviction (the caller checked :meth:`affords`)."""
        self._available -= cost_tokens
        self.spent_tokens += cost_tokens

    @property
    def available(self) -> float:
        """Tokens of recompute that may still be spent now."""
        return self._available


def evens_out(victim_resident: int, victim_rate: float, requester_resident: int,
              requester_rate: float) -> bool:
    """May a request of a user with ``victim_resident`` resident requests
    make room for one of a user with ``requester_resident``?

    Yes when the victim's user, even without that request, holds more
    resident requests per unit of rate than the requester's user would with
    its new one (each side counted at half a request, so that equal rates
    need a difference of two).  Every such move lowers
    sum(resident**2 / rate) over the users, so evictions cannot undo each
    other in a cycle: between two admissions into free room there are finitely
    many, and a user never loses a request to a user with as many (equal rates).
    """
    return (victim_resident - 0.5) * requester_rate > (requester_resident + 0.5) * victim_rate
