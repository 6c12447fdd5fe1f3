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

from vllm_output_rate_harness.scheduler_sim import MS, Harness

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
    lora: int | None = None  # LoRA adapter id
    image: tuple | None = None  # (offset, length, name) of an image placeholder


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
    max_loras: int | None = None  # LoRA on: adapters a batch may hold
    encoder_cache: int | None = None  # multimodal: encoder cache and budget (embeddings)


@st.composite
def workloads(draw, policy: str, chunked: bool, lora: bool = False, images: bool = False):
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
                lora=draw(st.one_of(st.none(), st.integers(1, 4))) if lora else None,
                image=draw(_images(prompt_len)) if images else None,
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
        max_loras=draw(st.integers(1, 3)) if lora else None,
        encoder_cache=draw(st.sampled_from([IMAGE, 2 * IMAGE, 4 * IMAGE])) if images else None,
    )


IMAGE = 16  # placeholder tokens (= embeddings) per image


def _images(prompt_len: int):
    if prompt_len < IMAGE:
        return st.none()
    return st.one_of(st.none(), st.tuples(
        st.integers(0, prompt_len - IMAGE), st.just(IMAGE), st.sampled_from(["i0", "i1", "i2"])
    ))


def _prompt(arrival: Arrival, index: int) -> list[int]:
    # Prompts of one prefix share their first tokens (prefix-cache hits); the
    # tail is unique to the request.
    shared = [200 + 10 * arrival.prefix + (i % 7) for i in range(arrival.prompt_len // 2)]
    tail = [300 + index + (i % 11) for i in range(arrival.prompt_len - len(shared))]
    return shared + tail


def trace(
    workload: Workload, limits: dict | None, async_: bool, spec_tokens: int = 0,
    scheduler_cls: type | None = None,
) -> list[dict]:
    """Per-step decisions of one scheduler on ``workload`` (``scheduler_cls``:
    another class than the harness's, e.g. shadow mode's, which lets tokens
    through beyond the limits: the harness's own quota check is off then)."""
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
        max_loras=workload.max_loras,
        encoder_cache_size=workload.encoder_cache,
        scheduler_cls=scheduler_cls,
    )
    if scheduler_cls is not None:
        h.shadow = None
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
                lora=arrival.lora,
                images=[arrival.image] if arrival.image else [],
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
LORA_CASES = [("fcfs", True, False), ("fcfs", True, True), ("priority", False, False)]
SPEC_CASES = [("fcfs", True, False), ("fcfs", True, True), ("priority", False, False), ("priority", True, True)]


def cases(table):
    """``table`` as parametrize arguments, each case named policy-prefill-scheduling."""
    ids = [f"{p}-{'chunked' if c else 'whole'}-{'async' if a else 'sync'}" for p, c, a in table]
    return pytest.mark.parametrize("policy,chunked,async_", table, ids=ids)


def check_like_stock(policy, chunked, async_, max_examples, spec_tokens=0, **kind):
    """Hypothesis over ``workloads(policy, chunked, **kind)``: every one decides like stock."""
    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(workloads(policy, chunked, **kind))
    def check(workload):
        assert_same_as_stock(workload, async_, spec_tokens=spec_tokens)

    check()


@cases(CASES)
def test_never_hit_limits_decide_like_stock(policy, chunked, async_):
    check_like_stock(policy, chunked, async_, max_examples=12)


@cases(LORA_CASES)
def test_never_hit_limits_decide_like_stock_with_lora(policy, chunked, async_):
    """The same, with LoRA on: requests name adapters (or none), max_loras 1-3,
    so vLLM's adapter cap keeps requests waiting."""
    check_like_stock(policy, chunked, async_, max_examples=10, lora=True)


@cases(LORA_CASES)
def test_never_hit_limits_decide_like_stock_with_images(policy, chunked, async_):
    """The same, with image placeholders (shared images too) and an encoder
    cache and budget of 1-4 images, so encoder room limits chunks."""
    check_like_stock(policy, chunked, async_, max_examples=10, images=True)


@cases(SPEC_CASES)
def test_never_hit_limits_decide_like_stock_with_speculative_decoding(policy, chunked, async_):
    """ngram speculative decoding, 3 drafts per step, a varying number
    proposed and accepted: the same tokens, drafts, preemptions and
    finishes as stock, step for step (drafts are charged, never trimmed)."""
    check_like_stock(policy, chunked, async_, max_examples=8, spec_tokens=3)


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


# -- prompt cost: weight 0 is today, an unreached weight is stock ---------------------

#: Limits that throttle: user "b" at 5 tok/s, everyone else at 30.
HIT = {"default_user_output_tokens_per_second": 30, "user_output_tokens_per_second": {"b": 5}}
PROMPT_CASES = [("fcfs", True, False), ("priority", True, True), ("fcfs", False, True)]


@pytest.mark.parametrize(
    "policy,chunked,async_",
    PROMPT_CASES,
    ids=[f"{p}-{'chunked' if c else 'whole'}-{'async' if a else 'sync'}" for p, c, a in PROMPT_CASES],
)
def test_input_token_weight_0_decides_exactly_as_without_it(policy, chunked, async_):
    """With limits that are hit, ``input_token_weight: 0`` changes no decision."""
    @settings(
        max_examples=8,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(workloads(policy, chunked))
    def check(workload):
        without = trace(workload, HIT, async_)
        with_zero = trace(workload, {**HIT, "input_token_weight": 0}, async_)
        difference = first_difference(without, with_zero)
        assert difference is None, difference

    check()


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_an_input_token_weight_never_reached_decides_like_stock(chunked):
    """Prompt cost at weight 0.5 with a quota it never exhausts: stock decisions."""
    @settings(
        max_examples=8,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(workloads("fcfs", chunked))
    def check(workload):
        stock = trace(workload, None, False)
        ours = trace(workload, {**NEVER_HIT, "input_token_weight": 0.5}, False)
        difference = first_difference(stock, ours)
        assert difference is None, difference

    check()
