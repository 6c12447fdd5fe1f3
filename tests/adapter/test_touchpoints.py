"""The table of vLLM members the adapter relies on, checked against the installed vLLM.

One test per row of ``touchpoints.TOUCHPOINTS`` for the installed series: a
vLLM upgrade that removes, renames or re-signs a member fails exactly the
row's test, with a message naming the member and the series.  Two guards
keep the table complete: every vLLM method the scheduler subclasses override
and every vLLM member the plugin's patches replaced must have a row.

Imports vLLM but builds no engine: seconds on both series.
"""

from __future__ import annotations

import inspect
import sys

import pytest

import vllm_output_rate
from vllm_output_rate.adapter import compat, touchpoints
from vllm_output_rate.adapter.series import SERIES
from vllm_output_rate.adapter.touchpoints import TOUCHPOINTS, TouchPoint, check, problems

vllm_output_rate.register()  # patches installed, as vLLM's plugin loader does

SERIES_NAME = compat.installed_series().name
ROWS = touchpoints.for_series(SERIES_NAME)


@pytest.mark.parametrize("tp", ROWS, ids=[f"{tp.name}[{tp.kind}]" for tp in ROWS])
def test_touchpoint_holds(tp: TouchPoint):
    why = check(tp)
    assert why is None, f"vLLM {SERIES_NAME}: {tp.name} ({tp.kind}) {why}; used for: {tp.use}"


def test_every_series_has_rows_and_every_row_a_known_series():
    for series in SERIES.values():
        assert len(touchpoints.for_series(series.name)) > 50, series.name
    for tp in TOUCHPOINTS:
        assert tp.series and set(tp.series) <= {s.name for s in SERIES.values()}, tp


# -- the check reports what broke, naming member and series ---------------------------


def test_removed_method_is_reported_with_member_and_series(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.delattr(Scheduler, "_ec_transfer_pending")
    lines = problems(SERIES_NAME)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"vLLM {SERIES_NAME}: Scheduler._ec_transfer_pending (method)")
    assert "does not exist" in lines[0]


def test_changed_signature_is_reported(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    def _preempt_request(self, request):  # lost its timestamp parameter
        pass

    monkeypatch.setattr(Scheduler, "_preempt_request", _preempt_request)
    lines = problems(SERIES_NAME)
    assert len(lines) == 1, lines
    assert "Scheduler._preempt_request" in lines[0] and f"vLLM {SERIES_NAME}" in lines[0]
    assert "has parameters (request), expected (request, timestamp, drop_stale_output)" in lines[0]


def test_removed_module_function_is_reported(monkeypatch):
    import vllm.v1.core.sched.utils as utils

    monkeypatch.delattr(utils, "remove_all")
    lines = problems(SERIES_NAME)
    assert [line.split(" (")[0] for line in lines] == [f"vLLM {SERIES_NAME}: vllm.v1.core.sched.utils.remove_all"]


def test_instance_attribute_no_longer_assigned_is_reported(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler

    real = touchpoints._class_sources

    def sources(cls):
        text = real(cls)
        if cls is Scheduler:
            text = text.replace("self.num_waiting_for_streaming_input", "self.renamed_counter")
        return text

    monkeypatch.setattr(touchpoints, "_class_sources", sources)
    lines = problems(SERIES_NAME)
    assert len(lines) == 1, lines
    assert "Scheduler.num_waiting_for_streaming_input (instance attribute)" in lines[0]


def test_kind_change_is_reported(monkeypatch):
    from vllm.v1.request import Request

    monkeypatch.setattr(Request, "num_tokens", 3)  # a property became a plain attribute
    lines = problems(SERIES_NAME)
    assert len(lines) == 1 and "Request.num_tokens (property) is int, not a property" in lines[0]


def test_a_row_for_another_series_is_not_checked_here():
    other = [tp for tp in TOUCHPOINTS if SERIES_NAME not in tp.series]
    assert other, "each series has rows of its own (e.g. the cli_args module)"
    assert all(tp not in ROWS for tp in other)
    # ... and those rows do fail here: the table really is per series.
    assert all(check(tp) is not None for tp in other), [tp.name for tp in other if check(tp) is None]


# -- completeness ------------------------------------------------------------------------


def _rows_for(where: str) -> set[str]:
    return {tp.member for tp in ROWS if tp.where == where}


def test_every_vllm_method_the_schedulers_override_is_in_the_table():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_output_rate.adapter import scheduler as ours

    listed = _rows_for(touchpoints.SCHED) | _rows_for(touchpoints.ASYNC_SCHED)
    missing = []
    for cls in (ours.OutputRateScheduler, ours.OutputRateAsyncScheduler):
        for klass in cls.__mro__:
            if not klass.__module__.startswith("vllm_output_rate"):
                continue
            for name in vars(klass):
                if name.startswith(("__", "_abc_")):
                    continue
                if hasattr(Scheduler, name) or hasattr(AsyncScheduler, name):
                    if name not in listed:
                        missing.append(f"{klass.__name__}.{name}")
    assert not missing, f"vLLM members overridden but not in touchpoints.TOUCHPOINTS: {missing}"


def test_every_patched_vllm_member_is_in_the_table():
    """Whatever the plugin's patches replaced on a vLLM class has a row."""
    listed = {(tp.where, tp.member) for tp in ROWS}
    patched = []
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("vllm.") or module is None:
            continue
        for cls_name, cls in list(vars(module).items()):
            if not inspect.isclass(cls) or cls.__module__ != module_name:
                continue
            for name, raw in list(vars(cls).items()):
                func = getattr(raw, "__func__", raw)
                if getattr(func, "_vllm_output_rate_patch", False):
                    patched.append((f"{module_name}:{cls_name}", name))
    assert patched, "register() installed no patch?"
    missing = [f"{w}.{m}" for w, m in patched if (w, m) not in listed]
    assert not missing, f"patched but not in touchpoints.TOUCHPOINTS: {missing}"
