"""Store configuration: flags, the additional_config ``store`` section, password handling."""

from __future__ import annotations

import argparse

import pytest

from vllm_output_rate.settings import OutputRateConfigError, OutputRateSettings
from vllm_output_rate.stores.config import (
    PASSWORD_ENV,
    StoreSettings,
    add_store_args,
    merge_store_args,
    parse_store_section,
)

ON = {"default_user_output_tokens_per_second": 30}


def parser():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_store_args(p)
    return p


def isolate_password_env(monkeypatch, value=None):
    """Parsing the flag writes the password into os.environ; make monkeypatch
    restore the variable afterwards (a bare delenv of an absent variable
    records nothing, and the password leaked into later tests' servers)."""
    monkeypatch.setenv(PASSWORD_ENV, "placeholder")
    if value is None:
        monkeypatch.delenv(PASSWORD_ENV)
    else:
        monkeypatch.setenv(PASSWORD_ENV, value)


def test_flags_fold_into_the_store_section(monkeypatch):
    isolate_password_env(monkeypatch)
    args = parser().parse_args(
        ["--output-rate-store", "redis://:pw-1@127.0.0.1:6390/2",
         "--output-rate-store-fallback", "closed",
         "--output-rate-expected-engines", "3",
         "--output-rate-store-prefix", "llama-70b"]
    )
    # The password left the URL at parse time (so vLLM's args log never sees it).
    assert args.output_rate_store == "redis://127.0.0.1:6390/2"
    import os

    assert os.environ[PASSWORD_ENV] == "pw-1"
    section = merge_store_args(args, dict(ON))
    assert section["store"] == {
        "url": "redis://127.0.0.1:6390/2", "fallback": "closed",
        "expected_engines": 3, "prefix": "llama-70b",
    }
    settings = OutputRateSettings.from_additional_config({"output_rate": section})
    assert settings.store == StoreSettings("redis://127.0.0.1:6390/2", "closed", 3, "llama-70b")
    # Round trip through to_config.
    again = OutputRateSettings.from_additional_config({"output_rate": settings.to_config()})
    assert again == settings


def test_without_the_store_flag_nothing_changes():
    args = parser().parse_args([])
    assert merge_store_args(args, dict(ON)) == ON
    assert merge_store_args(args, None) is None
    assert OutputRateSettings.from_additional_config({"output_rate": ON}).store is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--output-rate-store-prefix", "p"], "--output-rate-store-prefix needs --output-rate-store"),
        (["--output-rate-expected-engines", "2", "--output-rate-store-fallback", "local"],
         "need --output-rate-store"),
    ],
)
def test_store_options_without_a_store_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        merge_store_args(parser().parse_args(argv), dict(ON))


def test_store_without_the_feature_is_refused():
    args = parser().parse_args(["--output-rate-store", "redis://127.0.0.1:1/0"])
    with pytest.raises(ValueError, match="needs the feature on"):
        merge_store_args(args, None)


@pytest.mark.parametrize(
    "argv",
    [
        ["--output-rate-store", "http://127.0.0.1:1/"],
        ["--output-rate-store-fallback", "open"],
        ["--output-rate-expected-engines", "0"],
        ["--output-rate-expected-engines", "two"],
    ],
)
def test_bad_flag_values_are_refused_by_the_parser(argv):
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser().parse_args(argv)


@pytest.mark.parametrize(
    "store, message",
    [
        ("redis://x", "must be an object"),
        ({"url": "memcached://x"}, "url must be"),
        ({"url": "redis://x", "fallback": "open"}, "fallback"),
        ({"url": "redis://x", "expected_engines": 0}, "expected_engines"),
        ({"url": "redis://x", "expected_engines": True}, "expected_engines"),
        ({"url": "redis://x", "prefix": ""}, "prefix"),
        ({"url": "redis://x", "colour": 1}, "unknown keys"),
    ],
)
def test_bad_store_sections_name_the_problem(store, message):
    with pytest.raises(ValueError, match=message):
        parse_store_section(store)
    with pytest.raises(OutputRateConfigError, match=r"\['store'\].*" + message):
        OutputRateSettings.from_additional_config({"output_rate": {**ON, "store": store}})


def test_password_in_the_url_wins_over_one_in_the_environment(monkeypatch):
    isolate_password_env(monkeypatch, "inherited-pw")
    args = parser().parse_args(["--output-rate-store", "redis://:url-pw@127.0.0.1:6390/0"])
    assert args.output_rate_store == "redis://127.0.0.1:6390/0"
    import os

    assert os.environ[PASSWORD_ENV] == "url-pw"


def test_cluster_urls(monkeypatch):
    from vllm_output_rate.stores.config import cluster_nodes, split_userinfo
    from vllm_output_rate.stores.redis_store import redact

    isolate_password_env(monkeypatch)
    url = "redis+cluster://app:p%40ss@10.0.0.1:7000,10.0.0.2,[::1]:7002/0"
    assert cluster_nodes(url) == [("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002)]
    assert split_userinfo(url)[:2] == ("app", "p@ss")
    assert redact(url) == "redis+cluster://10.0.0.1:7000,10.0.0.2,[::1]:7002/0"
    # The flag takes the password out of a multi-host URL too (user name kept).
    args = parser().parse_args(["--output-rate-store", url])
    assert args.output_rate_store == "redis+cluster://app@10.0.0.1:7000,10.0.0.2,[::1]:7002/0"
    import os

    assert os.environ[PASSWORD_ENV] == "p@ss"
    section = merge_store_args(args, dict(ON))
    assert OutputRateSettings.from_additional_config({"output_rate": section}).store.url == (
        args.output_rate_store
    )
    assert parse_store_section({"url": "rediss+cluster://h:1"}).url == "rediss+cluster://h:1"


@pytest.mark.parametrize(
    "url, message",
    [
        ("redis+cluster://h:1/2", "database 0 only"),
        ("redis+cluster://h:1,:2", "without a host"),
        ("redis+cluster://h:x", "bad port"),
        ("redis+cluster://h:70000", "bad port"),
    ],
)
def test_bad_cluster_urls_name_the_problem(url, message):
    with pytest.raises(ValueError, match=message):
        parse_store_section({"url": url})
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser().parse_args(["--output-rate-store", url])
