"""Speculative decoding, prompt cost and a ceiling together, on vLLM's real scheduler.

Each mode has its own suite; this one checks how they compose (the charging
hook with drafts charges the prompt cost first, and drafts are paid through
the gate's limiter, so they count on a borrower's ceiling too):

* a user with a ceiling above its rate and drafts borrows beyond its rate,
  and every token the model emitted for it stays within the ceiling's bound
  plus the drafts in flight (this workload does not tell drafts paid on the
  rate alone from drafts paid on both: the slack of K per stream covers it);
* the prompt cost is charged as without drafts and without a ceiling (the
  same prompt tokens computed, prefix-cache hits excluded);
* nothing is lost or truncated.
"""

from __future__ import annotations

import pytest

from vllm_output_rate_harness.scheduler_sim import MS, Harness, max_in_window

K = 3
RATE, CEIL = 20.0, 60.0
STREAMS = 4


def _run(limit, weight: float, spec_tokens: int) -> Harness:
    limits = {
        "default_user_output_tokens_per_second": 1e6,
        "user_output_tokens_per_second": {"b": limit},
        "input_token_weight": weight,
    }
    h = Harness(limits, spec_tokens=spec_tokens, num_blocks=2000)
    for i in range(STREAMS):
        h.add("b", prompt_len=30 + i, max_tokens=60)
    for _ in range(5_000):
        if not h.sched.has_requests():
            break
        h.step(10 * MS)
    h.drain()
    return h


@pytest.mark.parametrize("weight", [0, 0.5], ids=["prompts-free", "prompt-weight-0.5"])
def test_drafts_count_on_the_ceiling_and_prompts_are_charged(weight):
    h = _run({"rate": RATE, "ceil": CEIL}, weight, spec_tokens=K)
    for rid, record in h.records.items():
        assert record.finished, rid
        assert len(record.sample_times) == record.max_tokens, rid
    times = sorted(t for r in h.records.values() for t in r.sample_times)
    for window_s in (0.1, 0.5, 1.0, 2.0):
        bound = (window_s + 0.1) * CEIL + 1 + K * STREAMS
        assert max_in_window(times, int(window_s * 1e9)) <= bound, window_s
    # It borrowed: above its rate.
    span_s = (times[-1] - times[0]) / 1e9
    assert len(times) > (span_s + 0.1) * RATE + 1 + K * STREAMS
    prompt_charged = h.sched.output_rate_prompt_cost.prompt_tokens.get("b", 0)
    plain = _run(RATE, weight, spec_tokens=0).sched.output_rate_prompt_cost.prompt_tokens.get("b", 0)
    assert prompt_charged == plain
    assert (prompt_charged > 0) == (weight > 0)
