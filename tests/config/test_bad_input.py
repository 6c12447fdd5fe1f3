"""Bad input that used to pass or fail unclearly (issue 31, "Bad input").

Each case was accepted silently on e17ecef or raised something other than a
one-line :class:`OutputRateConfigError` naming the key:

* a JSON integer beyond float range for ``input_token_weight`` or
  ``recompute_budget`` (``OverflowError``; at reload: not counted, and the
  file's signature advanced so a fixed file with the same signature was
  never read again);
* ``user_output_tokens_per_second`` / ``groups`` given as ``0``, ``[]`` or
  ``false`` (read as "none");
* a user or group named like the metrics' catch-all row;
* a named user of a default group silently leaving the group;
* rates, ceilings and weights far outside what the store and the borrowing
  counters can represent.
"""

from __future__ import annotations

import json

import pytest

from test_settings import refused
from vllm_output_rate.adapter import operate
from vllm_output_rate.adapter.operate import LimitsFileWatcher
from vllm_output_rate.policy.monitor import OTHER_USERS
from vllm_output_rate.settings import (
    CONFIG_KEY,
    DEFAULT_FLAG,
    DEFAULT_KEY,
    GROUPS_FLAG,
    GROUPS_KEY,
    INPUT_TOKEN_WEIGHT_KEY,
    OVERRIDES_FLAG,
    OVERRIDES_KEY,
    RECOMPUTE_BUDGET_KEY,
    OutputRateConfigError,
    OutputRateSettings,
    load_limits_file,
    parse_cli,
)

WHERE = f"additional_config[{CONFIG_KEY!r}]"
HUGE = 10**400  # a valid JSON integer, beyond float range


def from_section(**section):
    return OutputRateSettings.from_additional_config({CONFIG_KEY: section})


def write_json(path, data):
    path.write_text(json.dumps(data))
    return str(path)


# -- huge integers -------------------------------------------------------------------


@pytest.mark.parametrize("key", [INPUT_TOKEN_WEIGHT_KEY, RECOMPUTE_BUDGET_KEY])
def test_huge_integer_ratios_are_refused_naming_the_key(key):
    with pytest.raises(OutputRateConfigError) as e:
        from_section(**{DEFAULT_KEY: 10, key: HUGE})
    refused(e, WHERE, f"[{key!r}]", "at most")


def test_huge_integer_input_token_weight_in_a_limits_file_is_refused(tmp_path):
    path = write_json(tmp_path / "limits.json", {DEFAULT_KEY: 10, INPUT_TOKEN_WEIGHT_KEY: HUGE})
    with pytest.raises(OutputRateConfigError) as e:
        load_limits_file(path)
    refused(e, "--output-rate-limits-file", f"[{INPUT_TOKEN_WEIGHT_KEY!r}]", "at most")


def test_a_file_that_is_not_utf8_is_refused_clearly(tmp_path):
    path = tmp_path / "limits.yaml"
    path.write_bytes(b"default_user_output_tokens_per_second: 10\n# caf\xe9\n")
    with pytest.raises(OutputRateConfigError) as e:
        load_limits_file(str(path))
    refused(e, "--output-rate-limits-file", "not UTF-8")


class Calls:
    def __init__(self):
        self.good, self.bad = [], []

    def watcher(self, path):
        return LimitsFileWatcher(path, self.good.append, self.bad.append)


def test_reload_of_a_huge_integer_is_counted_as_a_rejected_file(tmp_path):
    calls = Calls()
    path = write_json(tmp_path / "limits.json", {DEFAULT_KEY: 10})
    watcher = calls.watcher(path)
    write_json(tmp_path / "limits.json", {DEFAULT_KEY: 10, INPUT_TOKEN_WEIGHT_KEY: HUGE})
    assert watcher.check()
    assert calls.good == [] and len(calls.bad) == 1
    assert f"[{INPUT_TOKEN_WEIGHT_KEY!r}]" in calls.bad[0]
    assert not watcher.check()  # the same bad file is reported once
    assert len(calls.bad) == 1


def test_a_failed_reload_of_any_kind_is_counted_and_the_file_read_again(tmp_path, monkeypatch):
    """An unexpected error while loading is a rejected file (counted once), and
    the watcher does not take the file as seen: once the cause is gone the
    same file (same signature) is applied."""
    calls = Calls()
    path = write_json(tmp_path / "limits.json", {DEFAULT_KEY: 10})
    watcher = calls.watcher(path)
    write_json(tmp_path / "limits.json", {DEFAULT_KEY: 20, OVERRIDES_KEY: {"a": 5}})

    def broken(*args, **kwargs):
        raise RuntimeError("disk hiccup")

    monkeypatch.setattr(operate, "load_limits_version", broken)  # the watcher's loader since ecb9f42
    assert watcher.check()
    assert calls.good == [] and len(calls.bad) == 1 and "disk hiccup" in calls.bad[0]
    assert "\n" not in calls.bad[0]
    assert not watcher.check()  # still failing the same way: not counted again
    assert len(calls.bad) == 1
    monkeypatch.undo()
    assert watcher.check()  # the file did not change, and is applied now
    assert [s.default_rate for s in calls.good] == [20]
    assert calls.good[0].user_rates == {"a": 5}
    assert not watcher.check()


def test_a_rejected_file_is_applied_once_fixed(tmp_path):
    calls = Calls()
    path = write_json(tmp_path / "limits.json", {DEFAULT_KEY: 10})
    watcher = calls.watcher(path)
    write_json(tmp_path / "limits.json", {DEFAULT_KEY: -1})
    assert watcher.check() and len(calls.bad) == 1
    write_json(tmp_path / "limits.json", {DEFAULT_KEY: 30})
    assert watcher.check()
    assert [s.default_rate for s in calls.good] == [30] and len(calls.bad) == 1


# -- wrong types read as "none" ----------------------------------------------------


WRONG_EMPTY = [0, [], False, "", 5, [["a", 1]]]


@pytest.mark.parametrize("key", [OVERRIDES_KEY, GROUPS_KEY])
@pytest.mark.parametrize("value", WRONG_EMPTY, ids=repr)
def test_users_and_groups_of_a_wrong_type_are_refused(key, value):
    with pytest.raises(OutputRateConfigError) as e:
        from_section(**{DEFAULT_KEY: 10, key: value})
    refused(e, WHERE, f"[{key!r}]", "must be a", "object", f"got {type(value).__name__}")
    # Without the default too: not taken as "no users" and the feature off.
    with pytest.raises(OutputRateConfigError) as e:
        from_section(**{key: value})
    refused(e, WHERE, f"[{key!r}]", "must be a", "object")


@pytest.mark.parametrize("key", [OVERRIDES_KEY, GROUPS_KEY])
@pytest.mark.parametrize("value", WRONG_EMPTY, ids=repr)
def test_users_and_groups_of_a_wrong_type_in_a_limits_file_are_refused(tmp_path, key, value):
    path = write_json(tmp_path / "limits.json", {DEFAULT_KEY: 10, key: value})
    with pytest.raises(OutputRateConfigError) as e:
        load_limits_file(path)
    refused(e, "--output-rate-limits-file", f"[{key!r}]", "must be a", "object")


@pytest.mark.parametrize("key", [OVERRIDES_KEY, GROUPS_KEY])
@pytest.mark.parametrize("value", [{}, None])
def test_an_empty_object_or_null_still_means_none(tmp_path, key, value):
    s = from_section(**{DEFAULT_KEY: 10, key: value})
    assert s.user_rates == {} and s.group_rates == {}
    assert from_section(**{key: value}) is None  # no default: the feature is off
    path = write_json(tmp_path / "limits.json", {DEFAULT_KEY: 10, key: value})
    assert load_limits_file(path).user_rates == {}


@pytest.mark.parametrize("flag_value", ["0", "[]", "false"])
def test_flags_of_a_wrong_type_are_refused(flag_value):
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", flag_value)
    refused(e, OVERRIDES_FLAG, "must be")
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", None, flag_value)
    refused(e, GROUPS_FLAG, "must be")


# -- the metrics' catch-all name ---------------------------------------------------


def test_the_catch_all_name_is_reserved_for_users(tmp_path):
    with pytest.raises(OutputRateConfigError) as e:
        from_section(**{DEFAULT_KEY: 10, OVERRIDES_KEY: {OTHER_USERS: 5}})
    refused(e, WHERE, f"[{OVERRIDES_KEY!r}]", repr(OTHER_USERS), "reserved")
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", json.dumps({OTHER_USERS: 5}))
    refused(e, OVERRIDES_FLAG, repr(OTHER_USERS), "reserved")
    path = write_json(tmp_path / "limits.json", {DEFAULT_KEY: 10, OVERRIDES_KEY: {OTHER_USERS: 5}})
    with pytest.raises(OutputRateConfigError) as e:
        load_limits_file(path)
    refused(e, "--output-rate-limits-file", repr(OTHER_USERS), "reserved")


def test_the_catch_all_name_is_reserved_for_groups():
    with pytest.raises(OutputRateConfigError) as e:
        from_section(**{DEFAULT_KEY: 10, GROUPS_KEY: {OTHER_USERS: 5}})
    refused(e, WHERE, f"[{GROUPS_KEY!r}]", repr(OTHER_USERS), "reserved")
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", None, json.dumps({OTHER_USERS: 5}))
    refused(e, GROUPS_FLAG, repr(OTHER_USERS), "reserved")


# -- a named user of the default group --------------------------------------------


def test_a_rate_override_keeps_the_default_group():
    s = from_section(**{
        DEFAULT_KEY: {"rate": 10, "group": "rest"},
        GROUPS_KEY: {"rest": 30, "team": 50},
        OVERRIDES_KEY: {
            "plain": 5,                                  # a number: still in "rest"
            "shared": {"rate": 5, "ceil": 8},           # a mapping without group: "rest"
            "moved": {"rate": 5, "group": "team"},      # its own group
            "alone": {"rate": 5, "group": None},        # explicitly in none
        },
    })
    assert {u: s.group_of(u) for u in ("anyone", "plain", "shared", "moved", "alone")} == {
        "anyone": "rest", "plain": "rest", "shared": "rest", "moved": "team", "alone": None}
    assert s.limit_of("plain") == (5, 5, 5) and s.limit_of("shared") == (5, 8, 5)
    assert OutputRateSettings.from_additional_config({CONFIG_KEY: s.to_config()}) == s


def test_without_a_default_group_an_override_is_in_no_group():
    s = from_section(**{DEFAULT_KEY: 10, GROUPS_KEY: {"team": 50},
                        OVERRIDES_KEY: {"plain": 5, "alone": {"rate": 5, "group": None}}})
    assert s.group_of("plain") is None and s.group_of("alone") is None
    assert OutputRateSettings.from_additional_config({CONFIG_KEY: s.to_config()}) == s


def test_the_default_group_is_kept_on_the_command_line_and_in_a_file(tmp_path):
    config = parse_cli('{"rate": 10, "group": "rest"}', '{"plain": 5}', '{"rest": 30}')
    assert OutputRateSettings.from_additional_config({CONFIG_KEY: config}).group_of("plain") == "rest"
    path = write_json(tmp_path / "limits.json", {
        DEFAULT_KEY: {"rate": 10, "group": "rest"}, GROUPS_KEY: {"rest": 30},
        OVERRIDES_KEY: {"plain": 5}})
    assert load_limits_file(path).group_of("plain") == "rest"


# -- ranges ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1e308, 1e10, 1e9 * 1.000001, 1e-7, 1e-300])
def test_rates_outside_the_range_are_refused(value):
    with pytest.raises(OutputRateConfigError) as e:
        from_section(**{DEFAULT_KEY: value})
    refused(e, WHERE, f"[{DEFAULT_KEY!r}]", "between 1e-06 and 1e+09")
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli(repr(value), None)
    refused(e, DEFAULT_FLAG, "between 1e-06 and 1e+09")
    with pytest.raises(OutputRateConfigError) as e:
        from_section(**{DEFAULT_KEY: 10, OVERRIDES_KEY: {"a": value}})
    refused(e, WHERE, "['a']", "between 1e-06 and 1e+09")
    with pytest.raises(OutputRateConfigError) as e:
        from_section(**{DEFAULT_KEY: 10, GROUPS_KEY: {"g": value}})
    refused(e, WHERE, "['g']", "between 1e-06 and 1e+09")


@pytest.mark.parametrize("key, value", [
    ("ceil", 1e308), ("ceil", 1e10), ("weight", 1e-300), ("weight", 1e-7), ("weight", 1e308),
])
def test_ceilings_and_weights_outside_the_range_are_refused(key, value):
    limit = {"rate": 1, key: value}
    for section in ({DEFAULT_KEY: limit},
                    {DEFAULT_KEY: 10, OVERRIDES_KEY: {"a": limit}},
                    {DEFAULT_KEY: 10, GROUPS_KEY: {"g": limit}}):
        with pytest.raises(OutputRateConfigError) as e:
            from_section(**section)
        refused(e, WHERE, f"[{key!r}]", "between 1e-06 and 1e+09")


def test_the_ends_of_the_range_are_accepted():
    s = from_section(**{DEFAULT_KEY: 1e9, OVERRIDES_KEY: {
        "slow": 1e-6, "b": {"rate": 1e-6, "ceil": 1e9, "weight": 1e-6}}})
    assert s.default_rate == 1e9 and s.limit_of("slow") == (1e-6, 1e-6, 1e-6)
    assert s.limit_of("b") == (1e-6, 1e9, 1e-6)


@pytest.mark.parametrize("key", [INPUT_TOKEN_WEIGHT_KEY, RECOMPUTE_BUDGET_KEY])
def test_ratios_above_the_range_are_refused(key):
    with pytest.raises(OutputRateConfigError) as e:
        from_section(**{DEFAULT_KEY: 10, key: 1e300})
    refused(e, WHERE, f"[{key!r}]", "at most 1e+06")
    assert getattr(from_section(**{DEFAULT_KEY: 10, key: 1e6}), key) == 1e6


# -- flags that would do nothing (issue 46, item 3) -----------------------------------


def _operate_args(argv):
    import argparse

    from vllm_output_rate.adapter.patches import add_output_rate_args

    parser = argparse.ArgumentParser()
    add_output_rate_args(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize("argv, flag", [
    (["--output-rate-unknown-users", "reject"], "--output-rate-unknown-users"),
    (["--output-rate-api-keys", "keys.yaml"], "--output-rate-api-keys"),
])
def test_identity_flags_are_refused_while_the_feature_is_off(argv, flag):
    from vllm_output_rate.adapter.options import merge_operate_args

    with pytest.raises(OutputRateConfigError) as info:
        merge_operate_args(_operate_args(argv), None)
    message = str(info.value)
    assert message.startswith(flag) and "needs the feature on" in message
    assert "\n" not in message


def test_the_user_header_warns_in_body_mode(caplog):
    import logging

    from vllm_output_rate.adapter.options import merge_operate_args

    args = _operate_args(["--default-user-output-tokens-per-second", "20",
                          "--output-rate-user-header", "x-user"])
    with caplog.at_level(logging.WARNING, logger="vllm_output_rate.adapter.options"):
        section = merge_operate_args(args, {DEFAULT_KEY: 20.0})
    assert section is not None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(
        "vllm-output-rate: --output-rate-user-header does nothing in --output-rate-identity body mode")


def test_the_default_header_in_body_mode_says_nothing(caplog):
    import logging

    from vllm_output_rate.adapter.options import merge_operate_args

    args = _operate_args(["--default-user-output-tokens-per-second", "20"])
    with caplog.at_level(logging.WARNING, logger="vllm_output_rate.adapter.options"):
        merge_operate_args(args, {DEFAULT_KEY: 20.0})
    assert caplog.records == []
