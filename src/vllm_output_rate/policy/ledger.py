"""The charge/refund ledger: what each request paid in the current step.

One part of :class:`vllm_output_rate.policy.gate.StepGate`.  A step's payments are
of two kinds: *prepaid* streams (the plan paid for a user's offered streams
with one bulk take; a repeated step paid for every resident stream) and
*charges* (one token taken when a request reaches its sampling position).
At the end of the step, :meth:`Ledger.settle` (or :meth:`Ledger.settle_repeat`
for a repeated step) keeps the payments of requests that sampled and refunds
the rest: the single refund point.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Container, Hashable, Iterable, Mapping, cast

from vllm_output_rate.policy.lanes import Lanes
from vllm_output_rate.policy.limiter import Limiter
from vllm_output_rate.policy.quota import available_on, payers, want_on

Key = Hashable
_NOTHING: frozenset[Key] = frozenset()


class Ledger:
    """Payments, refusals and blocked users of one step, over the limiter.

    Invariants (checked by ``tests/policy/test_gate_parts.py``):

    * a key is paid for at most once per step: prepaid, or charged once;
    * a user refused once in a step is not asked again in that step, and
      every refused or short user is *blocked* until the next step opens;
    * asking (``charge(key, take=False)``) and charging agree (one path),
      and only :meth:`charge` and the plan's bulk takes take tokens;
    * a blocked user's blocked time is added to ``throttled_ns`` when the
      next step opens, so the total covers whole steps;
    * after :meth:`settle` a payment is kept only for a key that sampled, and
      ``charged_tokens`` grows by exactly the payments kept;
    * the ledger alone records: the other parts (the plan, borrowing,
      drafts, prompt cost) report what they paid, kept or refused through
      its methods, and ``charged_tokens``, ``throttled_ns`` and ``ran``
      are written here only.
    """

    def __init__(self, limiter: Limiter, lanes: Lanes) -> None:
        self.limiter = limiter
        self._lanes = lanes
        self._user_of = lanes.user_of  # the same dicts, never rebound
        self._lane_of = lanes.lane_of
        #: The current step's time, on the limiter's clock.
        self.now_ns = 0
        #: Keys charged one token in this step (not prepaid) -> user.
        self.charged: dict[Key, str] = {}
        #: Keys the plan paid for in this step.
        self.prepaid: set[Key] | frozenset[Key] = _NOTHING
        #: (user, prepaid keys) per user the plan paid for, in plan order.
        self.offers: list[tuple[str, list[Key]]] = []
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
        #: The last settled step kept every prepaid payment and charged
        #: nothing besides: with the same streams it may be repeated.
        self.all_prepaid_kept = False
        #: Users of the last settled step whose only payment was for waiting
        #: requests whose turn came and that were not admitted though nothing
        #: refused them (no KV): what they wait for is room, not quota.
        self.unadmitted: set[str] = set()

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

    def prepay(self, user: str, keys: list[Key], short: bool = False) -> None:
        """Record the plan's take for ``user``: ``keys`` paid (one bulk take)
        and, if ``short``, streams left that it could not pay for (then it
        is blocked and its next token declared wanted)."""
        if keys:
            assert isinstance(self.prepaid, set), "a repeated step prepays every stream at once"
            self.prepaid.update(keys)
            self.offers.append((user, keys))
        if short:
            self.limiter.want(user, self.now_ns)
            self.short.append(user)
            self.blocked.add(user)

    def hold(self, user: str) -> None:
        """A request of ``user`` was kept out of sight for what its user
        cannot pay now (the plan's prefills prompt cost would refuse):
        blocked until the next step opens, its next token declared wanted.
        Not refused: what it can pay is still charged."""
        if user not in self.blocked:
            self.limiter.want(user, self.now_ns)
            self.blocked.add(user)

    def pay_borrowed(self, keys: Iterable[Key]) -> None:
        """Record ``keys`` as paid by borrowing in this step (on the ceiling;
        :class:`~vllm_output_rate.policy.borrow.Borrowing` keeps or refunds
        them and reports what it kept to :meth:`keep`)."""
        assert isinstance(self.prepaid, set), "a repeated step borrows nothing"
        self.prepaid.update(keys)

    def charge(self, key: Key, take: bool = True) -> bool:
        """Charge one token to the request's user, or with ``take=False`` only
        ask whether that would succeed now (nothing is taken); True if paid
        (now or before, in this step).

        One path for both, so the answer and the charge cannot disagree.  A
        no refuses the user for the rest of the step (not asked again) and
        declares its next token wanted."""
        if key in self.charged or key in self.prepaid or (
            self.all_resident_prepaid and key in self._lane_of
        ):
            return True
        user = self._user_of[key]
        if user in self.refused:
            return False
        if take:
            if self.limiter.try_take(user, self.now_ns):  # a failed take declares it wanted
                self.charged[key] = user
                return True
        elif self.limiter.available(user, self.now_ns) > 0:
            return True
        else:
            self.limiter.want(user, self.now_ns)
        self.refuse(user)
        return False

    def refuse(self, user: str) -> None:
        """``user`` was refused in this step (for its output or its prompt
        cost): not asked again, and blocked until the next step opens."""
        self.refused.add(user)
        self.blocked.add(user)

    def is_charged(self, key: Key) -> bool:
        """Paid for in this step (charged, or prepaid by the plan or a repeat)."""
        return (
            key in self.charged
            or key in self.prepaid
            or (self.all_resident_prepaid and key in self._lane_of)
        )

    def quota_now(self, user: str) -> int:
        """Tokens ``user`` could still be charged in this step (0 once
        refused; none left declares the next token wanted)."""
        if user in self.refused:
            return 0
        # The user's levels looked up once for the ask and the want (the
        # limiter's available + want, at one instant): the borrowing demand
        # and the waiting loop ask this once per waiting request.
        paid_by = payers(self.limiter, user)
        left = available_on(paid_by, self.now_ns)
        if not left:
            want_on(paid_by, self.now_ns, 1)
        return left

    def is_served_now(self, key: Key) -> bool:
        """Was a decoding stream of the key's user paid for in this step?"""
        user = self._user_of[key]
        if self.all_resident_prepaid:
            lane = self._lanes.order.get(user)
            return lane is not None and bool(lane.decoding)
        return any(offer_user == user for offer_user, _ in self.offers)

    def settle(self, sampled: Container[Key], all_prepaid_sampled: bool = False) -> int:
        """End the step: keep the payments of keys in ``sampled``, refund the
        rest, rotate the served streams and move served users to the back.

        The single refund point: a payment survives the step only if its
        request sampled.  ``all_prepaid_sampled`` is the caller's promise
        that every prepaid key sampled and no resident request left during
        the step; then the offers are settled per user, without looking at
        single keys.  Returns how many tokens were refunded.
        """
        self.all_prepaid_kept = all_prepaid_sampled and not self.charged
        order = self._lanes.order
        move_to_end = order.move_to_end
        refund = self.limiter.refund
        now_ns = self.now_ns
        refunded, ran, unadmitted = _settle_offers(
            self.offers, order, self._lanes.in_turn, _selector(sampled), all_prepaid_sampled, refund,
            now_ns,
        )
        # Refused (for its prompt cost, say), a user waited for quota or a
        # turn, which its refusal records; the others found no room.
        if unadmitted:
            unadmitted -= self.refused
            if unadmitted:
                self._lanes.room_wanted = True
        self.unadmitted = unadmitted
        for key, user in self.charged.items():
            if key in sampled:
                ran[user] = ran.get(user, 0) + 1
                # Just admitted or just done prefilling: already at the back
                # of its user's streams; only the user order changes.
                if user in order:
                    move_to_end(user)
            else:
                refund(user, now_ns, 1)
                refunded += 1
        self.ran = ran
        charged_tokens = self.charged_tokens
        for user, count in ran.items():
            charged_tokens[user] = charged_tokens.get(user, 0) + count
        self.charged.clear()
        self.offers = []
        self.prepaid = _NOTHING
        self.all_resident_prepaid = False
        return refunded

    def settle_repeat(self, resident: list[Key], sampled: Container[Key], all_sampled: bool) -> int:
        """End a repeated step (opened with ``all_resident_prepaid``) that
        started with ``resident``.

        ``all_sampled`` is the caller's promise that every one of them sampled
        and none left during the step; with nothing charged besides, every
        stream kept its payment and, every user having been served whole,
        every order stays as it was.  Otherwise the step is settled like a
        planned one whose offers were every resident stream.  Returns how
        many tokens were refunded.
        """
        self.all_resident_prepaid = False
        if all_sampled and not self.charged:
            self.all_prepaid_kept = True
            if self.unadmitted:
                self.unadmitted = set()
            ran = self.ran = {}
            charged_tokens = self.charged_tokens
            for user, lane in self._lanes.order.items():
                if lane.decoding:
                    ran[user] = count = len(lane.decoding)
                    charged_tokens[user] = charged_tokens.get(user, 0) + count
            return 0
        if not all_sampled:
            user_of = self._user_of
            by_user: dict[str, list[Key]] = {}
            for key in resident:
                by_user.setdefault(user_of[key], []).append(key)
            order = self._lanes.order
            users = [user for user in order if user in by_user]
            users += [user for user in by_user if user not in order]
            self.offers = [(user, by_user[user]) for user in users]
            return self.settle(sampled)
        # Every resident stream sampled and something else was charged too:
        # the charges settle as usual, and the streams' payments, all kept,
        # still count in the totals (no order changes: each user was served
        # whole).
        refunded = self.settle(sampled, all_prepaid_sampled=True)
        ran = self.ran
        charged_tokens = self.charged_tokens
        user_of = self._user_of
        for key in resident:
            user = user_of[key]
            ran[user] = ran.get(user, 0) + 1
            charged_tokens[user] = charged_tokens.get(user, 0) + 1
        return refunded

    def forget_totals(self, users: Iterable[str]) -> None:
        """Drop the per-user totals (``charged_tokens``, ``throttled_ns``) of
        ``users`` idle long enough to be forgotten; their exported counters
        are kept by whoever reported them."""
        charged_tokens, throttled_ns = self.charged_tokens, self.throttled_ns
        for user in users:
            charged_tokens.pop(user, None)
            throttled_ns.pop(user, None)

    def keep(self, tokens: Mapping[str, int], sampled: bool) -> None:
        """Count per user the tokens another part of the step paid and kept.

        ``sampled``: borrowed streams that sampled in the step just settled
        (:meth:`Borrowing.settle`); they count in ``ran`` too, and a user
        all of whose resident streams ran was not held back, so it is no
        longer blocked.  Otherwise accepted drafts whose output arrived
        (:meth:`DraftAccount.settle_output`): tokens only.  Either way
        ``charged_tokens`` grows, never shrinks.
        """
        charged_tokens = self.charged_tokens
        for user, count in tokens.items():
            if count <= 0:
                continue
            charged_tokens[user] = charged_tokens.get(user, 0) + count
            if not sampled:
                continue
            ran = self.ran[user] = self.ran.get(user, 0) + count
            lane = self._lanes.order.get(user)
            if lane is not None and ran >= lane.resident_streams():
                self.blocked.discard(user)


def _selector(sampled: Container[Key]) -> Callable[[list[Key]], list[Key]]:
    """What picks the keys of a batch that are in ``sampled``, in order: its
    own ``select`` if it has one (one call per user's batch, not one per key:
    the settle's cost at a thousand streams a step)."""
    select = getattr(sampled, "select", None)
    if select is not None:
        return cast("Callable[[list[Key]], list[Key]]", select)
    return lambda batch: [key for key in batch if key in sampled]


def _settle_offers(
    offers: list[tuple[str, list[Key]]], order: OrderedDict[Any, Any], in_turn: Container[Key],
    sampled_of: Callable[[list[Key]], list[Key]], all_prepaid_sampled: bool,
    refund: Callable[[str, int, int], None], now_ns: int,
) -> tuple[int, dict[str, int], set[str]]:
    """Settle the plan's prepaid offers; returns (tokens refunded, user ->
    keys that sampled, users none of whose offered keys ran, a waiting
    request that was not admitted among them).  Served streams move behind
    the user's others."""
    move_to_end = order.move_to_end
    refunded = 0
    ran: dict[str, int] = {}
    unadmitted: set[str] = set()
    for user, batch in offers:
        lane = order.get(user)
        if lane is not None and lane.waiting:
            # Its offer need not be the front of the rotation (waiting
            # requests passed over): served keys go to the back.
            served_set = set(sampled_of(batch))
            ran[user] = len(served_set)
            if len(served_set) < len(batch):
                refund(user, now_ns, len(batch) - len(served_set))
                refunded += len(batch) - len(served_set)
            # A waiting request whose turn came and that was not admitted
            # (no KV for it) had its turn: it goes to the back, and so do the
            # user's other waiting requests (vLLM admits nothing after a
            # refusal for KV, and until a request leaves there is no more
            # room), or they would take the user's token step after step
            # while its resident streams, whose progress frees the KV they
            # wait for, never ran.
            passed = set()
            if any(key in in_turn and key not in served_set for key in batch):
                passed = {key for key in lane.decoding if key in in_turn}
            if served_set or passed:
                # Its turn in the service order is used too: at the front it
                # would take the quota its group's other members need.
                lane.served_to_back(served_set | passed)
                move_to_end(user)
            if passed and not served_set:
                unadmitted.add(user)
            continue
        if all_prepaid_sampled and lane is not None:
            lane.decoding.rotate(-len(batch))
            move_to_end(user)
            ran[user] = len(batch)
            continue
        served = sampled_of(batch)
        ran[user] = len(served)
        unpaid = len(batch) - len(served)
        if unpaid:
            refund(user, now_ns, unpaid)
            refunded += unpaid
        if lane is None or not served:
            continue
        lane.rotate_front(batch, served)
        move_to_end(user)
    return refunded, ran, unadmitted
