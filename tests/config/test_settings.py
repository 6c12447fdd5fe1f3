"""Tests of the configuration layer (:mod:`vllm_output_rate.settings`).

Every refusal must be an :class:`OutputRateConfigError` (or
:class:`InvalidUserError` for request identities) whose message is one line,
names the flag or key at fault, and says what is wrong with it.
"""

from __future__ import annotations

import pytest

from vllm_output_rate.settings import (
    ANONYMOUS_USER,
    CONFIG_KEY,
    DEFAULT_FLAG,
    DEFAULT_KEY,
    MAX_USER_LEN,
    OVERRIDES_FLAG,
    OVERRIDES_KEY,
    USER_ARG,
    InvalidUserError,
    OutputRateConfigError,
    OutputRateSettings,
    parse_cli,
    resolve_user,
    validate_overrides,
    validate_rate,
)

WHERE = f"additional_config[{CONFIG_KEY!r}]"


def refused(exc_info, *fragments: str) -> str:
    """The error message, checked to be one line containing every fragment."""
    msg = str(exc_info.value)
    assert "\n" not in msg and "\r" not in msg, msg
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    return msg


def test_constants_are_the_documented_names():
    assert DEFAULT_FLAG == "--default-user-output-tokens-per-second"
    assert OVERRIDES_FLAG == "--user-output-tokens-per-second"
    assert DEFAULT_KEY == "default_user_output_tokens_per_second"
    assert OVERRIDES_KEY == "user_output_tokens_per_second"
    assert CONFIG_KEY == "output_rate"
    assert USER_ARG == "output_rate_user"
    assert ANONYMOUS_USER == "__anonymous__"
    # README promises identities of up to 256 characters.
    assert resolve_user({USER_ARG: "u" * 256}) == "u" * 256
    with pytest.raises(InvalidUserError):
        resolve_user({USER_ARG: "u" * 257})
    assert issubclass(OutputRateConfigError, ValueError)
    assert issubclass(InvalidUserError, ValueError)


# ---------------------------------------------------------------------------
# parse_cli: good inputs
# ---------------------------------------------------------------------------


def test_cli_off_when_no_flags():
    assert parse_cli(None, None) is None


@pytest.mark.parametrize(
    "default, overrides, expected",
    [
        ("100", None, {DEFAULT_KEY: 100.0, OVERRIDES_KEY: {}}),
        ("2.5", None, {DEFAULT_KEY: 2.5, OVERRIDES_KEY: {}}),
        (" 7 ", None, {DEFAULT_KEY: 7.0, OVERRIDES_KEY: {}}),
        ("1e3", "{}", {DEFAULT_KEY: 1000.0, OVERRIDES_KEY: {}}),
        (
            "100",
            '{"user-a": 20, "user-b": 0.5, "b\\u00e9b\\u00e9": 2.5}',
            {
                DEFAULT_KEY: 100.0,
                OVERRIDES_KEY: {"user-a": 20.0, "user-b": 0.5, "bébé": 2.5},
            },
        ),
        ("0.1", '{"x": 1e-3}', {DEFAULT_KEY: 0.1, OVERRIDES_KEY: {"x": 0.001}}),
        (
            "5",
            '  {\n "multi": 3,\n "line": 4 }\n',
            {DEFAULT_KEY: 5.0, OVERRIDES_KEY: {"multi": 3.0, "line": 4.0}},
        ),
        (
            "5",
            '{"%s": 1}' % ("u" * MAX_USER_LEN),
            {DEFAULT_KEY: 5.0, OVERRIDES_KEY: {"u" * MAX_USER_LEN: 1.0}},
        ),
    ],
)
def test_cli_good_inputs_give_the_exact_config_dict(default, overrides, expected):
    got = parse_cli(default, overrides)
    assert got == expected
    assert set(got) == {DEFAULT_KEY, OVERRIDES_KEY}
    assert all(type(v) is float for v in got[OVERRIDES_KEY].values())
    assert type(got[DEFAULT_KEY]) is float
    # The dict round-trips through additional_config.
    settings = OutputRateSettings.from_additional_config({CONFIG_KEY: got})
    assert settings is not None
    assert settings.to_config() == expected


# ---------------------------------------------------------------------------
# parse_cli: refusals
# ---------------------------------------------------------------------------


def test_cli_overrides_without_default_refused():
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli(None, '{"a": 1}')
    refused(e, OVERRIDES_FLAG, "requires", DEFAULT_FLAG)


@pytest.mark.parametrize(
    "value, problem",
    [
        ("abc", "must be a number"),
        ("", "must be a number"),
        ("   ", "must be a number"),
        ("1,5", "must be a number"),
        ("true", "must be a number"),
        ("nan", "must be a number, got NaN"),
        ("NaN", "must be a number, got NaN"),
        ("0", "must be positive"),
        ("0.0", "must be positive"),
        ("-0", "must be positive"),
        ("-5", "must be positive"),
        ("-0.001", "must be positive"),
        ("inf", "must be finite"),
        ("-inf", "must be finite"),
        ("Infinity", "must be finite"),
        ("1e400", "must be finite"),
    ],
)
def test_cli_bad_default_refused(value, problem):
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli(value, None)
    refused(e, DEFAULT_FLAG, problem)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("{", "malformed JSON"),
        ("", "malformed JSON"),
        ("{'a': 1}", "malformed JSON"),
        ('{"a": 1,}', "malformed JSON"),
        ('{"a": 1} trailing', "malformed JSON"),
        ("user-a=20", "malformed JSON"),
        ('{"a": NaN}', "NaN"),
        ('{"a": Infinity}', "Infinity"),
        ('{"a": -Infinity}', "-Infinity"),
        ("NaN", "NaN"),
    ],
)
def test_cli_malformed_json_refused(text, problem):
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", text)
    refused(e, OVERRIDES_FLAG, "malformed JSON", problem)


@pytest.mark.parametrize(
    "text, type_name",
    [
        ("[]", "list"),
        ('[["a", 1]]', "list"),
        ('"a"', "str"),
        ("5", "int"),
        ("null", "NoneType"),
        ("true", "bool"),
    ],
)
def test_cli_json_not_an_object_refused(text, type_name):
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", text)
    refused(e, OVERRIDES_FLAG, "must be a JSON object", type_name)


def test_cli_empty_user_name_refused():
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", '{"": 5}')
    refused(e, OVERRIDES_FLAG, "non-empty")


def test_cli_too_long_user_name_refused():
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", '{"%s": 5}' % ("u" * (MAX_USER_LEN + 1)))
    refused(e, OVERRIDES_FLAG, "longer than 256")


@pytest.mark.parametrize(
    "rate_json, problem",
    [
        ('"fast"', "must be a number"),
        ("null", "must be a number"),
        ("true", "must be a number"),
        ("false", "must be a number"),
        ("[5]", "must be a number"),
        ('{"r": 5}', "must be a number"),
        ("0", "must be positive"),
        ("0.0", "must be positive"),
        ("-0.0", "must be positive"),
        ("-1", "must be positive"),
        ("-2.5", "must be positive"),
        ("1e400", "must be finite"),
        ("-1e400", "must be finite"),
        # JSON rates are numbers, not numeric text.
        ('"5"', "must be a number, got '5'"),
        ('"nan"', "must be a number"),
        ('"inf"', "must be a number"),
    ],
)
def test_cli_bad_override_rate_refused_naming_the_user(rate_json, problem):
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", '{"good": 1, "user-x": %s}' % rate_json)
    refused(e, OVERRIDES_FLAG, "'user-x'", problem)


def test_cli_huge_integer_rate_is_a_config_error():
    # JSON integers are unbounded; one too large for a float must still be a
    # one-line config error, not an OverflowError traceback.
    huge = "9" * 400
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", '{"user-x": %s}' % huge)
    refused(e, OVERRIDES_FLAG, "'user-x'", "too large")
    with pytest.raises(OutputRateConfigError) as e:
        validate_rate(10**400, "somewhere")
    refused(e, "somewhere", "too large")


def test_cli_user_name_with_newline_keeps_message_on_one_line():
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("10", '{"evil\\nname": 0}')
    refused(e, OVERRIDES_FLAG, "must be positive")


def test_cli_bad_default_with_good_overrides_refused():
    with pytest.raises(OutputRateConfigError) as e:
        parse_cli("zero", '{"a": 1}')
    refused(e, DEFAULT_FLAG, "must be a number")


# ---------------------------------------------------------------------------
# validate_rate / validate_overrides directly
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected", [(1, 1.0), (2.5, 2.5), ("3", 3.0), (" 0.5 ", 0.5), (1e-6, 1e-6), (1e9, 1e9)]
)
def test_validate_rate_accepts(value, expected):
    got = validate_rate(value, "w")
    assert got == expected and type(got) is float


@pytest.mark.parametrize(
    "value, problem",
    [
        (True, "must be a number"),
        (False, "must be a number"),
        (None, "must be a number"),
        ([1], "must be a number"),
        (b"5", "must be a number"),
        (0, "must be positive"),
        (-1, "must be positive"),
        (float("nan"), "NaN"),
        (float("inf"), "must be finite"),
        (float("-inf"), "must be finite"),
    ],
)
def test_validate_rate_refuses(value, problem):
    with pytest.raises(OutputRateConfigError) as e:
        validate_rate(value, "the-key")
    refused(e, "the-key", problem)


@pytest.mark.parametrize("bad_user", ["", 3, None, ("t",)])
def test_validate_overrides_refuses_bad_user_names(bad_user):
    with pytest.raises(OutputRateConfigError) as e:
        validate_overrides({bad_user: 1}, "ov")
    refused(e, "ov", "user names must be non-empty strings")


def test_validate_overrides_returns_a_new_float_dict():
    src = {"a": 1, "b": 2.5}
    got = validate_overrides(src, "ov")
    assert got == {"a": 1.0, "b": 2.5}
    assert all(type(v) is float for v in got.values())
    assert got is not src


def test_validate_overrides_refuses_numeric_text():
    with pytest.raises(OutputRateConfigError) as e:
        validate_overrides({"a": 1, "b": "2.5"}, "ov")
    refused(e, "ov['b']", "must be a number", "'2.5'")


# ---------------------------------------------------------------------------
# from_additional_config
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        None,
        {},
        {"something_else": {"x": 1}},
        {CONFIG_KEY: None},
        {CONFIG_KEY: {}},
        {CONFIG_KEY: {DEFAULT_KEY: None}},
        {CONFIG_KEY: {DEFAULT_KEY: None, OVERRIDES_KEY: None}},
        {CONFIG_KEY: {DEFAULT_KEY: None, OVERRIDES_KEY: {}}},
        {CONFIG_KEY: {OVERRIDES_KEY: {}}},
    ],
)
def test_from_additional_config_off(config):
    assert OutputRateSettings.from_additional_config(config) is None


def test_from_additional_config_on():
    s = OutputRateSettings.from_additional_config(
        {"other": 1, CONFIG_KEY: {DEFAULT_KEY: 100, OVERRIDES_KEY: {"a": 20, "b": 0.5}}}
    )
    assert s == OutputRateSettings(default_rate=100.0, user_rates={"a": 20.0, "b": 0.5})
    assert s.to_config() == {DEFAULT_KEY: 100.0, OVERRIDES_KEY: {"a": 20.0, "b": 0.5}}
    # Overrides missing or null mean "no overrides".
    for section in ({DEFAULT_KEY: 3}, {DEFAULT_KEY: 3, OVERRIDES_KEY: None}):
        s = OutputRateSettings.from_additional_config({CONFIG_KEY: section})
        assert s == OutputRateSettings(default_rate=3.0, user_rates={})


def test_to_config_is_a_copy():
    s = OutputRateSettings(default_rate=1.0, user_rates={"a": 2.0})
    cfg = s.to_config()
    cfg[OVERRIDES_KEY]["b"] = 3.0
    assert dict(s.user_rates) == {"a": 2.0}


@pytest.mark.parametrize(
    "section, type_name", [("100", "str"), (100, "int"), ([1], "list"), (True, "bool")]
)
def test_from_additional_config_section_not_an_object(section, type_name):
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config({CONFIG_KEY: section})
    refused(e, WHERE, "must be an object", type_name)


def test_from_additional_config_unknown_keys_refused():
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config(
            {CONFIG_KEY: {DEFAULT_KEY: 1, "default_rate": 5, "burst": 1}}
        )
    refused(e, WHERE, "unknown keys", "'burst'", "'default_rate'")


def test_from_additional_config_unknown_keys_of_mixed_types_refused():
    # Python callers (LLM(additional_config=...)) may use non-string keys.
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config(
            {CONFIG_KEY: {DEFAULT_KEY: 1, 1: "x", "typo": 2}}
        )
    refused(e, WHERE, "unknown keys", "'typo'")


def test_from_additional_config_overrides_without_default_refused():
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config({CONFIG_KEY: {OVERRIDES_KEY: {"a": 1}}})
    refused(e, WHERE, OVERRIDES_KEY, "requires", DEFAULT_KEY)
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config(
            {CONFIG_KEY: {DEFAULT_KEY: None, OVERRIDES_KEY: {"a": 1}}}
        )
    refused(e, OVERRIDES_KEY, "requires", DEFAULT_KEY)


@pytest.mark.parametrize(
    "default, problem",
    [
        (0, "must be positive"),
        (-3, "must be positive"),
        (float("nan"), "NaN"),
        (float("inf"), "must be finite"),
        (False, "must be a number"),
        (True, "must be a number"),
        ("fast", "must be a number"),
        ([1], "must be a number"),
    ],
)
def test_from_additional_config_bad_default_refused(default, problem):
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config({CONFIG_KEY: {DEFAULT_KEY: default}})
    refused(e, f"{WHERE}[{DEFAULT_KEY!r}]", problem)


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        ([["a", 1]], ["must be a JSON object", "list"]),
        ("a=1", ["must be a JSON object", "str"]),
        ({"": 1}, ["non-empty"]),
        ({"a": 0}, ["'a'", "must be positive"]),
        ({"a": float("nan")}, ["'a'", "NaN"]),
        ({"a": float("-inf")}, ["'a'", "must be finite"]),
        ({"a": None}, ["'a'", "must be a number"]),
        ({"u" * (MAX_USER_LEN + 1): 1}, ["longer than 256"]),
    ],
)
def test_from_additional_config_bad_overrides_refused(overrides, fragments):
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config(
            {CONFIG_KEY: {DEFAULT_KEY: 1, OVERRIDES_KEY: overrides}}
        )
    refused(e, f"{WHERE}[{OVERRIDES_KEY!r}]", *fragments)


# ---------------------------------------------------------------------------
# resolve_user
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("extra_args", [None, {}, {"other": "x"}, {"output_rate_user_": "x"}])
def test_resolve_user_missing_is_anonymous(extra_args):
    assert resolve_user(extra_args) == ANONYMOUS_USER


@pytest.mark.parametrize(
    "user", ["alice", "a", "u" * MAX_USER_LEN, "é" * MAX_USER_LEN, " spaced ", ANONYMOUS_USER]
)
def test_resolve_user_valid(user):
    assert resolve_user({USER_ARG: user, "other": 1}) == user


@pytest.mark.parametrize(
    "value, fragments",
    [
        (None, ["must be a string", "NoneType"]),
        (5, ["must be a string", "int"]),
        (1.5, ["must be a string", "float"]),
        (True, ["must be a string", "bool"]),
        (["alice"], ["must be a string", "list"]),
        ({"name": "alice"}, ["must be a string", "dict"]),
        (b"alice", ["must be a string", "bytes"]),
        ("", ["must not be empty"]),
        ("u" * (MAX_USER_LEN + 1), ["at most 256"]),
        ("é" * (MAX_USER_LEN + 1), ["at most 256"]),
    ],
)
def test_resolve_user_invalid(value, fragments):
    with pytest.raises(InvalidUserError) as e:
        resolve_user({USER_ARG: value})
    refused(e, USER_ARG, *fragments)


# -- mode (issue 45: shadow mode) ------------------------------------------------------


def test_mode_defaults_to_enforce_and_round_trips():
    from vllm_output_rate.settings import MODE_KEY

    on = OutputRateSettings.from_additional_config({"output_rate": {DEFAULT_KEY: 5}})
    assert on.mode == "enforce" and MODE_KEY not in on.to_config()
    shadow = OutputRateSettings.from_additional_config(
        {"output_rate": {DEFAULT_KEY: 5, MODE_KEY: "shadow"}})
    assert shadow.mode == "shadow" and shadow.to_config()[MODE_KEY] == "shadow"
    assert OutputRateSettings.from_additional_config({"output_rate": shadow.to_config()}) == shadow


@pytest.mark.parametrize("bad", ["Shadow", "off", 1, None, ["shadow"]])
def test_a_bad_mode_is_refused_naming_the_key(bad):
    with pytest.raises(OutputRateConfigError) as e:
        OutputRateSettings.from_additional_config({"output_rate": {DEFAULT_KEY: 5, "mode": bad}})
    assert "'mode'" in str(e.value) and "enforce" in str(e.value)


def test_a_limits_file_mode_wins_and_without_it_the_flag_mode_stays(tmp_path):
    import hashlib
    import json as _json

    from vllm_output_rate.settings import load_limits_file

    path = tmp_path / "limits.json"
    path.write_text(_json.dumps({DEFAULT_KEY: 5, "mode": "shadow"}))
    assert load_limits_file(str(path), mode="enforce").mode == "shadow"
    path.write_text(_json.dumps({DEFAULT_KEY: 5}))
    loaded = load_limits_file(str(path), mode="shadow")
    assert loaded.mode == "shadow"
    assert loaded.limits_digest == hashlib.sha256(path.read_bytes()).hexdigest()
    path.write_text(_json.dumps({DEFAULT_KEY: 5, "mode": "dry-run"}))
    with pytest.raises(OutputRateConfigError, match="mode"):
        load_limits_file(str(path))


def test_limits_view_names_every_user_and_group_entry():
    from vllm_output_rate.settings import limits_view

    s = OutputRateSettings.from_additional_config({"output_rate": {
        DEFAULT_KEY: 5, OVERRIDES_KEY: {"a": 2, "b": {"rate": 1, "ceil": 3, "group": "g"}},
        "groups": {"g": 4}, "mode": "shadow"}})
    view = limits_view(s)
    assert view[DEFAULT_KEY] == 5 and view["mode"] == "shadow"
    assert view[f"{OVERRIDES_KEY}.a"] == 2
    assert view[f"{OVERRIDES_KEY}.b"] == {"rate": 1, "ceil": 3, "weight": 1, "group": "g"}
    assert view["groups.g"] == 4
