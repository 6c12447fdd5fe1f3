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
