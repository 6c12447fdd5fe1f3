"""LoRA adapters with per-user limits, on vLLM's real scheduler (every supported series).

vLLM keeps at most ``max_loras`` adapters in a batch by counting the adapters
of the requests it sees in ``running`` (0.32: those scheduled in the step;
0.33: all of them) and asserts that count after its running loop.  The
plugin hides throttled requests from ``running`` during a step, so without
:meth:`~vllm_output_rate.policy.step.StepDecision.adapter_fits` a newcomer with
another adapter was admitted beside a hidden one and vLLM's assertion
stopped the engine when both ran.  These tests drive the scheduler with
adapters and binding limits (the bound holds, the adapter cap holds in every
step, nothing is lost or truncated); stock equivalence with limits never hit
is in ``test_stock_equivalence.py``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_workloads import (
    LIMITS, assert_every_request_complete, assert_every_user_within_its_bound, engine_shapes, run_arrivals,
)
from vllm_output_rate.adapter.patches import check_vllm_config
from vllm_output_rate_harness.scheduler_sim import MS, Harness, max_in_window

SLOW = {"default_user_output_tokens_per_second": 1000, "user_output_tokens_per_second": {"slow": 1}}


def _resident_adapters(h: Harness) -> set[int]:
    return {r.lora_request.lora_int_id for r in h.sched.running if r.lora_request is not None}


def _step_checked(h: Harness, max_loras: int, dt_ns: int = 10 * MS):
    out = h.step(dt_ns)
    h.check_resident_consistent()
    assert len(_resident_adapters(h)) <= max_loras
    batch = {
        h.sched.requests[rid].lora_request.lora_int_id
        for rid in out.num_scheduled_tokens
        if rid in h.sched.requests and h.sched.requests[rid].lora_request is not None
    }
    assert len(batch) <= max_loras
    return out


def _run_checked(h: Harness, max_loras: int, dt_ns: int = 10 * MS, max_steps: int = 20_000):
    steps = 0
    while h.sched.has_requests() and steps < max_steps:
        _step_checked(h, max_loras, dt_ns)
        steps += 1
    h.drain()
    assert not h.sched.has_requests(), f"not done after {steps} steps"


def test_lora_is_accepted_with_the_feature_on():
    h = Harness(SLOW, max_loras=1)
    assert h.config.lora_config is not None
    check_vllm_config(h.config)  # no refusal


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_throttled_request_keeps_its_adapter_slot(async_):
    """max_loras 1: a throttled user's request holds adapter 1; another user's
    request with adapter 2 waits for it instead of joining the batch (before:
    admitted, then vLLM's own max_loras assertion stopped the engine)."""
    h = Harness(SLOW, async_=async_, max_loras=1)
    h.add("slow", max_tokens=4, request_id="slow-0", lora=1)
    h.step()  # prefill + first token: "slow" spent its burst
    for _ in range(3):
        assert h.step().total_num_scheduled_tokens == 0  # throttled, hidden
    h.add("fast", max_tokens=30, request_id="fast-0", lora=2)
    h.add("fast", max_tokens=30, request_id="fast-1", lora=1)  # same adapter: may join
    out = _step_checked(h, 1)
    assert "fast-0" not in out.num_scheduled_tokens
    assert "fast-1" in out.num_scheduled_tokens
    _run_checked(h, 1, dt_ns=50 * MS)
    assert_every_request_complete(h)
    slow = h.records["slow-0"].sample_times
    fast0 = h.records["fast-0"].sample_times
    # "slow" got its tokens at 1 tok/s; fast-0 started only after slow-0 left.
    assert max_in_window(h.charges["slow"], 1_000 * MS) <= (1 + 0.1) * 1 + 1
    assert fast0[0] > slow[-1]


@st.composite
def lora_workloads(draw):
    arrivals = []
    for i in range(draw(st.integers(2, 10))):
        arrivals.append((
            draw(st.integers(0, 40)),  # step
            draw(st.sampled_from(["slow", "a", "b"])),
            draw(st.integers(1, 40)),  # prompt length
            draw(st.integers(1, 12)),  # max tokens
            draw(st.one_of(st.none(), st.integers(1, 4))),  # adapter
        ))
    return {
        "max_loras": draw(st.integers(1, 3)),
        "engine": draw(engine_shapes()),
        "arrivals": sorted(arrivals, key=lambda a: a[0]),
    }


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(lora_workloads())
def test_binding_limits_with_adapters_keep_every_bound(w):
    """Random adapters, users (one at 2 tok/s, two at 50 tok/s) and caps: in
    every step at most max_loras adapters are resident and in the batch, each
    user's charges stay within its bound, every request ends with all its
    tokens, and the limiter's state is exactly that of the samples made."""
    h = Harness(LIMITS, max_loras=w["max_loras"], max_num_batched_tokens=64, **w["engine"])
    run_arrivals(h, w["arrivals"], lambda h: _step_checked(h, w["max_loras"], 20 * MS), feature="lora")
    assert_every_request_complete(h)
    assert_every_user_within_its_bound(h)
