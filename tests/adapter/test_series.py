"""The installed series' object (``adapter/series.py``) states facts about the installed vLLM.

Each field of :class:`VllmSeries` is checked against the vLLM that is
installed, by behaviour where it is cheap (the stock scheduler, no model).
A new series whose object copies a wrong fact fails here.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from vllm_output_rate.adapter import compat
from vllm_output_rate.adapter.series import SERIES, VllmSeries
from vllm_output_rate_harness.scheduler_sim import Harness

SERIES_OBJ = compat.installed_series()


def test_installed_series_is_one_of_the_supported():
    assert SERIES_OBJ in SERIES.values()
    assert compat.installed_vllm_version().startswith(SERIES_OBJ.name + ".")


def test_series_objects_are_complete_and_distinct():
    keys = list(SERIES)
    assert keys == sorted(keys)
    for key, series in SERIES.items():
        assert isinstance(series, VllmSeries) and series.key == key
    # Two series with identical facts would mean a missing difference.
    facts = [tuple(vars(s)[f] for f in vars(s) if f not in ("major", "minor")) for s in SERIES.values()]
    assert len(set(facts)) == len(facts)


def test_cli_args_module_has_the_serve_parser():
    module = importlib.import_module(SERIES_OBJ.cli_args_module)
    assert callable(module.make_arg_parser)
    for other in SERIES.values():
        if other.cli_args_module != SERIES_OBJ.cli_args_module:
            assert importlib.util.find_spec(other.cli_args_module) is None, other.name


def test_engine_watchdog_fact():
    has_module = importlib.util.find_spec("vllm.utils.watch_dog") is not None
    assert SERIES_OBJ.engine_watchdog == has_module
    guard = SERIES_OBJ.idle_wait_guard()
    with guard:
        if has_module:
            from vllm.utils.watch_dog import get_watch_dog

            assert get_watch_dog() is not None


def test_waiting_loop_skip_fact():
    """Stock scheduler: a waiting request for which no token can be scheduled
    either stops admission (0.32) or is passed over for the next one (0.33)."""
    h = Harness(None)
    blocked = h.add(None, prompt_len=8, max_tokens=4)
    behind = h.add(None, prompt_len=8, max_tokens=4)
    stock = h.sched._reserve_prefill_lookahead

    def lookahead(request, num_computed_tokens, num_new_tokens):
        if request is blocked:
            return 0
        return stock(request, num_computed_tokens, num_new_tokens)

    h.sched._reserve_prefill_lookahead = lookahead
    out = h.step()
    assert blocked.request_id not in out.num_scheduled_tokens
    skipped = behind.request_id in out.num_scheduled_tokens
    assert SERIES_OBJ.waiting_loop_skips_unschedulable == skipped, (
        f"vLLM {SERIES_OBJ.name}: the waiting loop "
        + ("skips" if skipped else "stops at") + " an unschedulable request"
    )


@pytest.mark.parametrize("series", list(SERIES.values()), ids=lambda s: s.name)
def test_version_maps_to_its_series(series):
    assert compat.series_of(f"{series.name}.2") is series
    assert compat.series_of(f"{series.name}.0+cpu") is series
