"""``burst_seconds``: how far every quota may run ahead of its rate (issue 44:
on a GPU a step of 1,024 running requests is longer than the 0.1 s default,
and a capped user lost (step - burst) x its limit in each).  Startup only,
validated like the other numbers, and built into every quota by the factory."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from vllm_output_rate.adapter.options import merge_operate_args
from vllm_output_rate.factory import make_borrowing, make_group_quotas, make_limiter
from vllm_output_rate.policy.gcra import DEFAULT_BURST_NS, NS_PER_S
from vllm_output_rate.settings import (
    BURST_FLAG,
    BURST_KEY,
    DEFAULT_BURST_SECONDS,
    LIMITS_FILE_KEY,
    OutputRateConfigError,
    OutputRateSettings,
    load_limits_file,
)

S = NS_PER_S


def parse(**section) -> OutputRateSettings:
    return OutputRateSettings.from_additional_config({"output_rate": section})


def greedy_take(limiter, user: str, now_ns: int) -> int:
    """Everything ``user`` can take at ``now_ns`` from a fresh quota."""
    return limiter.take_up_to(user, now_ns, 10**6)


def test_the_default_is_the_documented_100_ms_and_is_not_written():
    s = parse(default_user_output_tokens_per_second=10)
    assert s.burst_seconds == DEFAULT_BURST_SECONDS == 0.1
    assert s.burst_ns == DEFAULT_BURST_NS
    assert BURST_KEY not in s.to_config()


def test_a_burst_is_what_every_quota_the_factory_builds_holds():
    """Rate 10: a fresh quota holds burst x 10 + 1 tokens (GCRA's bound at
    W = 0), for the user's rate, its ceiling and its group alike."""
    s = parse(
        default_user_output_tokens_per_second=10,
        user_output_tokens_per_second={"b": {"rate": 10, "ceil": 20, "weight": 1, "group": "g"}},
        groups={"g": 10},
        burst_seconds=0.3,
    )
    assert s.burst_ns == 300_000_000
    assert s.to_config()[BURST_KEY] == 0.3
    assert greedy_take(make_limiter(s), "anyone", 5 * S) == 4  # 0.3 x 10 + 1
    groups = make_group_quotas(s)
    borrowing, _ = make_borrowing(s, make_limiter(s), None, groups)
    assert greedy_take(groups.rate, "g", 5 * S) == 4
    assert greedy_take(borrowing.ceiling, "b", 5 * S) == 7  # 0.3 x 20 + 1
    default = parse(default_user_output_tokens_per_second=10)
    assert greedy_take(make_limiter(default), "anyone", 5 * S) == 2  # 0.1 x 10 + 1


def test_a_backlogged_user_gets_its_limit_through_steps_longer_than_the_default_burst():
    """Steps of 0.25 s, rate 40, one greedy take per step, 40 steps (10 s):
    with the default burst each take gets 0.1 x 40 + 1 = 5 tokens (20 tok/s,
    half the limit); a burst of 0.3 s covers the step and gives the limit,
    within the bound (10 s + 0.3 s) x 40 + 1."""
    def taken_in_10_s(section: dict) -> int:
        limiter = make_limiter(parse(default_user_output_tokens_per_second=40, **section))
        return sum(greedy_take(limiter, "u", 10 * S + i * S // 4) for i in range(40))

    assert taken_in_10_s({}) == 40 * 5
    assert 400 <= taken_in_10_s({BURST_KEY: 0.3}) <= (10 + 0.3) * 40 + 1


@pytest.mark.parametrize("bad", [0, -1, 0.0005, 61, float("nan"), float("inf"), True, "x", None, [1]])
def test_a_bad_burst_is_refused_in_one_line_naming_the_key(bad):
    with pytest.raises(OutputRateConfigError) as exc:
        parse(default_user_output_tokens_per_second=10, burst_seconds=bad)
    message = str(exc.value)
    assert "\n" not in message and BURST_KEY in message and "seconds" in message


def test_a_limits_file_keeps_the_startup_burst_and_may_not_set_one(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({"default_user_output_tokens_per_second": 8}))
    s = parse(**{LIMITS_FILE_KEY: str(path), BURST_KEY: 0.25})
    assert s.burst_seconds == 0.25 and s.default_rate == 8
    path.write_text(json.dumps({"default_user_output_tokens_per_second": 8, BURST_KEY: 1}))
    with pytest.raises(OutputRateConfigError, match=BURST_KEY):
        load_limits_file(str(path))
    # A reload replaces the limits and keeps the rest (the adapter's
    # apply_output_rate_limits does dataclasses.replace on the running settings).
    assert dataclasses.replace(s, default_rate=4).burst_seconds == 0.25


def test_the_flag_goes_into_the_section_and_needs_the_feature_on(operate_parser):
    args = operate_parser().parse_args([BURST_FLAG, "0.3"])
    assert args.output_rate_burst_seconds == 0.3
    section = merge_operate_args(args, {"default_user_output_tokens_per_second": 10})
    assert section[BURST_KEY] == 0.3
    assert OutputRateSettings.from_additional_config({"output_rate": section}).burst_ns == 300_000_000
    for bad in ("0", "-1", "lots", "nan", "inf", "120"):
        with pytest.raises((SystemExit, argparse.ArgumentError, argparse.ArgumentTypeError)):
            operate_parser().parse_args([BURST_FLAG, bad])
    with pytest.raises(OutputRateConfigError, match="needs the feature on"):
        merge_operate_args(args, None)
