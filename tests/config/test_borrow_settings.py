"""Rates written ``{rate, ceil, weight}`` (issue 21) in every place a rate is given.

Refusals are one-line :class:`OutputRateConfigError` messages naming the user
and the key at fault.
"""

from __future__ import annotations

import json

import pytest

from test_settings import refused
from vllm_output_rate.adapter.patches import _default_rate_arg
from vllm_output_rate.policy.borrow import Share
from vllm_output_rate.settings import (
    CONFIG_KEY,
    DEFAULT_FLAG,
    OVERRIDES_FLAG,
    OutputRateConfigError,
    OutputRateSettings,
    load_limits_file,
    parse_cli,
)

WHERE = f"additional_config[{CONFIG_KEY!r}]"


def section(default, **users):
    return {"output_rate": {"default_user_output_tokens_per_second": default,
                            "user_output_tokens_per_second": users}}


def test_a_number_is_a_hard_cap_and_a_mapping_sets_ceil_and_weight():
    s = OutputRateSettings.from_additional_config(section(
        {"rate": 100, "ceil": 400},
        alice=20,
        bob={"rate": 10, "ceil": 1000, "weight": 2},
        carol={"rate": 5, "ceil": None},
        dave={"rate": 7},
    ))
    assert s.user_rates == {"alice": 20, "bob": 10, "carol": 5, "dave": 7}
    assert s.limit_of("alice") == (20, 20, 20)  # rate = ceil = weight: today
    assert s.limit_of("bob") == (10, 1000, 2)
    assert s.limit_of("carol") == (5, None, 5)  # ceil null: no ceiling; weight = rate
    assert s.limit_of("dave") == (7, 7, 7)  # ceil defaults to the rate: a hard cap
    assert s.limit_of("someone") == (100, 400, 100) == s.default_limit()
    table = s.share_table()
    assert [table.borrows(u) for u in ("alice", "bob", "carol", "dave", "x")] == [
        False, True, True, False, True]
    assert s.borrows()
    assert not OutputRateSettings.from_additional_config(section(5, a=3, b={"rate": 2})).borrows()


@pytest.mark.parametrize(
    ("limit", "key", "problem"),
    [
        ({"rate": 10, "ceil": 5}, "['ceil']", "at least the rate"),
        ({"rate": 10, "weight": 0}, "['weight']", "must be positive"),
        ({"rate": 10, "weight": -1}, "['weight']", "must be positive"),
        ({"rate": 10, "ceil": "20"}, "['ceil']", "must be a number"),
        ({"rate": 10, "burst": 3}, "unknown keys ['burst']", "{rate, ceil, weight}"),
        ({"ceil": 10}, "'rate' is required", ""),
        ({"rate": 0}, "['rate']", "must be positive"),
    ],
)
def test_bad_limits_are_refused_naming_the_user_and_key(limit, key, problem):
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config(section(1, bob=limit))
    refused(e, WHERE, "['bob']", key, problem)
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("1", json.dumps({"bob": limit}))
    refused(e, OVERRIDES_FLAG, "['bob']", key, problem)


def test_the_default_flag_takes_a_mapping_too():
    config = parse_cli('{"rate": 5, "ceil": null, "weight": 2}', '{"a": {"rate": 1, "ceil": 3}}')
    s = OutputRateSettings.from_additional_config({"output_rate": config})
    assert s.default_share == Share(None, 2) and s.user_shares == {"a": Share(3, 1)}
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli('{"rate": 5, "ceil": 1}', None)
    refused(e, DEFAULT_FLAG, "['ceil']", "at least the rate")
    assert _default_rate_arg('{"rate": 5}') == '{"rate": 5}'
    assert _default_rate_arg("5") == 5.0


def test_limits_file_with_shares(tmp_path):
    path = tmp_path / "limits.yaml"
    path.write_text(
        "default_user_output_tokens_per_second: {rate: 100, ceil: 400}\n"
        "user_output_tokens_per_second:\n"
        "  alice: 20\n"
        "  bob: {rate: 10, ceil: null, weight: 2}\n"
    )
    s = load_limits_file(str(path))
    assert s.limit_of("alice") == (20, 20, 20)
    assert s.limit_of("bob") == (10, None, 2)
    assert s.default_limit() == (100, 400, 100)
    path.write_text("default_user_output_tokens_per_second: 1\n"
                    "user_output_tokens_per_second: {bob: {rate: 10, ceil: 2}}\n")
    with pytest.raises(OutputRateConfigError) as e:
        load_limits_file(str(path))
    refused(e, "--output-rate-limits-file", "['bob']['ceil']", "at least the rate")


def test_round_trip_keeps_numbers_as_numbers():
    s = OutputRateSettings.from_additional_config(section(3, a=2, b={"rate": 1, "ceil": None}))
    config = s.to_config()
    assert config["user_output_tokens_per_second"] == {
        "a": 2.0, "b": {"rate": 1.0, "ceil": None, "weight": 1.0}}
    assert config["default_user_output_tokens_per_second"] == 3.0


def test_a_weight_without_a_ceiling_above_the_rate_is_named_as_doing_nothing():
    s = OutputRateSettings.from_additional_config({"output_rate": {
        "default_user_output_tokens_per_second": {"rate": 20, "weight": 4},
        "user_output_tokens_per_second": {
            "b": {"rate": 5, "weight": 3},  # no ceil: a hard cap; likely meant ceil: null
            "c": {"rate": 5, "ceil": 5, "weight": 2},
            "d": {"rate": 5, "ceil": None, "weight": 3},  # borrows: its weight counts
            "e": {"rate": 5, "ceil": 9, "weight": 3},
            "f": {"rate": 5},  # the weight is its default
            "g": 5,
            "h": {"rate": 5, "group": "team"},
        },
        "groups": {"team": {"rate": 50, "weight": 2}, "open": {"rate": 50, "ceil": None, "weight": 2}},
    }})
    assert s.inert_weights() == ["the default (weight 4)", "user 'b' (weight 3)", "user 'c' (weight 2)",
                                 "group 'team' (weight 2)"]
