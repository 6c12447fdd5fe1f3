"""``min_stream_tokens_per_second``: the minimum pace per resident stream
(issue 32), top-level and per user, validated like a rate (0: the
residency cap off), reloaded with the limits file, and built by the factory."""

from __future__ import annotations

import json

import pytest

from vllm_output_rate.factory import make_residency, update_residency
from vllm_output_rate.policy.residency import DEFAULT_MIN_STREAM_TOKENS_PER_SECOND
from vllm_output_rate.settings import (
    MIN_PACE_KEY,
    OutputRateConfigError,
    OutputRateSettings,
    load_limits_file,
)


def parse(**section):
    return OutputRateSettings.from_additional_config({"output_rate": section})


def test_default_pace_and_caps():
    s = parse(default_user_output_tokens_per_second=4)
    assert s.min_stream_tokens_per_second == DEFAULT_MIN_STREAM_TOKENS_PER_SECOND == 2.0
    assert s.min_pace_of("anyone") == 2.0
    assert MIN_PACE_KEY not in s.to_config()  # the default is not written
    assert make_residency(s).cap("anyone") == 2  # floor(4 / 2)


def test_top_level_and_per_user_paces():
    s = parse(
        default_user_output_tokens_per_second=10,
        min_stream_tokens_per_second=1,
        user_output_tokens_per_second={
            "a": {"rate": 10, "min_stream_tokens_per_second": 5},
            "b": {"rate": 10, "ceil": 40},  # a borrower counts its ceiling
            "c": {"rate": 10, "ceil": None},  # no ceiling: no cap
            "d": {"rate": 10, "min_stream_tokens_per_second": 0},  # off for d
            "e": 3,
        },
    )
    assert s.min_pace_of("a") == 5 and s.min_pace_of("e") == 1
    residency = make_residency(s)
    assert residency.cap("a") == 2
    assert residency.cap("b") == 40
    assert residency.cap("c") is None
    assert residency.cap("d") is None
    assert residency.cap("e") == 3
    assert residency.cap("other") == 10
    # The config form round-trips.
    again = OutputRateSettings.from_additional_config({"output_rate": s.to_config()})
    assert again == s


@pytest.mark.parametrize(
    "value, problem",
    [
        (-1, "positive"),
        ("2", "must be a number"),
        (True, "must be a number"),
        (float("nan"), "NaN"),
        (float("inf"), "finite"),
        (10**400, "too large"),
        (1e12, "between"),
        ([2], "must be a number"),
    ],
)
def test_bad_paces_are_refused_naming_the_key(value, problem):
    with pytest.raises(OutputRateConfigError) as top:
        parse(default_user_output_tokens_per_second=4, min_stream_tokens_per_second=value)
    assert MIN_PACE_KEY in str(top.value) and problem in str(top.value)
    with pytest.raises(OutputRateConfigError) as user:
        parse(
            default_user_output_tokens_per_second=4,
            user_output_tokens_per_second={"a": {"rate": 4, MIN_PACE_KEY: value}},
        )
    assert "'a'" in str(user.value) and MIN_PACE_KEY in str(user.value)


def test_a_group_or_the_default_entry_has_no_pace_of_its_own():
    with pytest.raises(OutputRateConfigError, match="unknown keys"):
        parse(default_user_output_tokens_per_second={"rate": 4, MIN_PACE_KEY: 1})
    with pytest.raises(OutputRateConfigError):
        parse(
            default_user_output_tokens_per_second=4,
            groups={"g": {"rate": 10, MIN_PACE_KEY: 1}},
        )


def test_limits_file_pace_is_reloaded_and_a_file_without_it_keeps_the_flags(tmp_path):
    path = tmp_path / "limits.json"
    path.write_text(json.dumps({
        "default_user_output_tokens_per_second": 8,
        "user_output_tokens_per_second": {"a": {"rate": 8, MIN_PACE_KEY: 4}},
        MIN_PACE_KEY: 1,
    }))
    s = load_limits_file(str(path))
    assert s.min_stream_tokens_per_second == 1 and s.min_pace_of("a") == 4
    started = parse(limits_file=str(path), min_stream_tokens_per_second=0.5)
    assert started.min_stream_tokens_per_second == 1  # the file wins
    residency = make_residency(started)
    assert residency.cap("a") == 2 and residency.cap("x") == 8
    path.write_text(json.dumps({"default_user_output_tokens_per_second": 8}))
    reloaded = load_limits_file(str(path), 0.0, 0.5)  # the section's pace
    assert reloaded.min_stream_tokens_per_second == 0.5
    update_residency(residency, reloaded)
    assert residency.cap("a") == 16 and residency.cap("x") == 16
    path.write_text(json.dumps({"default_user_output_tokens_per_second": 8, MIN_PACE_KEY: "x"}))
    with pytest.raises(OutputRateConfigError, match=MIN_PACE_KEY):
        load_limits_file(str(path))


def test_the_flag_sets_everybodys_default_pace(operate_parser):
    from vllm_output_rate.adapter.options import merge_operate_args
    from vllm_output_rate.settings import MIN_PACE_FLAG

    args = operate_parser().parse_args([MIN_PACE_FLAG, "0.5"])
    assert args.output_rate_min_stream_tokens_per_second == 0.5
    assert operate_parser().parse_args([f"{MIN_PACE_FLAG}=0"]).output_rate_min_stream_tokens_per_second == 0
    for bad in ("-1", "lots", "nan", "inf"):
        with pytest.raises((SystemExit, Exception)):
            operate_parser().parse_args([MIN_PACE_FLAG, bad])
    with pytest.raises(OutputRateConfigError, match="needs the feature on"):
        merge_operate_args(args, None)
