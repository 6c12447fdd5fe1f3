"""Borrowing: spare capacity shared by weight, up to each user's ceiling.

One optional part of :class:`vllm_output_rate.policy.gate.StepGate`, present
only when some user has a ceiling above its rate (``ceil > rate``, or no
ceiling at all).  Plain Python, no vLLM.

Every user has a guaranteed ``rate`` (the limiter, unchanged), a ``ceil``
and a ``weight`` (:class:`Share`).  When a step has room left after every
guaranteed request was offered, hidden streams of users that fell short of
their rate quota may run anyway, *borrowing*:

* **who**: users whose ceiling is above their rate, least weighted borrowed
  service first -- a virtual counter per user (tokens borrowed / weight),
  one stream at a time (water-filling); a user's own streams borrow oldest
  first (admission order, as stock vLLM runs requests to completion), so
  its requests finish one after another, not together.  A user that starts
  borrowing again starts at the smallest counter among the current
  borrowers (those that could borrow when spare capacity was last offered,
  or wait for a slot to borrow in), so idle time is never banked.  Free
  slots for borrowers' waiting requests are handed out the same way
  (:meth:`Borrowing.admissions`), not in arrival order.  Counters move
  only in steps that ration: when the spare room covers every borrower's
  hidden streams, no group's cap ran out and no borrower has a request
  waiting, each gets all it can use and nothing is counted (a user held
  back by its own demand, one stream say, would otherwise be owed the
  difference and take it back from the others at the next contention).
  Waiting requests make a step count: then slots are what is rationed;
* **how much**: a second GCRA at ``ceil`` (the *ceiling* limiter) counts
  every output token of such a user, guaranteed ones too (the factory
  composes the two quotas, :class:`~.quota.ComposedLimiter`, so a guaranteed
  token is paid on both), so over
  any window ``W`` the user gets at most ``(W + burst) * ceil + 1`` tokens.
  Borrowed tokens are paid on the ceiling only: they are not debt on the
  rate quota.  No ceiling (``ceil: None``): borrowing is bounded by room only;
* **admissions**: a borrower's request admitted into a spare slot
  (:meth:`Borrowing.admissions`) that reaches its sampling position in the
  same step borrows its sampled token too (:meth:`Borrowing.lend`), on the
  same cap, instead of stopping one position short and leaving its slot
  without a sample for a step;
* **refund**: a borrowed token whose request did not sample goes back to
  the ceiling and the counter (:meth:`Borrowing.settle`), never to the rate;
* **groups** (:mod:`.groups`): borrowed tokens are paid on every level's cap
  (``Borrowing.cap``), and spare capacity is shared first between groups and
  users without one, by weight, then inside a group by its members' weights.

Invariants (checked by ``tests/policy/test_borrow.py``):

* a borrowed key is resident, a decoding stream of a user the plan found
  short, not paid for otherwise in the step, and listed once;
* borrowing uses at most the room it is given, and a user with a ceiling
  never borrows more than the ceiling has left;
* after :meth:`Borrowing.settle` only sampled borrowed keys stay paid;
* :meth:`Borrowing.admissions` gives at most the slots it is given, never
  more requests to a user than it has waiting, and only to borrowing users.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Collection, Container, Hashable, Mapping, Protocol, Sequence, cast

from vllm_output_rate.policy.demand import unpaid_decoding, unpaid_streams
from vllm_output_rate.policy.lanes import Lanes
from vllm_output_rate.policy.ledger import Ledger
from vllm_output_rate.policy.limiter import Limiter

Key = Hashable
_INF = float("inf")


@dataclass(frozen=True, slots=True)
class Share:
    """What a user may take beyond its rate: up to ``ceil`` tokens/s (None:
    no ceiling), spare capacity shared in proportion to ``weight``."""

    ceil: float | None
    weight: float


class ShareTable:
    """Every user's :class:`Share` and rate: ``default`` unless ``overrides``
    names the user (as :class:`~.rates.RateTable`).

    ``rates``/``default_rate`` are the guaranteed rates; a user *borrows* when
    its ceiling is above its rate or absent.
    """

    def __init__(
        self,
        default_rate: float,
        user_rates: Mapping[str, float],
        default_share: Share | None,
        user_shares: Mapping[str, Share],
    ) -> None:
        self._default = (default_rate, default_share)
        self._users = {u: (r, user_shares.get(u)) for u, r in user_rates.items()}

    def _of(self, user: str) -> tuple[float, Share | None]:
        return self._users.get(user, self._default)

    def borrows(self, user: str) -> bool:
        # (``_of`` written out here and in ``ceiled``: both are asked for every
        # waiting request a step looks at, through the composed quota's levels.)
        rate, share = self._users.get(user, self._default)
        return share is not None and (share.ceil is None or share.ceil > rate)

    def ceiled(self, user: str) -> bool:
        """Borrows and has a ceiling: its tokens are paid on the ceiling too."""
        rate, share = self._users.get(user, self._default)
        return share is not None and share.ceil is not None and share.ceil > rate

    def weight(self, user: str) -> float:
        rate, share = self._of(user)
        return rate if share is None else share.weight

    def group_of(self, user: str) -> str | None:
        """Users of this table are in no group (see ``policy/groups.py``)."""
        return None

    def group_weight(self, group: str) -> float:
        """Never asked: users of this table are in no group."""
        raise KeyError(group)

    def ceilings(self) -> tuple[float, dict[str, float]]:
        """Default and per-user ceilings for the ceiling limiter (a rate
        where there is no finite ceiling: those users never ask it)."""
        rate, share = self._default
        default = share.ceil if share is not None and share.ceil is not None else rate
        users = {
            u: (s.ceil if s is not None and s.ceil is not None else r)
            for u, (r, s) in self._users.items()
        }
        return default, users

    def any_borrower(self) -> bool:
        """Does anybody borrow: anyone unnamed (the default) or a named user?"""
        rate, share = self._default
        if share is not None and (share.ceil is None or share.ceil > rate):
            return True
        return any(self.borrows(u) for u in self._users)


class BorrowerTable(Protocol):
    """What :class:`Borrowing` asks of a table of shares: a :class:`ShareTable`,
    or with groups a :class:`~.groups.GroupShareTable`."""

    def borrows(self, user: str) -> bool:
        """Is the user's ceiling above its rate (or absent)?"""

    def ceiled(self, user: str) -> bool:
        """Does it borrow up to a finite ceiling (paid on the cap)?"""

    def weight(self, user: str) -> float:
        """Its weight among the borrowers of its scope."""

    def group_of(self, user: str) -> str | None:
        """Its group (None: none)."""

    def group_weight(self, group: str) -> float:
        """A group's weight among the groups and ungrouped users."""

    def ceilings(self) -> tuple[float, dict[str, float]]:
        """Default and per-user ceilings for the ceiling limiter."""

    def any_borrower(self) -> bool:
        """Does anybody borrow?"""


class GroupedCap(Limiter, Protocol):
    """The cap with groups (:class:`~.groups.GroupCaps`): its levels apart."""

    def own_available(self, user: str, now_ns: int) -> int:
        """What the user's own level lets it borrow now."""

    def group_available(self, group: str, now_ns: int) -> int | None:
        """What the group's cap lets all its members borrow now (None: no cap)."""


class Borrowing:
    """Who borrows in a step, and the settling of what was borrowed.

    ``borrowed_tokens`` (user -> borrowed tokens that sampled, cumulative)
    is read by metrics.  Counters are kept for users with a lane only.

    ``ceiling`` is the users' ceiling quota (None when only groups borrow);
    borrowed tokens are paid on ``cap``: the ceiling itself, or with groups
    every level's cap (:class:`~.groups.GroupCaps`).  With groups the
    ``table`` names each user's group (``group_of``, ``group_weight``), and
    spare capacity is shared in two levels: between groups and users without
    one by their weights (a counter per group: tokens borrowed / group
    weight), then inside a group by its members' weights.
    """

    def __init__(
        self, table: BorrowerTable, ceiling: Limiter | None, cap: Limiter | None = None
    ) -> None:
        self.table = table
        self.ceiling = ceiling
        #: What borrowed tokens are paid on (None: nobody has a finite ceiling).
        self.cap: Limiter | None = ceiling if cap is None else cap
        #: user -> borrowed tokens that sampled, cumulative.
        self.borrowed_tokens: dict[str, int] = {}
        #: user -> tokens borrowed / weight (the virtual counter).
        self.counters: dict[str, float] = {}
        #: user -> the scope its counter was kept in (its group, or None):
        #: a counter means nothing in another scope (see :meth:`update`).
        self.scopes: dict[str, str | None] = {}
        #: group -> tokens its users borrowed / group weight.
        self.group_counters: dict[str, float] = {}
        #: The current borrowers: users that could borrow when spare
        #: capacity was last offered, and their groups.
        self.active: set[str] = set()
        self.active_groups: set[str] = set()
        #: Those of them that had streams to borrow with (the others only
        #: waited for a slot): they set a newcomer's level (see _floors).
        self.holding: set[str] = set()
        #: (user, keys) borrowed in the current step.
        self.step: list[tuple[str, list[Key]]] = []
        #: Does the current step ration (room or a group's cap left some
        #: borrower's stream out, or a borrower has a request waiting)?
        #: Else no counter moves.
        self.rationed = False
        self._now_ns = 0

    def offer(
        self, lanes: Lanes, ledger: Ledger, room: int, waiting: Collection[str] = ()
    ) -> list[Key]:
        """Borrow at most ``room`` hidden streams of users the plan found
        short, each user's oldest first, and pay them on the ceiling.
        Returns the borrowed keys, in the order chosen (the caller records
        them paid: :meth:`Ledger.pay_borrowed`).

        ``waiting``: users with waiting requests that would only run by
        borrowing.  They are current borrowers too (backlogged, waiting for
        a slot, see :meth:`admissions`): their counters are kept, not lifted
        as a newcomer's (and set the floor only where nobody has streams,
        see :meth:`_floors`)."""
        self.step = []
        self.rationed = False
        if not ledger.short and not waiting:
            self.active, self.holding = set(), set()  # nobody short, nobody borrows:
            self._level()  # everyone starts level next time
            return []
        if room <= 0 and not waiting:
            return []
        table = self.table
        group_of = table.group_of
        cap = self.cap
        now = self._now_ns = ledger.now_ns
        prepaid = ledger.prepaid
        counters = self.counters
        scopes = self.scopes
        group_counters = self.group_counters
        floors = self._floors()
        heap: list[tuple[float, float, int, str]] = []
        streams: dict[str, list[Key]] = {}
        #: group -> what its own cap lets all of its members borrow (None: no cap).
        group_left: dict[str, int | None] = {}
        for index, user in enumerate(ledger.short):
            if user in streams or not table.borrows(user):
                continue
            if user not in lanes.order:
                continue
            hidden = unpaid_streams(lanes, prepaid, user)
            if len(hidden) > 1:
                # Oldest first, as stock vLLM runs requests to completion:
                # borrowed in rotation, a user's requests would progress in
                # lockstep and finish together, and its clients' turnaround
                # would then leave it nothing to borrow with (issue 33).
                lanes.in_admission_order(hidden)
            group = group_of(user)
            if table.ceiled(user) and hidden:
                # A group's own cap is shared by its members (group_left
                # below): a member it holds back stays a borrower.
                assert cap is not None  # a ceiled user pays its ceiling
                room_now = cap.available if group is None else cast(GroupedCap, cap).own_available
                hidden = hidden[: room_now(user, now)]
            if not hidden:
                continue
            streams[user] = hidden
            start = counters[user] = self._start(user, floors)
            scopes[user] = group
            if group is not None and group not in group_left:
                group_left[group] = cast(GroupedCap, cap).group_available(group, now)
                group_counters[group] = self._group_start(group, floors)
            heap.append((start if group is None else group_counters[group], start, index, user))
        # Users waiting for a slot to borrow in are current borrowers too.
        waiting_borrowers = [u for u in waiting if table.borrows(u)]
        queued = {u for u in waiting_borrowers if u not in streams}
        queued_groups: set[str] = set()
        for user in queued:
            group = group_of(user)
            counters[user] = self._start(user, floors)
            scopes[user] = group
            if group is not None and group not in group_left and group not in queued_groups:
                queued_groups.add(group)
                group_counters[group] = self._group_start(group, floors)
        # The candidates are the current borrowers from now on: one that wins
        # no stream in a step keeps its counter (only newcomers are lifted).
        self.active = set(streams) | queued
        self.active_groups = set(group_left) | queued_groups
        self.holding = set(streams)
        if not self.active:
            self._level()  # nobody borrows: everyone starts level next time
        heapq.heapify(heap)
        step_groups = dict(group_counters) if group_left else group_counters
        taken: dict[str, int] = {}
        order: list[Key] = []
        group_capped = False
        while heap and room > 0:
            primary, counter, index, user = heapq.heappop(heap)
            group = group_of(user) if group_left else None
            if group is None:
                # One stream at a time, the user would be pushed back and
                # popped again for as long as it stays ahead of the heap's
                # head: it takes those streams in one go (the same ones, in
                # the same order; a lone borrower takes all it can at once).
                stream = streams[user]
                first = got = taken.get(user, 0)
                most = min(len(stream), got + room)
                per_token = 1 / table.weight(user)
                if heap:
                    head = heap[0][:3]
                    got += 1
                    counter += per_token
                    while got < most and (counter, counter, index) < head:
                        got += 1
                        counter += per_token
                else:
                    # Nobody else to give way to: it takes all it can, and
                    # the counter is compared with no other in this step.
                    counter += (most - first) * per_token
                    got = most
                order.extend(stream[first:got])
                taken[user] = got
                room -= got - first
                if got < len(stream):
                    heapq.heappush(heap, (counter, counter, index, user))
                continue
            # A member of a group: one stream at a time (its group's counter
            # and cap move with every stream any member takes).
            if primary != step_groups[group]:  # its group ran since: requeue
                heapq.heappush(heap, (step_groups[group], counter, index, user))
                continue
            left = group_left[group]
            if left is not None:
                if left <= 0:
                    group_capped = True  # its members compete for the cap
                    continue  # the group's cap is spent in this step
                group_left[group] = left - 1
            got = taken.get(user, 0)
            order.append(streams[user][got])
            taken[user] = got + 1
            room -= 1
            counter += 1 / table.weight(user)
            primary = step_groups[group] = step_groups[group] + 1 / table.group_weight(group)
            if got + 1 < len(streams[user]):
                heapq.heappush(heap, (primary, counter, index, user))
        self.rationed = bool(heap or group_capped or waiting_borrowers)
        unpaid: set[Key] = set()
        for user, count in taken.items():
            keys = streams[user][:count]
            if table.ceiled(user):
                assert cap is not None
                paid = cap.take_up_to(user, now, count)
                if paid < count:  # a quota that shrank since it was asked
                    unpaid.update(keys[paid:])
                    keys = keys[:paid]
            self.step.append((user, keys))
        if unpaid:
            order = [k for k in order if k not in unpaid]
        return order

    def can_lend(self, user: str, now_ns: int) -> bool:
        """Would :meth:`lend` pay for one token of ``user`` now?  Takes nothing."""
        table = self.table
        if not table.borrows(user):
            return False
        return not table.ceiled(user) or (self.cap is not None and self.cap.available(user, now_ns) > 0)

    def streams_it_could_add(self, lanes: Lanes, ledger: Ledger, user: str) -> int | None:
        """How many more resident streams of ``user`` its cap would feed a
        token in this step, beyond its hidden decoding streams (those the
        step did not pay for, which borrow first); None: no ceiling, any
        number.  0 for a user that does not borrow."""
        table = self.table
        if not table.borrows(user):
            return 0
        cap = self.cap
        if not table.ceiled(user) or cap is None:
            return None
        hidden = unpaid_decoding(lanes, ledger.prepaid, user)
        return max(0, cap.available(user, ledger.now_ns) - hidden)

    def could_borrow_another(self, lanes: Lanes, ledger: Ledger, user: str) -> bool:
        """Would one more resident stream of ``user`` borrow in this step?

        Its hidden decoding streams (those the plan did not pay for) borrow
        first, one token each; another stream adds service only if the cap
        has a token left beyond them.  A borrower whose ceiling binds gains
        nothing from another slot: the slot would only spread the same
        ceiling over more streams, while the user giving it up loses a
        stream's every token (issue 43).  No ceiling: any slot is used."""
        more = self.streams_it_could_add(lanes, ledger, user)
        return more is None or more > 0

    def lend(self, user: str, key: Key, now_ns: int) -> bool:
        """Borrow the sampled token of a request of ``user`` given a slot by
        :meth:`admissions` in this step, which reached its sampling position
        while its user is out of guaranteed quota.

        Its slot was counted out of the step's spare room before any resident
        stream borrowed, so this takes nothing from guaranteed users.  Paid
        on the cap like a borrowed stream (a ceiling is never exceeded) and
        settled with them by :meth:`settle`.  False: the cap is spent."""
        table = self.table
        if not table.borrows(user):
            return False
        if table.ceiled(user) and (self.cap is None or self.cap.take_up_to(user, now_ns, 1) < 1):
            return False
        self._now_ns = now_ns
        self.step.append((user, [key]))
        self.rationed = True  # a slot handed out by admissions: slots are rationed
        return True

    def admissions(
        self,
        queued: Mapping[str, Sequence[int]],
        committed: Mapping[str, int],
        slots: int,
        usable: Mapping[str, int | None] | None = None,
    ) -> list[str]:
        """Which borrowing users' waiting requests take ``slots`` free resident
        slots.  ``queued`` maps each user whose waiting requests would only
        run by borrowing to what each of them may still output (in queue
        order); ``committed`` maps a user to what its resident requests may
        still output.

        One request at a time to the user with the least weighted service,
        as VTC admits from the client with the lowest counter: the user's
        virtual counter (what it borrowed / weight) plus what it is already
        committed to (its resident requests' remaining output / weight, the
        length VTC's predicting variant charges at admission), plus each
        request given to it so far.  Counting the committed output keeps a
        user that holds many slots from winning the next one just because
        its counter has not caught up yet, and spreads slots freed together
        over the users by weight.  With groups the same is done first
        between groups (and users without one) on the group counters, then
        between a group's members.  A user or group that is not a current
        borrower starts at the smallest counter of its scope (no banked
        credit), as in :meth:`offer`.  Ties go to the user that appears
        first.

        ``usable`` (see :meth:`streams_it_could_add`) maps a user to how
        many more streams its cap would feed now (None or absent: any).  A
        user given that many competes for the slots left over only after
        every user that could still use one (issue 43: a borrower whose
        ceiling binds would spread the same ceiling over more streams while
        the slot could carry another borrower's every token); the order
        among those is the same counter order.  Returns one user per
        admission, in the order chosen; nothing is changed."""
        if slots <= 0 or not queued:
            return []
        table = self.table
        group_of = table.group_of
        floors = self._floors()
        #: group -> its counter plus what it is committed to, per group weight.
        group_keys: dict[str, float] = {}
        most_of = {} if usable is None else usable

        def tier(user: str, given: int) -> int:
            """0 while the user's cap would feed another stream, else 1."""
            most = most_of.get(user)
            return 0 if most is None or given < most else 1

        heap: list[tuple[int, float, float, int, str, int]] = []
        for index, (user, costs) in enumerate(queued.items()):
            if not costs or not table.borrows(user):
                continue
            weight = table.weight(user)
            key = self._start(user, floors) + committed.get(user, 0) / weight
            group = group_of(user)
            if group is None:
                heap.append((tier(user, 0), key, key, index, user, 0))
                continue
            if group not in group_keys:
                members = sum(n for u, n in committed.items() if group_of(u) == group)
                group_keys[group] = self._group_start(group, floors) + members / table.group_weight(group)
            heap.append((tier(user, 0), group_keys[group], key, index, user, 0))
        heapq.heapify(heap)
        order: list[str] = []
        while heap and len(order) < slots:
            rank, primary, key, index, user, given = heapq.heappop(heap)
            group = group_of(user) if group_keys else None
            if group is not None and primary != group_keys[group]:
                heapq.heappush(heap, (rank, group_keys[group], key, index, user, given))
                continue  # its group was given a slot since: requeued
            order.append(user)
            costs = queued[user]
            cost = max(costs[given], 1)
            key += cost / table.weight(user)
            if group is None:
                primary = key
            else:
                primary = group_keys[group] = group_keys[group] + cost / table.group_weight(group)
            if given + 1 < len(costs):
                heapq.heappush(heap, (tier(user, given + 1), primary, key, index, user, given + 1))
        return order

    def _floors(self) -> dict[str | None, float]:
        """The smallest counter among the current borrowers of each scope:
        users without a group and the groups themselves (scope None), or the
        members of one group (scope: the group).

        Borrowers that had streams to borrow with set the level; one that
        only waited for a slot counts only where no borrower had streams.
        Its counter stays low while it waits (its credit, spent when it gets
        a slot), and a newcomer lifted to it would take that credit: it
        would out-borrow every borrower running by the lag the waiting one
        built up."""
        group_of, counters = self.table.group_of, self.counters
        holding = self.holding
        floors: dict[str | None, float] = {}
        waiting: dict[str | None, float] = {}
        held_groups: set[str | None] = set()
        for u in self.active:
            scope, c = group_of(u), counters.get(u, 0.0)
            level = floors if u in holding else waiting
            if c < level.get(scope, _INF):
                level[scope] = c
            if u in holding and scope is not None:
                held_groups.add(scope)
        for g in self.active_groups:
            c = self.group_counters.get(g, 0.0)
            level = floors if g in held_groups else waiting
            if c < level.get(None, _INF):
                level[None] = c
        for scope, c in waiting.items():
            floors.setdefault(scope, c)
        return floors

    def _start(self, user: str, floors: Mapping[str | None, float]) -> float:
        """The user's counter; a newcomer's is lifted to its scope's floor."""
        start = self.counters.get(user, 0.0)
        if user not in self.active:
            floor = floors.get(self.table.group_of(user))
            start = 0.0 if floor is None else max(start, floor)
        return start

    def _group_start(self, group: str, floors: Mapping[str | None, float]) -> float:
        """The group's counter; a group new to borrowing is lifted likewise."""
        start = self.group_counters.get(group, 0.0)
        if group not in self.active_groups:
            floor = floors.get(None)
            start = 0.0 if floor is None else max(start, floor)
        return start

    def settle(self, lanes: Lanes, sampled: Container[Key]) -> dict[str, int]:
        """Keep the borrowed payments of keys that sampled; refund the rest to
        the ceiling.  Served streams move behind their user's others.
        Returns user -> borrowed tokens kept (for :meth:`Ledger.keep`)."""
        counters = self.counters
        table = self.table
        kept: dict[str, int] = {}
        for user, keys in self.step:
            served = set(filter(sampled.__contains__, keys))  # the loop runs in C
            unserved = len(keys) - len(served)
            if unserved and table.ceiled(user) and self.cap is not None:
                self.cap.refund(user, self._now_ns, unserved)
            if not served:
                continue
            n = len(served)
            group = self.scopes[user] = table.group_of(user)
            if self.rationed:
                counters[user] = counters.get(user, 0.0) + n / table.weight(user)
                if group is not None:
                    self.group_counters[group] = (
                        self.group_counters.get(group, 0.0) + n / table.group_weight(group)
                    )
            self.borrowed_tokens[user] = self.borrowed_tokens.get(user, 0) + n
            kept[user] = kept.get(user, 0) + n
            lane = lanes.order.get(user)
            if lane is not None:
                lane.served_to_back(served)
        self.step = []
        if len(counters) > 2 * len(lanes.order) + 16:
            for user in [u for u in counters if u not in lanes.order]:
                del counters[user]
                self.scopes.pop(user, None)
        return kept

    def update(
        self, table: BorrowerTable, ceiling: Limiter | None, cap: Limiter | None = None
    ) -> None:
        """New shares and quotas (a reload); counters and totals are kept,
        except those of users the new table puts in another scope or gives
        another weight.

        A counter is only comparable with the others of its scope (tokens
        borrowed / weight since that scope's borrowers started level), so a
        user that changed group, or joined or left one, enters its new scope
        as a returning borrower does: at the smallest counter of the current
        borrowers there, with no credit or debt banked in the old one.  Its
        old group keeps what it borrowed (the group did borrow it).  So does
        a user whose weight changed: its counter is in units of the old
        weight, and the lag or lead it holds against the others was built
        under the old shares (kept, it would be paid out under the new ones
        as if the new weights had been wrong all along).  The scopes are the
        ones recorded with the counters: ``table.group_of`` may already
        answer with the new membership when this is called (the owner
        updates its group quotas in place first, so a group's own weight
        cannot be compared this way: a group's counter is kept).
        """
        group_of = table.group_of
        old_weight, new_weight = self.table.weight, table.weight
        moved = [
            user for user, scope in self.scopes.items()
            if group_of(user) != scope or old_weight(user) != new_weight(user)
        ]
        for user in moved:
            del self.scopes[user]
            self.counters.pop(user, None)
            self.active.discard(user)
            self.holding.discard(user)
        self.table = table
        self.ceiling = ceiling
        self.cap = ceiling if cap is None else cap

    def _level(self) -> None:
        """Forget every counter: nobody borrows, all start level next time."""
        self.counters.clear()
        self.scopes.clear()
        self.group_counters.clear()
