"""The integer flags share one parser (``stores.config.int_arg``): checked
through the two flag groups that use it, as ``vllm serve`` would parse them."""

from __future__ import annotations

import argparse

import pytest

from vllm_output_rate.adapter.options import add_operate_args
from vllm_output_rate.settings import METRICS_MAX_USERS_FLAG
from vllm_output_rate.stores.config import ENGINES_FLAG, add_store_args


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_operate_args(parser)
    add_store_args(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "flag, text, value",
    [(METRICS_MAX_USERS_FLAG, "0", 0), (METRICS_MAX_USERS_FLAG, "25", 25),
     (ENGINES_FLAG, "1", 1), (ENGINES_FLAG, " 3", 3)],
)
def test_accepted(flag, text, value):
    args = parse([flag, text])
    if flag == METRICS_MAX_USERS_FLAG:
        assert args.output_rate_metrics_max_users == value
    else:
        assert args.output_rate_expected_engines == value


@pytest.mark.parametrize(
    "flag, text, kind",
    [(METRICS_MAX_USERS_FLAG, "-1", "non-negative"), (METRICS_MAX_USERS_FLAG, "many", "non-negative"),
     (METRICS_MAX_USERS_FLAG, "1.5", "non-negative"), (ENGINES_FLAG, "0", "positive"),
     (ENGINES_FLAG, "-2", "positive"), (ENGINES_FLAG, "two", "positive")],
)
def test_refused_with_the_bound_named(flag, text, kind):
    with pytest.raises(argparse.ArgumentError, match=f"must be a {kind} integer, got '{text}'"):
        parse([flag, text])
