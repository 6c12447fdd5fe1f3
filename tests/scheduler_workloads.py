"""Random three-user workloads on :class:`~vllm_output_rate_harness.scheduler_sim.Harness`.

Shared by the property tests that check a vLLM feature under binding limits
(``tests/adapter/test_lora.py``, ``tests/adapter/test_multimodal.py``): the
limits, the engine shapes drawn, driving the arrivals to the end, and the
checks every such run ends with.  What a feature adds to a request (an
adapter, images) and checks in each step stays in its own test module.
"""

from __future__ import annotations

from hypothesis import strategies as st

from vllm_output_rate_harness.scheduler_sim import MS, Harness, max_in_window

#: One slow user at 2 tok/s; every other user at 50 tok/s.
RATES = {"slow": 2, "a": 50, "b": 50}
LIMITS = {"default_user_output_tokens_per_second": 50, "user_output_tokens_per_second": {"slow": RATES["slow"]}}


@st.composite
def engine_shapes(draw) -> dict:
    """Harness keywords: 2-8 sequences (maybe fewer active), chunked prefill or not, sync or async."""
    max_num_seqs = draw(st.sampled_from([2, 4, 8]))
    active = draw(st.sampled_from([None, 1, 2]))
    return {
        "max_num_seqs": max_num_seqs,
        "max_num_active_seqs": None if active is None else min(active, max_num_seqs),
        "chunked": draw(st.booleans()),
        "async_": draw(st.booleans()),
    }


def run_arrivals(h: Harness, arrivals, step, feature: str) -> None:
    """Add each arrival ``(step, user, prompt_len, max_tokens, x)`` at its step
    (``x`` as the keyword ``feature`` of :meth:`Harness.add`), calling
    ``step(h)`` once a step until every request is done, then drain."""
    pending = list(arrivals)
    steps = 0
    while pending or h.sched.has_requests():
        while pending and pending[0][0] <= steps:
            _, user, prompt_len, max_tokens, x = pending.pop(0)
            h.add(user, prompt_len=prompt_len, max_tokens=max_tokens, **{feature: x})
        step(h)
        steps += 1
        assert steps < 20_000
    h.drain()


def assert_every_request_complete(h: Harness) -> None:
    for rid, record in h.records.items():
        assert record.finished, rid
        assert len(record.sample_times) == record.max_tokens, rid  # never truncated


def assert_every_user_within_its_bound(h: Harness) -> None:
    """Each user's charges in any 1 s fit its rate; the limiter's state is exactly that of the samples made."""
    for user, rate in RATES.items():
        assert max_in_window(h.charges[user], 1_000 * MS) <= (1 + 0.1) * rate + 1, user
    h.check_limiter_exact()
