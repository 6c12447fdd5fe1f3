"""The per-step "who may sample" gate, in plain Python.

The scheduler adapter drives one :class:`StepGate` per engine.  Requests are
opaque hashable keys here; the gate knows each key's user and, for resident
requests (holding KV and a model-runner slot), whether the request can make
progress without sampling (a prefill with at least two positions left).

A step goes like this:

1. :meth:`StepGate.plan` picks the resident requests the scheduler may look at
   in this step: users in least-recently-served order, and of each user its
   prefills plus as many decoding streams as the user can pay for right now,
   in rotation order, until the active cap is full.  The decoding streams it
   offers are paid for at once, one bulk take per user ("prepaid").
   Everything else stays resident but out of sight, so the step costs
   O(active requests + users visited), not O(resident requests).  The
   adapter hands the chosen requests to vLLM in admission order
   (:meth:`StepGate.in_admission_order`): the gate decides *which* requests
   run, vLLM's own order decides everything else.  Waiting requests that
   must sample to be admitted (no chunked prefill) sit in their user's
   rotation too (:meth:`StepGate.wait_in_turn`): when their turn comes, the
   user's token is kept for their admission.
2. :meth:`StepGate.charge` is called for each request about to be given a
   sampling position; prepaid requests pass for free, any other takes one
   unit of its user's quota, at most once per request per step.  A user
   refused once in a step is not asked again.
3. :meth:`StepGate.finish` refunds every charge -- prepaid or not -- whose
   request did not end up sampled (the single refund point), rotates each
   served user's streams and moves the user to the back of the service
   order.  When every prepaid request sampled and nothing was preempted it
   does this per user, without looking at single requests.

Invariants (checked by the tests):

* a request is charged at most once per step, and a charge survives the step
  only if the request sampled in it;
* within one user, a served stream moves behind the user's other streams;
* the visible set never holds more than ``slots`` requests.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from itertools import islice
from typing import Container, Hashable, Iterator

from vllm_output_rate.limiter import OutputRateLimiter

Key = Hashable

#: Every this many steps, users with no debt are dropped from the limiter.
CLEANUP_EVERY_STEPS = 256
#: Longest idle wait the engine loop is told to take, in nanoseconds.
MAX_IDLE_WAIT_NS = 50_000_000
_NOTHING: frozenset = frozenset()


@dataclass
class _Lane:
    """One user's resident requests."""

    decoding: deque = field(default_factory=deque)  # rotation order, front first
    progressing: dict = field(default_factory=dict)  # ordered set of prefills
    # Keys in ``decoding`` that are not resident: waiting requests that must
    # sample to be admitted, taking turns with the user's resident streams.
    waiting: int = 0

    def __len__(self) -> int:
        """Resident requests of the user."""
        return len(self.decoding) - self.waiting + len(self.progressing)


@dataclass(slots=True)
class StepPlan:
    """What :meth:`StepGate.plan` decided for one step."""

    visible: list  # keys to show the scheduler, in service order
    hidden: int  # resident requests kept out of sight
    over_cap: bool  # some runnable request was hidden only because slots ran out
    prepaid: set  # visible decoding keys whose token is already taken
    prefills: list  # visible keys that are still prefilling
    throttled: bool  # some resident request waits for its user's quota
    reserved: int = 0  # waiting requests whose turn came: quota kept for their admission


class StepGate:
    """Per-step quota decisions over one :class:`OutputRateLimiter`."""

    def __init__(
        self,
        limiter: OutputRateLimiter,
        cleanup_every: int = CLEANUP_EVERY_STEPS,
        max_idle_wait_ns: int = MAX_IDLE_WAIT_NS,
    ) -> None:
        self.limiter = limiter
        self._cleanup_every = cleanup_every
        self._max_idle_wait_ns = max_idle_wait_ns
        self._user_of: dict[Key, str] = {}
        self._known_per_user: dict[str, int] = {}  # user -> tracked requests
        self._lane_of: dict[Key, str] = {}
        # Waiting keys that take turns in their user's rotation (see wait_in_turn).
        self._in_turn: set = set()
        # Resident key -> admission number: vLLM's own order of `running`.
        self._admitted_at: dict[Key, int] = {}
        self._admissions = 0
        # Users with resident requests, least recently served first.
        self._lanes: OrderedDict[str, _Lane] = OrderedDict()
        self._steps = 0
        # Bumped whenever the resident set or a request's kind changes.
        self._membership_version = 0
        # The last step offered every resident request, each sampled, and
        # nobody was short of quota: the next one may repeat it (see steady()).
        self._repeatable = False
        self._plan_version = -1
        self._plan_was_full = False
        self._steady_step = False
        # Observability, read at stats time (never on the step's hot path).
        #: user -> tokens charged and kept (sampled), cumulative.
        self.charged_tokens: dict[str, int] = {}
        #: user -> ns during which the user had runnable requests and no quota.
        self.throttled_ns: dict[str, int] = {}
        #: Steps that ran nothing because every runnable request was throttled.
        self.idle_steps = 0
        self._last_ran: dict[str, int] = {}
        # Per-step state.
        self.now_ns = 0
        self._charged: dict[Key, str] = {}
        self._refused: set[str] = set()
        self._blocked: set[str] = set()
        self._throttled_lanes: list[str] = []
        self._offers: list[tuple[str, list]] = []  # (user, prepaid keys) this step
        self._prepaid: set = set()

    # -- membership ------------------------------------------------------

    def track(self, key: Key, user: str) -> None:
        """Remember the user of a request (resolved once, at arrival)."""
        if key not in self._user_of:
            self._known_per_user[user] = self._known_per_user.get(user, 0) + 1
        self._user_of[key] = user

    def wait_in_turn(self, key: Key) -> None:
        """A waiting request that must sample to be admitted (no chunked
        prefill) takes its turn in its user's rotation, behind the streams
        already there: it is admitted when the rotation reaches it and the
        user can pay, instead of after every resident stream of the user."""
        if key in self._in_turn or key in self._lane_of:
            return
        user = self._user_of[key]
        lane = self._lanes.get(user)
        if lane is None:
            lane = self._lanes[user] = _Lane()
        lane.decoding.append(key)
        lane.waiting += 1
        self._in_turn.add(key)
        self._membership_version += 1

    def _leave_turn(self, key: Key, user: str) -> _Lane:
        self._in_turn.discard(key)
        lane = self._lanes[user]
        lane.waiting -= 1
        self._membership_version += 1
        return lane

    def forget(self, key: Key) -> None:
        """The request is gone for good (finished or aborted)."""
        self.release(key)
        if key in self._in_turn:
            self._leave_turn(key, self._user_of[key]).decoding.remove(key)
        user = self._user_of.pop(key, None)
        if user is None:
            return
        left = self._known_per_user[user] - 1
        if left:
            self._known_per_user[user] = left
        else:
            del self._known_per_user[user]
            lane = self._lanes.get(user)
            if lane is not None and not lane:
                del self._lanes[user]

    def user_of(self, key: Key) -> str:
        return self._user_of[key]

    def is_resident(self, key: Key) -> bool:
        return key in self._lane_of

    def admit(self, key: Key, progressing: bool) -> None:
        """The request became resident (holds KV and a model-runner slot)."""
        user = self._user_of[key]
        lane = self._lanes.get(user)
        if lane is None:
            # A user with no resident request joins the service order at the
            # back, like a queue: it is served after the users already
            # waiting, in the order users arrived.
            lane = self._lanes[user] = _Lane()
        self._lane_of[key] = user
        self._admissions += 1
        self._admitted_at[key] = self._admissions
        self._membership_version += 1
        if key in self._in_turn:
            # Admitted in its turn: it keeps its place in the rotation.
            self._leave_turn(key, user)
            if not progressing:
                return
            lane.decoding.remove(key)
        if progressing:
            lane.progressing[key] = None
        else:
            lane.decoding.append(key)

    def release(self, key: Key) -> None:
        """The request stopped being resident (preempted, finished)."""
        user = self._lane_of.pop(key, None)
        if user is None:
            return
        del self._admitted_at[key]
        self._membership_version += 1
        lane = self._lanes[user]
        if key in lane.progressing:
            del lane.progressing[key]
        else:
            lane.decoding.remove(key)
        if not lane and user not in self._known_per_user:
            del self._lanes[user]
        # A user whose requests all went back to the waiting queue (e.g.
        # preempted) keeps its place in the service order until it has no
        # request left at all.

    def set_progressing(self, key: Key, progressing: bool) -> None:
        """Update whether a resident request can advance without sampling."""
        user = self._lane_of.get(key)
        if user is None:
            return
        lane = self._lanes[user]
        if progressing:
            if key not in lane.progressing:
                lane.decoding.remove(key)
                lane.progressing[key] = None
                self._membership_version += 1
        elif key in lane.progressing:
            del lane.progressing[key]
            lane.decoding.append(key)
            self._membership_version += 1

    def resident(self) -> Iterator[Key]:
        """Every resident key, lane by lane."""
        in_turn = self._in_turn
        for lane in self._lanes.values():
            yield from lane.progressing
            if lane.waiting:
                yield from (key for key in lane.decoding if key not in in_turn)
            else:
                yield from lane.decoding

    def service_order(self) -> list[str]:
        """Users holding a place in the service order, next to be served first."""
        return list(self._lanes)

    def num_resident(self) -> int:
        return len(self._lane_of)

    def in_admission_order(self, keys: list) -> None:
        """Sort resident ``keys`` in place into the order they became resident."""
        keys.sort(key=self._admitted_at.__getitem__)

    # -- one step ----------------------------------------------------------

    def plan(self, now_ns: int, slots: int) -> StepPlan:
        """Start a step at ``now_ns`` and choose at most ``slots`` requests."""
        self._start_step(now_ns)
        self._steady_step = False
        self._offers = []
        prepaid: set = set()
        self._prepaid = prepaid
        limiter = self.limiter

        visible: list = []
        prefills: list = []
        offers = self._offers
        room = max(slots, 0)
        over_cap = False
        reserved = 0
        take_up_to = limiter.take_up_to
        # Admissions the active cap leaves room for, counting every resident
        # request: quota is kept only for waiting requests that can get in.
        admit_room = max(0, room - len(self._lane_of))
        reached = 0  # resident requests of the lanes reached
        for user, lane in self._lanes.items():
            if room <= 0:
                # Lanes not reached: any resident request of theirs could run.
                over_cap = over_cap or reached < len(self._lane_of)
                break
            reached += len(lane)
            if lane.progressing:
                batch = list(islice(lane.progressing, room))
                prefills.extend(batch)
                visible.extend(batch)
                room -= len(batch)
                if len(batch) < len(lane.progressing):
                    over_cap = True  # a prefill that could run was left out
            decoding = lane.decoding
            if not decoding:
                continue
            if lane.waiting:
                used, admitted, lane_over_cap = self._offer_in_turn(
                    user, lane, room, admit_room, visible, prepaid
                )
                room -= used
                admit_room -= admitted
                reserved += admitted
                over_cap = over_cap or lane_over_cap
                continue
            streams = len(decoding)
            wanted = streams if streams <= room else room
            offered = take_up_to(user, now_ns, wanted)  # one bulk take per user
            if offered:
                batch = list(decoding) if offered == streams else list(islice(decoding, offered))
                visible.extend(batch)
                prepaid.update(batch)
                offers.append((user, batch))
                room -= offered
            if offered < streams:
                # Quota the user had before this take; asked again only when
                # room, not quota, stopped the take.
                can = offered if offered < wanted else offered + limiter.available(user, now_ns)
                if can < streams:
                    # Some streams wait for quota: the user is throttled.
                    self._throttled_lanes.append(user)
                    self._blocked.add(user)
                if offered < can:
                    over_cap = True  # quota was there, room was not
        hidden = len(self._lane_of) - len(visible)
        throttled = bool(self._throttled_lanes)
        self._plan_was_full = not (prefills or hidden or over_cap or throttled or self._in_turn)
        return StepPlan(visible, hidden, over_cap, prepaid, prefills, throttled, reserved)

    def _offer_in_turn(
        self, user: str, lane: _Lane, room: int, admit_room: int, visible: list, prepaid: set
    ) -> tuple[int, int, bool]:
        """Plan a lane whose rotation holds waiting requests (see wait_in_turn).

        In rotation order, resident streams take visible room and waiting
        requests take room for admission; the user pays for as many as it
        can, in that order.  A waiting request that could not be admitted
        this step anyway is passed over, so it never holds up the streams
        behind it.  Returns (room used, admissions reserved, over cap).
        """
        in_turn = self._in_turn
        candidates = []
        resident_left = 0
        for key in lane.decoding:
            if key in in_turn:
                if admit_room > 0:
                    candidates.append(key)
                    admit_room -= 1
            elif room > 0:
                candidates.append(key)
                room -= 1
            else:
                resident_left += 1
        offered = self.limiter.take_up_to(user, self.now_ns, len(candidates))
        batch = candidates[:offered]
        resident = [key for key in batch if key not in in_turn]
        if batch:
            visible.extend(resident)
            prepaid.update(batch)
            self._offers.append((user, batch))
        over_cap = False
        if offered < len(candidates) or (
            resident_left and not self.limiter.available(user, self.now_ns)
        ):
            self._throttled_lanes.append(user)
            self._blocked.add(user)
        elif resident_left:
            over_cap = True  # quota was there, room was not
        return len(resident), len(batch) - len(resident), over_cap

    def _start_step(self, now_ns: int) -> None:
        self._steps += 1
        if self._steps % self._cleanup_every == 0:
            self.limiter.cleanup_idle_users(now_ns)
        if self._blocked:
            # Users who waited for quota in the last step waited until now.
            elapsed = now_ns - self.now_ns
            throttled_ns = self.throttled_ns
            for user in self._blocked:
                throttled_ns[user] = throttled_ns.get(user, 0) + elapsed
        self.now_ns = now_ns
        self._plan_version = self._membership_version
        self._charged.clear()
        self._refused.clear()
        self._blocked.clear()
        self._throttled_lanes.clear()

    def steady(self, now_ns: int, slots: int) -> bool:
        """Start a step that repeats the last one, without a plan, if it can.

        Allowed when the last step offered every resident request (all of
        them decoding), each one sampled, no user was short of quota, and no
        request became or stopped being resident since.  Then, if every user
        can pay for all of its streams again (one bulk take per user), the
        quota is taken and True is returned: the caller runs the step on the
        full resident list, in its current order, and ends it with
        :meth:`finish_steady`.  Otherwise nothing is taken and False is
        returned; the caller plans the step.

        Seen from the limiter and the service order this is exactly what
        :meth:`plan` and :meth:`finish` would do: with every stream of every
        user served, the rotations and the move of each user to the back
        leave every order as it was.
        """
        if (
            not self._repeatable
            or self._in_turn
            or self._membership_version != self._plan_version
            or len(self._lane_of) > slots
        ):
            return False
        take_up_to = self.limiter.take_up_to
        taken: list = []
        for user, lane in self._lanes.items():
            streams = len(lane.decoding)
            if not streams:
                continue
            got = take_up_to(user, now_ns, streams)
            if got:
                taken.append((user, got))
            if got < streams:
                for paid_user, count in taken:
                    self.limiter.refund(paid_user, now_ns, count)
                self._repeatable = False
                return False
        self._start_step(now_ns)
        self._steady_step = True
        self._offers = []
        self._prepaid = _NOTHING
        return True

    def finish_steady(self, resident: list, sampled: Container[Key], all_sampled: bool) -> int:
        """End a :meth:`steady` step; ``resident`` lists the requests it started with.

        ``all_sampled`` is the caller's promise that every one of them sampled
        and none left during the step; then nothing needs doing.  Otherwise
        the step is settled like a planned one whose offers were every
        resident stream.  Returns how many tokens were refunded.
        """
        self._steady_step = False
        if all_sampled and not self._charged:
            ran = self._last_ran = {}
            charged_tokens = self.charged_tokens
            for user, lane in self._lanes.items():
                if lane.decoding:
                    ran[user] = count = len(lane.decoding)
                    charged_tokens[user] = charged_tokens.get(user, 0) + count
            return 0
        if not all_sampled:
            by_user: dict[str, list] = {}
            for key in resident:
                by_user.setdefault(self._user_of[key], []).append(key)
            order = [user for user in self._lanes if user in by_user]
            order += [user for user in by_user if user not in self._lanes]
            self._offers = [(user, by_user[user]) for user in order]
        return self.finish(sampled, all_prepaid_sampled=all_sampled)

    def charge(self, key: Key) -> bool:
        """Charge one output token to the request's user; False if refused."""
        if self.is_charged(key):
            return True
        user = self._user_of[key]
        if user in self._refused:
            return False
        if self.limiter.try_take(user, self.now_ns):
            self._charged[key] = user
            return True
        self._refused.add(user)
        self._blocked.add(user)
        return False

    def can_charge(self, key: Key) -> bool:
        """Would :meth:`charge` succeed now?  Does not take anything."""
        if self.is_charged(key):
            return True
        user = self._user_of[key]
        if user in self._refused:
            return False
        if self.limiter.available(user, self.now_ns) > 0:
            return True
        self._refused.add(user)
        self._blocked.add(user)
        return False

    def holds_residency(self, user: str) -> bool:
        """Does ``user`` have a resident request?"""
        lane = self._lanes.get(user)
        return lane is not None and len(lane) > 0

    def quota_now(self, user: str) -> int:
        """Tokens ``user`` could still be charged in this step (0 once refused)."""
        if user in self._refused:
            return 0
        return self.limiter.available(user, self.now_ns)

    def is_served_now(self, key: Key) -> bool:
        """Was the key's user offered (and paid for) a decoding stream in this step?"""
        user = self._user_of[key]
        if self._steady_step:  # every stream of every user was paid for
            lane = self._lanes.get(user)
            return lane is not None and bool(lane.decoding)
        return any(offer_user == user for offer_user, _ in self._offers)

    def is_charged(self, key: Key) -> bool:
        """Paid for in this step (charged, or prepaid by the plan or steady())."""
        return (
            key in self._charged
            or key in self._prepaid
            or (self._steady_step and key in self._lane_of)
        )

    def throttled_victims(self) -> Iterator[Key]:
        """Hidden requests of out-of-quota users, the user whose quota comes
        back last first.

        Only requests offered nothing in this step are listed; a user's
        least recently served hidden stream comes first.  The user ready
        latest is the one whose request would sit idle in KV longest.
        """
        now = self.now_ns
        ready_at = self.limiter.ready_at_ns
        for user in sorted(self._throttled_lanes, key=lambda u: -ready_at(u, now)):
            lane = self._lanes.get(user)
            if lane is None or self.limiter.available(user, self.now_ns) > 0:
                continue  # gone, or its hidden streams wait for room, not quota
            # Offered streams were the front of the deque; skip them by key,
            # since a released one shifts the positions.
            for key in list(lane.decoding):
                if self._lane_of.get(key) == user and not self.is_charged(key):
                    yield key

    def finish(self, sampled: Container[Key], all_prepaid_sampled: bool = False) -> int:
        """End the step: refund unsampled charges, rotate served streams.

        ``sampled`` holds the keys that were scheduled at a sampling position.
        ``all_prepaid_sampled`` is the caller's promise that every prepaid key
        sampled and no resident request left during the step; then the
        prepaid offers are settled per user without looking at single keys.
        Returns how many tokens were refunded.
        """
        refunded = 0
        lanes = self._lanes
        now = self.now_ns
        ran = self._last_ran = {}
        for user, batch in self._offers:
            lane = lanes.get(user)
            if lane is not None and lane.waiting:
                # Its offer need not be the front of the rotation (waiting
                # requests passed over): served keys go to the back.
                served_set = {key for key in batch if key in sampled}
                ran[user] = len(served_set)
                if len(served_set) < len(batch):
                    self.limiter.refund(user, now, len(batch) - len(served_set))
                    refunded += len(batch) - len(served_set)
                if served_set:
                    rest = [key for key in lane.decoding if key not in served_set]
                    lane.decoding = deque(rest + [k for k in lane.decoding if k in served_set])
                    lanes.move_to_end(user)
                continue
            if all_prepaid_sampled and lane is not None:
                lane.decoding.rotate(-len(batch))
                lanes.move_to_end(user)
                ran[user] = len(batch)
                continue
            served = [key for key in batch if key in sampled]
            ran[user] = len(served)
            unpaid = len(batch) - len(served)
            if unpaid:
                self.limiter.refund(user, now, unpaid)
                refunded += unpaid
            if lane is None or not served:
                continue
            # The batch was the front of the deque; keys may have left since.
            head = [lane.decoding.popleft() for _ in range(min(len(batch), len(lane.decoding)))]
            served_set = set(served)
            lane.decoding.extendleft(reversed([k for k in head if k not in served_set]))
            lane.decoding.extend(k for k in head if k in served_set)
            lanes.move_to_end(user)
        for key, user in self._charged.items():
            if key in sampled:
                ran[user] = ran.get(user, 0) + 1
                # Just admitted or just done prefilling: already at the back
                # of its user's streams; only the user order changes.
                if user in lanes:
                    lanes.move_to_end(user)
            else:
                self.limiter.refund(user, now)
                refunded += 1
        charged_tokens = self.charged_tokens
        for user, count in ran.items():
            charged_tokens[user] = charged_tokens.get(user, 0) + count
        self._repeatable = (
            all_prepaid_sampled
            and self._plan_was_full
            and not self._charged
            and self._membership_version == self._plan_version
        )
        self._charged.clear()
        self._offers = []
        self._prepaid = _NOTHING
        return refunded

    def idle_wait_ns(self) -> int | None:
        """How long the engine may sleep if this step ran nothing.

        The earliest time any user blocked in this step gets quota back,
        capped at ``max_idle_wait_ns``; None when no user was blocked.
        """
        if not self._blocked:
            return None
        self.idle_steps += 1
        now = self.now_ns
        earliest = min(self.limiter.ready_at_ns(user, now) for user in self._blocked)
        return max(0, min(earliest - now, self._max_idle_wait_ns))

    def last_step_users(self) -> dict[str, tuple[int, int]]:
        """user -> (requests that sampled in the last finished step, resident
        requests held back for quota in it), for users with resident requests
        or a sample in that step."""
        ran = self._last_ran
        throttled = self._blocked  # the last step's until the next one starts
        result: dict[str, tuple[int, int]] = {}
        for user, lane in self._lanes.items():
            count = ran.get(user, 0)
            held = max(len(lane) - count, 0) if user in throttled else 0
            if count or held or lane:
                result[user] = (count, held)
        for user, count in ran.items():
            if user not in result:
                result[user] = (count, 0)
        return result

