"""The per-step "who may sample" gate, in plain Python.

The scheduler adapter drives one :class:`StepGate` per engine.  Requests are
opaque hashable keys here; the gate knows each key's user and, for resident
requests (holding KV and a model-runner slot), whether the request can make
progress without sampling (a prefill with at least two positions left).

:class:`StepGate` is a small composition of named parts, each in its own
module with its invariants in its docstring, and each unit-tested alone
(``tests/policy/test_gate_parts.py``):

* **membership and lanes** -- :class:`~vllm_output_rate.policy.lanes.Lanes`:
  each request's user, which requests are resident, users in service order
  (least recently served first) and each user's streams in rotation order;
* **the per-step planner** -- :func:`~vllm_output_rate.policy.plan.plan_step`:
  which resident requests the scheduler may look at in a step;
* **the charge/refund ledger** -- :class:`~vllm_output_rate.policy.ledger.Ledger`:
  what each request paid in the step, who was refused or blocked, refunds,
  and the per-user totals read by metrics;
* **victim candidates** -- :func:`~vllm_output_rate.policy.victims.throttled_victims`:
  which hidden requests could give way when KV or slots run out
  (:class:`~vllm_output_rate.policy.displacement.Displacement` picks one
  for a given request).

:class:`StepGate` itself starts the step (:meth:`~StepGate.plan`), lends
spare capacity (:meth:`~StepGate.borrow`, :meth:`~StepGate.lend`), ends a
planned step (:meth:`~StepGate.settle`: the ledger, then borrowing, whose
result the ledger records), owns the repeated-step fast path
(:meth:`~StepGate.steady`, ended by :meth:`Ledger.settle_repeat`) and the
limiter's cleanup cadence.  Callers hold its parts for everything else:
membership goes to ``gate.lanes``, per-request payments to ``gate.ledger``
(no call through the gate on the per-request path).

A step goes like this:

1. :meth:`StepGate.plan` picks the resident requests the scheduler may look at
   in this step: users in least-recently-served order, and of each user its
   prefills plus as many decoding streams as the user can pay for right now,
   in rotation order, until the active cap is full.  The decoding streams it
   offers are paid for at once, one bulk take per user ("prepaid").
   Everything else stays resident but out of sight, so the step costs
   O(active requests + users visited), not O(resident requests).  The
   adapter hands the chosen requests to vLLM in admission order
   (:meth:`Lanes.in_admission_order`): the gate decides *which* requests
   run, vLLM's own order decides everything else.  Waiting requests that
   must sample to be admitted (no chunked prefill) sit in their user's
   rotation too (:meth:`Lanes.wait_in_turn`): when their turn comes, the
   user's token is kept for their admission.
2. :meth:`Ledger.charge` is called for each request about to be given a
   sampling position; prepaid requests pass for free, any other takes one
   unit of its user's quota, at most once per request per step.  A user
   refused once in a step is not asked again.
3. :meth:`Ledger.settle` refunds every charge -- prepaid or not -- whose
   request did not end up sampled (the single refund point), rotates each
   served user's streams and moves the user to the back of the service
   order.  When every prepaid request sampled and nothing was preempted it
   does this per user, without looking at single requests.

Invariants (checked by the tests):

* a request is charged at most once per step, and a charge survives the step
  only if the request sampled in it;
* within one user, a served stream moves behind the user's other streams;
* the visible set never holds more than ``slots`` requests;
* a repeated step (:meth:`StepGate.steady`) leaves the limiter and every
  order exactly as a planned step would.
"""

from __future__ import annotations

from typing import Callable, Collection, Container, Hashable

from vllm_output_rate.policy.borrow import Borrowing
from vllm_output_rate.policy.lanes import Lane, Lanes
from vllm_output_rate.policy.ledger import Ledger
from vllm_output_rate.policy.limiter import Limiter
from vllm_output_rate.policy.plan import StepPlan, plan_step
from vllm_output_rate.policy.prompt_cost import PromptCost

__all__ = ["CLEANUP_EVERY_STEPS", "MAX_IDLE_WAIT_NS", "StepGate", "StepPlan"]

Key = Hashable

#: Every this many steps, users with no debt are dropped from the limiter.
CLEANUP_EVERY_STEPS = 256
#: Longest idle wait the engine loop is told to take, in nanoseconds.  Every
#: wake-up of a throttled-only engine runs an empty step, which costs the model
#: worker two messages and a short spin: at a 50 ms cap that was most of the
#: 20 % of a core such a server used, at 250 ms it is 8 % (benchmarks/idle_cpu.py).
#: New requests, aborts and admin calls wake the loop at once; a reloaded limits
#: file applies at the latest this much later.
MAX_IDLE_WAIT_NS = 250_000_000


class StepGate:
    """Per-step quota decisions over one :class:`Limiter`.

    ``lanes`` (membership and order) and ``ledger`` (this step's payments)
    are its parts; callers use them directly.
    """

    def __init__(
        self,
        limiter: Limiter,
        cleanup_every: int = CLEANUP_EVERY_STEPS,
        max_idle_wait_ns: int = MAX_IDLE_WAIT_NS,
    ) -> None:
        self.lanes = Lanes()
        self.ledger = Ledger(limiter, self.lanes)
        self._cleanup_every = cleanup_every
        self._max_idle_wait_ns = max_idle_wait_ns
        self._steps = 0
        #: Steps that ran nothing because every runnable request was throttled.
        self.idle_steps = 0
        self._plan_version = -1  # lanes.version when the step started
        # The last plan offered every resident request, all of them decoding
        # streams, and nobody was short of quota (see steady()).
        self._plan_was_full = False
        #: Spare capacity for users with a ceiling above their rate; None
        #: while nobody has one (then nothing of it runs).
        self.borrowing: Borrowing | None = None
        #: The prompt cost paid through :attr:`ledger` (set by its owner);
        #: its debts and turns hold users back beyond their quota.
        self.prompt_cost: PromptCost | None = None
        #: user -> tokens its cap must hold before its waiting prompt can be
        #: borrowed (the step policy notes them in each planned step).
        self.cap_wanted: dict[str, int] = {}

    @property
    def limiter(self) -> Limiter:
        """The quota every token is paid from; the ledger holds it (one owner)."""
        return self.ledger.limiter

    # -- one step ----------------------------------------------------------

    def plan(
        self, now_ns: int, slots: int,
        prefill_refused: Callable[[str, Key, int], bool] | None = None,
        kv_room: Callable[[Key], bool] | None = None,
    ) -> StepPlan:
        """Start a step at ``now_ns`` and choose at most ``slots`` requests
        (``prefill_refused``, ``kv_room``: see :func:`~.plan.plan_step`)."""
        self._start_step(now_ns, repeat=False)
        prompt_cost = self.prompt_cost
        if prompt_cost is None or not prompt_cost.weight:
            plan = plan_step(self.lanes, self.ledger, slots, kv_room=kv_room)
        else:
            plan = plan_step(
                self.lanes, self.ledger, slots, prompt_cost.holds_prompt, prefill_refused, kv_room
            )
        self._plan_was_full = not (
            plan.prefills or plan.hidden or plan.over_cap or plan.throttled or self.lanes.in_turn
        )
        return plan

    def borrow(self, plan: StepPlan, spare: int, waiting: Collection[str] = ()) -> None:
        """After :meth:`plan`: run up to ``spare`` hidden streams of short
        users on spare capacity (:mod:`~vllm_output_rate.policy.borrow`);
        they are listed in ``plan.borrowed``, not in ``plan.visible``.
        ``waiting``: users whose waiting requests would only run by borrowing."""
        assert self.borrowing is not None, "borrow() is for a gate built with borrowing"
        borrowed = self.borrowing.offer(self.lanes, self.ledger, spare, waiting)
        if borrowed:
            self.ledger.pay_borrowed(borrowed)
            plan.borrowed = borrowed
            plan.hidden -= len(borrowed)
            self._plan_was_full = False  # a step that borrowed is never repeated

    def lend(self, key: Key) -> bool:
        """Borrow the sampled token of ``key``, a waiting request admitted to
        borrow (:meth:`Borrowing.lend`) whose user is out of quota; True if
        paid (then recorded in the ledger)."""
        borrowing = self.borrowing
        ledger = self.ledger
        if borrowing is None or not borrowing.lend(self.lanes.user_of[key], key, ledger.now_ns):
            return False
        ledger.pay_borrowed((key,))
        return True

    def settle(self, sampled: Container[Key], all_prepaid_sampled: bool = False) -> None:
        """End a planned step: the ledger settles its payments
        (:meth:`Ledger.settle`), then borrowing its own, and the ledger
        records what borrowing kept."""
        ledger = self.ledger
        ledger.settle(sampled, all_prepaid_sampled)
        borrowing = self.borrowing
        if borrowing is not None and borrowing.step:
            ledger.keep(borrowing.settle(self.lanes, sampled), sampled=True)

    def _start_step(self, now_ns: int, repeat: bool) -> None:
        self._steps += 1
        if self._steps % self._cleanup_every == 0:
            self.limiter.cleanup_idle_users(now_ns)
        self.ledger.open(now_ns, repeat)
        self._plan_version = self.lanes.version

    def steady(self, now_ns: int, slots: int) -> bool:
        """Start a step that repeats the last one, without a plan, if it can.

        Allowed when the last step offered every resident request (all of
        them decoding), each one sampled, no user was short of quota, and no
        request became or stopped being resident since.  Then, if every user
        can pay for all of its streams again (one bulk take per user), the
        quota is taken and True is returned: the caller runs the step on the
        full resident list, in its current order, and ends it with
        :meth:`Ledger.settle_repeat`.  Otherwise nothing is taken and False
        is returned; the caller plans the step.

        Seen from the limiter and the service order this is exactly what
        :meth:`plan` and :meth:`Ledger.settle` would do: with every stream of
        every user served, the rotations and the move of each user to the
        back leave every order as it was.
        """
        lanes = self.lanes
        if (
            not (self._plan_was_full and self.ledger.all_prepaid_kept)
            or lanes.in_turn
            or lanes.version != self._plan_version
            or len(lanes.lane_of) > slots
        ):
            return False
        take_up_to = self.limiter.take_up_to
        taken: list[tuple[str, int]] = []
        for user, lane in lanes.order.items():
            streams = len(lane.decoding)
            if not streams:
                continue
            got = take_up_to(user, now_ns, streams)
            if got:
                taken.append((user, got))
            if got < streams:
                for paid_user, count in taken:
                    self.limiter.refund(paid_user, now_ns, count)
                return False
        self._start_step(now_ns, repeat=True)
        return True

    # -- after the step --------------------------------------------------------

    def idle_wait_ns(self) -> int | None:
        """How long the engine may sleep if this step ran nothing.

        The earliest time any user blocked in this step can run again
        (:meth:`ready_at_ns`), capped at ``max_idle_wait_ns``; None when no
        user was blocked.  Counted in :attr:`idle_steps`.

        A blocked user whose turn went to a waiting request that found no
        room (``Ledger.unadmitted``) and that has no resident stream to run
        instead, or any blocked user with nothing resident while admissions
        wait for a request to leave (``Lanes.room_wanted``), waits for room,
        not quota: the quota it has would only buy an admission that cannot
        fit (the engine would spin).  Room comes when a request leaves (a new
        request or an abort wakes the engine) or when the other blocked users
        run and finish: their ready time counts, or the cap when there is
        none.
        """
        ledger = self.ledger
        if not ledger.blocked:
            return None
        self.idle_steps += 1
        now = ledger.now_ns
        lanes = self.lanes
        order = lanes.order
        room_wanted = lanes.room_wanted
        waiting_for_quota = []
        for user in ledger.blocked:
            lane = order.get(user)
            if not _has_resident_stream(lane) and (
                user in ledger.unadmitted
                # While admissions wait for a request to leave, a user with
                # nothing resident waits for that too, whatever stopped it.
                or (room_wanted and not (lane is not None and lane.progressing))
            ):
                continue
            waiting_for_quota.append(user)
        if not waiting_for_quota:
            return self._max_idle_wait_ns
        earliest = min(self.ready_at_ns(user, now) for user in waiting_for_quota)
        return max(0, min(earliest - now, self._max_idle_wait_ns))

    def ready_at_ns(self, user: str, now_ns: int) -> int:
        """When ``user``, blocked in a step that ran nothing, can run again.

        Its guaranteed quota must pay a token (every level of it: the
        limiter's ready time) and its prompt cost let it go (debt
        paid, its group's turn come).  Borrowing is another way in, but in a
        step that ran nothing it already had its chance: a borrower it did
        not run is waiting for something borrowing does not pay (a prompt
        chunk or its debt, an in-turn admission), or for its cap.  So the cap
        counts only while it is spent: then its refill may be what the user
        waits for.  Earlier is only an empty step more; later, or 0 while
        nobody can run, is the engine idling on work or spinning without.
        """
        limiter = self.ledger.limiter

        def quota_ready(who: str) -> int:
            return limiter.ready_at_ns(who, now_ns)

        prompt_cost = self.prompt_cost
        decoding = _has_resident_stream(self.lanes.order.get(user))
        if prompt_cost is None:
            ready = quota_ready(user)
        else:
            ready = prompt_cost.ready_at_ns(user, now_ns, quota_ready, decoding)
        borrowing = self.borrowing
        if borrowing is None or borrowing.cap is None:
            return ready
        if prompt_cost is not None and not decoding and prompt_cost.held_by_debt(user):
            # Its prompts wait for a debt, repaid from the guaranteed quota
            # alone: no refill of its cap lets it run sooner.
            return ready
        if borrowing.table.borrows(user) and borrowing.table.ceiled(user):
            wanted = self.cap_wanted.get(user, 1)
            if wanted > 1 and not decoding:
                # Nothing of it runs before its cap holds its prompt's cost.
                cap_ready = _ready_for(
                    borrowing.cap, user, now_ns, wanted, self._max_idle_wait_ns
                )
            else:
                cap_ready = borrowing.cap.ready_at_ns(user, now_ns)
            if now_ns < cap_ready < ready:
                ready = cap_ready
        return ready

    def last_step_users(self) -> dict[str, tuple[int, int]]:
        """user -> (requests that sampled in the last settled step, resident
        requests held back for quota in it), for users with resident requests
        or a sample in that step."""
        ran = self.ledger.ran
        throttled = self.ledger.blocked  # the last step's until the next one starts
        result: dict[str, tuple[int, int]] = {}
        for user, lane in self.lanes.order.items():
            count = ran.get(user, 0)
            held = max(len(lane) - count, 0) if user in throttled else 0
            if count or held or lane:
                result[user] = (count, held)
        for user, count in ran.items():
            if user not in result:
                result[user] = (count, 0)
        return result


def _ready_for(limiter: Limiter, user: str, now_ns: int, count: int, horizon_ns: int) -> int:
    """Earliest time >= ``now_ns`` at which ``limiter`` holds ``count``
    tokens for ``user`` (searched on whole nanoseconds; past ``horizon_ns``
    from now, some time beyond it)."""
    available = limiter.available
    if available(user, now_ns) >= count:
        return now_ns
    low = now_ns  # holds fewer than count
    high = max(limiter.ready_at_ns(user, now_ns), now_ns + 1)
    stride = high - now_ns
    while available(user, high) < count:
        if high - now_ns > horizon_ns:
            return high
        low = high
        high += stride
        stride *= 2
    while high - low > 1:
        middle = (low + high) // 2
        if available(user, middle) >= count:
            high = middle
        else:
            low = middle
    return high


def _has_resident_stream(lane: Lane | None) -> bool:
    return lane is not None and lane.resident_streams() > 0
