"""The charge/refund ledger: what each request paid in the current step.

One part of :class:`vllm_output_rate.policy.gate.StepGate`.  A step's payments are
of two kinds: *prepaid* streams (the plan paid for a user's offered streams
with one bulk take; a repeated step paid for every resident stream) and
*charges* (one token taken when a request reaches its sampling position).
At the end of the step, :meth:`vllm_output_rate.policy.gate.StepGate.finish` keeps
the payments of requests that sampled and refunds the rest through
:meth:`Ledger.refund`, the single refund point.
"""

from __future__ import annotations

from typing import Hashable

from vllm_output_rate.policy.lanes import Lanes
from vllm_output_rate.policy.limiter import OutputRateLimiter

Key = Hashable
_NOTHING: frozenset = frozenset()


class Ledger:
    """Payments, refusals and blocked users of one step, over the limiter.

    Invariants (checked by ``tests/policy/test_gate_parts.py``):

    * a key is paid for at most once per step: prepaid, or charged once;
    * a user refused once in a step is not asked again in that step, and
      every refused or short user is *blocked* until the next step opens;
    * :meth:`charge` and :meth:`can_charge` agree, and only :meth:`charge`
      and the plan's bulk takes take tokens;
    * a blocked user's blocked time is added to ``throttled_ns`` when the
      next step opens, so the total covers whole steps.
    """

    def __init__(self, limiter: OutputRateLimiter, lanes: Lanes) -> None:
        self.limiter = limiter
        self._lanes = lanes
        self._user_of = lanes.user_of  # the same dicts, never rebound
        self._lane_of = lanes.lane_of
        #: The current step's time, on the limiter's clock.
        self.now_ns = 0
        #: Keys charged one token in this step (not prepaid) -> user.
        self.charged: dict[Key, str] = {}
        #: Keys the plan paid for in this step.
        self.prepaid: set | frozenset = _NOTHING
        #: (user, prepaid keys) per user the plan paid for, in plan order.
        self.offers: list[tuple[str, list]] = []
        #: A repeated step: every resident stream is paid for.
        self.all_resident_prepaid = False
        #: Users the plan could not pay every stream for, in plan order.
        self.short: list[str] = []
        #: Users refused in this step (not asked again).
        self.refused: set[str] = set()
        #: Users that waited for quota in this step (short or refused).
        self.blocked: set[str] = set()
        # Observability, read at stats time.
        #: user -> tokens charged and kept (sampled), cumulative.
        self.charged_tokens: dict[str, int] = {}
        #: user -> ns during which the user had runnable requests and no quota.
        self.throttled_ns: dict[str, int] = {}
        #: user -> requests that sampled in the last settled step.
        self.ran: dict[str, int] = {}
        #: Steps that ran nothing because every runnable request was throttled.
        self.idle_steps = 0

    def open(self, now_ns: int, all_resident_prepaid: bool) -> None:
        """Start a step at ``now_ns``: count the last step's blocked time and
        forget its payments, refusals and blocked users."""
        if self.blocked:
            elapsed = now_ns - self.now_ns
            throttled_ns = self.throttled_ns
            for user in self.blocked:
                throttled_ns[user] = throttled_ns.get(user, 0) + elapsed
        self.now_ns = now_ns
        self.charged.clear()
        self.refused.clear()
        self.blocked.clear()
        self.short.clear()
        self.offers = []
        self.all_resident_prepaid = all_resident_prepaid
        self.prepaid = _NOTHING if all_resident_prepaid else set()

    def prepay(self, user: str, keys: list) -> None:
        """Record that the plan paid for ``keys`` of ``user`` (one bulk take)."""
        self.prepaid.update(keys)
        self.offers.append((user, keys))

    def fall_short(self, user: str) -> None:
        """The plan could not pay for every stream of ``user``: it is blocked."""
        self.short.append(user)
        self.blocked.add(user)

    def charge(self, key: Key) -> bool:
        """Charge one token to the request's user; True if paid (now or
        before, in this step), False if refused."""
        if key in self.charged or key in self.prepaid or (
            self.all_resident_prepaid and key in self._lane_of
        ):
            return True
        user = self._user_of[key]
        if user in self.refused:
            return False
        if self.limiter.try_take(user, self.now_ns):
            self.charged[key] = user
            return True
        self.refused.add(user)
        self.blocked.add(user)
        return False

    def can_charge(self, key: Key) -> bool:
        """Would :meth:`charge` succeed now?  Takes nothing; a no is remembered."""
        if key in self.charged or key in self.prepaid or (
            self.all_resident_prepaid and key in self._lane_of
        ):
            return True
        user = self._user_of[key]
        if user in self.refused:
            return False
        if self.limiter.available(user, self.now_ns) > 0:
            return True
        self.refused.add(user)
        self.blocked.add(user)
        return False

    def is_charged(self, key: Key) -> bool:
        """Paid for in this step (charged, or prepaid by the plan or a repeat)."""
        return (
            key in self.charged
            or key in self.prepaid
            or (self.all_resident_prepaid and key in self._lane_of)
        )

    def quota_now(self, user: str) -> int:
        """Tokens ``user`` could still be charged in this step (0 once refused)."""
        if user in self.refused:
            return 0
        return self.limiter.available(user, self.now_ns)

    def is_served_now(self, key: Key) -> bool:
        """Was a decoding stream of the key's user paid for in this step?"""
        user = self._user_of[key]
        if self.all_resident_prepaid:
            lane = self._lanes.order.get(user)
            return lane is not None and bool(lane.decoding)
        return any(offer_user == user for offer_user, _ in self.offers)

    def refund(self, user: str, count: int = 1) -> None:
        """Give ``count`` unsampled tokens back to ``user``."""
        self.limiter.refund(user, self.now_ns, count)

    def credit(self, ran: dict[str, int]) -> None:
        """Record the settled step: ``ran`` maps each user to its sampled requests."""
        self.ran = ran
        charged_tokens = self.charged_tokens
        for user, count in ran.items():
            charged_tokens[user] = charged_tokens.get(user, 0) + count

    def close(self) -> None:
        """The step is settled: no payment is left open."""
        self.charged.clear()
        self.offers = []
        self.prepaid = _NOTHING
        self.all_resident_prepaid = False

    def idle_wait_ns(self, cap_ns: int) -> int | None:
        """How long an engine that ran nothing may sleep: until the earliest
        blocked user gets quota back, at most ``cap_ns``; None if none blocked."""
        if not self.blocked:
            return None
        self.idle_steps += 1
        now = self.now_ns
        earliest = min(self.limiter.ready_at_ns(user, now) for user in self.blocked)
        return max(0, min(earliest - now, cap_ns))
