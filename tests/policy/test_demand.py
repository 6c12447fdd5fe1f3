"""The waiting demand the borrowing offer keeps room for (``policy/demand.py``), no vLLM."""

from __future__ import annotations

import pytest

from vllm_output_rate.policy.demand import waiting_demand
from vllm_output_rate.policy.gate import StepGate
from vllm_output_rate.policy.limiter import OutputRateLimiter

NOW = 10**12


def _paying_and_borrowing(paying_waiting: int):
    """p {100 tok/s, quota now} has ``paying_waiting`` waiting requests;
    b {0.01 tok/s, burst spent} has two resident streams that could borrow."""
    gate = StepGate(OutputRateLimiter(0.01, {"p": 100.0}))
    lanes = gate.lanes
    for key in ("b0", "b1"):
        lanes.track(key, "b")
        lanes.admit(key, progressing=False)
    waiting = [f"p{i}" for i in range(paying_waiting)]
    for key in waiting:
        lanes.track(key, "p")
    while gate.ledger.limiter.try_take("b", NOW):
        pass
    gate.plan(NOW, 8)
    return gate, waiting


@pytest.mark.parametrize("free_slots", [0, 1, 2, 5])
def test_room_is_kept_only_for_paying_requests_a_model_runner_slot_is_free_for(free_slots):
    """Without a free slot vLLM admits none of them: room kept for them
    would stay empty while borrowers' streams wait (issue 43)."""
    gate, waiting = _paying_and_borrowing(4)
    demand = waiting_demand(
        waiting, gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=6, free_slots=free_slots, output_left=lambda key: 100, queued={},
    )
    assert demand == (min(free_slots, 4), 0)


def test_the_scan_still_stops_after_as_many_paying_requests_as_the_room():
    """Past the room's worth of paying requests nothing later counts (the
    queue's scan stays bounded by the room, slots free or not)."""
    gate, waiting = _paying_and_borrowing(10)
    seen: list[str] = []

    def output_left(key):
        return 100

    def counted(keys):
        for key in keys:
            seen.append(key)
            yield key

    waiting_demand(
        counted(waiting), gate.lanes, gate.ledger, lambda user: user == "b", None,
        limit=3, free_slots=0, output_left=output_left, queued={},
    )
    assert seen == waiting[:3]
