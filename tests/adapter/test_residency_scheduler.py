"""Residency follows the rate (issue 32) on vLLM's real Scheduler and KV manager.

A throttled user's requests become resident only as far as its quota keeps
each of them moving at the minimum pace (``policy/residency.py``): with the
default 2 tok/s a user limited to 4 tok/s holds at most
max(1, floor(4 / 2)) = 2 requests' KV (the documented bound, floor(R/p) + 1,
is 3); its other requests wait un-admitted.  A fake clock drives the
quotas, so every assertion is exact.
"""

from __future__ import annotations

import math

import pytest

from vllm_output_rate.settings import OutputRateSettings
from vllm_output_rate_harness.scheduler_sim import MS, BLOCK_SIZE, Harness, bound, limits

S = 1_000_000_000
A_RATE = 4.0
PACE = 2.0  # the default min_stream_tokens_per_second
BOUND = math.floor(A_RATE / PACE) + 1  # the documented bound on A's resident requests
TOKEN_BUDGET = 512  # the harness's max_num_batched_tokens


def resident_of(h: Harness, user: str) -> int:
    return sum(1 for r in h.sched.running if h.records[r.request_id].user == user)


def distinct(n: int, seed: int) -> list[int]:
    """A prompt no other request shares a block of (no prefix-cache hits)."""
    return [1000 + (seed * 7919 + j * 31) % 20000 for j in range(n)]


def first_sample_step(h: Harness, rid: str) -> int | None:
    for step, log in enumerate(h.sampled_log):
        if rid in log:
            return step
    return None


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole-prefill"])
def test_a_throttled_user_with_many_streams_never_holds_more_than_the_bound(async_, chunked):
    h = Harness(limits(100, a=A_RATE), async_=async_, chunked=chunked, max_num_seqs=16)
    for _ in range(12):
        h.add("a", prompt_len=200, max_tokens=12)
    most = 0
    for _ in range(1500):  # 15 s
        h.step(10 * MS)
        h.check_resident_consistent()
        held = resident_of(h, "a")
        assert held <= BOUND
        most = max(most, held)
    # What the rule admits, max(1, floor(4 / 2)) = 2, is reached and kept.
    assert most == max(1, math.floor(A_RATE / PACE))
    # The user's rate is kept: its requests turned over at its limit.
    charged = len(h.charges["a"])
    assert charged <= bound(15, A_RATE)
    assert charged >= 0.95 * A_RATE * 15


def _kv_pressure(budget: float, async_: bool, trials: int = 5):
    """A (4 tok/s) with 6 long streams in a KV cache of 100 blocks, then B's
    requests one after another; per trial, the steps from B's arrival to
    the step that samples its first token (None: none in 300 steps)."""
    config = limits(100, a=A_RATE) | {"recompute_budget": budget}
    # A's requests need 37 blocks each at full length (380 + 200 tokens);
    # B's prompt 19: 100 blocks hold A's cap (2 streams) and B, not A's six.
    h = Harness(config, async_=async_, num_blocks=100, max_num_seqs=16)
    for i in range(6):
        h.add("a", max_tokens=200, prompt=distinct(380, i))
    for _ in range(100):  # A settles in at its rate
        h.step(10 * MS)
    waits = []
    for _ in range(trials):
        b = h.add("b", prompt_len=300, max_tokens=4, prompt=[500 + i % 97 for i in range(300)])
        arrived = len(h.sampled_log)
        first = None
        for _ in range(300):
            h.step(10 * MS)
            if first is None and b.request_id in h.sampled_log[-1]:
                first = len(h.sampled_log) - 1 - arrived
            if h.records[b.request_id].finished:
                break
        waits.append(first)
        for _ in range(20):
            h.step(10 * MS)
    return h, waits


# The stated bound on a newcomer's wait: B (quota left, within its own cap)
# is admitted in the step it arrives, because A's resident requests -- at
# most max(1, floor(4 / 2)) = 2, each at most prompt + max_tokens long --
# leave room for B's prompt; its first token is sampled in the step that
# schedules its last prompt chunk: within ceil(300 / 512) = 1 step.
B_WAIT_STEPS = math.ceil(300 / TOKEN_BUDGET)


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("budget", [0.0, 0.25, 1.0], ids=["budget-0", "budget-0.25", "budget-1"])
def test_a_newcomer_under_kv_pressure_gets_its_first_token_within_the_stated_steps(budget, async_):
    h, waits = _kv_pressure(budget, async_)
    assert waits == [B_WAIT_STEPS - 1] * len(waits)  # step index 0 = the arrival step
    assert resident_of(h, "a") <= BOUND
    # A keeps its rate throughout (charges on the fake clock).
    elapsed_s = (h.clock.now_ns - h.charges["a"][0]) / S
    assert len(h.charges["a"]) >= 0.95 * A_RATE * (elapsed_s - 0.1)
    assert len(h.charges["a"]) <= bound(elapsed_s, A_RATE)


def test_streams_beyond_a_lowered_limit_give_way_to_a_newcomer_least_generated_first():
    """A reload lowers A from 40 to 4 tok/s while it holds 6 streams: the 4
    beyond its new cap are surplus; B, under KV pressure, is admitted at
    once by releasing the surplus stream that generated least."""
    h = Harness(limits(100, a=40) | {"recompute_budget": 1.0}, num_blocks=100, max_num_seqs=16)
    for i in range(6):  # staggered: the later a stream came, the less it generated
        h.add("a", max_tokens=400, request_id=f"a{i}", prompt=distinct(220, i))
        for _ in range(30):
            h.step(10 * MS)
    assert resident_of(h, "a") == 6
    lowered = OutputRateSettings.from_additional_config(
        {"output_rate": limits(100, a=A_RATE) | {"recompute_budget": 1.0}}
    )
    h.sched.apply_output_rate_limits(lowered)
    for _ in range(50):
        h.step(10 * MS)
    generated = {r.request_id: r.num_output_tokens for r in h.sched.running}
    least = min(generated, key=generated.get)
    assert sorted(generated.values()).count(generated[least]) == 1
    free = h.free_blocks()
    b_prompt = 300
    assert free * BLOCK_SIZE < b_prompt + BLOCK_SIZE  # B does not fit into free KV
    b = h.add("b", prompt_len=b_prompt, max_tokens=4, prompt=[500 + i % 97 for i in range(300)])
    arrived = len(h.sampled_log)
    for _ in range(5):
        h.step(10 * MS)
    assert first_sample_step(h, b.request_id) == arrived + B_WAIT_STEPS - 1
    assert h.sched.requests[least].status.name == "PREEMPTED"
    assert resident_of(h, "a") < 6
