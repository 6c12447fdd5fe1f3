"""Work-conservation gaps the charge-path machine found (issue 43), each as a
small deterministic case on vLLM's real scheduler and the fake clock.

The machine's ``work`` check (tests/adapter/test_charge_path_machine.py)
names each case below as an exception and counts it; a case leaves this file
(and the machine's exception list) once the step conserves work there.
"""

from __future__ import annotations

import pytest

from vllm_output_rate_harness.scheduler_sim import MS, Harness, limits

ACTIVE = 2


def _slots_full_of_throttled_and_borrowing():
    """4 model-runner slots, 2 active: t {20 tok/s, hard cap} holds two
    resident streams (throttled: about one token in five steps), v {rate 1,
    no ceiling} two borrowing streams; no residency cap (pace 0) and no
    recompute budget, so nothing may be evicted.  Then n {100 tok/s}, in
    quota, sends a request: every slot is held, so vLLM cannot admit it."""
    config = limits(100, v={"rate": 1, "ceil": None, "weight": 1}, t=20, n=100)
    config["min_stream_tokens_per_second"] = 0
    config["recompute_budget"] = 0
    h = Harness(config, max_num_seqs=4, max_num_active_seqs=ACTIVE, max_num_batched_tokens=32,
                max_model_len=512)
    for user in ("t", "t", "v", "v"):
        h.add(user, prompt_len=17, max_tokens=400)
    for _ in range(30):
        h.step(10 * MS)
    assert len(h.sched.running) == 4  # every slot held
    newcomer = h.add("n", prompt_len=17, max_tokens=400)
    return h, newcomer


def test_room_not_kept_for_a_request_that_finds_no_slot_goes_to_borrowers():
    """While n's request cannot be admitted (no slot, no eviction), both
    active slots carry a stream in every step: v has two resident streams
    and no ceiling.  On 94ea7e8 only one stream runs per step (v's r2 or a
    throttled t stream) and v's other stream waits beside one unused active
    slot and 31 unused tokens of the budget, for as long as n waits."""
    h, newcomer = _slots_full_of_throttled_and_borrowing()
    for _ in range(20):
        output = h.step(10 * MS)
        assert newcomer.request_id not in output.num_scheduled_tokens  # it never gets a slot
        assert len(output.num_scheduled_tokens) == ACTIVE, dict(output.num_scheduled_tokens)


def _group_line_beside_a_borrower():
    """a and b (50 tok/s each) in one group g0 (100 tok/s), prompts at weight
    1; v (rate 1, no ceiling) outside it with one borrowing stream; 3 of 6
    slots active.  a's 230-token prompt leaves a debt that holds the group's
    prompts while b sends two requests: b waits first in the group's line."""
    config = limits(100, v={"rate": 1, "ceil": None, "weight": 1},
                    a={"rate": 50, "group": "g0"}, b={"rate": 50, "group": "g0"})
    config["groups"] = {"g0": 100}
    config["input_token_weight"] = 1
    config["min_stream_tokens_per_second"] = 0  # no residency cap: slots and room decide
    h = Harness(config, max_num_seqs=6, max_num_active_seqs=3, max_num_batched_tokens=64,
                max_model_len=512)
    stream = h.add("v", prompt_len=17, max_tokens=400)
    for _ in range(5):
        h.step(10 * MS)
    h.add("a", prompt_len=230, max_tokens=50)
    h.step(10 * MS)
    h.add("b", prompt_len=17, max_tokens=50)
    h.add("b", prompt_len=17, max_tokens=50)
    return h, stream


def test_room_not_kept_for_a_group_members_second_prompt_in_one_turn():
    """In every step while a's debt is paid off and the members take turns,
    v's borrowed stream runs whenever an active slot and a token of the budget
    are left unused.  On 34bf0d3 the step that pays a's debt admits b's first
    request only and v's stream sits out beside an unused active slot (the
    charge-path machine's GroupTurns example: u1 beside 1 slot and 61 tokens):
    the borrowing demand counted both of b's prompts, but b goes one chunk
    per turn and a (its resident prefill) asks before b's second."""
    h, stream = _group_line_beside_a_borrower()
    gaps = []
    for index in range(150):
        output = h.step(10 * MS)
        scheduled = output.num_scheduled_tokens
        if (len(scheduled) < 3 and output.total_num_scheduled_tokens < 64
                and stream.request_id not in scheduled):
            gaps.append((index, dict(scheduled)))
    assert not gaps, gaps
