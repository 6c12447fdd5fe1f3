"""A resident slot handed from one borrower to another (issue 33).

When every model-runner slot (``--max-num-seqs``) is held and the active cap
has room the borrowers' resident streams cannot fill, each borrower borrows
with as many streams as it holds: borrowed tokens follow residency, not
weights.  Which borrower holds a slot follows the order requests finished:
a freed slot goes to a user within its rate first (possibly up to its
residency cap), then to the borrower with the least weighted service
(:meth:`~.borrow.Borrowing.admissions`).  The user with the larger weight
finishes its requests sooner, so it loses its slots sooner, and until its
slots come back (as the other's requests finish, hundreds of steps later)
its share of borrowed tokens is far from its weight.  Admissions alone
cannot fix that: they only hand out slots that free up.

So a borrower *ahead* of its weighted share gives one of its resident
streams to a borrower *behind* it (:func:`slot_handover` chooses the pair,
:meth:`~.displacement.Displacement.handover_victim` the stream), when

* no model-runner slot is free (otherwise admissions hand it out);
* the receiver R has a waiting request that would only run by borrowing, is
  within its residency cap, and could borrow with one more stream in this
  step: it holds fewer resident requests than the room left to borrowers,
  and its quota has a token left beyond what its hidden streams borrow
  (:meth:`~.borrow.Borrowing.could_borrow_another`).  A receiver whose
  ceiling binds would sample no more with another slot, while the donor
  loses every token of the stream it gives (issue 43: hand-overs took 6 of
  8 slots from a borrower without ceiling for one capped at 20 tok/s, and
  the engine made 220 tokens a second instead of 720);
* the donor V, in the same scope (both without a group, or in the same
  one), is ahead of R by more than ``margin`` tokens: of what the two
  borrowed since they started level, V got more than its weighted part,

      (c_V - c_R) * w_V * w_R / (w_V + w_R)  >  margin

  (``c`` the virtual counters, tokens borrowed / weight, ``w`` the
  weights; the left side is V's tokens beyond its part, the same for both
  sides of the pair);
* and V is gaining on R with the streams they hold now: taking streams
  lowest counter first, R borrows ``g_R = min(r_R, room)`` and V
  ``g_V = min(r_V, room - g_R)``, and ``g_V / w_V > g_R / w_R``.

The donor's stream is a hidden stream of a user out of guaranteed quota
(never a user within its rate), the one that generated least, and only if
the recompute budget affords it (the same budget as every eviction for a
waiting request).  The receiver is given the freed slot.

No thrash.  While V gains on R its lead grows; a hand-over stops it gaining
(or the next one does: at most one per step, each toward the weighted
split), and the lead then shrinks.  A slot goes back from R to V only once
R is ahead by more than ``margin`` in turn, so between two hand-overs in
opposite directions the pair borrows at least ``2 * margin`` tokens beyond
the weighted split; with slots too few to split by weight exactly, the pair
alternates between the two nearest splits, spending about as long in each
(the weighted share on average).  Each hand-over is paid from the recompute
budget.

Limits: users of different groups are never compared (their counters are
not); the adapter does not ask with priority scheduling, without chunked
prefill or with prompt cost (a borrower's new request is then not admitted by
borrowing).  Plain Python: no vLLM import.
"""

from __future__ import annotations

from typing import Collection

from vllm_output_rate.policy.borrow import Borrowing
from vllm_output_rate.policy.lanes import Lanes
from vllm_output_rate.policy.ledger import Ledger

#: Tokens a borrower must be ahead of its weighted share (against the
#: borrower it gives a slot to) before it gives one.  Larger: fewer
#: hand-overs (less recompute), longer swings around the weighted share.
HANDOVER_MARGIN_TOKENS = 128


def slot_handover(
    borrowing: Borrowing,
    lanes: Lanes,
    waiting: Collection[str],
    room: int,
    margin: float = HANDOVER_MARGIN_TOKENS,
    ledger: Ledger | None = None,
) -> tuple[str, str] | None:
    """(donor, receiver): the borrower that gives one resident stream and
    the one its slot goes to, or None.

    Called when no model-runner slot is free.  ``waiting``: users with
    waiting requests that would only run by borrowing; ``room``: active
    slots left to borrowers in this step.  Only current borrowers with a
    counter are compared (see the module docstring for the rule).  The
    receiver is the one furthest behind (least counter) that could use a
    slot (given ``ledger``, the step's payments: one its quota could also
    feed); the donor the one furthest ahead of it that qualifies.  Nothing is
    changed.
    """
    if room <= 0 or not waiting:
        return None
    table = borrowing.table
    counters = borrowing.counters
    active = borrowing.active
    residency = lanes.residency
    resident_count = lanes.resident_count
    receiver: str | None = None
    for user in waiting:
        if user not in active or user not in counters or not table.borrows(user):
            continue
        held = resident_count(user)
        if held >= room:
            continue  # its own streams take all the room it could get
        if residency is not None and not residency.admits(user, held):
            continue  # its request would not be admitted
        if ledger is not None and not borrowing.could_borrow_another(lanes, ledger, user):
            continue  # its ceiling binds: another slot would not add a token
        if receiver is None or counters[user] < counters[receiver]:
            receiver = user
    if receiver is None:
        return None
    scope = table.group_of(receiver)
    w_r = table.weight(receiver)
    c_r = counters[receiver]
    r_r = resident_count(receiver)
    g_r = min(r_r, room)
    donor: str | None = None
    for user in lanes.order:  # service order: ties go the same way every run
        if user == receiver or user not in active or user not in counters or table.group_of(user) != scope:
            continue
        held = resident_count(user)
        if not held or not table.borrows(user):
            continue
        c_v = counters[user]
        w_v = table.weight(user)
        if (c_v - c_r) * w_v * w_r / (w_v + w_r) <= margin:
            continue  # not ahead by the margin
        if min(held, room - g_r) * w_r <= g_r * w_v:
            continue  # not gaining on the receiver with what they hold
        if donor is None or c_v > counters[donor]:
            donor = user
    return None if donor is None else (donor, receiver)
