"""Two quotas paid together: a user's own and the one it shares with others.

A :class:`JointLimiter` is a :class:`~.limiter.Limiter` over two limiters:
``own`` (keyed by user) and ``shared`` (keyed by whatever ``shared_key``
maps the user to: its group; ``None`` for a user outside any).  A token is
taken only when both quotas can pay for it, and then from both, so each
quota's own bound holds over every window whatever the other does:

* a user gets at most ``(W + burst) * own rate + 1`` tokens (``own``'s bound);
* all users mapped to one key together get at most
  ``(W + burst) * shared rate + 1`` (``shared``'s bound, since every token of
  theirs was taken from it).

Joint takes are all or nothing per token: a bulk take asks ``shared`` how
much it could pay, takes at most that from ``own``, pays it on ``shared``
and refunds ``own`` whatever ``shared`` then refused, so neither quota is
left charged for a token the other did not pay.

Plain Python, no vLLM.  Rate changes go to each limiter by its owner
(:meth:`update_rates` changes ``own``'s, which are the per-user rates).
"""

from __future__ import annotations

from typing import Callable, Mapping

from vllm_output_rate.policy.limiter import Limiter


class JointLimiter:
    """Pay every token on ``own[user]`` and, if the user has a shared key, on
    ``shared[shared_key(user)]``."""

    def __init__(self, own: Limiter, shared: Limiter, shared_key: Callable[[str], str | None]) -> None:
        self.own = own
        self.shared = shared
        self.shared_key = shared_key

    def rate_of(self, user: str) -> float:
        """The user's own configured rate."""
        return self.own.rate_of(user)

    def available(self, user: str, now_ns: int) -> int:
        """How many tokens both quotas could pay for in a row."""
        got = self.own.available(user, now_ns)
        key = self.shared_key(user)
        if key is not None:
            # Both asked even when one has nothing: a leased quota asks its
            # store for tokens of whoever was found short.
            return min(got, self.shared.available(key, now_ns))
        return got

    def try_take(self, user: str, now_ns: int, count: int = 1) -> bool:
        """Take ``count`` from both quotas, or nothing from either."""
        key = self.shared_key(user)
        if key is None:
            return self.own.try_take(user, now_ns, count)
        if count <= 0:
            return True
        if self.shared.available(key, now_ns) < count:
            self.own.available(user, now_ns)  # asked all the same (see available)
            return False
        if not self.own.try_take(user, now_ns, count):
            return False
        if self.shared.try_take(key, now_ns, count):
            return True
        self.own.refund(user, now_ns, count)
        return False

    def take_up_to(self, user: str, now_ns: int, count: int) -> int:
        """Take as many of ``count`` as both quotas allow, from both."""
        key = self.shared_key(user)
        if key is None:
            return self.own.take_up_to(user, now_ns, count)
        room = self.shared.available(key, now_ns)
        if room <= 0 < count:
            self.own.available(user, now_ns)  # asked all the same (see available)
            return 0
        taken = self.own.take_up_to(user, now_ns, min(count, room))
        if taken:
            paid = self.shared.take_up_to(key, now_ns, taken)
            if paid < taken:
                self.own.refund(user, now_ns, taken - paid)
                taken = paid
        return taken

    def refund(self, user: str, now_ns: int, count: int = 1) -> None:
        """Give ``count`` back to both quotas."""
        self.own.refund(user, now_ns, count)
        key = self.shared_key(user)
        if key is not None:
            self.shared.refund(key, now_ns, count)

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """When both quotas can pay for one token again."""
        ready = self.own.ready_at_ns(user, now_ns)
        key = self.shared_key(user)
        if key is not None:
            ready = max(ready, self.shared.ready_at_ns(key, now_ns))
        return ready

    def cleanup_idle_users(self, now_ns: int) -> int:
        """Forget idle users and idle shared keys; return how many users."""
        self.shared.cleanup_idle_users(now_ns)
        return self.own.cleanup_idle_users(now_ns)

    def update_rates(self, default_rate: float, user_rates: Mapping[str, float] | None = None) -> list[str]:
        """Replace the users' own rates (the shared quota's owner updates its own)."""
        return self.own.update_rates(default_rate, user_rates)

    def figures(self, user: str | None = None) -> dict[str, int]:
        """The own limiter's store figures (a mode is a gauge: two do not add)."""
        return self.own.figures(user)

    def close(self) -> None:
        """Nothing of its own: the owners of both limiters close them (the
        scheduler its rate limiter, :class:`~.groups.GroupQuotas` the groups'),
        so neither is closed twice."""
