"""Shared by the configuration tests: the plugin's operating flags alone."""

from __future__ import annotations

import argparse
from typing import Callable

import pytest

from vllm_output_rate.adapter.options import add_operate_args


@pytest.fixture
def operate_parser() -> Callable[[], argparse.ArgumentParser]:
    """A fresh parser of the operating flags (``adapter/options.py``) per call,
    raising instead of exiting on a bad value."""

    def make() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(exit_on_error=False)
        add_operate_args(parser)
        return parser

    return make
