"""Shared fixtures.  The tiny model is generated once if it is missing."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from server_harness import TINY_MODEL_DIR  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    from vllm_output_rate.tools.tiny_model import is_tiny_model_dir, write_tiny_model

    if not is_tiny_model_dir(TINY_MODEL_DIR):
        write_tiny_model(TINY_MODEL_DIR)
    return str(TINY_MODEL_DIR)


@pytest.fixture(scope="module")
def server_log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("server-logs")
