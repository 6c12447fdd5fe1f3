"""Quotas paid together: every level of a user's, all or nothing per token.

A user's token may have to be paid on several quotas: its rate, its ceiling
(borrowing, :mod:`.borrow`), its group's rate and ceiling (:mod:`.groups`).
Each is a *level*: a :class:`~.limiter.Limiter` and the key the user pays
it under (itself, its group), or None where the level does not apply to the
user (a user without a ceiling, or outside any group).  A
:class:`ComposedLimiter` over a list of levels is a
:class:`~.limiter.Limiter` with one rule for each operation:

* **Asking** (``available``, ``ready_at_ns``) is free of side effects:
  ``available`` is the least any level could pay, ``ready_at_ns`` the earliest
  time every level can pay (the latest level's time).
* **Paying** is all or nothing per token: a take goes only as far as every
  level allows, and then from every level, in order; a level that pays less
  than it was asked (a quota that shrank since it was asked) has the
  difference given back by the levels before it.  So each level's own bound
  holds over every window whatever the others do.  A take that comes up
  short declares the shortfall to every level (:meth:`ComposedLimiter.want`),
  so a leased level asks its store for tokens even when another level
  stopped the take before it was asked.
* **Refunds** go to the levels that paid: :func:`payers` names them at the
  time of a take, :func:`refund_payers` gives back to exactly those, whatever
  the user's levels are when the refund comes (a reload may have moved the
  user to another group in between).  :meth:`ComposedLimiter.refund` is the
  same for a refund within the step of its take.
* **Demand** (``want``) is declared to every level the user pays on.

Plain Python, no vLLM.  Each level's limiter is owned (updated, closed) by
whoever built it; the composition closes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from vllm_output_rate.policy.limiter import Limiter
from vllm_output_rate.policy.rates import Rate

#: What a composition without a level that applies could pay: more than any step asks.
UNBOUNDED = 1 << 62
#: The quotas one take was paid on: (limiter, key) per level, in level order.
Payers = tuple[tuple[Limiter, str], ...]


def _same(user: str) -> str:
    return user


@dataclass(frozen=True)
class Level:
    """One quota of a composition: ``limiter``, paid under ``key_of(user)``
    when that is not None and ``applies`` (if given) holds for it.  By
    default every user pays it under its own name."""

    limiter: Limiter
    key_of: Callable[[str], str | None] = _same
    applies: Callable[[str], bool] | None = None

    def key(self, user: str) -> str | None:
        """The key ``user`` pays this level under; None where it does not apply."""
        key = self.key_of(user)
        if key is None or (self.applies is not None and not self.applies(key)):
            return None
        return key


def payers(limiter: Limiter, user: str) -> Payers:
    """The quotas a take of ``user``'s on ``limiter`` is paid on now: the
    applicable levels of a composition, else ``limiter`` itself."""
    if not isinstance(limiter, ComposedLimiter):
        return ((limiter, user),)
    return limiter.payers_of(user)


def refund_payers(paid_by: Payers, now_ns: int, count: int) -> None:
    """Give ``count`` back to each quota of ``paid_by``, and to nothing else."""
    if count > 0:
        for limiter, key in paid_by:
            limiter.refund(key, now_ns, count)


def available_on(paid_by: Payers, now_ns: int) -> int:
    """The least any of ``paid_by`` could pay now (stops at 0; asks have no effect)."""
    least = UNBOUNDED
    for limiter, key in paid_by:
        got = limiter.available(key, now_ns)
        if got < least:
            least = got
            if least <= 0:
                return 0
    return least


class ComposedLimiter:
    """A :class:`~.limiter.Limiter` paying every token on each of ``levels``
    that applies to the user (see the module doc).

    The first level is the user's own rate: ``rate_of``, ``update_rates``
    and ``figures`` are its.
    """

    def __init__(self, levels: Sequence[Level]) -> None:
        assert levels, "a composition needs a level"
        self.levels = tuple(levels)
        # What payers_of reads of each level, unpacked once: the waiting loop
        # asks a user's quota once per waiting request, and every ask works out
        # the user's levels afresh (they read membership live, never kept).
        # None for a level paid under the user's own name (no call for it).
        self._asks = tuple(
            (level.limiter, None if level.key_of is _same else level.key_of, level.applies)
            for level in self.levels
        )

    def payers_of(self, user: str) -> Payers:
        """The applicable levels of ``user`` with its key at each, now (see :func:`payers`)."""
        out = []
        for limiter, key_of, applies in self._asks:
            key = user if key_of is None else key_of(user)
            if key is not None and (applies is None or applies(key)):
                out.append((limiter, key))
        return tuple(out)

    def rate_of(self, user: str) -> float:
        return self.levels[0].limiter.rate_of(user)

    def available(self, user: str, now_ns: int) -> int:
        return available_on(self.payers_of(user), now_ns)

    def want(self, user: str, now_ns: int, count: int = 1) -> None:
        want_on(self.payers_of(user), now_ns, count)

    def try_take(self, user: str, now_ns: int, count: int = 1) -> bool:
        if count <= 0:
            return True
        paid_by = self.payers_of(user)
        if available_on(paid_by, now_ns) >= count:
            taken = _take(paid_by, now_ns, count)
            if taken == count:
                return True
            refund_payers(paid_by, now_ns, taken)  # a level shrank since it was asked: none
        want_on(paid_by, now_ns, count)
        return False

    def take_up_to(self, user: str, now_ns: int, count: int) -> int:
        if count <= 0:
            return 0
        paid_by = self.payers_of(user)
        if len(paid_by) == 1:
            # One quota pays (most users: no group): its own take is the
            # composition's, without asking it first (the plan's per-user cost).
            limiter, key = paid_by[0]
            taken = limiter.take_up_to(key, now_ns, count)
            if taken < count:
                limiter.want(key, now_ns, count - taken)
            return taken
        taken = _take(paid_by, now_ns, min(count, available_on(paid_by, now_ns)))
        if taken < count:
            want_on(paid_by, now_ns, count - taken)
        return taken

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Give back to the user's levels now (a refund in the step of its
        take; one that may cross a reload goes through :func:`refund_payers`)."""
        refund_payers(self.payers_of(user), now_ns, count)

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        ready = now_ns
        for limiter, key in self.payers_of(user):
            at = limiter.ready_at_ns(key, now_ns)
            if at > ready:
                ready = at
        return ready

    def cleanup_idle_users(self, now_ns: int) -> int:
        """Forget idle keys at every level; return how many of the first level's."""
        first, *rest = {id(level.limiter): level.limiter for level in self.levels}.values()
        for limiter in rest:
            limiter.cleanup_idle_users(now_ns)
        return first.cleanup_idle_users(now_ns)

    def update_rates(self, default_rate: Rate, user_rates: Mapping[str, Rate] | None = None) -> list[str]:
        """Replace the first level's rates (each other level's owner updates its own)."""
        return self.levels[0].limiter.update_rates(default_rate, user_rates)

    def figures(self, user: str | None = None) -> dict[str, int]:
        """The first level's store figures (a mode is a gauge: two do not add)."""
        return self.levels[0].limiter.figures(user)

    def close(self) -> None:
        """Nothing of its own: the owners of the levels close them."""


def want_on(paid_by: Payers, now_ns: int, count: int) -> None:
    """Declare ``count`` tokens wanted on every quota of ``paid_by``."""
    for limiter, key in paid_by:
        limiter.want(key, now_ns, count)


def _take(paid_by: Payers, now_ns: int, count: int) -> int:
    """Take up to ``count`` from every quota of ``paid_by`` in order; a quota
    that pays less has the difference given back by the ones before it.
    Returns what every quota paid."""
    if count <= 0:
        return 0
    done = 0
    for limiter, key in paid_by:
        got = limiter.take_up_to(key, now_ns, count)
        if got < count:
            refund_payers(paid_by[:done], now_ns, count - got)
            count = got
            if not count:
                return 0
        done += 1
    return count
