"""Which throttled resident request gives way, and for whom.

A resident request whose user is out of quota holds a model-runner slot and
KV while it cannot run.  When slots or KV run out, such a request is the one
to preempt ("evict"): first when a running request needs KV, and also when a
waiting request of another user could run now but finds every slot taken.
:class:`Displacement` decides who gives way; the scheduler adapter carries
the eviction out.  Requests are opaque keys here; what the policy needs of
a request beyond its key (priority, tokens held, whether its KV can be
released) comes from functions the adapter supplies.

Plain Python: no vLLM import.
"""

from __future__ import annotations

from typing import Callable, Container, Hashable, Iterable, Iterator

from vllm_output_rate.policy.eviction import EvictionBudget, evens_out
from vllm_output_rate.policy.lanes import Lanes
from vllm_output_rate.policy.ledger import Ledger
from vllm_output_rate.policy.plan import StepPlan
from vllm_output_rate.policy.residency import Residency
from vllm_output_rate.policy.victims import throttled_victims

Key = Hashable


class Displacement:
    """Victim choice for KV and slot pressure over one gate's lanes and ledger.

    Invariants (checked by ``tests/policy/test_eviction.py``):

    * a victim is a hidden stream of an out-of-quota user (see
      :func:`~vllm_output_rate.policy.victims.throttled_victims`), never of
      the requester's own user, and never the requester;
    * only a request whose user can pay now takes anything from others, and
      a request in ``evicted`` (evicted for quota, not yet back) takes only
      free room, so evictions never chain;
    * for a waiting request a victim must also even out the users'
      rate-weighted shares (:func:`~vllm_output_rate.policy.eviction.evens_out`)
      and its recompute must be affordable from ``budget``; a running
      request that needs KV would cost a preemption anyway, so any throttled
      victim will do;
    * with a :class:`~vllm_output_rate.policy.residency.Residency`, a waiting
      request of a user within its residency cap first takes the KV of a
      throttled stream beyond its own user's cap (a surplus: resident since
      before a limit was lowered), the one that generated least, if the
      budget affords it -- also when its user holds resident streams
      already; evens_out is not asked, the caps keep such moves from
      cycling (see :meth:`_surplus_victim`);
    * under priority scheduling, a waiting request its user's residency cap
      keeps out takes the place of a less important hidden stream of the
      same user, never another user's (:meth:`own_stream_victim`).
    """

    def __init__(
        self,
        lanes: Lanes,
        ledger: Ledger,
        budget: EvictionBudget,
        evicted: Container[Key],
        *,
        tokens_held: Callable[[Key], int],
        priority_of: Callable[[Key], int] | None,
        can_release: Callable[[Key], bool],
        residency: Residency | None = None,
        generated_of: Callable[[Key], int] | None = None,
    ) -> None:
        self._lanes = lanes
        self._ledger = ledger
        self._budget = budget
        self._evicted = evicted
        self._tokens_held = tokens_held
        self._priority_of = priority_of
        self._can_release = can_release
        #: Residency caps (:mod:`~vllm_output_rate.policy.residency`): a
        #: user's streams beyond its cap are released first.
        self.residency = residency
        self._generated_of = generated_of or tokens_held

    def victim_for(
        self, key: Key, waiting: bool, least_important: int | None = None, paid: bool = False
    ) -> Key | None:
        """The throttled request that gives way for ``key``, or None.

        ``waiting``: ``key`` asks for admission, not for KV to keep running.
        Under priority scheduling (``priority_of`` given) a victim is never
        more important (a smaller priority value) than ``key``, nor, for a
        running ``key``, than ``least_important``: the least important
        visible request, which the scheduler's own preemption would pick.
        ``paid``: answer as if ``key``'s user could pay now (who would give
        way once its quota returns; nothing is evicted here either way).
        """
        if key in self._evicted:
            return None  # it comes back into free KV only (no eviction chains)
        lanes = self._lanes
        user_of = lanes.user_of
        requester = user_of[key]
        resident_count = lanes.resident_count
        ledger = self._ledger
        priority_of = self._priority_of
        floor = None
        if priority_of is not None:
            floor = priority_of(key)
            if not waiting and least_important is not None:
                floor = max(floor, least_important)
        if waiting and self.residency is not None:
            surplus = self._surplus_victim(self.residency, key, requester, floor)
            if surplus is not None:
                return surplus
        if waiting and resident_count(requester):
            # Served through resident streams already: evicting others for
            # it would churn.
            return None
        if not (paid or _could_pay(ledger, key, requester)):
            return None
        rate_of = ledger.limiter.rate_of
        requester_resident = resident_count(requester)
        requester_rate = rate_of(requester)
        for victim in throttled_victims(lanes, ledger):
            if victim is key or user_of[victim] == requester:
                continue  # never trade one stream of a user for another
            if waiting:
                victim_user = user_of[victim]
                if not evens_out(resident_count(victim_user), rate_of(victim_user),
                                 requester_resident, requester_rate):
                    continue
                if not self._budget.affords(self._tokens_held(victim)):
                    continue  # its recompute would cost more than serving has earned
            if priority_of is not None and floor is not None and priority_of(victim) < floor:
                continue
            if not self._can_release(victim):
                continue
            return victim
        return None

    def _surplus_victim(
        self, residency: Residency, key: Key, requester: str, floor: int | None
    ) -> Key | None:
        """A throttled stream beyond its user's residency cap, for a waiting
        ``key`` whose user can pay now and is within its own cap.

        Such a stream holds KV its user's quota cannot keep moving at the
        minimum pace (it became resident before a limit was lowered, or while
        a borrower had spare capacity).  Of all of them, the one that has
        generated least goes first, so its recompute stays small; its
        recompute must be affordable from the budget.  Evictions cannot
        cycle: the victim's user is above its cap and may not admit again
        until it is below it, the requester's user stays within its own.
        """
        lanes = self._lanes
        resident_count = lanes.resident_count
        priority_of = self._priority_of
        # The cheap checks first.
        if not any(
            user != requester and residency.surplus(user, resident_count(user)) > 0
            for user in self._ledger.short
        ):
            return None
        if not residency.admits(requester, resident_count(requester)):
            return None
        if not _could_pay(self._ledger, key, requester):
            return None
        user_of = lanes.user_of
        surplus_of: dict[str, int] = {}

        def candidates() -> Iterator[Key]:
            for victim in throttled_victims(lanes, self._ledger):
                user = user_of[victim]
                if user == requester or victim is key:
                    continue
                surplus = surplus_of.get(user)
                if surplus is None:
                    surplus = surplus_of[user] = residency.surplus(user, resident_count(user))
                if surplus <= 0:
                    continue
                if priority_of is not None and floor is not None and priority_of(victim) < floor:
                    continue
                yield victim

        return self._least_generated(candidates())

    def own_stream_victim(self, key: Key, hidden: Callable[[Key], bool]) -> Key | None:
        """Under priority scheduling: the resident stream of ``key``'s own
        user that gives way for ``key``, a waiting request its user's
        residency cap keeps out, or None.

        Residency caps how many of a user's requests hold KV; which of them
        do is the user's own business, so a more important request of the
        user takes the place of a less important one of the same user (never
        another user's).  The victim is one of the user's resident decoding
        streams with a larger priority value than ``key`` (the least
        important first, then the one that generated least), ``hidden`` in
        this step (not offered to vLLM: its KV can go without undoing
        anything scheduled), whose recompute the budget affords and whose KV
        can be released.  It comes back (recomputed) when its user has room
        under its cap again: a returning stream is never more important than
        the one that displaced it, so displacements never cycle.  Without
        priority scheduling (every request equally important) None.
        """
        priority_of = self._priority_of
        if priority_of is None or key in self._evicted:
            return None
        lanes = self._lanes
        user = lanes.user_of[key]
        lane = lanes.order.get(user)
        if lane is None:
            return None
        urgency = priority_of(key)
        lane_of = lanes.lane_of
        best: Key | None = None
        best_rank: tuple[int, int] = (0, 0)
        for victim in lane.decoding:
            if lane_of.get(victim) != user or victim is key:
                continue
            priority = priority_of(victim)
            if priority <= urgency:
                continue  # as important as the request, or more: it stays
            rank = (-priority, self._generated_of(victim))
            if best is not None and rank >= best_rank:
                continue
            if not hidden(victim) or not self._can_release(victim):
                continue
            if not self._budget.affords(self._tokens_held(victim)):
                continue
            best, best_rank = victim, rank
        return best

    def handover_victim(self, donor: str) -> Key | None:
        """The resident stream a borrower gives up for another borrower
        (:mod:`~vllm_output_rate.policy.handover`), or None.

        ``donor`` must be short of quota in this step, with none left now
        and none of its streams offered on its guaranteed rate (so a user
        within its rate never gives way, and the victim cannot come back
        in the same step); the victim is one of its hidden decoding streams,
        the one that generated least, if the recompute budget affords it
        and its KV can be released.  Never under priority scheduling.
        """
        ledger = self._ledger
        if self._priority_of is not None or donor not in ledger.short:
            return None
        if ledger.limiter.available(donor, ledger.now_ns) > 0:
            return None
        if any(user == donor for user, _ in ledger.offers):
            return None
        lanes = self._lanes
        lane = lanes.order.get(donor)
        if lane is None:
            return None
        lane_of = lanes.lane_of
        return self._least_generated(
            key for key in lane.decoding if lane_of.get(key) == donor and not ledger.is_charged(key)
        )

    def _least_generated(self, candidates: Iterable[Key]) -> Key | None:
        """Of ``candidates``, the one that generated least (the first of
        equals) whose recompute the budget affords and whose KV can be
        released; None if none."""
        best: Key | None = None
        best_generated = 0
        for key in candidates:
            generated = self._generated_of(key)
            if best is not None and generated >= best_generated:
                continue
            if not self._budget.affords(self._tokens_held(key)):
                continue
            if not self._can_release(key):
                continue
            best, best_generated = key, generated
        return best

    def free_slots_for(
        self,
        waiting: Iterable[Key],
        plan: StepPlan,
        free_slots: int,
        active_cap: int,
        evict: Callable[[Key], None],
    ) -> set[str]:
        """Throttled requests must not keep every model-runner slot from others.

        With no slot free (``free_slots`` <= 0), a request in ``waiting``
        (admission order, only those vLLM could admit now) of a user with no
        resident request and quota to run it takes the slot of a throttled
        one, least recently served first: ``evict(victim)`` is called at
        once, so the next choice sees it gone.  A slot is freed only while
        the active cap leaves room to run the request it is freed for, and a
        user is promised no more slots than its quota pays for.  Returns the
        users who gave up a slot (they may not take one back this step);
        ``plan.hidden`` counts the victims out.
        """
        donors: set[str] = set()
        if free_slots > 0:
            return donors
        room = active_cap - len(plan.visible)
        if plan.over_cap or room <= 0:
            return donors
        lanes = self._lanes
        ledger = self._ledger
        user_of = lanes.user_of
        evicted = self._evicted
        promised: dict[str, int] = {}  # user -> freed slots whose token it must pay
        resident: set[str] = set()  # users known to hold a slot (a long queue repeats them)
        for key in waiting:
            if room <= 0:
                break
            if key in evicted:
                continue  # comes back into a free slot and free KV only
            user = user_of[key]
            if user in resident or lanes.resident_count(user):
                resident.add(user)
                continue  # served through its own resident streams: no churn
            if not ledger.is_charged(key) and ledger.quota_now(user) <= promised.get(user, 0):
                continue  # its user could not run it now either
            victim = self.victim_for(key, waiting=True)
            if victim is None:
                break
            evict(victim)
            resident.discard(user_of[victim])
            donors.add(user_of[victim])
            promised[user] = promised.get(user, 0) + 1
            plan.hidden -= 1
            room -= 1
        return donors


def fits_in_free_kv(tokens: int, block_size: int, running: int, free_blocks: int) -> bool:
    """Could a request of ``tokens`` be recomputed into ``free_blocks``,
    leaving each of ``running`` requests a block to grow into?

    A request evicted for lack of quota comes back only then: taking KV from
    others (or being evicted again as soon as they grow) would make its
    recompute, and theirs, a loss.
    """
    needed = -(-(tokens + 1) // block_size) + running
    return free_blocks >= needed


def _could_pay(ledger: Ledger, key: Key, user: str) -> bool:
    """Could the request's user pay for its token now?  Asked without
    refusing the user: the question comes while the request looks for KV,
    possibly after its prompt chunk took the user's last token (refunded at
    the end of the step if no KV is found).  A refusal there would count the
    user as waiting for quota and, with that refund, ready again at once: an
    engine with nothing to run would be told to wait 0 and step empty."""
    return ledger.is_charged(key) or (
        user not in ledger.refused and ledger.limiter.available(user, ledger.now_ns) > 0
    )
