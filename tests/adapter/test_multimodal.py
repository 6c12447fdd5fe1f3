"""Multimodal requests with per-user limits, on vLLM's real scheduler.

Output tokens are charged as for text; what a multimodal request adds is
its encoder inputs: vLLM computes an item's encoder output in the step whose
chunk reaches the item (within a per-step encoder budget), keeps it in the
encoder cache while the request references it, and frees the reference once
the request's computed tokens have passed the item.  Requests hidden for
lack of quota must neither hold that cache (from others) nor lose it (a
chunk reaching an item whose output is neither cached nor scheduled).

The harness gives the tiny model's scheduler an encoder cache and budget
(as vLLM sizes them for a vision-language model) and requests with image
placeholders (``MultiModalFeatureSpec`` / ``PlaceholderRange``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_workloads import (
    LIMITS, assert_every_request_complete, assert_every_user_within_its_bound, engine_shapes, run_arrivals,
)
from vllm_output_rate_harness.scheduler_sim import MS, Harness, max_in_window

SLOW = {"default_user_output_tokens_per_second": 1000, "user_output_tokens_per_second": {"slow": 1}}
ITEM = 32  # embeddings per image
# The residency cap off (issue 32): these tests keep several requests of a
# 1 tok/s user resident, to check what a throttled resident request holds.
SLOW_RESIDENT = SLOW | {"min_stream_tokens_per_second": 0}


def _held_by(h: Harness, request) -> set[int]:
    return set(h.sched.encoder_cache_manager.get_cached_input_ids(request))


def _checked(h: Harness) -> Harness:
    """Check every step's output as ``schedule()`` returns it (before the
    harness feeds model output back, which frees consumed items)."""
    schedule = h.sched.schedule

    def schedule_and_check(*args, **kwargs):
        out = schedule(*args, **kwargs)
        _check_output(h, out)
        return out

    h.sched.schedule = schedule_and_check  # this scheduler object only
    return h


def _check_output(h: Harness, out) -> None:
    """Nothing lost: every item a scheduled chunk reaches is cached for its request
    or computed in this step; the encoder budget per step is respected."""
    manager = h.sched.encoder_cache_manager
    computed_now = 0
    for rid, n in out.num_scheduled_tokens.items():
        request = h.sched.requests.get(rid)
        if request is None or not request.mm_features:
            continue
        scheduled = set(out.scheduled_encoder_inputs.get(rid, ()))
        computed_now += sum(request.mm_features[i].mm_position.length for i in scheduled)
        start = request.num_computed_tokens - n  # advanced by schedule() already
        end = start + n
        for i, feature in enumerate(request.mm_features):
            lo = feature.mm_position.offset
            hi = lo + feature.mm_position.length
            if lo < end and start < hi:  # the chunk reaches this item
                cached = rid in manager.cached.get(feature.identifier, ())
                assert i in scheduled or cached, (rid, i, start, end)
    assert computed_now <= h.sched.max_num_encoder_input_tokens


def _step(h: Harness, dt_ns: int = 10 * MS):
    out = h.step(dt_ns)
    h.check_resident_consistent()
    return out


def _assert_nothing_lost(h: Harness) -> None:
    assert_every_request_complete(h)
    manager = h.sched.encoder_cache_manager
    assert not any(manager.cached.values())  # no reference left
    assert manager.num_freeable_slots == manager.cache_size


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_throttled_image_requests_hold_no_encoder_cache(async_):
    """The cache holds one image.  A throttled user's three image requests
    are prefilled and then wait for quota at 1 tok/s, hidden most of the
    time; meanwhile another user's image requests (different images) each
    get the cache in turn."""
    h = _checked(Harness(SLOW_RESIDENT, async_=async_, encoder_cache_size=ITEM,
                         max_num_batched_tokens=256))
    slow = [h.add("slow", prompt_len=48, max_tokens=3, images=[(8, ITEM, f"slow-{i}")])
            for i in range(3)]
    for _ in range(6):
        _step(h)
    # Prefilled (images included) at least up to the sampling position, then
    # throttled: the first one decodes at 1 tok/s, the others wait for their first.
    assert all(r.num_computed_tokens >= r.num_prompt_tokens - 1 for r in slow)
    assert all(_held_by(h, r) == set() for r in slow)
    fast = [h.add("fast", prompt_len=48, max_tokens=5, images=[(8, ITEM, f"fast-{i}")])
            for i in range(3)]
    for _ in range(40):
        _step(h)
    assert all(h.records[r.request_id].finished for r in fast)
    assert not any(h.records[r.request_id].finished for r in slow)  # still at 1 tok/s
    h.run_until_done(dt_ns=100 * MS)
    _assert_nothing_lost(h)
    assert max_in_window(h.charges["slow"], 1_000 * MS) <= (1 + 0.1) * 1 + 1


def test_prompt_ending_in_an_image_is_not_split_when_chunking_it_is_off():
    """--disable-chunked-mm-input, prompt ending with an image, user out of
    quota: the chunk stops before the image instead of one short of the
    prompt's end (inside the image); the image's encoder output waits in
    the cache."""
    h = _checked(Harness(SLOW_RESIDENT, chunked=True, encoder_cache_size=ITEM,
                         disable_chunked_mm_input=True, max_num_batched_tokens=256))
    h.add("slow", prompt_len=8, max_tokens=2)
    h.step()  # "slow" spends its burst
    request = h.add("slow", prompt_len=40, max_tokens=2, images=[(8, ITEM, "tail")])
    out = _step(h)
    assert out.num_scheduled_tokens.get(request.request_id) == 8  # up to the image
    # vLLM chose the step's encoder inputs before the charge cut the chunk:
    # the image is computed now and stays cached for the request (held, not
    # lost) until its user can pay for the chunk that reads it.
    assert _held_by(h, request) == {0}
    for _ in range(5):
        out = _step(h)
        assert request.request_id not in out.num_scheduled_tokens
        assert _held_by(h, request) == {0}
    h.run_until_done(dt_ns=100 * MS)
    _assert_nothing_lost(h)


@st.composite
def mm_workloads(draw):
    arrivals = []
    for _ in range(draw(st.integers(2, 9))):
        prompt_len = draw(st.integers(ITEM + 2, 3 * ITEM))
        offset = draw(st.integers(0, prompt_len - ITEM))
        arrivals.append((
            draw(st.integers(0, 30)),  # step
            draw(st.sampled_from(["slow", "a", "b"])),
            prompt_len,
            draw(st.integers(1, 10)),  # max tokens
            [(offset, ITEM, f"img-{draw(st.integers(0, 4))}")] if draw(st.booleans()) else [],
        ))
    cache_items = draw(st.integers(1, 3))
    engine = draw(engine_shapes())
    whole_items = draw(st.booleans())
    # Whole items need a token budget that holds one: vLLM 0.33 (stock too)
    # never schedules an image wider than the budget when items are whole.
    budget = draw(st.sampled_from([48, 128] if whole_items else [16, 48, 128]))
    return {
        "cache_items": cache_items,
        "engine": engine,
        "budget": budget,
        "whole_items": whole_items,
        "arrivals": sorted(arrivals, key=lambda a: a[0]),
    }


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mm_workloads())
def test_binding_limits_with_images_keep_every_bound(w):
    """Random image requests (shared images too), users (one at 2 tok/s, two
    at 50), encoder caches of 1-3 images, token budgets below an image:
    every chunk finds its items, every request ends complete, each user's
    charges stay within the bound and the cache is empty at the end."""
    chunked = w["engine"]["chunked"]
    budget = w["budget"] if chunked else 3 * ITEM + 16  # whole prompts need room
    h = _checked(Harness(
        LIMITS, max_num_batched_tokens=budget, max_model_len=budget if not chunked else 1024,
        encoder_cache_size=w["cache_items"] * ITEM, disable_chunked_mm_input=w["whole_items"], **w["engine"],
    ))
    run_arrivals(h, w["arrivals"], lambda h: _step(h, 20 * MS), feature="images")
    _assert_nothing_lost(h)
    assert_every_user_within_its_bound(h)
