"""The plugin's scheduler object stays small and never rewires itself.

Issue 31: the scheduler keeps at most 25 attributes of its own (beyond
stock vLLM's), and no method replaces another at run time -- every feature
is an object assembled at start or on a reload (``configure``), and what a
step decides lives in one per-step object, dropped when the step ends.
Driven here with every feature on at once (borrowing, groups, prompt cost,
drafts, a reload), so an attribute that only one feature adds is counted.
"""

from __future__ import annotations

import inspect

import pytest
from vllm_output_rate_harness.scheduler_sim import Harness

from vllm_output_rate.settings import OutputRateSettings

MAX_OWN_ATTRIBUTES = 25
#: Clocks the class declares for tests to replace (the harness sets a fake one).
INJECTED = {"output_rate_clock", "output_rate_operate_clock"}

EVERY_FEATURE = {
    "default_user_output_tokens_per_second": 50,
    "user_output_tokens_per_second": {
        "borrower": {"rate": 5, "ceil": None, "weight": 2},
        "capped": 10,
        "member": {"rate": 20, "group": "team"},
        "other": {"rate": 20, "group": "team"},
    },
    "groups": {"team": {"rate": 30, "ceil": 60}},
    "input_token_weight": 0.5,
    "min_stream_tokens_per_second": 2,
}


def _drive(h: Harness, steps: int) -> None:
    for i in range(steps):
        if i % 5 == 0:
            for user in ("borrower", "capped", "member", "other", None):
                h.add(user, prompt_len=40, max_tokens=12)
        h.step()


def _own_attributes(sched, stock) -> set[str]:
    return set(vars(sched)) - set(vars(stock))


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_the_scheduler_keeps_few_attributes_and_swaps_no_method(async_):
    stock = Harness(None, async_=async_, spec_tokens=2).sched
    h = Harness(EVERY_FEATURE, async_=async_, spec_tokens=2, num_blocks=200)
    sched = h.sched
    at_start = _own_attributes(sched, stock)
    _drive(h, 40)
    # A reload assembles the features again, in place.
    reloaded = dict(EVERY_FEATURE, input_token_weight=0, default_user_output_tokens_per_second=5)
    sched.apply_output_rate_limits(OutputRateSettings.from_additional_config({"output_rate": reloaded}))
    _drive(h, 40)
    own = _own_attributes(sched, stock)
    assert len(own) <= MAX_OWN_ATTRIBUTES, sorted(own)
    # Nothing appears at run time: every attribute is set when the object is built.
    assert own == at_start, sorted(own ^ at_start)
    # No method swapped for another: no instance attribute holds a bound
    # method of the scheduler, or shadows one of its class's methods.
    for name, value in vars(sched).items():
        assert not (inspect.ismethod(value) and value.__self__ is sched), name
        if name in own and name not in INJECTED:
            assert not callable(getattr(type(sched), name, None)), name
    assert sched._step is None  # what a step decided is dropped when it ends


def test_the_async_scheduler_keeps_vllms_own_lookahead_hook():
    """The charging hook calls vLLM's ``Scheduler._reserve_prefill_lookahead``
    directly for both scheduler classes (it runs for every scheduled request):
    a vLLM whose AsyncScheduler overrides it must fail here, not schedule wrong."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    assert AsyncScheduler._reserve_prefill_lookahead is Scheduler._reserve_prefill_lookahead
