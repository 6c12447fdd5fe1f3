"""Groups of users (issue 25) in every place limits are given.

``groups: {team-a: {rate, ceil, weight}}`` next to the users, and ``group:
team-a`` in a user's limit.  Refusals are one-line
:class:`OutputRateConfigError` messages naming the user or group and the key.
"""

from __future__ import annotations

import json

import pytest

from test_settings import refused
from vllm_output_rate.adapter.patches import _groups_arg, _overrides_arg
from vllm_output_rate.policy.borrow import Share
from vllm_output_rate.settings import (
    CONFIG_KEY,
    DEFAULT_FLAG,
    GROUPS_FLAG,
    GROUPS_KEY,
    OVERRIDES_FLAG,
    OutputRateConfigError,
    OutputRateSettings,
    load_limits_file,
    parse_cli,
)

WHERE = f"additional_config[{CONFIG_KEY!r}]"


def section(default, groups=None, **users):
    config = {"default_user_output_tokens_per_second": default,
              "user_output_tokens_per_second": users}
    if groups is not None:
        config[GROUPS_KEY] = groups
    return {"output_rate": config}


def test_users_join_groups_and_groups_take_a_users_limit():
    s = OutputRateSettings.from_additional_config(section(
        100,
        {"team-a": {"rate": 200, "ceil": 400, "weight": 2}, "team-b": 50},
        alice={"rate": 50, "group": "team-a"},
        bob={"rate": 50, "ceil": 80, "group": "team-a"},
        carol={"rate": 5, "group": "team-b"},
        dave=7,
    ))
    assert s.user_rates == {"alice": 50, "bob": 50, "carol": 5, "dave": 7}
    assert s.group_rates == {"team-a": 200, "team-b": 50}
    assert s.group_limit_of("team-a") == (200, 400, 2)
    assert s.group_limit_of("team-b") == (50, 50, 50)  # a number: a hard cap
    assert [s.group_of(u) for u in ("alice", "bob", "carol", "dave", "someone")] == [
        "team-a", "team-a", "team-b", None, None]
    assert s.limit_of("bob") == (50, 80, 50)  # the group key is not part of the limit
    table = s.group_table()
    assert table.borrows("team-a") and not table.borrows("team-b")


def test_without_groups_nothing_changes():
    s = OutputRateSettings.from_additional_config(section(10, a=3))
    assert s.group_rates == {} and s.user_groups == {} and s.default_group is None
    assert GROUPS_KEY not in s.to_config()


def test_the_default_may_name_a_group_for_every_user_without_an_entry():
    # ... and for every entry that names none: a rate of one's own does not
    # move a user out of the default's group; "group": null does (issue 31).
    s = OutputRateSettings.from_additional_config(section(
        {"rate": 10, "group": "others"}, {"others": 30}, named=5,
        alone={"rate": 5, "group": None}))
    assert s.group_of("anyone") == "others" and s.group_of("named") == "others"
    assert s.group_of("alone") is None
    assert s.default_limit() == (10, 10, 10)


@pytest.mark.parametrize(
    ("users", "groups", "fragments"),
    [
        ({"alice": {"rate": 5, "group": "team-x"}}, {"team-a": 10},
         ["['alice']['group']", "unknown group 'team-x'", "team-a"]),
        ({"alice": {"rate": 5, "group": "team-x"}}, None,
         ["['alice']['group']", "unknown group 'team-x'", "no 'groups'"]),
        ({"alice": {"rate": 5, "group": 7}}, {"team-a": 10},
         ["['alice']['group']", "must be a group name"]),
        ({"alice": {"rate": 5, "group": ""}}, {"team-a": 10},
         ["['alice']['group']", "must be a group name"]),
        ({"alice": {"group": "team-a"}}, {"team-a": 10}, ["['alice']", "'rate' is required"]),
        ({}, {"team-a": {"rate": 10, "ceil": 5}}, ["['groups']['team-a']['ceil']", "at least the rate"]),
        ({}, {"team-a": {"rate": 10, "weight": 0}}, ["['groups']['team-a']['weight']", "must be positive"]),
        ({}, {"team-a": {"rate": 10, "burst": 3}}, ["['groups']['team-a']", "unknown keys ['burst']"]),
        ({}, {"team-a": {"rate": 10, "group": "team-b"}, "team-b": 5},
         ["['groups']['team-a']", "one level of groups"]),
        ({}, {"team-a": 0}, ["['groups']['team-a']", "must be positive"]),
        ({}, {"team-a": "10"}, ["['groups']['team-a']", "must be a number"]),
        ({}, {"": 10}, ["['groups']", "group names must be non-empty"]),
        ({}, {"g" * 257: 10}, ["['groups']", "longer than 256"]),
        ({}, [10], ["['groups']", "must be an object of group -> limit"]),
    ],
)
def test_bad_groups_are_refused_naming_the_user_or_group_and_key(users, groups, fragments):
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config(section(1, groups, **users))
    refused(e, WHERE, *fragments)
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("1", json.dumps(users), None if groups is None else json.dumps(groups))
    flag = OVERRIDES_FLAG if any("['alice']" in f for f in fragments) else GROUPS_FLAG
    refused(e, flag, *[f.replace("['groups']", "") for f in fragments])


def test_groups_need_the_feature_on():
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config(
            {"output_rate": {GROUPS_KEY: {"team-a": 10}}})
    refused(e, f"[{GROUPS_KEY!r}] requires")
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli(None, None, '{"team-a": 10}')
    refused(e, GROUPS_FLAG, "requires", DEFAULT_FLAG)


def test_flags_round_trip_and_each_flag_alone_accepts_any_group():
    config = parse_cli(
        '{"rate": 5, "group": "rest"}', '{"a": {"rate": 2, "group": "t"}, "b": 3}',
        '{"t": {"rate": 3, "ceil": 6}, "rest": 50}',
    )
    s = OutputRateSettings.from_additional_config({"output_rate": config})
    assert s.user_groups == {"a": "t", "b": "rest"} and s.default_group == "rest"
    assert s.group_shares == {"t": Share(6, 3)} and s.group_rates == {"t": 3, "rest": 50}
    assert OutputRateSettings.from_additional_config({"output_rate": s.to_config()}) == s
    # vLLM's argparse checks each flag alone: the group a user names is
    # checked once every flag is in (merge_cli_into_engine_args).
    text = '{"a": {"rate": 2, "group": "not-yet-known"}}'
    assert _overrides_arg(text) == text
    assert _groups_arg('{"t": 3}') == '{"t": 3}'
    import argparse

    with pytest.raises(argparse.ArgumentTypeError) as e:
        _groups_arg('{"t": {"rate": 3, "group": "u"}}')
    assert "one level of groups" in str(e.value)


def test_limits_file_with_groups(tmp_path):
    path = tmp_path / "limits.yaml"
    path.write_text(
        "default_user_output_tokens_per_second: 100\n"
        "groups:\n"
        "  team-a: {rate: 200, ceil: 400, weight: 2}\n"
        "user_output_tokens_per_second:\n"
        "  alice: {rate: 50, group: team-a}\n"
        "  bob:   {rate: 50, group: team-a}\n"
    )
    s = load_limits_file(str(path))
    assert s.group_of("alice") == s.group_of("bob") == "team-a"
    assert s.group_limit_of("team-a") == (200, 400, 2)
    path.write_text(
        "default_user_output_tokens_per_second: 100\n"
        "groups: {team-a: 200}\n"
        "user_output_tokens_per_second: {alice: {rate: 50, group: team-b}}\n"
    )
    with pytest.raises(OutputRateConfigError) as e:
        load_limits_file(str(path))
    refused(e, "--output-rate-limits-file", "['alice']['group']", "unknown group 'team-b'")
