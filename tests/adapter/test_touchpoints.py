"""The table of vLLM members the adapter relies on, checked against the installed vLLM.

One test per row of ``touchpoints.TOUCHPOINTS`` for the installed series: a
vLLM upgrade that removes, renames or re-signs a member fails exactly the
row's test, with a message naming the member and the series.  Two guards
keep the table complete: every vLLM method the scheduler subclasses override
and every vLLM member the plugin's patches changed must have a row.  Every
patch of the registry (``patches.PATCHES``) names the rows it relies on, and
every member the plugin changed is named by a patch.

Imports vLLM but builds no engine: seconds on both series.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys

import pytest

import vllm_output_rate
from vllm_output_rate.adapter import compat, touchpoints
from vllm_output_rate.adapter.install import field_is_ours, is_ours
from vllm_output_rate.adapter.patches import PATCHES
from vllm_output_rate.adapter.series import SERIES
from vllm_output_rate.adapter.touchpoints import (
    TOUCHPOINTS,
    TouchPoint,
    check,
    problems,
    problems_of,
)

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
    from vllm_output_rate.adapter import shadow

    listed = _rows_for(touchpoints.SCHED) | _rows_for(touchpoints.ASYNC_SCHED)
    missing = []
    for cls in (ours.OutputRateScheduler, ours.OutputRateAsyncScheduler,
                shadow.ShadowScheduler, shadow.ShadowAsyncScheduler):
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


def _changed_vllm_members() -> list[tuple[str, str]]:
    """(where, member) of every class member and dataclass field the plugin installed."""
    changed = []
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("vllm.") or module is None:
            continue
        for cls_name, cls in list(vars(module).items()):
            if not inspect.isclass(cls) or cls.__module__ != module_name:
                continue
            where = f"{module_name}:{cls_name}"
            for name, raw in list(vars(cls).items()):
                if is_ours(raw):
                    changed.append((where, name))
            for name in list(getattr(cls, "__dataclass_fields__", {})):
                if field_is_ours(cls, name) and (where, name) not in changed:
                    changed.append((where, name))
    return changed


def test_every_patched_vllm_member_is_in_the_table():
    """Whatever the plugin's patches changed on a vLLM class has a row."""
    listed = {(tp.where, tp.member) for tp in ROWS}
    changed = _changed_vllm_members()
    assert changed, "register() installed no patch?"
    missing = [f"{w}.{m}" for w, m in changed if (w, m) not in listed]
    assert not missing, f"patched but not in touchpoints.TOUCHPOINTS: {missing}"


# -- the registry ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PATCHES))
def test_patch_relies_only_on_rows_that_hold(name):
    patch = PATCHES[name]
    assert patch.name == name and patch.changes and patch.why and patch.relies_on
    assert problems_of(patch.relies_on, SERIES_NAME) == []


def test_every_changed_member_is_named_by_a_patch():
    """No change to vLLM outside the registry: each one is some patch's touch-point."""
    by_name = {tp.name: tp for tp in ROWS}
    named = {
        (by_name[n].where, by_name[n].member)
        for patch in PATCHES.values() if SERIES_NAME in patch.series
        for n in patch.relies_on if n in by_name
    }
    changed = _changed_vllm_members()
    assert changed
    loose = [f"{w}.{m}" for w, m in changed if (w, m) not in named]
    assert not loose, f"changed but named by no patch in patches.PATCHES: {loose}"


def test_apply_all_installs_only_the_patches_of_the_installed_series(monkeypatch):
    from vllm_output_rate.adapter import patches

    installed: list[str] = []

    def entry(name, series):
        return patches.Patch(name, "changes", "why", ("EngineArgs.add_cli_args",),
                             lambda: installed.append(name), series=series)

    monkeypatch.setattr(patches, "PATCHES", {
        "here": entry("here", (SERIES_NAME,)),
        "elsewhere": entry("elsewhere", ("0.1",)),
    })
    patches.apply_all()
    assert installed == ["here"]


def test_a_patch_that_cannot_install_is_named(monkeypatch):
    from vllm_output_rate.adapter import patches

    def broken():
        raise AttributeError("no such member")

    monkeypatch.setattr(patches, "PATCHES", {
        "broken": patches.Patch("broken", "changes", "why", (), broken),
    })
    with pytest.raises(RuntimeError, match="cannot install patch 'broken'.*no such member"):
        patches.apply_all()


def test_unknown_row_name_is_reported():
    assert problems_of(["EngineArgs.no_such_member"], SERIES_NAME) == [
        "EngineArgs.no_such_member: no row in touchpoints.TOUCHPOINTS"
    ]


def test_rows_of_another_series_are_not_relied_on_here():
    other = next(tp for tp in TOUCHPOINTS if SERIES_NAME not in tp.series)
    if any(tp.name == other.name and SERIES_NAME in tp.series for tp in TOUCHPOINTS):
        pytest.skip("that member has a row for this series too")
    assert problems_of([other.name], SERIES_NAME) == []


def test_a_name_vllm_starts_using_is_reported(monkeypatch):
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.metrics.stats import SchedulerStats

    monkeypatch.setattr(EngineCore, "output_rate_users", lambda self: None)
    lines = problems_of(["EngineCore.output_rate_users"], SERIES_NAME)
    assert len(lines) == 1 and "is already defined in this vLLM" in lines[0], lines

    spec = SchedulerStats.__dataclass_fields__["output_rate"]
    monkeypatch.setitem(SchedulerStats.__dataclass_fields__, "output_rate", _unmarked_copy(spec))
    lines = problems_of(["SchedulerStats.output_rate"], SERIES_NAME)
    assert len(lines) == 1 and "is already a field in this vLLM" in lines[0], lines


def _unmarked_copy(spec):
    """The same field as vLLM itself would declare it (no plugin mark)."""
    copy = dataclasses.field(default=spec.default)
    copy.name, copy.type, copy._field_type = spec.name, spec.type, spec._field_type
    return copy


def test_admin_plugin_matches_vllm_endpoint_plugin_rows():
    """The endpoint plugin implements vLLM's protocol with the signatures the rows check."""
    from vllm_output_rate.adapter.admin import OutputRateAdminPlugin

    rows = [tp for tp in ROWS if tp.where.endswith(":EndpointPlugin")]
    assert {tp.member for tp in rows} == {"attach_router", "init_state"}
    for tp in rows:
        ours = inspect.signature(getattr(OutputRateAdminPlugin, tp.member))
        assert tuple(ours.parameters)[1:] == tp.params, tp.member


# -- the install primitives every patch uses (adapter/install.py) ------------------------


def test_wrap_is_idempotent_keeps_the_kind_and_the_original():
    from vllm_output_rate.adapter.install import unwrap, wrap

    class Owner:
        def method(self, x):
            return x

        @staticmethod
        def static(x):
            return x

        @classmethod
        def klass(cls, x):
            return x

    def plus_one(original):
        def replacement(*args):
            return original(*args) + 1

        return replacement

    originals = {name: Owner.__dict__[name] for name in ("method", "static", "klass")}
    for _ in range(2):  # a second install changes nothing
        for name in originals:
            wrap(Owner, name, plus_one)
    assert (Owner().method(1), Owner.static(1), Owner.klass(1)) == (2, 2, 2)
    assert isinstance(Owner.__dict__["static"], staticmethod)
    assert isinstance(Owner.__dict__["klass"], classmethod)
    assert unwrap(Owner.__dict__["method"]) is originals["method"]
    assert all(is_ours(Owner.__dict__[name]) for name in originals)


def test_added_members_never_shadow_vllms_own():
    from vllm_output_rate.adapter.install import add_field, add_method

    @dataclasses.dataclass
    class Stats:
        taken: int = 0

        def used(self):
            return 1

    def extra(self):
        return "ours"

    add_method(Stats, "extra", extra)
    add_method(Stats, "extra", extra)  # once
    assert Stats().extra() == "ours" and is_ours(Stats.extra)
    with pytest.raises(RuntimeError, match="Stats.used already exists"):
        add_method(Stats, "used", extra)

    add_field(Stats, "report", dict | None, None)
    add_field(Stats, "report", dict | None, None)  # once
    assert Stats().report is None and field_is_ours(Stats, "report")
    assert [f.name for f in dataclasses.fields(Stats)] == ["taken", "report"]
    with pytest.raises(RuntimeError, match="Stats.taken is already a field"):
        add_field(Stats, "taken", int, 0)
