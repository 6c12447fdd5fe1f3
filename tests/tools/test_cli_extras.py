"""A CLI tool whose extra is not installed says which extra, in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Runs the CLI with ``package`` unimportable (as if its extra were not installed).
WITHOUT = (
    "import sys; sys.modules[{package!r}] = None; "
    "from vllm_output_rate.tools.cli import main; main({argv!r})"
)


def run_without(package: str, argv: list[str]) -> subprocess.CompletedProcess:
    code = WITHOUT.format(package=package, argv=argv)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "package, argv, extra",
    [
        # Port 9 (discard) on loopback: nothing is served; the error comes first.
        ("openai", ["bench", "--url", "http://127.0.0.1:9", "--user", "a:1", "--duration", "1",
                    "--no-progress"], "tools"),
        # top imports rich only when it draws: the error must still be one line.
        ("rich", ["top", "--url", "http://127.0.0.1:9", "--once"], "tools"),
    ],
)
def test_missing_extra_is_one_line_naming_it(package, argv, extra):
    done = run_without(package, argv)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"vllm-output-rate: error: this command needs the '{package}' package: "
        f"pip install 'vllm-output-rate[{extra}]'"
    ]


def test_other_import_errors_are_not_disguised():
    # A package that is no extra's: the real error surfaces.
    done = run_without("json", ["bench", "--help"])
    assert done.returncode != 0
    assert "pip install 'vllm-output-rate[" not in done.stderr
