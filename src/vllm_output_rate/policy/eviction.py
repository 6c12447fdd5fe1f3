"""What evicting a resident request for a waiting one may cost.

An eviction frees a throttled request's slot and KV for another request, and
its price is paid later: when the evicted request comes back, vLLM computes
its prompt and every token generated so far again.  Under sustained pressure
that price can exceed the work the engine is there for, so evictions draw on
a budget earned by serving: each request scheduled in a step (an output
token, or rarely an intermediate prefill chunk) earns ``ratio`` tokens of
recompute, and the budget holds at most ``burst_tokens``.  An eviction costs
the tokens the victim holds (all of them, as if the prefix cache kept none).

Evictions for a waiting request happen only when the budget can pay.  An
eviction for a running request that needs KV is paid even into debt (vLLM
would preempt somebody then anyway); waiting requests then wait until the
debt is paid back.  Bound: tokens recomputed because of the plugin's
evictions for waiting requests <= burst_tokens + ratio x (requests scheduled,
summed over steps).  While the budget cannot pay, waiting requests take
slots and KV as they free up, the way stock vLLM admits them.

Which waiting request may displace whom is decided by
:func:`evens_out`: resident requests are shared between users in proportion
to their rates, and an eviction must move a slot from a user above its share
to one below it.

Plain Python: no vLLM import.
"""

from __future__ import annotations

#: Recomputed tokens allowed per request scheduled in a step (the default).
DEFAULT_RECOMPUTE_RATIO = 0.25


class EvictionBudget:
    """Tokens of recompute that evictions for waiting requests may still cause."""

    __slots__ = ("ratio", "burst_tokens", "_available", "earned_tokens", "spent_tokens",
                 "forced_tokens", "evictions")

    def __init__(self, burst_tokens: int, ratio: float = DEFAULT_RECOMPUTE_RATIO) -> None:
        if burst_tokens < 0 or ratio < 0:
            raise ValueError("burst_tokens and ratio must not be negative")
        self.ratio = ratio
        self.burst_tokens = burst_tokens
        self._available = float(burst_tokens)  # starts full: the first eviction is never late
        # Cumulative, for metrics and tests: recompute credited (before the
        # cap), spent by every eviction, and spent by those paid into debt.
        self.earned_tokens = 0.0
        self.spent_tokens = 0
        self.forced_tokens = 0
        self.evictions = 0

    def earn(self, output_tokens: int) -> None:
        """Credit the tokens of one step."""
        if output_tokens > 0:
            credit = self.ratio * output_tokens
            self.earned_tokens += credit
            self._available = min(self._available + credit, float(self.burst_tokens))

    def affords(self, cost_tokens: int) -> bool:
        """Could an eviction that costs ``cost_tokens`` of recompute be paid now?"""
        return cost_tokens <= self._available

    def spend(self, cost_tokens: int) -> None:
        """Pay for one eviction (into debt if it could not be afforded)."""
        if cost_tokens > self._available:
            self.forced_tokens += cost_tokens
        self._available -= cost_tokens
        self.spent_tokens += cost_tokens
        self.evictions += 1

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
