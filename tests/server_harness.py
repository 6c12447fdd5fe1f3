"""Real ``vllm-output-rate serve`` processes for tests (one per test module).

Thin test-side names over :mod:`vllm_output_rate.tools.serverproc`, with the
tiny model of this checkout as the default model.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_output_rate.tools import serverproc
from vllm_output_rate.tools.serverproc import Server, free_port, run_cli, server_env  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL_DIR = Path(os.environ.get("TINY_MODEL_DIR", REPO / "models" / "tiny-llama"))
CLI = serverproc.CLI


def running_server(args: list[str], log_dir: Path, name: str = "server", **kwargs):
    """Start ``vllm-output-rate serve <tiny model> ARGS`` and wait until healthy."""
    kwargs.setdefault("model", TINY_MODEL_DIR)
    return serverproc.running_server(args, log_dir, name, **kwargs)
