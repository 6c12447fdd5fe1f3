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

Nor, when the engine says so (``prefill``), more requests than the step's
token budget can begin to prefill (:class:`PrefillBudget`): vLLM's waiting
loop goes on only while the budget has tokens left, and a prompt it cannot
begin ends it (issue 44: a wave of 120-token prompts against a 128-token
budget kept room for a dozen admissions a step while one could begin, and
borrowers' 8 resident streams decoded 0-2 a step).

Plain Python: no vLLM import.  Requests are opaque keys.
"""

from __future__ import annotations

from itertools import filterfalse
from typing import Callable, Container, Hashable, Iterable, Mapping

from vllm_output_rate.policy.lanes import Lanes
from vllm_output_rate.policy.ledger import Ledger
from vllm_output_rate.policy.residency import Residency

Key = Hashable
_UNASKED = -1  # never a room: Residency.room is None or >= 0


class PrefillBudget:
    """The tokens a step's token budget leaves for its admissions, spent as
    the engine's waiting loop spends them.

    ``tokens``: what is left once the requests running before the waiting
    loop took theirs; ``wants(request)``: the tokens a waiting request's
    admission would schedule (its uncomputed prompt); ``longest``: the
    engine's cap on one prefill chunk (0: none); ``chunked``: with chunked
    prefill an admission begins with whatever is left, without it one whose
    chunk does not fit does not begin (and vLLM's loop stops there).
    """

    __slots__ = ("tokens", "chunked", "longest", "_wants")

    def __init__(
        self, tokens: int, chunked: bool, longest: int, wants: Callable[[Key], int]
    ) -> None:
        self.tokens = tokens
        self.chunked = chunked
        self.longest = longest
        self._wants = wants

    def chunk(self, request: Key) -> int:
        """The tokens ``request``'s admission would take with the budget unspent."""
        wants = self._wants(request)
        longest = self.longest
        return longest if 0 < longest < wants else wants

    def spend(self, spent: int, chunk: int) -> int:
        """Tokens spent once an admission taking ``chunk`` began after
        ``spent`` were; -1 if it cannot begin."""
        left = self.tokens - spent
        if left <= 0 or (chunk > left and not self.chunked):
            return -1
        return spent + min(chunk, left)


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
    prefill: PrefillBudget | None = None,
    committed: Mapping[str, int] | None = None,
) -> tuple[int, int]:
    """(guaranteed, admissions): waiting requests that get room before
    borrowed streams, up to ``limit`` (the step's active room).

    ``waiting``: the requests vLLM could admit now, in queue order;
    ``free_slots``: model-runner slots free; ``queued`` receives, per
    borrowing user, what each of its waiting requests that would only run
    by borrowing may output (in queue order), as many of them as the
    admissions returned (no user is given more; every such user is a key,
    possibly with an empty list).  Requests already waiting
    their turn for quota (``lanes.in_turn``) are reserved for elsewhere and
    not counted.  ``prompt_blocked(request, has_quota)``: would prompt
    cost refuse the request, its user's quota counted so far spent or not
    (None: no prompt cost)?  The first such request of a user settles it,
    as its cap does.  ``kv_room(request)``: would its KV fit now (None:
    not asked)?  The first request counted that would not ends the count,
    as an allocation failure ends the engine's waiting loop.
    ``prefill`` (None: not asked): the token budget the step's admissions
    share; guaranteed requests spend it first, in queue order, and the first
    that could not begin ends the count; admissions count only as many as
    begin in what they leave.
    ``guaranteed_keys`` (if given) receives the requests counted in
    ``guaranteed``.  ``committed``: tokens of each user's quota the step
    spends before its waiting loop (its visible prefills' first tokens), not
    counted for its waiting requests.  Nothing else is changed.
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
    # The prefill budget: what guaranteed requests take (they go first: a
    # borrower's admissions are capped to what they leave, see below), and
    # the admissions counted, in queue order (their chunks are worked out
    # below, only as far as the budget reaches: a borrower's whole backlog
    # may be counted, a few dozen of it begin).
    spent_guaranteed = 0
    borrowed: list[Key] = []
    # user -> its requests counted for admission by borrowing, in queue order
    # (what they may output is read below, only for as many as are admitted).
    counted: dict[str, list[Key]] = {}
    # Queue positions of the borrowers' candidates, and of the last request
    # counted as guaranteed (see the rule below).
    position: dict[Key, int] = {}
    last_guaranteed = -1
    for index, request in enumerate(waiting):
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
            if committed and user in committed:
                left = max(0, left - committed[user])
        if left > 0:
            if prompt_blocked is not None and prompt_blocked(request, True):
                settled.add(user)  # its prompts are held (a debt, its group's turn)
                if len(settled) == everyone:
                    break
                continue
            if kv_room is not None and not kv_room(request):
                break
            if guaranteed < free_slots and prefill is not None:
                chunk = prefill.chunk(request)
                spent = prefill.spend(spent_guaranteed, chunk)
                if spent < 0:
                    break  # nor would any request after it begin
                spent_guaranteed = spent
            quota[user] = left - 1
            paying += 1
            if guaranteed < free_slots:
                guaranteed += 1  # beyond the free slots vLLM admits none of them
                last_guaranteed = index
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
        costs = counted.setdefault(user, [])
        most = admittable.get(user)
        if most is None:
            most = admittable[user] = min(wanted, limit - unpaid_decoding(lanes, prepaid, user))
        if len(costs) < most:
            position[request] = index
            if prefill is not None:
                # Every borrower stays a candidate whatever its place in the
                # queue: which of them is admitted is the borrowing's choice
                # (least weighted service first); the budget bounds how many.
                borrowed.append(request)
            costs.append(request)
        if len(costs) >= most:
            settled.add(user)
            if len(settled) == everyone:
                break
    if prompt_blocked is not None and prefill is not None and last_guaranteed >= 0:
        # With prompt cost, a borrowed prompt ahead of a guaranteed request in
        # the queue is refused in the engine's loop (it would spend the token
        # budget first: ``StepDecision._admit_to_borrow``); counted, its slot
        # stayed empty beside a borrower's hidden stream.  (``borrowed`` holds
        # every request of ``counted``: judged once each.)
        refused = {
            request
            for request in borrowed
            if position[request] < last_guaranteed and prefill.chunk(request) > 1
        }
        if refused:
            borrowed = [request for request in borrowed if request not in refused]
            for user, requests in counted.items():
                counted[user] = [request for request in requests if request not in refused]
    slots = min(free_slots, limit) - guaranteed
    admissions = sum(map(len, counted.values()))
    if prefill is not None and admissions:
        # Counted in queue order, but admitted after the guaranteed requests
        # (with prompt cost a borrower's prompt waits for them; otherwise
        # ``borrow_admits`` holds borrowers to this count, and the engine's
        # loop passes over the rest): they begin in what the guaranteed
        # requests leave.
        admissions = 0
        spent = spent_guaranteed
        chunk_of = prefill.chunk
        for request in borrowed:
            if admissions >= slots:
                break  # no more than the slots are admitted (below)
            spent = prefill.spend(spent, chunk_of(request))
            if spent < 0:
                break
            admissions += 1
    admissions = max(0, min(slots, admissions))
    for user, requests in counted.items():
        queued[user] = [output_left(request) for request in requests[:admissions]]
    return guaranteed, admissions
