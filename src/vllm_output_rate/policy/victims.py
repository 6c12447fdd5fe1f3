"""Victim choice: which resident requests give way when KV or slots run out.

One part of :class:`vllm_output_rate.policy.gate.StepGate`; reads the lanes and the
step's ledger, changes nothing.
"""

from __future__ import annotations

from typing import Hashable, Iterator

from vllm_output_rate.policy.lanes import Lanes
from vllm_output_rate.policy.ledger import Ledger

Key = Hashable


def throttled_victims(lanes: Lanes, ledger: Ledger) -> Iterator[Key]:
    """Hidden requests of out-of-quota users, the user whose quota comes
    back last first.

    Invariants (checked by the tests): every key listed is resident, a
    decoding stream of a user the plan found short, not paid for in this
    step, and its user has no quota left now; a user's least recently served
    stream comes first.  The user ready latest is the one whose request
    would sit idle in KV longest.  Evaluated lazily: a victim released by
    the caller while iterating is not listed again.
    """
    now = ledger.now_ns
    limiter = ledger.limiter
    ready_at = limiter.ready_at_ns
    lane_of = lanes.lane_of
    is_charged = ledger.is_charged
    for user in sorted(ledger.short, key=lambda u: -ready_at(u, now)):
        lane = lanes.order.get(user)
        if lane is None or limiter.available(user, now) > 0:
            continue  # gone, or its hidden streams wait for room, not quota
        # Offered streams were the front of the deque; skip them by key,
        # since a released one shifts the positions.
        for key in list(lane.decoding):
            if lane_of.get(key) == user and not is_charged(key):
                yield key
