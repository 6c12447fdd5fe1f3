"""Limits configured but never hit: our scheduler decides exactly what stock vLLM decides.

Both schedulers are driven side by side on the same generated workload --
arrivals, prompt lengths (some far longer than the token budget), shared
prefixes (prefix-cache hits), ``max_tokens``, stop tokens, aborts, a KV cache
small enough to force preemptions, FCFS and PRIORITY, sync and async, with
and without speculative decoding -- and
every step's decisions are compared: which requests got how many tokens (in
vLLM's order), which were preempted, which finished.  Fabricated model
outputs depend only on the request and its output position, never on the
batch, so any difference is a scheduling difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_output_rate.tools.scheduler_sim import MS, Harness

NEVER_HIT = {"default_user_output_tokens_per_second": 1e9}
USERS = ("a", "b", "c")


@dataclass(frozen=True)
class Arrival:
    step: int
    user: str
    prompt_len: int
    max_tokens: int
    priority: int
    prefix: int  # which shared prefix the prompt starts with
    stop_after: int | None  # output index that is a stop token


@dataclass(frozen=True)
class Workload:
    policy: str
    chunked: bool
    budget: int
    num_blocks: int
    max_num_seqs: int
    arrivals: tuple
    aborts: tuple  # (step, arrival index)
    steps: int


@st.composite
def workloads(draw, policy: str, chunked: bool):
    budget = draw(st.sampled_from([32, 64, 128]))
    max_model_len = 1024 if chunked else budget
    steps = draw(st.integers(20, 70))
    arrivals = []
    for i in range(draw(st.integers(1, 12))):
        long_prompt = chunked and draw(st.booleans()) and draw(st.booleans())
        prompt_len = (
            draw(st.integers(budget + 1, 4 * budget))
            if long_prompt
            else draw(st.integers(1, max(1, max_model_len // 2)))
        )
        max_tokens = draw(st.integers(1, min(40, max_model_len - prompt_len)))
        arrivals.append(
            Arrival(
                step=draw(st.integers(0, steps // 2)),
                user=draw(st.sampled_from(USERS)),
                prompt_len=prompt_len,
                max_tokens=max_tokens,
                priority=draw(st.integers(0, 2)) if policy == "priority" else 0,
                prefix=draw(st.integers(0, 2)),
                stop_after=draw(st.one_of(st.none(), st.integers(0, max_tokens))),
            )
        )
    arrivals.sort(key=lambda a: a.step)
    aborts = tuple(
        (draw(st.integers(0, steps)), draw(st.integers(0, len(arrivals) - 1)))
        for _ in range(draw(st.integers(0, 2)))
    )
    return Workload(
        policy=policy,
        chunked=chunked,
        budget=budget,
        num_blocks=draw(st.integers(8, 40)),
        max_num_seqs=draw(st.sampled_from([2, 4, 8])),
        arrivals=tuple(arrivals),
        aborts=aborts,
        steps=steps,
    )


def _prompt(arrival: Arrival, index: int) -> list[int]:
    # Prompts of one prefix share their first tokens (prefix-cache hits); the
    # tail is unique to the request.
    shared = [200 + 10 * arrival.prefix + (i % 7) for i in range(arrival.prompt_len // 2)]
    tail = [300 + index + (i % 11) for i in range(arrival.prompt_len - len(shared))]
    return shared + tail


def trace(workload: Workload, limits: dict | None, async_: bool, spec_tokens: int = 0) -> list[dict]:
    """Per-step decisions of one scheduler on ``workload``."""
    h = Harness(
        limits,
        async_=async_,
        spec_tokens=spec_tokens,
        policy=workload.policy,
        chunked=workload.chunked,
        num_blocks=workload.num_blocks,
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.budget,
        max_model_len=1024,
    )
    ids = [f"q{i}" for i in range(len(workload.arrivals))]
    steps = []
    for step in range(workload.steps):
        for index, arrival in enumerate(workload.arrivals):
            if arrival.step != step:
                continue
            h.add(
                arrival.user,
                max_tokens=arrival.max_tokens,
                priority=arrival.priority,
                prompt=_prompt(arrival, index),
                request_id=ids[index],
            )
            if arrival.stop_after is not None:
                h.stop_at[ids[index]] = arrival.stop_after
        for abort_step, index in workload.aborts:
            rid = ids[index]
            if abort_step == step and rid in h.sched.requests:
                h.abort(rid)
        out = h.step(10 * MS)
        steps.append(
            {
                "scheduled": list(out.num_scheduled_tokens.items()),
                "drafts": sorted(out.scheduled_spec_decode_tokens.items()),
                "preempted": sorted(out.preempted_req_ids),
                "finished": sorted(out.finished_req_ids),
                "running": [r.request_id for r in h.sched.running],
                "waiting": sorted(r.request_id for r in h.sched.waiting),
            }
        )
    h.drain()
    return steps


def first_difference(stock: list[dict], ours: list[dict]) -> str | None:
    for step, (s, o) in enumerate(zip(stock, ours)):
        if s != o:
            keys = [k for k in s if s[k] != o[k]]
            detail = "; ".join(f"{k}: stock {s[k]} vs ours {o[k]}" for k in keys)
            return f"step {step} differs -- {detail}"
    return None


def assert_same_as_stock(workload: Workload, async_: bool, spec_tokens: int = 0) -> None:
    stock = trace(workload, None, async_, spec_tokens)
    ours = trace(workload, NEVER_HIT, async_, spec_tokens)
    difference = first_difference(stock, ours)
    assert difference is None, difference


CASES = [
    (policy, chunked, async_)
    for policy in ("fcfs", "priority")
    for chunked in (True, False)
    for async_ in (False, True)
]


@pytest.mark.parametrize(
    "policy,chunked,async_",
    CASES,
    ids=[f"{p}-{'chunked' if c else 'whole'}-{'async' if a else 'sync'}" for p, c, a in CASES],
)
def test_never_hit_limits_decide_like_stock(policy, chunked, async_):
    @settings(
        max_examples=12,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(workloads(policy, chunked))
    def check(workload):
        assert_same_as_stock(workload, async_)

    check()


SPEC_CASES = [("fcfs", True, False), ("fcfs", True, True), ("priority", False, False), ("priority", True, True)]


@pytest.mark.parametrize(
    "policy,chunked,async_",
    SPEC_CASES,
    ids=[f"{p}-{'chunked' if c else 'whole'}-{'async' if a else 'sync'}" for p, c, a in SPEC_CASES],
)
def test_never_hit_limits_decide_like_stock_with_speculative_decoding(policy, chunked, async_):
    """ngram speculative decoding, 3 drafts per step, a varying number
    proposed and accepted: the same tokens, drafts, preemptions and
    finishes as stock, step for step (drafts are charged, never trimmed)."""
    @settings(
        max_examples=8,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(workloads(policy, chunked))
    def check(workload):
        assert_same_as_stock(workload, async_, spec_tokens=3)

    check()


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("users", [("a", "a", "a"), ("a", "b", "c")], ids=["one-user", "three-users"])
def test_decodes_keep_their_token_when_a_long_prompt_arrives(async_, users):
    """Two decoding requests and then a 1000-token prompt, budget 64: stock
    gives the decodes their token every step and the prompt what is left."""
    def run(limits):
        h = Harness(limits, async_=async_, max_num_batched_tokens=64, max_num_seqs=8)
        a = h.add(users[0], prompt_len=8, max_tokens=60, request_id="A")
        b = h.add(users[1], prompt_len=8, max_tokens=60, request_id="B")
        for _ in range(3):
            h.step(10 * MS)
        h.add(users[2], prompt_len=1000, max_tokens=4, request_id="C")
        return [dict(h.step(10 * MS).num_scheduled_tokens) for _ in range(8)], (a, b)

    stock, _ = run(None)
    ours, _ = run(NEVER_HIT)
    assert all(step.get("A") == 1 and step.get("B") == 1 for step in stock)
    assert ours == stock


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_kv_pressure_victims_are_the_newest_like_stock(async_):
    """FCFS under KV pressure preempts the most recently admitted request."""
    def run(limits):
        h = Harness(limits, async_=async_, num_blocks=10, max_num_batched_tokens=128)
        for i in range(4):
            h.add(USERS[i % 3], prompt_len=30, max_tokens=40, request_id=f"r{i}")
            h.step(10 * MS)
        preempted = []
        for _ in range(40):
            preempted.append(sorted(h.step(10 * MS).preempted_req_ids))
        return preempted

    stock = run(None)
    assert any(stock)
    assert run(NEVER_HIT) == stock
