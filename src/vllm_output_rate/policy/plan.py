"""The per-step planner: which resident requests the scheduler may look at.

One part of :class:`vllm_output_rate.policy.gate.StepGate`.  :func:`plan_step`
reads the lanes (:mod:`vllm_output_rate.policy.lanes`) and records what it
paid for in the step's ledger (:mod:`vllm_output_rate.policy.ledger`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import Callable, Hashable

from vllm_output_rate.policy.lanes import Lane, Lanes
from vllm_output_rate.policy.ledger import Ledger

Key = Hashable


@dataclass(slots=True)
class StepPlan:
    """What :func:`plan_step` decided for one step."""

    visible: list[Key]  # keys to show the scheduler, in service order
    hidden: int  # resident requests kept out of sight
    over_cap: bool  # some runnable request was hidden only because slots ran out
    prepaid: set[Key]  # visible decoding keys whose token is already taken
    prefills: list[Key]  # visible keys that are still prefilling
    throttled: bool  # some resident request waits for its user's quota
    reserved: int = 0  # waiting requests whose turn came: quota kept for their admission
    borrowed: list[Key] = field(default_factory=list)  # keys run on spare capacity (policy.borrow)


def plan_step(
    lanes: Lanes, ledger: Ledger, slots: int, prompt_held: Callable[[str], bool] | None = None,
    prefill_refused: Callable[[str, Key, int], bool] | None = None,
    kv_room: Callable[[Key], bool] | None = None,
) -> StepPlan:
    """Choose at most ``slots`` resident requests for the step the ledger opened.

    ``prompt_held(user)``: the user's new prompts wait for prompt cost now
    (``PromptCost.holds_prompt``); its waiting requests are then passed over
    in its rotation, as those the active cap keeps out are: admitted, they
    would be refused for their prompt, with the token kept for them taken
    from the quota (a group's) that the member whose turn it is needs.

    ``prefill_refused(user, key, decoding)``: prompt cost will refuse the
    next chunk of the resident prefill ``key`` in this step, its user's
    ``decoding`` streams paid first (its debt; outside groups, a quota they
    leave empty with no borrowing to pay it instead).  Such a prefill is
    kept out of sight, as a stream its user cannot pay is: shown, it would
    take a visible slot from a stream that can run, and run nothing.  Its
    user is blocked (the step's idle wait counts it).

    ``kv_room(key)``: would the waiting request ``key`` fit into the free
    KV cache now (None: not asked)?  One that would not is passed over in
    its user's rotation, as one the active cap keeps out: vLLM cannot admit
    it, so a token kept for it would be refunded at the end of the step,
    after it took the quota (a group's) its user's or a group member's
    resident streams needed; the step would run nothing, and with that
    quota back at once, the engine would be told to wait 0 and spin.

    Users are visited in service order; each shows its prefills (free) and
    then as many decoding streams, in rotation order, as it can pay for now,
    paid with one bulk take.  Invariants (checked by the tests):

    * ``visible`` holds each key once and at most ``max(slots, 0)`` keys;
    * of a user without in-turn waiting requests, the visible streams are
      the front of its rotation, min(streams, quota, room left) of them;
    * ``throttled`` iff some user reached could not pay for all its streams;
      ``over_cap`` iff something runnable was hidden for lack of room only;
    * at most one take from the limiter per user reached; prefills are free.

    The cost is O(visible requests + users reached), not O(resident).
    """
    now_ns = ledger.now_ns
    limiter = ledger.limiter
    take_up_to = limiter.take_up_to
    num_resident = len(lanes.lane_of)
    visible: list[Key] = []
    prefills: list[Key] = []
    room = max(slots, 0)
    over_cap = False
    reserved = 0
    # Admissions the active cap leaves room for, counting every resident
    # request: quota is kept only for waiting requests that can get in.
    # No room at all while an admission waits for a request to leave
    # (Lanes.room_wanted).
    admit_room = 0 if lanes.room_wanted else max(0, room - num_resident)
    reached = 0  # resident requests of the lanes reached
    for user, lane in lanes.order.items():
        if room <= 0:
            # Lanes not reached: any resident request of theirs could run.
            over_cap = over_cap or reached < num_resident
            break
        reached += len(lane)
        if lane.progressing:
            if prefill_refused is None:
                batch = list(islice(lane.progressing, room))
                left_out = len(batch) < len(lane.progressing)
            else:
                batch, left_out = _prefills_that_can_run(
                    ledger, user, lane, room, prefill_refused
                )
            prefills.extend(batch)
            visible.extend(batch)
            room -= len(batch)
            if left_out:
                over_cap = True  # a prefill that could run was left out
        decoding = lane.decoding
        if not decoding:
            continue
        if lane.waiting:
            used, admitted, lane_over_cap = _offer_in_turn(
                lanes, ledger, user, lane, room,
                0 if prompt_held is not None and prompt_held(user) else admit_room, visible,
                kv_room,
            )
            room -= used
            admit_room -= admitted
            reserved += admitted
            over_cap = over_cap or lane_over_cap
            continue
        streams = len(decoding)
        wanted = streams if streams <= room else room
        offered = take_up_to(user, now_ns, wanted)  # one bulk take per user
        batch = []
        if offered:
            batch = list(decoding) if offered == streams else list(islice(decoding, offered))
            visible.extend(batch)
            room -= offered
        short = False
        if offered < streams:
            # Quota the user had before this take; asked again only when
            # room, not quota, stopped the take.
            can = offered if offered < wanted else offered + limiter.available(user, now_ns)
            short = can < streams  # some streams wait for quota
            if offered < can:
                over_cap = True  # quota was there, room was not
        ledger.prepay(user, batch, short)
    hidden = num_resident - len(visible)
    prepaid = ledger.prepaid
    assert isinstance(prepaid, set), "a planned step's ledger collects what it prepays"
    return StepPlan(visible, hidden, over_cap, prepaid, prefills, bool(ledger.short), reserved)


def _prefills_that_can_run(
    ledger: Ledger, user: str, lane: Lane, room: int,
    prefill_refused: Callable[[str, Key, int], bool],
) -> tuple[list[Key], bool]:
    """The lane's prefills to show, at most ``room``, those prompt cost will
    refuse passed over (their user blocked); and whether one that could run
    was left out for room."""
    batch: list[Key] = []
    decoding = len(lane.decoding)
    for key in lane.progressing:
        if prefill_refused(user, key, decoding):
            ledger.hold(user)
            continue
        if len(batch) >= room:
            return batch, True
        batch.append(key)
    return batch, False


def _offer_in_turn(
    lanes: Lanes, ledger: Ledger, user: str, lane: Lane, room: int, admit_room: int,
    visible: list[Key], kv_room: Callable[[Key], bool] | None = None,
) -> tuple[int, int, bool]:
    """Plan a lane whose rotation holds waiting requests (see Lanes.wait_in_turn).

    In rotation order, resident streams take visible room and waiting
    requests take room for admission; the user pays for as many as it can,
    in that order.  A waiting request that could not be admitted this step
    anyway (no admission room, its residency cap, no free KV for it:
    ``kv_room``) is passed over, so it never holds up the streams behind it.
    Returns (room used, admissions reserved, over cap).
    """
    in_turn = lanes.in_turn
    limiter = ledger.limiter
    now_ns = ledger.now_ns
    residency = lanes.residency
    if residency is not None:
        # A request the user's residency cap keeps out is passed over like
        # one the active cap keeps out: it must not hold its turn (and the
        # user's token) while the user's resident streams wait behind it.
        cap_room = residency.room(user, len(lane))
        if cap_room is not None and cap_room < admit_room:
            admit_room = cap_room
    candidates = []
    resident_left = 0
    for key in lane.decoding:
        if key in in_turn:
            if admit_room > 0 and (kv_room is None or kv_room(key)):
                candidates.append(key)
                admit_room -= 1
        elif room > 0:
            candidates.append(key)
            room -= 1
        else:
            resident_left += 1
    offered = limiter.take_up_to(user, now_ns, len(candidates))
    batch = candidates[:offered]
    resident = [key for key in batch if key not in in_turn]
    visible.extend(resident)
    short = offered < len(candidates) or bool(resident_left and not limiter.available(user, now_ns))
    ledger.prepay(user, batch, short)
    over_cap = bool(resident_left) and not short  # quota was there, room was not
    return len(resident), len(batch) - len(resident), over_cap
