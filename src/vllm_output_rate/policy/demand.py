"""What the waiting queue asks of a step's room before borrowed streams get it.

When a step has active room left after the plan, waiting requests that can
run are served first and borrowers' hidden streams get what remains
(:meth:`~.borrow.Borrowing.offer`).  :func:`waiting_demand` counts, in queue
order, the waiting requests that will take some of that room:

* *guaranteed*: requests whose user has quota now, as many as model-runner
  slots are free (those freed for waiting requests in the step counted):
  without a slot vLLM admits none of them, and room kept for them would
  stay empty while borrowers' streams wait beside it;
* *admissions*: while model-runner slots are free, requests of users that
  may borrow (admitted, they join the borrowing as resident streams).  A
  borrower's requests count only for the room its own hidden streams cannot
  fill: admitted instead of them they would add nothing to its service,
  only spread it over more requests, which then progress in lockstep and
  finish together (a lone borrower's closed-loop clients would then leave
  the engine empty while they send their next requests).

Both count only requests residency will admit (:mod:`.residency`): a user
holding as many resident requests as its cap takes no new one in this step,
so room set aside for its waiting requests would stay empty -- neither they
nor the borrowed streams it was taken from would run (issue 43: a borrower
at its cap with 20 requests waiting cut another borrower's borrowed tokens
by 62 %).

Nor do they count requests prompt cost refuses (``prompt_blocked``): a
user out of quota cannot pay a prompt position nobody has paid for,
borrowing or not, and a user in prompt debt (or held by its group's) pays
none with quota either (:meth:`.PromptCost.can_pay`); room kept for such a
request would stay empty just the same (issue 44: two borrowers' queued
prompts held their resident streams to their own rates).

Nor, when the engine says so (``kv_room``), requests the free KV cache
cannot take: vLLM admits none of them, and stops its waiting loop at the
first (issue 44, the GPU twin at 1,024 running with prompt cost off: with
the KV cache full, room kept for 400-650 such requests a step left 590-770
borrowers' resident streams hidden each step, holding about half the cache
without running).

Plain Python: no vLLM import.  Requests are opaque keys.
"""

from __future__ import annotations

from itertools import filterfalse
from typing import Callable, Container, Hashable, Iterable

from vllm_output_rate.policy.lanes import Lanes
from vllm_output_rate.policy.ledger import Ledger
from vllm_output_rate.policy.residency import Residency

Key = Hashable
_UNASKED = -1  # never a room: Residency.room is None or >= 0


def unpaid_streams(lanes: Lanes, prepaid: Container[Key], user: str) -> list[Key]:
    """Resident decoding streams of ``user`` the step's plan did not pay for
    (those that would borrow), in rotation order."""
    lane = lanes.order.get(user)
    if lane is None:
        return []
    decoding = lane.decoding
    if lane.waiting:  # in-turn waiting keys sit among the streams: not resident
        lane_of = lanes.lane_of
        return [key for key in decoding if lane_of.get(key) == user and key not in prepaid]
    # Without in-turn keys every key of the lane's ``decoding`` is a resident
    # stream of the user (Lanes' invariants): only the plan's payments are
    # left out, by a filter run in C (a borrower's lane is walked every step).
    if not prepaid:
        return list(decoding)
    return list(filterfalse(prepaid.__contains__, decoding))


def unpaid_decoding(lanes: Lanes, prepaid: Container[Key], user: str) -> int:
    """How many :func:`unpaid_streams` ``user`` has."""
    lane = lanes.order.get(user)
    if lane is None:
        return 0
    if lane.waiting:
        return len(unpaid_streams(lanes, prepaid, user))
    decoding = lane.decoding
    if not prepaid:
        return len(decoding)
    return len(decoding) - sum(map(prepaid.__contains__, decoding))


def waiting_demand(
    waiting: Iterable[Key],
    lanes: Lanes,
    ledger: Ledger,
    borrows: Callable[[str], bool],
    residency: Residency | None,
    *,
    limit: int,
    free_slots: int,
    output_left: Callable[[Key], int],
    queued: dict[str, list[int]],
    prompt_blocked: Callable[[Key, bool], bool] | None = None,
    kv_room: Callable[[Key], bool] | None = None,
    guaranteed_keys: set[Key] | None = None,
) -> tuple[int, int]:
    """(guaranteed, admissions): waiting requests that get room before
    borrowed streams, up to ``limit`` (the step's active room).

    ``waiting``: the requests vLLM could admit now, in queue order;
    ``free_slots``: model-runner slots free; ``queued`` receives, per
    borrowing user, what each of its waiting requests that would only run
    by borrowing may output (in queue order).  Requests already waiting
    their turn for quota (``lanes.in_turn``) are reserved for elsewhere and
    not counted.  ``prompt_blocked(request, has_quota)``: would prompt
    cost refuse the request, its user's quota counted so far spent or not
    (None: no prompt cost)?  The first such request of a user settles it,
    as its cap does.  ``kv_room(request)``: would its KV fit now (None:
    not asked)?  The first request counted that would not ends the count,
    as an allocation failure ends the engine's waiting loop.
    ``guaranteed_keys`` (if given) receives the requests counted in
    ``guaranteed``.  Nothing else is changed.
    """
    user_of, in_turn = lanes.user_of, lanes.in_turn
    quota_now = ledger.quota_now
    resident_count = lanes.resident_count
    prepaid = ledger.prepaid
    # No user can be given more admissions than there are slots: longer
    # lists would only cost a scan of their requests' lengths.
    wanted = max(0, min(free_slots, limit))
    borrowing: dict[str, bool] = {}
    admittable: dict[str, int] = {}  # borrowing user -> its requests worth admitting
    quota: dict[str, int] = {}
    #: user -> requests residency still admits in this step (None: no cap).
    cap_room: dict[str, int | None] = {}
    # Users whose later requests change nothing: those out of quota that may
    # not borrow, borrowers whose list is full, and users at their cap.
    settled: set[str] = set()
    # Once every user with a tracked request is settled, no later request
    # can change anything: the scan stops (a lone borrower's backlog then
    # costs one request per step, not one lookup per request).
    everyone = lanes.tracked_users()
    guaranteed = 0
    paying = 0  # requests of users with quota now, with a slot or not
    for request in waiting:
        if request in in_turn:
            continue
        user = user_of.get(request)
        if user is None or user in settled:
            continue
        if residency is not None:
            room = cap_room.get(user, _UNASKED)
            if room == _UNASKED:
                room = cap_room[user] = residency.room(user, resident_count(user))
            if room is not None:
                if room <= 0:
                    settled.add(user)  # its requests wait un-admitted this step
                    if len(settled) == everyone:
                        break
                    continue
                cap_room[user] = room - 1
        left = quota.get(user)
        if left is None:
            left = quota_now(user)
        if left > 0:
            if prompt_blocked is not None and prompt_blocked(request, True):
                settled.add(user)  # its prompts are held (a debt, its group's turn)
                if len(settled) == everyone:
                    break
                continue
            if kv_room is not None and not kv_room(request):
                break
            quota[user] = left - 1
            paying += 1
            if guaranteed < free_slots:
                guaranteed += 1  # beyond the free slots vLLM admits none of them
                if guaranteed_keys is not None:
                    guaranteed_keys.add(request)
            if paying >= limit:
                break
            continue
        quota[user] = 0
        may = borrowing.get(user)
        if may is None:
            may = borrowing[user] = borrows(user)
        if not may:
            settled.add(user)
            if len(settled) == everyone:
                break
            continue
        if prompt_blocked is not None and prompt_blocked(request, False):
            # Its prompt waits for its user's quota: the step admits none of
            # its requests that need one, so none takes room from borrowers.
            settled.add(user)
            if len(settled) == everyone:
                break
            continue
        if kv_room is not None and not kv_room(request):
            break
        costs = queued.setdefault(user, [])
        most = admittable.get(user)
        if most is None:
            most = admittable[user] = min(wanted, limit - unpaid_decoding(lanes, prepaid, user))
        if len(costs) < most:
            costs.append(output_left(request))
        if len(costs) >= most:
            settled.add(user)
            if len(settled) == everyone:
                break
    slots = min(free_slots, limit) - guaranteed
    return guaranteed, max(0, min(slots, sum(map(len, queued.values()))))
