"""A waiting request's turn in its user's rotation under priority scheduling
(``Lanes.wait_in_turn`` with ``priority_of``)."""

from __future__ import annotations

from vllm_output_rate.policy.lanes import Lanes

PRIORITY = {"s1": 10, "s2": 10, "urgent": 0, "late": 10, "also urgent": 0}


def _lanes_with_two_streams() -> Lanes:
    lanes = Lanes()
    for key in ("s1", "s2"):
        lanes.track(key, "u")
        lanes.admit(key, progressing=False)
    return lanes


def test_a_more_important_request_waits_ahead_of_its_users_less_important_keys():
    lanes = _lanes_with_two_streams()
    for key in ("late", "urgent", "also urgent"):
        lanes.track(key, "u")
        lanes.wait_in_turn(key, PRIORITY.__getitem__)
    lane = lanes.order["u"]
    # Urgent ones first, in arrival order among equals; an equally important
    # request goes behind the streams, as without priorities.
    assert list(lane.decoding) == ["urgent", "also urgent", "s1", "s2", "late"]
    assert lane.waiting == 3 and lanes.resident_count("u") == 2


def test_without_priorities_a_waiting_request_goes_to_the_back():
    lanes = _lanes_with_two_streams()
    lanes.track("urgent", "u")
    lanes.wait_in_turn("urgent")
    assert list(lanes.order["u"].decoding) == ["s1", "s2", "urgent"]
